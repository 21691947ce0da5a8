// A model's chat template: the Jinja2 program in tokenizer_config.json's
// "chat_template" that turns a conversation into prompt text. ChatTemplate
// renders it as Hugging Face transformers' apply_chat_template does: Jinja2
// with trim_blocks, lstrip_blocks and loop controls, Jinja2's default
// Undefined, in the immutable sandbox, with transformers' globals
// raise_exception(msg) and strftime_now(fmt), its tojson filter
// (json.dumps(x, ensure_ascii=False, indent=None, separators=None,
// sort_keys=False)) and its {% generation %} tag. Values behave as Python's
// (None, bool, int, float, str, list, dict; truthiness, ==, +, slicing,
// string methods), so the output is byte-for-byte what transformers gives.
//
// Supported: {{ }}, {% if/elif/else %}, {% for %} (tuple targets, `if`
// filter, else, the loop variable, break/continue), {% set %} (names,
// tuples, namespace attributes, blocks), {% macro %} and calls, {% filter %},
// {% with %}, {% raw %}, {% print %}, {% generation %}, comments and all
// whitespace control; the filters, tests, globals and methods listed in
// builtins.cc. Not supported (Create fails): include/extends/block/import,
// {% call %}, recursive loops, *args/**kwargs in calls, str.format.
// Integers are 64-bit (Python's are unbounded): overflow is an error.
// Known differences, all in corners no chat template uses: printing a
// function, method or generator (Python shows a memory address) is an
// error; markupsafe.Markup is modelled only for escape/safe and `+`;
// float round() to negative precision is approximate; `is sameas` on two
// equal string literals is false; the filters batch, slice, groupby,
// striptags, urlize, urlencode, wordwrap, xmlattr, pprint, filesizeformat
// and random are unknown (Create fails); macros take no *varargs/**kwargs.
//
// Contract: Create parses and validates once. A syntax error, an unknown
// filter, test or function, a call of a method the interpreter lacks, or an
// unsupported tag is InvalidArgument "chat template: line L col C: <why>",
// so that a bad template fails at startup, never per request. Render errors
// are InvalidArgument (a client's conversation is at fault, HTTP 400):
// raise_exception(msg) gives exactly msg; Python's runtime errors (a type
// error, using an undefined value) give "chat template: line L: <Python's
// message>"; so do the guards against runaway templates (output or any
// string over 16 MiB, more than a million loop iterations, macro calls
// nested over 50 deep, values nested over 512 deep). A context nested over
// 512 deep is refused before rendering.
//
// The render context is a JSON object of the template's variables:
// "messages", "add_generation_prompt", "bos_token", "eos_token", ... and any
// extras ("tools", "documents", "enable_thinking"). transformers always
// passes "tools" and "documents" (None when absent); callers should do the
// same. An ordered_json context keeps object key order, which tojson and
// dict.items() expose (Python dicts keep insertion order); nlohmann::json
// sorts keys.
//
// Thread safety: a ChatTemplate is immutable after Create; concurrent
// Render calls are safe. Render is a tree walk over the parsed template
// (no reparsing): tens of microseconds for a dozen messages through Qwen3's
// 4 KB template, about a tenth of what Jinja2 itself takes.
#ifndef TANDEM_ORCHESTRATOR_CHAT_TEMPLATE_CHAT_TEMPLATE_H_
#define TANDEM_ORCHESTRATOR_CHAT_TEMPLATE_CHAT_TEMPLATE_H_

#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace tandem::router {

namespace jinja {
struct Template;
}  // namespace jinja

class ChatTemplate {
 public:
  static absl::StatusOr<std::unique_ptr<ChatTemplate>> Create(std::string_view source);

  ChatTemplate(const ChatTemplate&) = delete;
  ChatTemplate& operator=(const ChatTemplate&) = delete;
  ~ChatTemplate();

  // REQUIRES: context is a JSON object (else InvalidArgument).
  absl::StatusOr<std::string> Render(const nlohmann::ordered_json& context) const;
  absl::StatusOr<std::string> Render(const nlohmann::json& context) const;

 private:
  explicit ChatTemplate(std::unique_ptr<jinja::Template> tpl);

  std::unique_ptr<jinja::Template> tpl_;
};

}  // namespace tandem::router

#endif  // TANDEM_ORCHESTRATOR_CHAT_TEMPLATE_CHAT_TEMPLATE_H_
