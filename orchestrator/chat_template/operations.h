// Python operators and Jinja2's sandboxed attribute/item access on Values:
// what `a + b`, `a // b`, `x.attr`, `x[key]`, `x[a:b:c]` and `fmt % args`
// do in a template rendered by transformers (ImmutableSandboxedEnvironment).
//
// Errors are positionless kUnknown statuses carrying Python's message
// (value.h); the interpreter adds the line.
#ifndef TANDEM_ORCHESTRATOR_CHAT_TEMPLATE_OPERATIONS_H_
#define TANDEM_ORCHESTRATOR_CHAT_TEMPLATE_OPERATIONS_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "orchestrator/chat_template/ast.h"
#include "orchestrator/chat_template/value.h"

namespace tandem::router::jinja {

// Every string or list a template builds is capped, so that a runaway
// template (a string doubling in a loop) fails instead of exhausting memory.
inline constexpr size_t kMaxStringBytes = size_t{16} << 20;
inline constexpr size_t kMaxListItems = size_t{1} << 20;
absl::Status CheckStringSize(size_t bytes);
absl::Status CheckListSize(size_t items);

// A positionless error with Python's message (kUnknown; see value.h).
absl::Status PyError(std::string message);
// The error for using an Undefined in an operation (jinja2's UndefinedError).
absl::Status UndefinedError(const Value& undefined);

// a <op> b for + - * / // % **.
absl::StatusOr<Value> BinaryOperation(BinaryOp op, const Value& a, const Value& b);
// -a and +a.
absl::StatusOr<Value> Negate(const Value& a);
absl::StatusOr<Value> UnaryPlus(const Value& a);

// environment.getattr(obj, name): the attribute (a bound method of str,
// dict, list; a namespace's or loop's attribute), else obj[name], else an
// Undefined. Fails only when `obj` is Undefined.
absl::StatusOr<Value> GetAttr(const Value& obj, std::string_view name);
// Python's getattr(obj, name) for the types templates see (methods of str,
// dict, list; a namespace's or loop's attributes); nullopt for
// AttributeError. Private (_x) names are hidden, as by the sandbox.
std::optional<Value> PythonAttribute(const Value& obj, std::string_view name);
// environment.getitem(obj, key): obj[key], else (for string keys) the
// attribute, else an Undefined. Fails only when `obj` is Undefined.
absl::StatusOr<Value> GetItem(const Value& obj, const Value& key);
// obj[start:stop:step] (absent bounds as None). Jinja does not route slices
// through getitem: an object that cannot be sliced, a bound that is not an
// integer or None, and a zero step fail as in Python.
absl::StatusOr<Value> GetSlice(const Value& obj, const Value& start, const Value& stop, const Value& step);
// Python's attribute of a loop object (index, first, ...); the interpreter
// calls cycle() and changed() through GetAttr.
Value LoopAttribute(const Value& loop, std::string_view name);

// printf-style `fmt % args`: `args` a tuple (several values), a dict
// (%(name)s) or a single value.
absl::StatusOr<Value> PercentFormat(std::string_view fmt, const Value& args);

// Python's int(str, base) and float(str); nullopt on ValueError.
std::optional<int64_t> ParsePyInt(std::string_view s, int base);
std::optional<double> ParsePyFloat(std::string_view s);

// Python's str.join of str(item) for each item.
absl::StatusOr<Value> JoinStrings(std::string_view separator, const std::vector<Value>& items);

}  // namespace tandem::router::jinja

#endif  // TANDEM_ORCHESTRATOR_CHAT_TEMPLATE_OPERATIONS_H_
