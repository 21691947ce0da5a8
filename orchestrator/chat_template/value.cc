#include "orchestrator/chat_template/value.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "common/status_macros.h"
#include "orchestrator/chat_template/py_text.h"
#include "orchestrator/chat_template/str_cat.h"

namespace tandem::router::jinja {
namespace {

absl::Status TypeError(std::string message) { return absl::UnknownError(std::move(message)); }

std::string_view ListTypeName(ListKind kind) {
  switch (kind) {
    case ListKind::kList:
      return "list";
    case ListKind::kTuple:
      return "tuple";
    case ListKind::kIterator:
      return "generator";
    case ListKind::kDictKeys:
      return "dict_keys";
    case ListKind::kDictValues:
      return "dict_values";
    case ListKind::kDictItems:
      return "dict_items";
    case ListKind::kRange:
      return "range";
  }
  return "list";
}

// Exact int/float comparison: -1, 0, 1, or 2 when unordered (NaN).
int CompareNumbers(const Value& a, const Value& b) {
  if (a.is_integral() && b.is_integral()) {
    return a.int_value() < b.int_value() ? -1 : a.int_value() > b.int_value() ? 1 : 0;
  }
  if (std::isnan(a.AsDouble()) || std::isnan(b.AsDouble())) return 2;
  // long double holds every int64 exactly (x86-64's 64-bit mantissa).
  const long double x = a.is_float() ? static_cast<long double>(a.float_value()) : a.int_value();
  const long double y = b.is_float() ? static_cast<long double>(b.float_value()) : b.int_value();
  return x < y ? -1 : x > y ? 1 : 0;
}

bool ApplyOrder(int cmp, CompareOp op) {
  switch (op) {
    case CompareOp::kEq:
      return cmp == 0;
    case CompareOp::kNe:
      return cmp != 0;
    case CompareOp::kLt:
      return cmp == -1;
    case CompareOp::kLe:
      return cmp == -1 || cmp == 0;
    case CompareOp::kGt:
      return cmp == 1;
    case CompareOp::kGe:
      return cmp == 1 || cmp == 0;
  }
  return false;
}

std::string_view OpSymbol(CompareOp op) {
  switch (op) {
    case CompareOp::kEq:
      return "==";
    case CompareOp::kNe:
      return "!=";
    case CompareOp::kLt:
      return "<";
    case CompareOp::kLe:
      return "<=";
    case CompareOp::kGt:
      return ">";
    case CompareOp::kGe:
      return ">=";
  }
  return "?";
}

bool IsSequenceComparable(const Value& v) {
  return v.is_list() && (v.list().kind == ListKind::kList || v.list().kind == ListKind::kTuple);
}

void AppendJsonString(std::string_view s, bool ensure_ascii, std::string* out) {
  out->push_back('"');
  char buf[16];
  size_t pos = 0;
  while (pos < s.size()) {
    const unsigned char c = static_cast<unsigned char>(s[pos]);
    if (c < 0x80) {
      ++pos;
      switch (c) {
        case '"':
          out->append("\\\"");
          break;
        case '\\':
          out->append("\\\\");
          break;
        case '\n':
          out->append("\\n");
          break;
        case '\r':
          out->append("\\r");
          break;
        case '\t':
          out->append("\\t");
          break;
        case '\b':
          out->append("\\b");
          break;
        case '\f':
          out->append("\\f");
          break;
        default:
          if (c < 0x20 || (ensure_ascii && c == 0x7f)) {
            std::snprintf(buf, sizeof(buf), "\\u%04x", c);
            out->append(buf);
          } else {
            out->push_back(static_cast<char>(c));
          }
      }
      continue;
    }
    const size_t start = pos;
    const char32_t cp = NextCodePoint(s, &pos);
    if (!ensure_ascii) {
      out->append(s.substr(start, pos - start));
    } else if (cp < 0x10000) {
      std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(cp));
      out->append(buf);
    } else {
      const char32_t v = cp - 0x10000;
      std::snprintf(buf, sizeof(buf), "\\u%04x\\u%04x", static_cast<unsigned>(0xD800 | (v >> 10)),
                    static_cast<unsigned>(0xDC00 | (v & 0x3FF)));
      out->append(buf);
    }
  }
  out->push_back('"');
}

void AppendJsonFloat(double d, std::string* out) {
  if (std::isnan(d)) {
    out->append("NaN");
  } else if (std::isinf(d)) {
    out->append(d > 0 ? "Infinity" : "-Infinity");
  } else {
    AppendFloatRepr(d, out);
  }
}

absl::Status DumpJsonAt(const Value& v, const JsonDumpOptions& options, int level, std::string* out) {
  switch (v.kind()) {
    case Value::Kind::kNone:
      out->append("null");
      return absl::OkStatus();
    case Value::Kind::kBool:
      out->append(v.bool_value() ? "true" : "false");
      return absl::OkStatus();
    case Value::Kind::kInt:
      AppendCat(out, v.int_value());
      return absl::OkStatus();
    case Value::Kind::kFloat:
      AppendJsonFloat(v.float_value(), out);
      return absl::OkStatus();
    case Value::Kind::kString:
      AppendJsonString(v.str(), options.ensure_ascii, out);
      return absl::OkStatus();
    default:
      break;
  }
  const bool is_array = v.is_list() && (v.list().kind == ListKind::kList || v.list().kind == ListKind::kTuple);
  if (!is_array && !v.is_dict()) {
    return TypeError(Cat("Object of type ", TypeName(v), " is not JSON serializable"));
  }
  const size_t size = is_array ? v.list().items.size() : v.dict().entries.size();
  if (size == 0) {
    out->append(is_array ? "[]" : "{}");
    return absl::OkStatus();
  }
  out->push_back(is_array ? '[' : '{');
  std::string newline_indent;
  if (options.indent) {
    newline_indent.push_back('\n');
    for (int i = 0; i <= level; ++i) newline_indent.append(*options.indent);
    out->append(newline_indent);
  }
  auto separator = [&] {
    out->append(options.item_separator);
    out->append(newline_indent);
  };
  if (is_array) {
    bool first = true;
    for (const Value& item : v.list().items) {
      if (!first) separator();
      first = false;
      RETURN_IF_ERROR(DumpJsonAt(item, options, level + 1, out));
    }
  } else {
    std::vector<const std::pair<Value, Value>*> entries;
    entries.reserve(size);
    for (const auto& entry : v.dict().entries) entries.push_back(&entry);
    if (options.sort_keys) {
      absl::Status error;
      std::stable_sort(entries.begin(), entries.end(), [&](const auto* x, const auto* y) {
        absl::StatusOr<bool> less = Less(x->first, y->first);
        if (!less.ok()) {
          error = less.status();
          return false;
        }
        return *less;
      });
      RETURN_IF_ERROR(error);
    }
    bool first = true;
    for (const auto* entry : entries) {
      if (!first) separator();
      first = false;
      const Value& key = entry->first;
      switch (key.kind()) {
        case Value::Kind::kString:
          AppendJsonString(key.str(), options.ensure_ascii, out);
          break;
        case Value::Kind::kNone:
          out->append("\"null\"");
          break;
        case Value::Kind::kBool:
          out->append(key.bool_value() ? "\"true\"" : "\"false\"");
          break;
        case Value::Kind::kInt:
          AppendCat(out, "\"", key.int_value(), "\"");
          break;
        case Value::Kind::kFloat:
          out->push_back('"');
          AppendJsonFloat(key.float_value(), out);
          out->push_back('"');
          break;
        default:
          return TypeError(Cat("keys must be str, int, float, bool or None, not ", TypeName(key)));
      }
      out->append(options.key_separator);
      RETURN_IF_ERROR(DumpJsonAt(entry->second, options, level + 1, out));
    }
  }
  if (options.indent) {
    out->push_back('\n');
    for (int i = 0; i < level; ++i) out->append(*options.indent);
  }
  out->push_back(is_array ? ']' : '}');
  return absl::OkStatus();
}

template <typename Json>
Value FromJsonImpl(const Json& json) {
  switch (json.type()) {
    case nlohmann::json::value_t::null:
      return Value::None();
    case nlohmann::json::value_t::boolean:
      return Value::Bool(json.template get<bool>());
    case nlohmann::json::value_t::number_integer:
      return Value::Int(json.template get<int64_t>());
    case nlohmann::json::value_t::number_unsigned: {
      const uint64_t u = json.template get<uint64_t>();
      // Python's int is unbounded; beyond int64 the value keeps its magnitude as a float.
      return u <= static_cast<uint64_t>(INT64_MAX) ? Value::Int(static_cast<int64_t>(u))
                                                   : Value::Float(static_cast<double>(u));
    }
    case nlohmann::json::value_t::number_float:
      return Value::Float(json.template get<double>());
    case nlohmann::json::value_t::string:
      return Value::Borrowed(json.template get_ref<const std::string&>());
    case nlohmann::json::value_t::array: {
      std::vector<Value> items;
      items.reserve(json.size());
      for (const auto& item : json) items.push_back(FromJsonImpl(item));
      return Value::MakeList(std::move(items));
    }
    case nlohmann::json::value_t::object: {
      auto dict = std::make_shared<Dict>();
      dict->entries.reserve(json.size());
      for (auto it = json.begin(); it != json.end(); ++it) {
        dict->Append(Value::Borrowed(it.key()), FromJsonImpl(it.value()));
      }
      return Value::FromDict(std::move(dict));
    }
    default:
      return Value::None();  // Binary and discarded values do not come from JSON text.
  }
}

}  // namespace

const Value* Dict::Find(const Value& key) const {
  if (key.is_string()) return FindString(key.str());
  for (const auto& [k, v] : entries) {
    if (Equals(k, key)) return &v;
  }
  return nullptr;
}

const Value* Dict::FindString(std::string_view key) const {
  if (!string_index_.empty()) {
    const auto it = string_index_.find(key);
    return it == string_index_.end() ? nullptr : &entries[it->second].second;
  }
  for (const auto& [k, v] : entries) {
    if (k.is_string() && k.str() == key) return &v;
  }
  return nullptr;
}

void Dict::Set(Value key, Value value) {
  if (key.is_string() && !string_index_.empty()) {
    const auto it = string_index_.find(key.str());
    if (it != string_index_.end()) {
      depth = std::max(depth, Depth(value) + 1);
      entries[it->second].second = std::move(value);
      return;
    }
  } else {
    for (auto& [k, v] : entries) {
      if (Equals(k, key)) {
        depth = std::max(depth, Depth(value) + 1);
        v = std::move(value);
        return;
      }
    }
  }
  Append(std::move(key), std::move(value));
}

void Dict::Append(Value key, Value value) {
  depth = std::max({depth, Depth(key) + 1, Depth(value) + 1});
  entries.emplace_back(std::move(key), std::move(value));
  if (entries.size() == kIndexedSize) {
    for (size_t i = 0; i < entries.size(); ++i) Index(i);
  } else if (entries.size() > kIndexedSize) {
    Index(entries.size() - 1);
  }
}

// The view points at the key's bytes (a shared or borrowed buffer), which
// do not move when `entries` reallocates.
void Dict::Index(size_t entry) {
  const Value& key = entries[entry].first;
  if (key.is_string()) string_index_.emplace(key.str(), entry);
}

Value Value::String(std::string s) {
  Value v(Kind::kString);
  auto owned = std::make_shared<std::string>(std::move(s));
  v.str_ = *owned;
  v.ref_ = std::move(owned);
  return v;
}

Value Value::Markup(std::string s) {
  Value v = String(std::move(s));
  v.markup_ = true;
  return v;
}

Value Value::MakeList(std::vector<Value> items, ListKind kind) {
  auto list = std::make_shared<List>();
  list->kind = kind;
  for (const Value& item : items) list->depth = std::max(list->depth, Depth(item) + 1);
  list->items = std::move(items);
  return FromList(std::move(list));
}

Value Value::UndefinedWithMessage(std::string message) {
  Value v = String(std::move(message));
  v.kind_ = Kind::kUndefined;
  return v;
}

Value Value::MissingAttribute(const Value& obj, std::string_view name) {
  std::string message;
  AppendPyStrRepr(ObjectTypeRepr(obj), &message);
  message.append(" has no attribute ");
  AppendPyStrRepr(name, &message);
  return UndefinedWithMessage(std::move(message));
}

Value Value::MissingItem(const Value& obj, const Value& key) {
  if (key.is_string()) return MissingAttribute(obj, key.str());
  std::string message = Cat(ObjectTypeRepr(obj), " has no element ");
  if (!AppendRepr(key, &message).ok()) message.append("?");
  return UndefinedWithMessage(std::move(message));
}

std::string Value::UndefinedMessage() const {
  return str_.empty() ? std::string("value is undefined") : std::string(str_);
}

int Depth(const Value& v) {
  if (v.is_list()) return v.list().depth;
  if (v.is_dict()) return v.dict().depth;
  return 0;
}

std::string_view TypeName(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined:
      return "Undefined";
    case Value::Kind::kNone:
      return "NoneType";
    case Value::Kind::kBool:
      return "bool";
    case Value::Kind::kInt:
      return "int";
    case Value::Kind::kFloat:
      return "float";
    case Value::Kind::kString:
      return v.is_markup() ? "Markup" : "str";
    case Value::Kind::kList:
      return ListTypeName(v.list().kind);
    case Value::Kind::kDict:
      return "dict";
    case Value::Kind::kObject:
      switch (v.object().kind) {
        case Object::Kind::kNamespace:
          return "Namespace";
        case Object::Kind::kLoop:
          return "LoopContext";
        case Object::Kind::kMacro:
          return "Macro";
        case Object::Kind::kFunction:
          return "function";
        case Object::Kind::kMethod:
          return "builtin_function_or_method";
      }
  }
  return "object";
}

std::string ObjectTypeRepr(const Value& v) {
  if (v.is_none()) return "None";
  if (v.is_undefined()) return "jinja2.runtime.Undefined object";
  if (v.is_markup()) return "markupsafe.Markup object";
  if (v.is_object()) {
    switch (v.object().kind) {
      case Object::Kind::kNamespace:
        return "jinja2.utils.Namespace object";
      case Object::Kind::kLoop:
        return "jinja2.runtime.LoopContext object";
      case Object::Kind::kMacro:
        return "jinja2.runtime.Macro object";
      default:
        break;
    }
  }
  return Cat(TypeName(v), " object");
}

bool Truthy(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone:
      return false;
    case Value::Kind::kBool:
    case Value::Kind::kInt:
      return v.int_value() != 0;
    case Value::Kind::kFloat:
      return v.float_value() != 0.0;
    case Value::Kind::kString:
      return !v.str().empty();
    case Value::Kind::kList:
      return v.list().kind == ListKind::kIterator || !v.list().items.empty();
    case Value::Kind::kDict:
      return !v.dict().entries.empty();
    case Value::Kind::kObject:
      return true;
  }
  return false;
}

void AppendFloatRepr(double d, std::string* out) {
  if (std::isnan(d)) {
    out->append("nan");
    return;
  }
  if (std::isinf(d)) {
    out->append(d > 0 ? "inf" : "-inf");
    return;
  }
  // Shortest round-trip digits, laid out as CPython's float_repr does:
  // positional for 1e-4 <= |d| < 1e16, otherwise with an exponent.
  char buf[64];
  const auto result = std::to_chars(buf, buf + sizeof(buf), d, std::chars_format::scientific);
  std::string_view sci(buf, result.ptr - buf);
  if (sci.front() == '-') {
    out->push_back('-');
    sci.remove_prefix(1);
  }
  const size_t e = sci.find('e');
  std::string digits;
  for (char c : sci.substr(0, e)) {
    if (c != '.') digits.push_back(c);
  }
  const int exponent = std::atoi(std::string(sci.substr(e + 1)).c_str());
  const int decpt = exponent + 1;  // value = 0.DIGITS * 10^decpt
  if (decpt <= -4 || decpt > 16) {
    out->push_back(digits[0]);
    if (digits.size() > 1) {
      out->push_back('.');
      out->append(digits, 1, std::string::npos);
    }
    std::snprintf(buf, sizeof(buf), "e%c%02d", exponent < 0 ? '-' : '+', std::abs(exponent));
    out->append(buf);
  } else if (decpt <= 0) {
    out->append("0.");
    out->append(static_cast<size_t>(-decpt), '0');
    out->append(digits);
  } else if (static_cast<size_t>(decpt) < digits.size()) {
    out->append(digits, 0, decpt);
    out->push_back('.');
    out->append(digits, decpt, std::string::npos);
  } else {
    out->append(digits);
    out->append(decpt - digits.size(), '0');
    out->append(".0");
  }
}

namespace {

absl::Status AppendStrAt(const Value& v, std::string* out, int depth);
absl::Status AppendReprAt(const Value& v, std::string* out, int depth);

absl::Status AppendDictRepr(const Dict& dict, std::string* out, int depth) {
  out->push_back('{');
  bool first = true;
  for (const auto& [key, value] : dict.entries) {
    if (!first) out->append(", ");
    first = false;
    RETURN_IF_ERROR(AppendReprAt(key, out, depth + 1));
    out->append(": ");
    RETURN_IF_ERROR(AppendReprAt(value, out, depth + 1));
  }
  out->push_back('}');
  return absl::OkStatus();
}

absl::Status AppendStrAt(const Value& v, std::string* out, int depth) {
  // Objects are not containers: a namespace holding itself only stops here.
  if (depth > 2 * kMaxValueDepth) return TypeError("values nested too deeply (or circular) to print");
  switch (v.kind()) {
    case Value::Kind::kUndefined:
      return absl::OkStatus();
    case Value::Kind::kString:
      out->append(v.str());
      return absl::OkStatus();
    case Value::Kind::kObject:
      switch (v.object().kind) {
        case Object::Kind::kNamespace:
          out->append("<Namespace ");
          RETURN_IF_ERROR(AppendDictRepr(static_cast<const Namespace&>(v.object()).attrs, out, depth));
          out->push_back('>');
          return absl::OkStatus();
        case Object::Kind::kLoop: {
          const auto& loop = static_cast<const Loop&>(v.object());
          AppendCat(out, "<LoopContext ", loop.index0 + 1, "/", loop.items.size(), ">");
          return absl::OkStatus();
        }
        case Object::Kind::kMacro:
          out->append("<Macro ");
          AppendPyStrRepr(static_cast<const Macro&>(v.object()).name, out);
          out->push_back('>');
          return absl::OkStatus();
        default:
          return TypeError(Cat("cannot print a ", TypeName(v), " (Python would print its memory address)"));
      }
    default:
      return AppendReprAt(v, out, depth);
  }
}

}  // namespace

absl::Status AppendStr(const Value& v, std::string* out) { return AppendStrAt(v, out, 0); }

absl::StatusOr<std::string> Str(const Value& v) {
  if (v.is_string()) return std::string(v.str());
  std::string out;
  RETURN_IF_ERROR(AppendStr(v, &out));
  return out;
}

absl::Status AppendRepr(const Value& v, std::string* out) { return AppendReprAt(v, out, 0); }

namespace {

absl::Status AppendReprAt(const Value& v, std::string* out, int depth) {
  switch (v.kind()) {
    case Value::Kind::kUndefined:
      out->append("Undefined");
      return absl::OkStatus();
    case Value::Kind::kNone:
      out->append("None");
      return absl::OkStatus();
    case Value::Kind::kBool:
      out->append(v.bool_value() ? "True" : "False");
      return absl::OkStatus();
    case Value::Kind::kInt:
      AppendCat(out, v.int_value());
      return absl::OkStatus();
    case Value::Kind::kFloat:
      AppendFloatRepr(v.float_value(), out);
      return absl::OkStatus();
    case Value::Kind::kString:
      if (v.is_markup()) out->append("Markup(");
      AppendPyStrRepr(v.str(), out);
      if (v.is_markup()) out->push_back(')');
      return absl::OkStatus();
    case Value::Kind::kDict:
      return AppendDictRepr(v.dict(), out, depth);
    case Value::Kind::kList: {
      const List& list = v.list();
      std::string_view open = "[", close = "]";
      switch (list.kind) {
        case ListKind::kList:
          break;
        case ListKind::kTuple:
          open = "(";
          close = list.items.size() == 1 ? ",)" : ")";
          break;
        case ListKind::kDictKeys:
          open = "dict_keys([";
          close = "])";
          break;
        case ListKind::kDictValues:
          open = "dict_values([";
          close = "])";
          break;
        case ListKind::kDictItems:
          open = "dict_items([";
          close = "])";
          break;
        case ListKind::kRange:
          AppendCat(out, "range(", list.range_args[0], ", ", list.range_args[1]);
          if (list.range_args[2] != 1) AppendCat(out, ", ", list.range_args[2]);
          out->push_back(')');
          return absl::OkStatus();
        case ListKind::kIterator:
          return TypeError("cannot print a generator (Python would print its memory address)");
      }
      out->append(open);
      bool first = true;
      for (const Value& item : list.items) {
        if (!first) out->append(", ");
        first = false;
        RETURN_IF_ERROR(AppendReprAt(item, out, depth + 1));
      }
      out->append(close);
      return absl::OkStatus();
    }
    case Value::Kind::kObject:
      return AppendStrAt(v, out, depth + 1);
  }
  return absl::OkStatus();
}

}  // namespace

bool Equals(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) return CompareNumbers(a, b) == 0;
  if (a.kind() != b.kind()) return false;
  switch (a.kind()) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone:
      return true;
    case Value::Kind::kString:
      return a.str() == b.str();
    case Value::Kind::kList: {
      const List& x = a.list();
      const List& y = b.list();
      if (&x == &y) return true;
      const bool sequences =
          (x.kind == y.kind) && (x.kind == ListKind::kList || x.kind == ListKind::kTuple || x.kind == ListKind::kRange);
      if (!sequences || x.items.size() != y.items.size()) return false;
      for (size_t i = 0; i < x.items.size(); ++i) {
        if (!Equals(x.items[i], y.items[i])) return false;
      }
      return true;
    }
    case Value::Kind::kDict: {
      const Dict& x = a.dict();
      const Dict& y = b.dict();
      if (x.entries.size() != y.entries.size()) return false;
      for (const auto& [key, value] : x.entries) {
        const Value* other = y.Find(key);
        if (other == nullptr || !Equals(value, *other)) return false;
      }
      return true;
    }
    case Value::Kind::kObject:
      return a.identity() == b.identity();
    default:
      return false;
  }
}

absl::StatusOr<bool> Compare(const Value& a, CompareOp op, const Value& b) {
  if (op == CompareOp::kEq) return Equals(a, b);
  if (op == CompareOp::kNe) return !Equals(a, b);
  if (a.is_number() && b.is_number()) return ApplyOrder(CompareNumbers(a, b), op);
  if (a.is_string() && b.is_string()) {
    const int c = a.str().compare(b.str());  // UTF-8 byte order is code point order.
    return ApplyOrder(c < 0 ? -1 : c > 0 ? 1 : 0, op);
  }
  if (IsSequenceComparable(a) && IsSequenceComparable(b) && a.list().kind == b.list().kind) {
    const auto& x = a.list().items;
    const auto& y = b.list().items;
    for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
      if (!Equals(x[i], y[i])) return Compare(x[i], op, y[i]);
    }
    return ApplyOrder(x.size() < y.size() ? -1 : x.size() > y.size() ? 1 : 0, op);
  }
  if (a.is_undefined() || b.is_undefined()) {
    return TypeError((a.is_undefined() ? a : b).UndefinedMessage());
  }
  return TypeError(
      Cat("'", OpSymbol(op), "' not supported between instances of '", TypeName(a), "' and '", TypeName(b), "'"));
}

bool IsHashable(const Value& v) {
  if (v.is_dict()) return false;
  if (v.is_list()) {
    if (v.list().kind != ListKind::kTuple && v.list().kind != ListKind::kRange &&
        v.list().kind != ListKind::kIterator) {
      return false;
    }
    for (const Value& item : v.list().items) {
      if (!IsHashable(item)) return false;
    }
  }
  return true;
}

absl::StatusOr<bool> Contains(const Value& container, const Value& item) {
  switch (container.kind()) {
    case Value::Kind::kUndefined:
      return false;
    case Value::Kind::kString:
      if (!item.is_string()) {
        return TypeError(Cat("'in <string>' requires string as left operand, not ", TypeName(item)));
      }
      return container.str().find(item.str()) != std::string_view::npos;
    case Value::Kind::kList:
      for (const Value& x : container.list().items) {
        if (Equals(x, item)) return true;
      }
      return false;
    case Value::Kind::kDict:
      if (!IsHashable(item)) return TypeError(Cat("unhashable type: '", TypeName(item), "'"));
      return container.dict().Find(item) != nullptr;
    default:
      return TypeError(Cat("argument of type '", TypeName(container), "' is not iterable"));
  }
}

absl::StatusOr<int64_t> Length(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined:
      return 0;
    case Value::Kind::kString:
      return static_cast<int64_t>(CodePointCount(v.str()));
    case Value::Kind::kList:
      if (v.list().kind == ListKind::kIterator) break;
      return static_cast<int64_t>(v.list().items.size());
    case Value::Kind::kDict:
      return static_cast<int64_t>(v.dict().entries.size());
    default:
      break;
  }
  return TypeError(Cat("object of type '", TypeName(v), "' has no len()"));
}

absl::StatusOr<std::vector<Value>> Iterate(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined:
      return std::vector<Value>();
    case Value::Kind::kList:
      return v.list().items;
    case Value::Kind::kDict: {
      std::vector<Value> keys;
      keys.reserve(v.dict().entries.size());
      for (const auto& entry : v.dict().entries) keys.push_back(entry.first);
      return keys;
    }
    case Value::Kind::kString: {
      std::vector<Value> chars;
      const std::string_view s = v.str();
      size_t pos = 0;
      while (pos < s.size()) {
        const size_t start = pos;
        NextCodePoint(s, &pos);
        chars.push_back(Value::SubString(v, s.substr(start, pos - start)));
      }
      return chars;
    }
    default:
      return TypeError(Cat("'", TypeName(v), "' object is not iterable"));
  }
}

absl::Status DumpJson(const Value& v, const JsonDumpOptions& options, std::string* out) {
  return DumpJsonAt(v, options, 0, out);
}

Value FromJson(const nlohmann::json& json) { return FromJsonImpl(json); }
Value FromJson(const nlohmann::ordered_json& json) { return FromJsonImpl(json); }

}  // namespace tandem::router::jinja
