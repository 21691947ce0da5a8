#include "orchestrator/chat_template/chat_template.h"

#include <algorithm>
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

// The nesting depth of `json`, without recursion (a hostile request may nest deeply).
template <typename Json>
int JsonDepth(const Json& json) {
  int max_depth = 0;
  std::vector<std::pair<const Json*, int>> stack = {{&json, 1}};
  while (!stack.empty()) {
    const auto [node, depth] = stack.back();
    stack.pop_back();
    if (!node->is_structured()) continue;
    max_depth = std::max(max_depth, depth);
    for (const auto& child : *node) stack.emplace_back(&child, depth + 1);
  }
  return max_depth;
}

template <typename Json>
absl::StatusOr<std::string> RenderJson(const jinja::Template& tpl, const Json& context) {
  if (!context.is_object()) {
    return absl::InvalidArgumentError("chat template: the render context must be a JSON object");
  }
  // The top-level object is not a template value: its members may nest kMaxValueDepth deep.
  if (JsonDepth(context) > jinja::kMaxValueDepth + 1) {
    return absl::InvalidArgumentError(
        "chat template: the render context nests deeper than " + std::to_string(jinja::kMaxValueDepth) + " levels");
  }
  // Variables are converted on first use; their strings stay in `context`.
  auto lookup = [&context](std::string_view name, jinja::Value* value) {
    const auto it = context.find(name);
    if (it == context.end()) return false;
    *value = jinja::FromJson(*it);
    return true;
  };
  return jinja::Render(tpl, lookup, jinja::RenderLimits());
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
