#include "orchestrator/chat_template/operations.h"

#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <utility>
#include <vector>

#include "common/status_macros.h"
#include "orchestrator/chat_template/builtins.h"
#include "orchestrator/chat_template/py_text.h"
#include "orchestrator/chat_template/str_cat.h"

namespace tandem::router::jinja {
namespace {

std::string_view OpSymbol(BinaryOp op) {
  switch (op) {
    case BinaryOp::kAdd:
      return "+";
    case BinaryOp::kSub:
      return "-";
    case BinaryOp::kMul:
      return "*";
    case BinaryOp::kDiv:
      return "/";
    case BinaryOp::kFloorDiv:
      return "//";
    case BinaryOp::kMod:
      return "%";
    case BinaryOp::kPow:
      return "** or pow()";
  }
  return "?";
}

absl::Status UnsupportedOperands(BinaryOp op, const Value& a, const Value& b) {
  return PyError(
      Cat("unsupported operand type(s) for ", OpSymbol(op), ": '", TypeName(a), "' and '", TypeName(b), "'"));
}

absl::Status IntegerOverflow() { return PyError("integer overflow (only 64-bit integers are supported)"); }

absl::StatusOr<Value> Repeat(const Value& seq, int64_t times) {
  if (times <= 0) {
    return seq.is_string() ? Value::Borrowed("") : Value::MakeList({}, seq.list().kind);
  }
  if (seq.is_string()) {
    RETURN_IF_ERROR(CheckStringSize(seq.str().size() * static_cast<size_t>(std::min<int64_t>(times, 1 << 30))));
    std::string out;
    out.reserve(seq.str().size() * times);
    for (int64_t i = 0; i < times; ++i) out.append(seq.str());
    return Value::String(std::move(out));
  }
  const auto& items = seq.list().items;
  RETURN_IF_ERROR(CheckListSize(items.size() * static_cast<size_t>(std::min<int64_t>(times, 1 << 30))));
  std::vector<Value> out;
  out.reserve(items.size() * times);
  for (int64_t i = 0; i < times; ++i) out.insert(out.end(), items.begin(), items.end());
  return Value::MakeList(std::move(out), seq.list().kind);
}

bool IsRepeatable(const Value& v) {
  return v.is_string() || (v.is_list() && (v.list().kind == ListKind::kList || v.list().kind == ListKind::kTuple));
}

absl::StatusOr<Value> IntPow(int64_t base, int64_t exp) {
  int64_t result = 1;
  while (exp > 0) {
    if (exp & 1) {
      if (__builtin_mul_overflow(result, base, &result)) return IntegerOverflow();
    }
    exp >>= 1;
    if (exp > 0 && __builtin_mul_overflow(base, base, &base)) return IntegerOverflow();
  }
  return Value::Int(result);
}

absl::StatusOr<Value> FloatOp(BinaryOp op, double x, double y) {
  switch (op) {
    case BinaryOp::kAdd:
      return Value::Float(x + y);
    case BinaryOp::kSub:
      return Value::Float(x - y);
    case BinaryOp::kMul:
      return Value::Float(x * y);
    case BinaryOp::kDiv:
      if (y == 0) return PyError("float division by zero");
      return Value::Float(x / y);
    case BinaryOp::kFloorDiv:
    case BinaryOp::kMod: {
      if (y == 0) return PyError(op == BinaryOp::kMod ? "float modulo" : "float floor division by zero");
      // CPython's _float_div_mod.
      double mod = std::fmod(x, y);
      double div = (x - mod) / y;
      if (mod != 0) {
        if ((y < 0) != (mod < 0)) {
          mod += y;
          div -= 1.0;
        }
      } else {
        mod = std::copysign(0.0, y);
      }
      if (op == BinaryOp::kMod) return Value::Float(mod);
      double floordiv;
      if (div != 0) {
        floordiv = std::floor(div);
        if (div - floordiv > 0.5) floordiv += 1.0;
      } else {
        floordiv = std::copysign(0.0, x / y);
      }
      return Value::Float(floordiv);
    }
    case BinaryOp::kPow:
      if (x == 0 && y < 0) return PyError("0.0 cannot be raised to a negative power");
      if (x < 0 && std::isfinite(y) && y != std::floor(y)) {
        return PyError("a negative number to a fractional power is complex (unsupported)");
      }
      return Value::Float(std::pow(x, y));
  }
  return Value::Float(0);
}

absl::StatusOr<Value> IntOp(BinaryOp op, int64_t x, int64_t y) {
  int64_t r;
  switch (op) {
    case BinaryOp::kAdd:
      if (__builtin_add_overflow(x, y, &r)) return IntegerOverflow();
      return Value::Int(r);
    case BinaryOp::kSub:
      if (__builtin_sub_overflow(x, y, &r)) return IntegerOverflow();
      return Value::Int(r);
    case BinaryOp::kMul:
      if (__builtin_mul_overflow(x, y, &r)) return IntegerOverflow();
      return Value::Int(r);
    case BinaryOp::kDiv:
      if (y == 0) return PyError("division by zero");
      return Value::Float(static_cast<double>(x) / static_cast<double>(y));
    case BinaryOp::kFloorDiv: {
      if (y == 0) return PyError("integer division or modulo by zero");
      if (x == INT64_MIN && y == -1) return IntegerOverflow();
      int64_t q = x / y;
      if ((x % y != 0) && ((x < 0) != (y < 0))) --q;
      return Value::Int(q);
    }
    case BinaryOp::kMod: {
      if (y == 0) return PyError("integer division or modulo by zero");
      if (y == -1) return Value::Int(0);
      int64_t m = x % y;
      if (m != 0 && ((m < 0) != (y < 0))) m += y;
      return Value::Int(m);
    }
    case BinaryOp::kPow:
      if (y < 0) return FloatOp(op, static_cast<double>(x), static_cast<double>(y));
      return IntPow(x, y);
  }
  return Value::Int(0);
}

Receiver ReceiverOf(const Value& v, bool* ok) {
  *ok = true;
  if (v.is_string()) return Receiver::kStr;
  if (v.is_dict()) return Receiver::kDict;
  if (v.is_list() && v.list().kind == ListKind::kList) return Receiver::kList;
  if (v.is_list() && v.list().kind == ListKind::kTuple) return Receiver::kTuple;
  if (v.is_object() && v.object().kind == Object::Kind::kLoop) return Receiver::kLoop;
  *ok = false;
  return Receiver::kStr;
}

}  // namespace

std::optional<Value> PythonAttribute(const Value& obj, std::string_view name) {
  if (!name.empty() && name[0] == '_') {  // The sandbox hides private attributes.
    return std::nullopt;
  }
  bool has_methods;
  const Receiver receiver = ReceiverOf(obj, &has_methods);
  if (has_methods) {
    const MethodLookup m = LookupMethod(receiver, name);
    if (m.unsafe) {
      return Value::UndefinedWithMessage(
          Cat("access to attribute '", name, "' of '", TypeName(obj), "' object is unsafe."));
    }
    if (m.exists) {
      auto method = std::make_shared<Callable>(Object::Kind::kMethod);
      method->name = name;
      method->id = m.id;
      method->self = obj;
      return Value::FromObject(std::move(method));
    }
  }
  if (obj.is_object()) {
    Object& object = obj.object();
    if (object.kind == Object::Kind::kNamespace) {
      const Value* v = static_cast<Namespace&>(object).attrs.FindString(name);
      if (v != nullptr) return *v;
    } else if (object.kind == Object::Kind::kLoop) {
      Value v = LoopAttribute(obj, name);
      if (!v.is_undefined() || name == "previtem" || name == "nextitem") return v;
    }
  }
  return std::nullopt;
}

namespace {

// Python's slice.indices(length) and the selected indices.
std::vector<int64_t> SliceIndices(int64_t length, std::optional<int64_t> start, std::optional<int64_t> stop,
                                  int64_t step) {
  int64_t lo, hi;
  if (step > 0) {
    lo = start.value_or(0);
    hi = stop.value_or(length);
    if (lo < 0) lo = std::max<int64_t>(lo + length, 0);
    if (hi < 0) hi = std::max<int64_t>(hi + length, 0);
    lo = std::min(lo, length);
    hi = std::min(hi, length);
  } else {
    lo = start.value_or(length - 1);
    hi = stop.value_or(-1 - length);  // "before the first" after the adjustment below
    if (lo < 0) lo = std::max<int64_t>(lo + length, -1);
    if (hi < 0) hi = std::max<int64_t>(hi + length, -1);
    lo = std::min(lo, length - 1);
    hi = std::min(hi, length - 1);
  }
  std::vector<int64_t> out;
  for (int64_t i = lo; step > 0 ? i < hi : i > hi; i += step) out.push_back(i);
  return out;
}

// One conversion of PercentFormat.
struct FormatSpec {
  bool left = false, plus = false, space = false, alt = false, zero = false;
  int width = -1;
  int precision = -1;
  char conversion = 0;
};

std::string Pad(std::string body, const FormatSpec& spec, bool numeric) {
  const int len = static_cast<int>(CodePointCount(body));
  if (spec.width <= len) return body;
  const size_t fill = spec.width - len;
  if (spec.left) return body + std::string(fill, ' ');
  if (spec.zero && numeric) {
    size_t sign = (!body.empty() && (body[0] == '-' || body[0] == '+' || body[0] == ' ')) ? 1 : 0;
    if (body.size() > sign + 1 && body[sign] == '0' && (body[sign + 1] | 0x20) != '.' &&
        std::string_view("xXo").find(body[sign + 1]) != std::string_view::npos) {
      sign += 2;  // After 0x / 0o.
    }
    return body.substr(0, sign) + std::string(fill, '0') + body.substr(sign);
  }
  return std::string(fill, ' ') + body;
}

absl::StatusOr<std::string> FormatOne(const FormatSpec& spec, const Value& v) {
  switch (spec.conversion) {
    case 's':
    case 'r':
    case 'a': {
      std::string s;
      if (spec.conversion == 's') {
        ASSIGN_OR_RETURN(s, Str(v));
      } else {
        RETURN_IF_ERROR(AppendRepr(v, &s));
      }
      if (spec.precision >= 0) {
        const std::vector<size_t> offsets = CodePointOffsets(s);
        if (static_cast<size_t>(spec.precision) + 1 < offsets.size()) s.resize(offsets[spec.precision]);
      }
      return Pad(std::move(s), spec, false);
    }
    case 'd':
    case 'i':
    case 'u':
    case 'x':
    case 'X':
    case 'o':
    case 'c': {
      int64_t n = 0;
      // A float past int64 (Python's ints have no limit): the exact decimal
      // digits of its integer part, which is what int(x) prints.
      std::string float_digits;
      bool float_negative = false;
      if (v.is_integral()) {
        n = v.int_value();
      } else if (v.is_float() && (spec.conversion == 'd' || spec.conversion == 'i' || spec.conversion == 'u')) {
        if (!std::isfinite(v.float_value())) return PyError("cannot convert float infinity or NaN to integer");
        const double whole = std::trunc(v.float_value());
        if (std::fabs(whole) < 9223372036854775808.0) {  // 2^63: the cast is defined
          n = static_cast<int64_t>(whole);
        } else {
          char big[400];  // DBL_MAX has 309 digits
          std::snprintf(big, sizeof(big), "%.0f", std::fabs(whole));
          float_digits = big;
          float_negative = whole < 0;
        }
      } else if (spec.conversion == 'c' && v.is_string() && CodePointCount(v.str()) == 1) {
        return Pad(std::string(v.str()), spec, false);
      } else {
        if (v.is_undefined()) return UndefinedError(v);
        return PyError(Cat("%", std::string(1, spec.conversion), " format: a ",
                           spec.conversion == 'd' || spec.conversion == 'i' ? "real number" : "integer",
                           " is required, not ", TypeName(v)));
      }
      std::string body;
      if (spec.conversion == 'c') {
        if (n < 0 || n > 0x10FFFF) return PyError("%c arg not in range(0x110000)");
        AppendUtf8(static_cast<char32_t>(n), &body);
        return Pad(std::move(body), spec, false);
      }
      const bool negative = float_digits.empty() ? n < 0 : float_negative;
      const uint64_t magnitude = n < 0 ? 0 - static_cast<uint64_t>(n) : static_cast<uint64_t>(n);
      std::string digits = std::move(float_digits);
      if (digits.empty()) {
        char buf[80];
        if (spec.conversion == 'x' || spec.conversion == 'X') {
          std::snprintf(buf, sizeof(buf), spec.conversion == 'x' ? "%llx" : "%llX",
                        static_cast<unsigned long long>(magnitude));
        } else if (spec.conversion == 'o') {
          std::snprintf(buf, sizeof(buf), "%llo", static_cast<unsigned long long>(magnitude));
        } else {
          std::snprintf(buf, sizeof(buf), "%llu", static_cast<unsigned long long>(magnitude));
        }
        digits = buf;
      }
      if (spec.precision >= 0 && static_cast<int>(digits.size()) < spec.precision) {
        digits.insert(0, spec.precision - digits.size(), '0');
      }
      if (spec.alt && spec.conversion != 'd' && spec.conversion != 'i' && spec.conversion != 'u') {
        digits.insert(0, spec.conversion == 'o' ? "0o" : spec.conversion == 'x' ? "0x" : "0X");
      }
      body = negative ? "-" : spec.plus ? "+" : spec.space ? " " : "";
      body += digits;
      return Pad(std::move(body), spec, true);
    }
    case 'f':
    case 'F':
    case 'e':
    case 'E':
    case 'g':
    case 'G': {
      if (!v.is_number()) {
        if (v.is_undefined()) return UndefinedError(v);
        return PyError(Cat("must be real number, not ", TypeName(v)));
      }
      std::string fmt = "%";
      if (spec.plus) fmt += '+';
      if (spec.space) fmt += ' ';
      if (spec.alt) fmt += '#';
      fmt += '.';
      fmt += std::to_string(spec.precision >= 0 ? spec.precision : 6);
      fmt += spec.conversion;
      char buf[512];
      const double d = v.AsDouble();
      if (std::fabs(d) >= 1e100 && (spec.conversion == 'f' || spec.conversion == 'F')) {
        return PyError("%f of a number this large is not supported");
      }
      std::snprintf(buf, sizeof(buf), fmt.c_str(), d);
      return Pad(buf, spec, std::isfinite(d));
    }
    default:
      return PyError(Cat("unsupported format character '", std::string(1, spec.conversion), "'"));
  }
}

bool ParseDigitsWithUnderscores(std::string_view s, int base, uint64_t* value, bool* overflow) {
  if (s.empty() || s.front() == '_' || s.back() == '_') return false;
  *value = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    if (c == '_') {
      if (s[i - 1] == '_') return false;
      continue;
    }
    int d;
    if (c >= '0' && c <= '9') {
      d = c - '0';
    } else if ((c | 0x20) >= 'a' && (c | 0x20) <= 'z') {
      d = (c | 0x20) - 'a' + 10;
    } else {
      return false;
    }
    if (d >= base) return false;
    if (__builtin_mul_overflow(*value, static_cast<uint64_t>(base), value) ||
        __builtin_add_overflow(*value, static_cast<uint64_t>(d), value)) {
      *overflow = true;
    }
  }
  return true;
}

}  // namespace

absl::Status CheckStringSize(size_t bytes) {
  if (bytes > kMaxStringBytes) {
    return PyError(Cat("string of ", bytes, " bytes exceeds the chat template limit of ", kMaxStringBytes));
  }
  return absl::OkStatus();
}

absl::Status CheckListSize(size_t items) {
  if (items > kMaxListItems) {
    return PyError(Cat("list of ", items, " items exceeds the chat template limit of ", kMaxListItems));
  }
  return absl::OkStatus();
}

absl::Status PyError(std::string message) { return absl::UnknownError(std::move(message)); }

absl::Status UndefinedError(const Value& undefined) { return PyError(undefined.UndefinedMessage()); }

absl::StatusOr<Value> BinaryOperation(BinaryOp op, const Value& a, const Value& b) {
  if (a.is_undefined()) return UndefinedError(a);
  if (b.is_undefined()) return UndefinedError(b);
  if (a.is_number() && b.is_number()) {
    if (a.is_integral() && b.is_integral()) return IntOp(op, a.int_value(), b.int_value());
    return FloatOp(op, a.AsDouble(), b.AsDouble());
  }
  switch (op) {
    case BinaryOp::kAdd:
      if (a.is_string() && b.is_string()) {
        RETURN_IF_ERROR(CheckStringSize(a.str().size() + b.str().size()));
        if (a.is_markup() || b.is_markup()) {  // Markup.__add__ / __radd__ escape the plain side.
          std::string out = a.is_markup() ? std::string(a.str()) : HtmlEscape(a.str());
          out += b.is_markup() ? std::string(b.str()) : HtmlEscape(b.str());
          return Value::Markup(std::move(out));
        }
        std::string out;
        out.reserve(a.str().size() + b.str().size());
        out.append(a.str());
        out.append(b.str());
        return Value::String(std::move(out));
      }
      if (a.is_string()) {
        return PyError(Cat("can only concatenate str (not \"", TypeName(b), "\") to str"));
      }
      if (IsRepeatable(a) && b.is_list()) {
        if (b.list().kind != a.list().kind) {
          return PyError(Cat("can only concatenate ", TypeName(a), " (not \"", TypeName(b), "\") to ", TypeName(a)));
        }
        RETURN_IF_ERROR(CheckListSize(a.list().items.size() + b.list().items.size()));
        std::vector<Value> items = a.list().items;
        items.insert(items.end(), b.list().items.begin(), b.list().items.end());
        return Value::MakeList(std::move(items), a.list().kind);
      }
      break;
    case BinaryOp::kMul:
      if (IsRepeatable(a) && b.is_integral()) return Repeat(a, b.int_value());
      if (a.is_integral() && IsRepeatable(b)) return Repeat(b, a.int_value());
      break;
    case BinaryOp::kMod:
      if (a.is_string()) return PercentFormat(a.str(), b);
      break;
    default:
      break;
  }
  return UnsupportedOperands(op, a, b);
}

absl::StatusOr<Value> Negate(const Value& a) {
  if (a.is_undefined()) return UndefinedError(a);
  if (a.is_integral()) {
    if (a.int_value() == INT64_MIN) return IntegerOverflow();
    return Value::Int(-a.int_value());
  }
  if (a.is_float()) return Value::Float(-a.float_value());
  return PyError(Cat("bad operand type for unary -: '", TypeName(a), "'"));
}

absl::StatusOr<Value> UnaryPlus(const Value& a) {
  if (a.is_undefined()) return UndefinedError(a);
  if (a.is_integral()) return Value::Int(a.int_value());
  if (a.is_float()) return a;
  return PyError(Cat("bad operand type for unary +: '", TypeName(a), "'"));
}

Value LoopAttribute(const Value& loop_value, std::string_view name) {
  const auto& loop = static_cast<const Loop&>(loop_value.object());
  const int64_t length = static_cast<int64_t>(loop.items.size());
  const int64_t i = loop.index0;
  if (name == "index") return Value::Int(i + 1);
  if (name == "index0") return Value::Int(i);
  if (name == "revindex") return Value::Int(length - i);
  if (name == "revindex0") return Value::Int(length - i - 1);
  if (name == "first") return Value::Bool(i == 0);
  if (name == "last") return Value::Bool(i == length - 1);
  if (name == "length") return Value::Int(length);
  if (name == "depth") return Value::Int(1);
  if (name == "depth0") return Value::Int(0);
  if (name == "previtem") {
    return i > 0 ? loop.items[i - 1] : Value::UndefinedWithMessage("there is no previous item");
  }
  if (name == "nextitem") {
    return i + 1 < length ? loop.items[i + 1] : Value::UndefinedWithMessage("there is no next item");
  }
  return Value();
}

absl::StatusOr<Value> GetAttr(const Value& obj, std::string_view name) {
  if (obj.is_undefined()) return UndefinedError(obj);
  if (std::optional<Value> attr = PythonAttribute(obj, name)) return *std::move(attr);
  if (obj.is_dict()) {
    if (const Value* v = obj.dict().FindString(name)) return *v;
  }
  return Value::MissingAttribute(obj, name);
}

absl::StatusOr<Value> GetItem(const Value& obj, const Value& key) {
  if (obj.is_undefined()) return UndefinedError(obj);
  if (obj.is_dict()) {
    if (IsHashable(key)) {
      if (const Value* v = obj.dict().Find(key)) return *v;
    }
  } else if (key.is_integral() && (obj.is_string() || (obj.is_list() && (obj.list().kind == ListKind::kList ||
                                                                         obj.list().kind == ListKind::kTuple ||
                                                                         obj.list().kind == ListKind::kRange)))) {
    int64_t i = key.int_value();
    if (obj.is_string()) {
      const std::string_view s = obj.str();
      const bool ascii = CodePointCount(s) == s.size();
      if (ascii) {
        const int64_t n = static_cast<int64_t>(s.size());
        if (i < 0) i += n;
        if (i >= 0 && i < n) return Value::SubString(obj, s.substr(i, 1));
      } else {
        const std::vector<size_t> offsets = CodePointOffsets(s);
        const int64_t n = static_cast<int64_t>(offsets.size()) - 1;
        if (i < 0) i += n;
        if (i >= 0 && i < n) return Value::SubString(obj, s.substr(offsets[i], offsets[i + 1] - offsets[i]));
      }
    } else {
      const auto& items = obj.list().items;
      const int64_t n = static_cast<int64_t>(items.size());
      if (i < 0) i += n;
      if (i >= 0 && i < n) return items[i];
    }
    return Value::MissingItem(obj, key);
  }
  if (key.is_string()) {
    if (std::optional<Value> attr = PythonAttribute(obj, key.str())) return *std::move(attr);
  }
  return Value::MissingItem(obj, key);
}

absl::StatusOr<Value> GetSlice(const Value& obj, const Value& start, const Value& stop, const Value& step) {
  if (obj.is_undefined()) return UndefinedError(obj);
  auto bound = [](const Value& v, bool* ok) -> std::optional<int64_t> {
    if (v.is_none()) return std::nullopt;
    if (v.is_integral()) return v.int_value();
    *ok = false;
    return std::nullopt;
  };
  bool ok = true;
  const std::optional<int64_t> lo = bound(start, &ok);
  const std::optional<int64_t> hi = bound(stop, &ok);
  const std::optional<int64_t> by = bound(step, &ok);
  const bool sliceable =
      obj.is_string() || (obj.is_list() && (obj.list().kind == ListKind::kList || obj.list().kind == ListKind::kTuple ||
                                            obj.list().kind == ListKind::kRange));
  // Jinja compiles slices to a plain obj[a:b:c] (not environment.getitem), so
  // Python's errors surface instead of becoming Undefined.
  if (!sliceable) {
    if (obj.is_dict()) return PyError("unhashable type: 'slice'");
    return PyError(Cat("'", TypeName(obj), "' object is not subscriptable"));
  }
  if (!ok) return PyError("slice indices must be integers or None or have an __index__ method");
  const int64_t step_value = by.value_or(1);
  if (step_value == 0) return PyError("slice step cannot be zero");
  if (obj.is_string()) {
    const std::string_view s = obj.str();
    if (step_value == 1 && CodePointCount(s) == s.size()) {
      const std::vector<int64_t> idx = SliceIndices(static_cast<int64_t>(s.size()), lo, hi, 1);
      if (idx.empty()) return Value::Borrowed("");
      return Value::SubString(obj, s.substr(idx.front(), idx.size()));
    }
    const std::vector<size_t> offsets = CodePointOffsets(s);
    const std::vector<int64_t> idx = SliceIndices(static_cast<int64_t>(offsets.size()) - 1, lo, hi, step_value);
    if (step_value == 1) {
      if (idx.empty()) return Value::Borrowed("");
      return Value::SubString(obj, s.substr(offsets[idx.front()], offsets[idx.back() + 1] - offsets[idx.front()]));
    }
    std::string out;
    for (int64_t i : idx) out.append(s.substr(offsets[i], offsets[i + 1] - offsets[i]));
    return Value::String(std::move(out));
  }
  const List& list = obj.list();
  const std::vector<int64_t> idx = SliceIndices(static_cast<int64_t>(list.items.size()), lo, hi, step_value);
  std::vector<Value> items;
  items.reserve(idx.size());
  for (int64_t i : idx) items.push_back(list.items[i]);
  if (list.kind != ListKind::kRange) return Value::MakeList(std::move(items), list.kind);
  // A slice of a range is a range: keep its repr arguments.
  auto range = std::make_shared<List>();
  range->kind = ListKind::kRange;
  const int64_t new_step = list.range_args[2] * step_value;
  const int64_t first = idx.empty() ? 0 : items.front().int_value();
  range->range_args = {idx.empty() ? list.range_args[0] : first,
                       idx.empty() ? list.range_args[0] : items.back().int_value() + new_step, new_step};
  range->items = std::move(items);
  return Value::FromList(std::move(range));
}

absl::StatusOr<Value> PercentFormat(std::string_view fmt, const Value& args) {
  std::vector<Value> positional;
  const Dict* mapping = nullptr;
  if (args.is_list() && args.list().kind == ListKind::kTuple) {
    positional = args.list().items;
  } else {
    if (args.is_dict()) mapping = &args.dict();
    positional.push_back(args);
  }
  size_t next_arg = 0;
  bool used_mapping = false;
  std::string out;
  for (size_t i = 0; i < fmt.size(); ++i) {
    if (fmt[i] != '%') {
      out.push_back(fmt[i]);
      continue;
    }
    if (++i >= fmt.size()) return PyError("incomplete format");
    if (fmt[i] == '%') {
      out.push_back('%');
      continue;
    }
    const Value* arg = nullptr;
    if (fmt[i] == '(') {
      const size_t close = fmt.find(')', i);
      if (close == std::string_view::npos) return PyError("incomplete format key");
      if (mapping == nullptr) return PyError("format requires a mapping");
      arg = mapping->FindString(fmt.substr(i + 1, close - i - 1));
      if (arg == nullptr) return PyError(Cat("'", fmt.substr(i + 1, close - i - 1), "'"));  // KeyError
      used_mapping = true;
      i = close + 1;
    }
    FormatSpec spec;
    for (; i < fmt.size(); ++i) {
      const char c = fmt[i];
      if (c == '-')
        spec.left = true;
      else if (c == '+')
        spec.plus = true;
      else if (c == ' ')
        spec.space = true;
      else if (c == '#')
        spec.alt = true;
      else if (c == '0')
        spec.zero = true;
      else
        break;
    }
    auto number = [&](int* out_value) {
      if (i < fmt.size() && fmt[i] == '*') return false;
      int v = -1;
      while (i < fmt.size() && fmt[i] >= '0' && fmt[i] <= '9') {
        v = (v < 0 ? 0 : v) * 10 + (fmt[i++] - '0');
        if (v > 100000) return false;
      }
      *out_value = v;
      return true;
    };
    if (!number(&spec.width)) return PyError("'*' widths and huge widths are not supported");
    if (i < fmt.size() && fmt[i] == '.') {
      ++i;
      if (!number(&spec.precision)) return PyError("'*' precisions and huge precisions are not supported");
      if (spec.precision < 0) spec.precision = 0;
    }
    while (i < fmt.size() && (fmt[i] == 'h' || fmt[i] == 'l' || fmt[i] == 'L')) ++i;
    if (i >= fmt.size()) return PyError("incomplete format");
    spec.conversion = fmt[i];
    if (arg == nullptr) {
      if (next_arg >= positional.size()) return PyError("not enough arguments for format string");
      arg = &positional[next_arg++];
    }
    ASSIGN_OR_RETURN(std::string piece, FormatOne(spec, *arg));
    out += piece;
    RETURN_IF_ERROR(CheckStringSize(out.size()));
  }
  if (next_arg < positional.size() && mapping == nullptr) {
    return PyError("not all arguments converted during string formatting");
  }
  (void)used_mapping;
  return Value::String(std::move(out));
}

std::optional<int64_t> ParsePyInt(std::string_view text, int base) {
  const std::string ascii = PyDecimalsToAscii(text);
  std::string_view s = PyStrip(ascii, std::nullopt, true, true);
  bool negative = false;
  if (!s.empty() && (s[0] == '+' || s[0] == '-')) {
    negative = s[0] == '-';
    s.remove_prefix(1);
  }
  auto prefix_base = [&](std::string_view t) {
    if (t.size() < 2 || t[0] != '0') return 0;
    const char p = static_cast<char>(t[1] | 0x20);
    return p == 'x' ? 16 : p == 'o' ? 8 : p == 'b' ? 2 : 0;
  };
  const int prefixed = prefix_base(s);
  if (base == 0) {
    if (prefixed != 0) {
      base = prefixed;
      s.remove_prefix(2);
    } else {
      base = 10;
      // Base 0 rejects leading zeros ("010") except for zero itself.
      if (s.size() > 1 && s[0] == '0' && s.find_first_not_of("0_") != std::string_view::npos) return std::nullopt;
    }
  } else if (prefixed != 0 && prefixed == base) {
    s.remove_prefix(2);
    if (!s.empty() && s[0] == '_') s.remove_prefix(1);
  }
  if (base < 2 || base > 36) return std::nullopt;
  uint64_t magnitude = 0;
  bool overflow = false;
  if (!ParseDigitsWithUnderscores(s, base, &magnitude, &overflow) || overflow) return std::nullopt;
  if (negative) {
    if (magnitude > static_cast<uint64_t>(INT64_MAX) + 1) return std::nullopt;
    return static_cast<int64_t>(0 - magnitude);
  }
  if (magnitude > static_cast<uint64_t>(INT64_MAX)) return std::nullopt;
  return static_cast<int64_t>(magnitude);
}

std::optional<double> ParsePyFloat(std::string_view input) {
  const std::string ascii = PyDecimalsToAscii(input);
  std::string_view s = PyStrip(ascii, std::nullopt, true, true);
  std::string text;
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    if (c == '_') {  // Only between digits.
      if (i == 0 || i + 1 >= s.size() || !std::isdigit(static_cast<unsigned char>(s[i - 1])) ||
          !std::isdigit(static_cast<unsigned char>(s[i + 1]))) {
        return std::nullopt;
      }
      continue;
    }
    text.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  }
  std::string_view body = text;
  bool negative = false;
  if (!body.empty() && (body[0] == '+' || body[0] == '-')) {
    negative = body[0] == '-';
    body.remove_prefix(1);
  }
  if (body == "inf" || body == "infinity") return negative ? -HUGE_VAL : HUGE_VAL;
  if (body == "nan") return std::nan("");
  // [digits][.digits][e[sign]digits], with at least one digit in the mantissa.
  size_t i = 0;
  size_t mantissa_digits = 0;
  while (i < body.size() && std::isdigit(static_cast<unsigned char>(body[i]))) ++i, ++mantissa_digits;
  if (i < body.size() && body[i] == '.') {
    ++i;
    while (i < body.size() && std::isdigit(static_cast<unsigned char>(body[i]))) ++i, ++mantissa_digits;
  }
  if (mantissa_digits == 0) return std::nullopt;
  if (i < body.size() && body[i] == 'e') {
    ++i;
    if (i < body.size() && (body[i] == '+' || body[i] == '-')) ++i;
    const size_t exp_start = i;
    while (i < body.size() && std::isdigit(static_cast<unsigned char>(body[i]))) ++i;
    if (i == exp_start) return std::nullopt;
  }
  if (i != body.size()) return std::nullopt;
  const double d = std::strtod(std::string(body).c_str(), nullptr);
  return negative ? -d : d;
}

absl::StatusOr<Value> JoinStrings(std::string_view separator, const std::vector<Value>& items) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i > 0) out.append(separator);
    RETURN_IF_ERROR(AppendStr(items[i], &out));
    RETURN_IF_ERROR(CheckStringSize(out.size()));
  }
  return Value::String(std::move(out));
}

}  // namespace tandem::router::jinja
