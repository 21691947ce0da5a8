// libFuzzer target: chat templates as an operator configures them and
// conversations and chat_template_kwargs as clients send them. An input is a
// template, optionally followed by the marker {#context#} and a JSON object:
// the client's part. Like the router's RenderChat, the context holds
// messages (a default conversation), tools and documents (null),
// add_generation_prompt, bos_token and eos_token, and the object's members
// are laid over them (kwargs). A template that parses is rendered; a
// template or context that the interpreter refuses must be InvalidArgument.
// The seeds are the real templates of testdata/templates with conversations
// from testdata/conversations.json, so mutations explore both adversarial
// templates and adversarial kwargs against real ones.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "nlohmann/json.hpp"
#include "orchestrator/chat_template/chat_template.h"

namespace tandem::router {
namespace {

constexpr std::string_view kMarker = "{#context#}";

nlohmann::ordered_json BaseContext() {
  nlohmann::ordered_json context = nlohmann::ordered_json::object();
  context["messages"] = nlohmann::ordered_json::array({{{"role", "system"}, {"content", "Be brief."}},
                                                       {{"role", "user"}, {"content", "Hi"}},
                                                       {{"role", "assistant"}, {"content", "Hello."}},
                                                       {{"role", "user"}, {"content", "And?"}}});
  context["tools"] = nullptr;
  context["documents"] = nullptr;
  context["add_generation_prompt"] = true;
  context["bos_token"] = "<|begin_of_text|>";
  context["eos_token"] = "<|eot_id|>";
  return context;
}

void CheckRefusal(const absl::Status& status) {
  if (status.code() != absl::StatusCode::kInvalidArgument) {
    std::fprintf(stderr, "a refusal that is not InvalidArgument: %s\n", status.ToString().c_str());
    std::abort();
  }
}

void RenderOne(std::string_view input) {
  std::string_view source = input;
  std::string_view client;
  if (const size_t at = input.find(kMarker); at != std::string_view::npos) {
    source = input.substr(0, at);
    client = input.substr(at + kMarker.size());
  }
  absl::StatusOr<std::unique_ptr<ChatTemplate>> tpl = ChatTemplate::Create(source);
  if (!tpl.ok()) {
    CheckRefusal(tpl.status());
    return;
  }
  nlohmann::ordered_json context = BaseContext();
  if (!client.empty()) {
    nlohmann::ordered_json kwargs = nlohmann::ordered_json::parse(client, nullptr, /*allow_exceptions=*/false);
    if (kwargs.is_object()) {
      for (auto it = kwargs.begin(); it != kwargs.end(); ++it) context[it.key()] = std::move(it.value());
    }
  }
  absl::StatusOr<std::string> text = (*tpl)->Render(context);
  if (!text.ok()) {
    CheckRefusal(text.status());
    return;
  }
  // The same through the sorted-key overload, as other callers use it (the
  // conversion recurses: only for a context that passed the depth check).
  const nlohmann::json sorted(context);
  absl::StatusOr<std::string> again = (*tpl)->Render(sorted);
  if (!again.ok()) CheckRefusal(again.status());
}

}  // namespace
}  // namespace tandem::router

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  tandem::router::RenderOne(std::string_view(reinterpret_cast<const char*>(data), size));
  return 0;
}
