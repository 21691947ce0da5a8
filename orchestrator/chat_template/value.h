// The chat-template interpreter's values, with Python's semantics as Jinja2
// sees them: Undefined (jinja2's default Undefined), None, bool, int, float,
// str, the list-like types (list, tuple, generator/iterator, dict views,
// range), dict (insertion-ordered) and a few objects (namespace, loop, macro,
// functions and bound methods).
//
// Ownership: a Value is cheap to copy. Containers are shared and immutable
// once built (the sandbox transformers renders in forbids mutating them);
// only a namespace's attributes and a loop's state change, and both live in
// one render. A string either owns its bytes or borrows them: borrowed
// strings point into the template (literals) or the render context (JSON),
// both of which outlive a render.
//
// Errors: operations that Python would reject return an absl::Status with
// code kUnknown and Python's message, without a position; the interpreter
// adds the template line (see interpreter.h).
//
// Thread safety: Values of one render are used by one thread.
#ifndef TANDEM_ORCHESTRATOR_CHAT_TEMPLATE_VALUE_H_
#define TANDEM_ORCHESTRATOR_CHAT_TEMPLATE_VALUE_H_

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/html.h"
#include "nlohmann/json.hpp"

namespace tandem::router::jinja {

class Value;
struct Object;

// How a sequence behaves: a plain list, a tuple (repr "(a, b)"), a one-shot
// iterator (generators of map/select/..., reversed(); no len(), no
// subscript, always truthy), a dict view (len, no subscript) or a range.
enum class ListKind : uint8_t { kList, kTuple, kIterator, kDictKeys, kDictValues, kDictItems, kRange };

// Values nest at most this deep: Python's own repr and json recurse, and a
// template could otherwise wrap a list in a list in a loop until printing
// (or freeing) it overflows the stack.
inline constexpr int kMaxValueDepth = 512;

struct List {
  ListKind kind = ListKind::kList;
  std::vector<Value> items;
  std::array<int64_t, 3> range_args{};  // kRange: start, stop, step (for repr).
  int depth = 1;                        // 1 + the deepest item's depth (Value::MakeList computes it).
};

// A Python dict: insertion-ordered entries with Python key equality
// (1 == 1.0 == True). Small dicts are searched linearly; past
// kIndexedSize entries string keys are also hashed, so that a request with a
// huge JSON object cannot make lookups quadratic.
struct Dict {
  static constexpr size_t kIndexedSize = 16;

  // Read-only outside Set/Append, which keep the index in step.
  std::vector<std::pair<Value, Value>> entries;

  const Value* Find(const Value& key) const;
  const Value* FindString(std::string_view key) const;
  // Replaces the value of an equal key in place or appends.
  void Set(Value key, Value value);
  // Appends a key known to be new (a JSON object's).
  void Append(Value key, Value value);

  int depth = 1;  // 1 + the deepest key's or value's depth; never decreases.

 private:
  void Index(size_t entry);
  absl::flat_hash_map<std::string_view, size_t> string_index_;  // Empty while small.
};

class Value {
 public:
  enum class Kind : uint8_t { kUndefined, kNone, kBool, kInt, kFloat, kString, kList, kDict, kObject };

  Value() = default;  // Undefined.
  static Value None() { return Value(Kind::kNone); }
  static Value Bool(bool b) {
    Value v(Kind::kBool);
    v.int_ = b;
    return v;
  }
  static Value Int(int64_t i) {
    Value v(Kind::kInt);
    v.int_ = i;
    return v;
  }
  static Value Float(double d) {
    Value v(Kind::kFloat);
    v.float_ = d;
    return v;
  }
  // REQUIRES: `s` outlives every copy of the value (template text, context).
  static Value Borrowed(std::string_view s) {
    Value v(Kind::kString);
    v.str_ = s;
    return v;
  }
  static Value String(std::string s);
  // A markupsafe.Markup string (from |escape or |safe): `+` escapes the other
  // operand, as Markup.__add__ does.
  static Value Markup(std::string s);
  static Value FromList(std::shared_ptr<const List> list) {
    Value v(Kind::kList);
    v.ref_ = std::const_pointer_cast<List>(std::move(list));
    return v;
  }
  static Value MakeList(std::vector<Value> items, ListKind kind = ListKind::kList);
  static Value FromDict(std::shared_ptr<const Dict> dict) {
    Value v(Kind::kDict);
    v.ref_ = std::const_pointer_cast<Dict>(std::move(dict));
    return v;
  }
  static Value FromObject(std::shared_ptr<Object> object) {
    Value v(Kind::kObject);
    v.ref_ = std::move(object);
    return v;
  }
  // An Undefined whose use fails with `message`, e.g. "'x' is undefined".
  static Value UndefinedWithMessage(std::string message);
  // jinja2's Undefined(obj=..., name=...): "'dict object' has no attribute 'x'".
  static Value MissingAttribute(const Value& obj, std::string_view name);
  static Value MissingItem(const Value& obj, const Value& key);
  // A part of string `s` that shares its storage. REQUIRES: `part` lies in s.str().
  static Value SubString(const Value& s, std::string_view part) {
    Value v = s;
    v.markup_ = false;
    v.str_ = part;
    return v;
  }

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::kUndefined; }
  bool is_none() const { return kind_ == Kind::kNone; }
  bool is_bool() const { return kind_ == Kind::kBool; }
  bool is_int() const { return kind_ == Kind::kInt; }
  bool is_float() const { return kind_ == Kind::kFloat; }
  // int or bool: Python's bool is an int.
  bool is_integral() const { return kind_ == Kind::kInt || kind_ == Kind::kBool; }
  bool is_number() const { return is_integral() || kind_ == Kind::kFloat; }
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_markup() const { return kind_ == Kind::kString && markup_; }
  bool is_list() const { return kind_ == Kind::kList; }
  bool is_dict() const { return kind_ == Kind::kDict; }
  bool is_object() const { return kind_ == Kind::kObject; }

  bool bool_value() const { return int_ != 0; }
  int64_t int_value() const { return int_; }  // REQUIRES: is_integral().
  double float_value() const { return float_; }
  // The value as a double. REQUIRES: is_number().
  double AsDouble() const { return kind_ == Kind::kFloat ? float_ : static_cast<double>(int_); }
  std::string_view str() const { return str_; }  // Strings; an Undefined's message.
  // REQUIRES: the matching kind.
  const List& list() const { return *static_cast<const List*>(ref_.get()); }
  const Dict& dict() const { return *static_cast<const Dict*>(ref_.get()); }
  Object& object() const { return *static_cast<Object*>(ref_.get()); }
  std::shared_ptr<Object> object_ptr() const { return std::static_pointer_cast<Object>(ref_); }
  const void* identity() const { return ref_.get(); }  // The shared container or object, for `is`.

  // The message that using this Undefined fails with.
  std::string UndefinedMessage() const;

 private:
  explicit Value(Kind kind) : kind_(kind) {}

  Kind kind_ = Kind::kUndefined;
  bool markup_ = false;
  union {
    int64_t int_ = 0;
    double float_;
  };
  std::string_view str_;
  // The owner: a string's bytes (std::string; null when borrowed), a List,
  // a Dict or an Object, as kind_ says. One untyped pointer keeps copies cheap.
  std::shared_ptr<void> ref_;
};

// Objects that are neither containers nor scalars. The interpreter defines
// the behaviour of each kind; this header only needs to print them.
struct Object {
  enum class Kind : uint8_t { kNamespace, kLoop, kMacro, kFunction, kMethod };
  explicit Object(Kind k) : kind(k) {}
  virtual ~Object() = default;
  const Kind kind;
};

// jinja2.utils.Namespace: attributes settable with {% set ns.attr = ... %}.
struct Namespace : Object {
  Namespace() : Object(Kind::kNamespace) {}
  Dict attrs;
};

// The `loop` variable of a for loop.
struct Loop : Object {
  Loop() : Object(Kind::kLoop) {}
  std::vector<Value> items;  // The iterated (filtered) items.
  int64_t index0 = 0;
  std::optional<Value> last_changed;  // loop.changed()'s memory.
};

struct MacroStmt;  // ast.h

// A {% macro %}: calling it renders its body in a new scope.
struct Macro : Object {
  Macro() : Object(Kind::kMacro) {}
  const MacroStmt* definition = nullptr;
  std::string_view name;  // Borrowed from the template.
  // The variables of the scopes around a definition inside a loop or block
  // (a Python closure; the top level is read at call time instead).
  std::vector<std::pair<int, Value>> closure;
};

// A built-in global function (range, namespace, ...) or a bound method
// (a string's split, a dict's get, loop.cycle): `id` indexes the
// interpreter's tables, `self` is the receiver of a method.
struct Callable : Object {
  explicit Callable(Kind k) : Object(k) {}
  std::string_view name;
  int id = -1;
  Value self;
};

// How deep containers nest in `v`: 0 for scalars and objects.
int Depth(const Value& v);

// Python's name of the value's type ('str', 'dict', 'NoneType', ...).
std::string_view TypeName(const Value& v);
// jinja2's object_type_repr: "dict object", "None", "str object".
std::string ObjectTypeRepr(const Value& v);

// bool(v).
bool Truthy(const Value& v);
// str(v) appended to `out`. Fails for values whose str() shows a memory
// address (functions, generators); Undefined prints as nothing.
absl::Status AppendStr(const Value& v, std::string* out);
absl::StatusOr<std::string> Str(const Value& v);
// repr(v) appended to `out`.
absl::Status AppendRepr(const Value& v, std::string* out);
// Appends repr(d) of a Python float ("1.0", "1e+20", "inf", "nan").
void AppendFloatRepr(double d, std::string* out);

// a == b.
bool Equals(const Value& a, const Value& b);
// a <op> b for the rich comparisons; a TypeError for unorderable types.
enum class CompareOp : uint8_t { kEq, kNe, kLt, kLe, kGt, kGe };
absl::StatusOr<bool> Compare(const Value& a, CompareOp op, const Value& b);
inline absl::StatusOr<bool> Less(const Value& a, const Value& b) { return Compare(a, CompareOp::kLt, b); }
// `item in container`.
absl::StatusOr<bool> Contains(const Value& container, const Value& item);
// len(v); a TypeError for values without a length.
absl::StatusOr<int64_t> Length(const Value& v);
// list(v)'s items: a list's items, a dict's keys, a string's characters;
// Undefined is empty; TypeError for non-iterables.
absl::StatusOr<std::vector<Value>> Iterate(const Value& v);
// Whether hash(v) works: dict keys and `in dict` need it.
bool IsHashable(const Value& v);

// json.dumps options, as transformers' tojson filter passes them.
struct JsonDumpOptions {
  bool ensure_ascii = false;
  std::optional<std::string> indent;  // Absent: one line.
  std::string item_separator = ", ";
  std::string key_separator = ": ";
  bool sort_keys = false;
};
absl::Status DumpJson(const Value& v, const JsonDumpOptions& options, std::string* out);

// Converts a JSON document; its strings are borrowed, so `json` must outlive
// the value.
Value FromJson(const nlohmann::json& json);
Value FromJson(const nlohmann::ordered_json& json);

// markupsafe.escape of a string: common/html.h's.
using ::tandem::HtmlEscape;

}  // namespace tandem::router::jinja

#endif  // TANDEM_ORCHESTRATOR_CHAT_TEMPLATE_VALUE_H_
