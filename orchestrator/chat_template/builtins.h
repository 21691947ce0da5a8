// The chat-template interpreter's built-ins: Jinja2's filters and tests,
// the globals of transformers' environment (range, namespace, dict,
// raise_exception, strftime_now) and the Python methods templates call on
// strings, dicts, lists and `loop`. Each has a Python-style signature that
// binds positional and keyword arguments; the parser checks calls against it
// at Create so that an unknown name or a wrong argument is a startup error.
//
// Only the built-ins listed in builtins.cc exist; the tables are fixed
// (a closed set, not a registry). Thread-safe: the tables are immutable.
#ifndef TANDEM_ORCHESTRATOR_CHAT_TEMPLATE_BUILTINS_H_
#define TANDEM_ORCHESTRATOR_CHAT_TEMPLATE_BUILTINS_H_

#include <cstddef>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "orchestrator/chat_template/value.h"

namespace tandem::router::jinja {

// The arguments of one call.
struct CallArgs {
  std::vector<Value> positional;
  std::vector<std::pair<std::string_view, Value>> keywords;
};

// A built-in's parameters after the value it applies to: Python's
// def f(value, p0=..., p1=...). `required` leading params must be given;
// `varargs` built-ins take any arguments and check them themselves.
struct Signature {
  std::vector<std::string_view> params;
  size_t required = 0;
  bool varargs = false;
  bool keywords = true;  // False for positional-only Python methods (str.strip).
};

// Who is called, for error messages: "filter 'trim'", "test 'odd'" or
// "split()" (kind empty). Built only when an error needs it.
struct Callee {
  std::string_view kind;
  std::string_view name;
};
std::string CalleeText(const Callee& callee);

// Arguments bound to a Signature: args[i] is the value of params[i], or
// null when not given.
class BoundArgs {
 public:
  const Value* operator[](size_t i) const { return i < slots_.size() ? slots_[i] : nullptr; }
  const CallArgs& call() const { return *call_; }

 private:
  friend absl::StatusOr<BoundArgs> Bind(const Callee& callee, const Signature& sig, const CallArgs& args);
  std::vector<const Value*> slots_;
  const CallArgs* call_ = nullptr;
};

// Binds `args` to `sig`.
absl::StatusOr<BoundArgs> Bind(const Callee& callee, const Signature& sig, const CallArgs& args);
// The same check with only the shape of a call, for the parser.
absl::Status CheckCallShape(const Callee& callee, const Signature& sig, size_t positional,
                            const std::vector<std::string_view>& keywords);

using BuiltinFn = absl::StatusOr<Value> (*)(const Value& self, const BoundArgs& args);

struct Builtin {
  std::string_view name;
  BuiltinFn fn;
  Signature signature;
};

// Index of a filter / test / global function by name, or -1.
int FindFilter(std::string_view name);
int FindTest(std::string_view name);
int FindGlobalFunction(std::string_view name);
const Builtin& Filter(int index);
const Builtin& Test(int index);
const Builtin& GlobalFunction(int index);

// Applies filter / test `name` (map('lower'), select('odd')); an error for
// unknown names.
absl::StatusOr<Value> ApplyFilter(std::string_view name, const Value& value, const CallArgs& args);
absl::StatusOr<bool> ApplyTest(std::string_view name, const Value& value, const CallArgs& args);

// Methods. The receiver's type decides which attribute names exist (Python
// semantics: `d.items` is dict.items even when d has an "items" key).
enum class Receiver : uint8_t { kStr, kDict, kList, kTuple, kLoop };
struct MethodLookup {
  bool exists = false;  // Python has the attribute.
  bool unsafe = false;  // The immutable sandbox forbids it (list.append, dict.pop).
  int id = -1;          // Index into the implemented methods; -1 when not implemented.
};
MethodLookup LookupMethod(Receiver receiver, std::string_view name);
const Builtin& Method(int id);
// Whether some receiver has an implemented method `name`: a template may
// call x.name(...) only then.
bool IsImplementedMethodName(std::string_view name);
// The signature of method `name` on the first receiver that implements it.
const Signature* MethodSignature(std::string_view name);

// Calls a global function, method or filter with bound checking.
absl::StatusOr<Value> CallBuiltin(const Callee& callee, const Builtin& builtin, const Value& self,
                                  const CallArgs& args);

}  // namespace tandem::router::jinja

#endif  // TANDEM_ORCHESTRATOR_CHAT_TEMPLATE_BUILTINS_H_
