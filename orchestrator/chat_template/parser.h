// The chat-template parser: Jinja2's grammar (jinja2/parser.py) for the
// tags transformers' environment knows (if, for, set, macro, filter, with,
// print, raw, break/continue from loopcontrols, generation from
// transformers), plus the validation that makes a template fail at startup
// rather than at request time: unknown filters and tests, calls of anything
// but the built-in globals, the template's own macros and the implemented
// methods, wrong built-in arguments, and unsupported tags (include, extends,
// block, import, call, autoescape, recursive loops) are InvalidArgument
// "chat template: line L col C: <why>".
#ifndef TANDEM_ORCHESTRATOR_CHAT_TEMPLATE_PARSER_H_
#define TANDEM_ORCHESTRATOR_CHAT_TEMPLATE_PARSER_H_

#include <memory>
#include <string_view>

#include "absl/status/statusor.h"
#include "orchestrator/chat_template/ast.h"

namespace tandem::router::jinja {

absl::StatusOr<std::unique_ptr<Template>> ParseTemplate(std::string_view source);

}  // namespace tandem::router::jinja

#endif  // TANDEM_ORCHESTRATOR_CHAT_TEMPLATE_PARSER_H_
