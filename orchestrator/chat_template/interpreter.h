// Renders a parsed chat template. Scoping follows Jinja2: the template's
// top level is one scope; each for-loop iteration, macro call, set block,
// filter block, {% with %} and {% generation %} body gets a new scope whose
// `set`s do not leak out (hence templates' namespace()); `if` opens none.
// Macros see the top-level scope, not their caller's.
//
// Errors: raise_exception(msg) is InvalidArgument(msg) exactly; every other
// runtime error is InvalidArgument "chat template: line L: <Python's
// message>". Helpers below the interpreter report positionless kUnknown
// statuses, which the innermost expression or statement turns into that
// form.
//
// Thread safety: Render only reads the Template; concurrent renders of one
// template are safe.
#ifndef TANDEM_ORCHESTRATOR_CHAT_TEMPLATE_INTERPRETER_H_
#define TANDEM_ORCHESTRATOR_CHAT_TEMPLATE_INTERPRETER_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "orchestrator/chat_template/ast.h"
#include "orchestrator/chat_template/value.h"

namespace tandem::router::jinja {

struct RenderLimits {
  // Output (and any captured block or macro output) beyond this fails.
  size_t max_output_bytes = size_t{16} << 20;
  // Loop iterations over the whole render.
  int64_t max_loop_iterations = 1'000'000;
  // Nested macro calls: recursion in a template is legal but must end.
  int max_call_depth = 50;
  // Expressions and statement bodies being evaluated at once. The parser
  // caps the template's own nesting; macro calls multiply it (50 calls deep
  // through 100 nested negations overflowed an 8 MB stack), so the render
  // counts the nesting it is in and stops at this. Under ASan a level costs
  // 8-16 KB of stack (1000 levels overflowed 8 MB, 500 did not); release
  // builds use well under 1 KB.
  int max_nesting = 400;
  // Macro calls over the whole render: a macro that calls itself twice is
  // 2^depth calls within max_call_depth (a fuzzer's template ran for minutes).
  int64_t max_macro_calls = 100'000;
  // Work over the whole render: one unit per expression evaluated plus one
  // per string byte or container item it yields, so reading a 1 MB string
  // costs a million. It bounds what the caps above leave open: a loop or a
  // macro that hands a long string to a filter on every pass scans it each
  // time (a fuzzer's template spent 10 s in |int within the macro cap).
  // ChatTemplate scales it with the size of the context.
  int64_t max_work = int64_t{1} << 20;
};

// Looks up a top-level render variable ("messages", "bos_token", ...) that
// no {% set %} has defined; returns false when the context lacks it.
using ContextLookup = absl::FunctionRef<bool(std::string_view name, Value* value)>;

absl::StatusOr<std::string> Render(const Template& tpl, ContextLookup context, const RenderLimits& limits);

}  // namespace tandem::router::jinja

#endif  // TANDEM_ORCHESTRATOR_CHAT_TEMPLATE_INTERPRETER_H_
