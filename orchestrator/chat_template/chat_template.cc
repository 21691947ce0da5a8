#include "orchestrator/chat_template/chat_template.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "common/status_macros.h"
#include "orchestrator/chat_template/ast.h"
#include "orchestrator/chat_template/interpreter.h"
#include "orchestrator/chat_template/parser.h"
#include "orchestrator/chat_template/value.h"

namespace tandem::router {
namespace {

// The work a render may do (RenderLimits::max_work): a floor for the
// template's own statements plus a multiple of the context's size, so that a
// long conversation is never refused while a template that rescans it, or a
// string of its own making, on every pass is (chat_template_test's
// WorkAllowanceFitsRealTemplates measures the real templates against it).
// The floor, in units of work: about 0.1 s of the interpreter's time at most.
// Fuzzing builds (ASan, coverage) run each unit about 50 times slower and
// use 64k: far above what a real template spends on the fuzzer's short
// conversation, while inputs that spin until the budget stops them cost 16x
// less than at 1M (the fuzzer ran 4.2x the executions a second, with the same
// coverage at the same count).
#ifdef FUZZING_BUILD_MODE_UNSAFE_FOR_PRODUCTION
constexpr int64_t kWorkFloor = int64_t{1} << 16;
#else
constexpr int64_t kWorkFloor = int64_t{16} << 20;
#endif
constexpr int64_t kWorkPerContextUnit = 64;

struct JsonShape {
  int depth = 0;
  int64_t size = 0;  // Values plus string bytes (keys' and values').
};

// The nesting depth and size of `json`, without recursion (a hostile request may nest deeply).
template <typename Json>
JsonShape MeasureJson(const Json& json) {
  JsonShape shape;
  std::vector<std::pair<const Json*, int>> stack = {{&json, 1}};
  while (!stack.empty()) {
    const auto [node, depth] = stack.back();
    stack.pop_back();
    ++shape.size;
    if (node->is_string()) shape.size += static_cast<int64_t>(node->template get_ref<const std::string&>().size());
    if (!node->is_structured()) continue;
    shape.depth = std::max(shape.depth, depth);
    if (node->is_object()) {
      for (auto it = node->begin(); it != node->end(); ++it) {
        shape.size += static_cast<int64_t>(it.key().size());
        stack.emplace_back(&*it, depth + 1);
      }
    } else {
      for (const auto& child : *node) stack.emplace_back(&child, depth + 1);
    }
  }
  return shape;
}

template <typename Json>
absl::StatusOr<std::string> RenderJson(const jinja::Template& tpl, const Json& context) {
  if (!context.is_object()) {
    return absl::InvalidArgumentError("chat template: the render context must be a JSON object");
  }
  const JsonShape shape = MeasureJson(context);
  // The top-level object is not a template value: its members may nest kMaxValueDepth deep.
  if (shape.depth > jinja::kMaxValueDepth + 1) {
    return absl::InvalidArgumentError("chat template: the render context nests deeper than " +
                                      std::to_string(jinja::kMaxValueDepth) + " levels");
  }
  // Variables are converted on first use; their strings stay in `context`.
  auto lookup = [&context](std::string_view name, jinja::Value* value) {
    const auto it = context.find(name);
    if (it == context.end()) return false;
    *value = jinja::FromJson(*it);
    return true;
  };
  jinja::RenderLimits limits;
  limits.max_work = kWorkFloor + kWorkPerContextUnit * shape.size;
  return jinja::Render(tpl, lookup, limits);
}

}  // namespace

absl::StatusOr<std::unique_ptr<ChatTemplate>> ChatTemplate::Create(std::string_view source) {
  ASSIGN_OR_RETURN(std::unique_ptr<jinja::Template> tpl, jinja::ParseTemplate(source));
  return std::unique_ptr<ChatTemplate>(new ChatTemplate(std::move(tpl)));
}

ChatTemplate::ChatTemplate(std::unique_ptr<jinja::Template> tpl) : tpl_(std::move(tpl)) {}

ChatTemplate::~ChatTemplate() = default;

absl::StatusOr<std::string> ChatTemplate::Render(const nlohmann::ordered_json& context) const {
  return RenderJson(*tpl_, context);
}

absl::StatusOr<std::string> ChatTemplate::Render(const nlohmann::json& context) const {
  return RenderJson(*tpl_, context);
}

}  // namespace tandem::router
