#include "orchestrator/chat_template/builtins.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <memory>
#include <optional>

#include "absl/container/flat_hash_map.h"
#include "common/status_macros.h"
#include "orchestrator/chat_template/operations.h"
#include "orchestrator/chat_template/py_text.h"
#include "orchestrator/chat_template/str_cat.h"

namespace tandem::router::jinja {
namespace {

// ---------------------------------------------------------------------------
// Argument helpers.

std::vector<std::string_view> SplitOn(std::string_view s, char sep) {
  std::vector<std::string_view> parts;
  size_t start = 0;
  for (size_t at = s.find(sep); at != std::string_view::npos; at = s.find(sep, start)) {
    parts.push_back(s.substr(start, at - start));
    start = at + 1;
  }
  parts.push_back(s.substr(start));
  return parts;
}

Value ArgOr(const BoundArgs& args, size_t i, Value fallback) { return args[i] ? *args[i] : std::move(fallback); }

absl::StatusOr<int64_t> IntArg(const BoundArgs& args, size_t i, int64_t fallback, std::string_view what) {
  if (!args[i]) return fallback;
  if (args[i]->is_integral()) return args[i]->int_value();
  if (args[i]->is_undefined()) return UndefinedError(*args[i]);
  return PyError(Cat("'", TypeName(*args[i]), "' object cannot be interpreted as an integer (", what, ")"));
}

absl::StatusOr<std::optional<std::string_view>> OptionalStrArg(const BoundArgs& args, size_t i, std::string_view what) {
  if (!args[i] || args[i]->is_none()) return std::optional<std::string_view>();
  if (args[i]->is_string()) return std::optional<std::string_view>(args[i]->str());
  return PyError(Cat(what, " arg must be None or str"));
}

absl::StatusOr<std::string_view> StrArg(const BoundArgs& args, size_t i, std::string_view what) {
  if (args[i] && args[i]->is_string()) return args[i]->str();
  const Value v = args[i] ? *args[i] : Value();
  if (v.is_undefined()) return UndefinedError(v);
  return PyError(Cat(what, " must be str, not ", TypeName(v)));
}

Value IgnoreCase(const Value& v) { return v.is_string() ? Value::String(PyLower(v.str())) : v; }

// jinja2.filters.make_attrgetter: "a.b.0" looks up item by item (digits as
// integers); with `fallback`, an Undefined on the way becomes it.
absl::StatusOr<Value> GetAttributePath(const Value& item, const Value& attribute, const Value* fallback) {
  Value current = item;
  auto step = [&](const Value& key) -> absl::Status {
    ASSIGN_OR_RETURN(current, GetItem(current, key));
    if (fallback != nullptr && current.is_undefined()) current = *fallback;
    return absl::OkStatus();
  };
  if (attribute.is_none()) return current;
  if (!attribute.is_string()) {
    RETURN_IF_ERROR(step(attribute));
    return current;
  }
  for (std::string_view part : SplitOn(attribute.str(), '.')) {
    const bool digits =
        !part.empty() && std::all_of(part.begin(), part.end(), [](char c) { return c >= '0' && c <= '9'; });
    if (digits && part.size() < 18) {
      RETURN_IF_ERROR(step(Value::Int(std::stoll(std::string(part)))));
    } else {
      RETURN_IF_ERROR(step(Value::Borrowed(part)));
    }
  }
  return current;
}

// The sort key of make_multi_attrgetter: one value per comma-separated
// attribute (the item itself without one), lowered unless case-sensitive.
absl::StatusOr<Value> SortKey(const Value& item, const Value& attribute, bool case_sensitive) {
  std::vector<Value> keys;
  if (attribute.is_string()) {
    for (std::string_view part : SplitOn(attribute.str(), ',')) {
      ASSIGN_OR_RETURN(Value key, GetAttributePath(item, Value::Borrowed(part), nullptr));
      keys.push_back(case_sensitive ? key : IgnoreCase(key));
    }
  } else {
    ASSIGN_OR_RETURN(Value key, GetAttributePath(item, attribute, nullptr));
    keys.push_back(case_sensitive ? key : IgnoreCase(key));
  }
  return Value::MakeList(std::move(keys));
}

// Stable sort by precomputed keys; a comparison that Python rejects fails.
absl::Status SortByKeys(std::vector<Value>* items, const std::vector<Value>& keys, bool reverse) {
  std::vector<size_t> order(items->size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  absl::Status error;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    if (!error.ok()) return false;
    absl::StatusOr<bool> less = reverse ? Less(keys[b], keys[a]) : Less(keys[a], keys[b]);
    if (!less.ok()) {
      error = less.status();
      return false;
    }
    return *less;
  });
  RETURN_IF_ERROR(error);
  std::vector<Value> sorted;
  sorted.reserve(items->size());
  for (size_t i : order) sorted.push_back((*items)[i]);
  *items = std::move(sorted);
  return absl::OkStatus();
}

Value EmptyIterator() { return Value::MakeList({}, ListKind::kIterator); }

// reversed(v): a reverse iterator; nullopt when Python's reversed() rejects it.
std::optional<std::vector<Value>> Reversed(const Value& v) {
  std::vector<Value> items;
  if (v.is_undefined()) return items;  // Undefined has __len__ and __getitem__.
  if (v.is_list() && v.list().kind == ListKind::kIterator) return std::nullopt;
  if (v.is_list()) {
    items = v.list().items;
  } else if (v.is_dict()) {
    for (const auto& entry : v.dict().entries) items.push_back(entry.first);
  } else if (v.is_string()) {
    items = *Iterate(v);
  } else {
    return std::nullopt;
  }
  std::reverse(items.begin(), items.end());
  return items;
}

absl::StatusOr<std::string> StrOf(const Value& v) { return Str(v); }

// ---------------------------------------------------------------------------
// Filters (jinja2/filters.py).

absl::StatusOr<Value> FilterAbs(const Value& v, const BoundArgs&) {
  if (v.is_integral()) {
    if (v.int_value() == INT64_MIN) return PyError("integer overflow");
    return Value::Int(std::abs(v.int_value()));
  }
  if (v.is_float()) return Value::Float(std::fabs(v.float_value()));
  if (v.is_undefined()) return UndefinedError(v);
  return PyError(Cat("bad operand type for abs(): '", TypeName(v), "'"));
}

absl::StatusOr<Value> FilterAttr(const Value& v, const BoundArgs& args) {
  if (v.is_undefined()) return UndefinedError(v);
  ASSIGN_OR_RETURN(std::string_view name, StrArg(args, 0, "attribute name"));
  if (std::optional<Value> attr = PythonAttribute(v, name)) return *std::move(attr);
  return Value::MissingAttribute(v, name);
}

absl::StatusOr<Value> FilterCapitalize(const Value& v, const BoundArgs&) {
  ASSIGN_OR_RETURN(std::string s, StrOf(v));
  return Value::String(PyCapitalize(s));
}

absl::StatusOr<Value> Justify(std::string_view s, int64_t width, std::string_view fill, char how) {
  if (CodePointCount(fill) != 1) return PyError("The fill character must be exactly one character long");
  const int64_t len = static_cast<int64_t>(CodePointCount(s));
  if (width <= len) return Value::String(std::string(s));
  RETURN_IF_ERROR(CheckStringSize(static_cast<size_t>(width) * fill.size()));
  const int64_t marg = width - len;
  int64_t left = 0;
  if (how == 'c') {
    left = marg / 2 + (marg & width & 1);  // CPython's str.center.
  } else if (how == 'r') {
    left = marg;
  }
  std::string out;
  for (int64_t i = 0; i < left; ++i) out.append(fill);
  out.append(s);
  for (int64_t i = 0; i < marg - left; ++i) out.append(fill);
  return Value::String(std::move(out));
}

absl::StatusOr<Value> FilterCenter(const Value& v, const BoundArgs& args) {
  ASSIGN_OR_RETURN(std::string s, StrOf(v));
  ASSIGN_OR_RETURN(int64_t width, IntArg(args, 0, 80, "width"));
  return Justify(s, width, " ", 'c');
}

absl::StatusOr<Value> FilterLength(const Value& v, const BoundArgs&) {
  ASSIGN_OR_RETURN(int64_t n, Length(v));
  return Value::Int(n);
}

absl::StatusOr<Value> FilterDefault(const Value& v, const BoundArgs& args) {
  const bool boolean = args[1] && Truthy(*args[1]);
  if (v.is_undefined() || (boolean && !Truthy(v))) return ArgOr(args, 0, Value::Borrowed(""));
  return v;
}

absl::StatusOr<Value> FilterDictSort(const Value& v, const BoundArgs& args) {
  const bool case_sensitive = args[0] && Truthy(*args[0]);
  const Value by = ArgOr(args, 1, Value::Borrowed("key"));
  const bool reverse = args[2] && Truthy(*args[2]);
  size_t pos;
  if (by.is_string() && by.str() == "key") {
    pos = 0;
  } else if (by.is_string() && by.str() == "value") {
    pos = 1;
  } else {
    return PyError("You can only sort by either \"key\" or \"value\"");
  }
  if (!v.is_dict()) {
    if (v.is_undefined()) return UndefinedError(v);
    return PyError(Cat("'", TypeName(v), "' object has no attribute 'items'"));
  }
  std::vector<Value> items;
  std::vector<Value> keys;
  for (const auto& [key, value] : v.dict().entries) {
    items.push_back(Value::MakeList({key, value}, ListKind::kTuple));
    const Value& k = pos == 0 ? key : value;
    keys.push_back(case_sensitive ? k : IgnoreCase(k));
  }
  RETURN_IF_ERROR(SortByKeys(&items, keys, reverse));
  return Value::MakeList(std::move(items));
}

absl::StatusOr<Value> FilterEscape(const Value& v, const BoundArgs&) {
  if (v.is_markup()) return v;
  ASSIGN_OR_RETURN(std::string s, StrOf(v));
  return Value::Markup(HtmlEscape(s));
}

absl::StatusOr<Value> FilterForceEscape(const Value& v, const BoundArgs&) {
  ASSIGN_OR_RETURN(std::string s, StrOf(v));
  return Value::Markup(HtmlEscape(s));
}

absl::StatusOr<Value> FilterFirst(const Value& v, const BoundArgs&) {
  ASSIGN_OR_RETURN(std::vector<Value> items, Iterate(v));
  if (items.empty()) return Value::UndefinedWithMessage("No first item, sequence was empty.");
  return items.front();
}

absl::StatusOr<Value> FilterLast(const Value& v, const BoundArgs&) {
  std::optional<std::vector<Value>> items = Reversed(v);
  if (!items) return PyError(Cat("'", TypeName(v), "' object is not reversible"));
  if (items->empty()) return Value::UndefinedWithMessage("No last item, sequence was empty.");
  return items->front();
}

absl::StatusOr<Value> FilterFloat(const Value& v, const BoundArgs& args) {
  if (v.is_undefined()) return UndefinedError(v);
  if (v.is_number()) return Value::Float(v.AsDouble());
  if (v.is_string()) {
    if (std::optional<double> d = ParsePyFloat(v.str())) return Value::Float(*d);
  }
  return ArgOr(args, 0, Value::Float(0.0));
}

absl::StatusOr<Value> FilterFormat(const Value& v, const BoundArgs& args) {
  const CallArgs& call = args.call();
  if (!call.positional.empty() && !call.keywords.empty()) {
    return PyError("can't handle positional and keyword arguments at the same time");
  }
  ASSIGN_OR_RETURN(std::string fmt, StrOf(v));
  if (!call.keywords.empty()) {
    auto dict = std::make_shared<Dict>();
    for (const auto& [name, value] : call.keywords) dict->Set(Value::String(std::string(name)), value);
    return PercentFormat(fmt, Value::FromDict(std::move(dict)));
  }
  return PercentFormat(fmt, Value::MakeList(call.positional, ListKind::kTuple));
}

absl::StatusOr<Value> FilterIndent(const Value& v, const BoundArgs& args) {
  if (v.is_undefined()) return UndefinedError(v);
  if (!v.is_string()) return PyError(Cat("unsupported operand type(s) for +=: '", TypeName(v), "' and 'str'"));
  std::string indention;
  const Value width = ArgOr(args, 0, Value::Int(4));
  if (width.is_string()) {
    indention = std::string(width.str());
  } else if (width.is_integral()) {
    RETURN_IF_ERROR(CheckStringSize(std::max<int64_t>(width.int_value(), 0)));
    indention.assign(std::max<int64_t>(width.int_value(), 0), ' ');
  } else {
    return PyError(Cat("can't multiply sequence by non-int of type '", TypeName(width), "'"));
  }
  const bool first = args[1] && Truthy(*args[1]);
  const bool blank = args[2] && Truthy(*args[2]);
  const std::string s = Cat(v.str(), "\n");
  const std::vector<std::string_view> lines = PySplitLines(s, false);
  std::string out;
  if (blank) {
    for (size_t i = 0; i < lines.size(); ++i) {
      if (i > 0) AppendCat(&out, "\n", indention);
      out.append(lines[i]);
    }
  } else {
    out.append(lines.empty() ? std::string_view() : lines[0]);
    for (size_t i = 1; i < lines.size(); ++i) {
      out.push_back('\n');
      if (!lines[i].empty()) out.append(indention);
      out.append(lines[i]);
    }
  }
  if (first) out.insert(0, indention);
  RETURN_IF_ERROR(CheckStringSize(out.size()));
  return Value::String(std::move(out));
}

absl::StatusOr<Value> FilterInt(const Value& v, const BoundArgs& args) {
  if (v.is_undefined()) return UndefinedError(v);
  const Value fallback = ArgOr(args, 0, Value::Int(0));
  auto from_double = [&](double d) -> absl::StatusOr<Value> {
    if (std::isnan(d)) return fallback;
    if (std::isinf(d)) return PyError("cannot convert float infinity to integer");
    if (std::fabs(d) >= 9.2233720368547758e18) return PyError("integer overflow (only 64-bit integers are supported)");
    return Value::Int(static_cast<int64_t>(d));
  };
  if (v.is_integral()) return Value::Int(v.int_value());
  if (v.is_float()) return from_double(v.float_value());
  if (v.is_string()) {
    ASSIGN_OR_RETURN(int64_t base, IntArg(args, 1, 10, "base"));
    if (std::optional<int64_t> i = ParsePyInt(v.str(), static_cast<int>(base))) return Value::Int(*i);
    if (std::optional<double> d = ParsePyFloat(v.str())) return from_double(*d);
  }
  return fallback;
}

absl::StatusOr<Value> FilterItems(const Value& v, const BoundArgs&) {
  if (v.is_undefined()) return EmptyIterator();
  if (!v.is_dict()) return PyError("Can only get item pairs from a mapping.");
  std::vector<Value> items;
  for (const auto& [key, value] : v.dict().entries) items.push_back(Value::MakeList({key, value}, ListKind::kTuple));
  return Value::MakeList(std::move(items), ListKind::kIterator);
}

absl::StatusOr<Value> FilterJoin(const Value& v, const BoundArgs& args) {
  ASSIGN_OR_RETURN(std::vector<Value> items, Iterate(v));
  if (args[1] && !args[1]->is_none()) {
    for (Value& item : items) {
      ASSIGN_OR_RETURN(item, GetAttributePath(item, *args[1], nullptr));
    }
  }
  ASSIGN_OR_RETURN(std::string separator, StrOf(ArgOr(args, 0, Value::Borrowed(""))));
  return JoinStrings(separator, items);
}

absl::StatusOr<Value> FilterList(const Value& v, const BoundArgs&) {
  ASSIGN_OR_RETURN(std::vector<Value> items, Iterate(v));
  return Value::MakeList(std::move(items));
}

absl::StatusOr<Value> FilterLower(const Value& v, const BoundArgs&) {
  ASSIGN_OR_RETURN(std::string s, StrOf(v));
  return Value::String(PyLower(s));
}

absl::StatusOr<Value> FilterUpper(const Value& v, const BoundArgs&) {
  ASSIGN_OR_RETURN(std::string s, StrOf(v));
  return Value::String(PyUpper(s));
}

absl::StatusOr<Value> FilterMap(const Value& v, const BoundArgs& args) {
  const CallArgs& call = args.call();
  if (!Truthy(v)) return EmptyIterator();
  ASSIGN_OR_RETURN(std::vector<Value> items, Iterate(v));
  const auto attribute =
      std::find_if(call.keywords.begin(), call.keywords.end(), [](const auto& kw) { return kw.first == "attribute"; });
  if (call.positional.empty() && attribute != call.keywords.end()) {
    const Value* fallback = nullptr;
    for (const auto& [name, value] : call.keywords) {
      if (name == "default") {
        if (!value.is_none()) fallback = &value;
      } else if (name != "attribute") {
        return PyError(Cat("Unexpected keyword argument '", name, "'"));
      }
    }
    for (Value& item : items) {
      ASSIGN_OR_RETURN(item, GetAttributePath(item, attribute->second, fallback));
    }
    return Value::MakeList(std::move(items), ListKind::kIterator);
  }
  if (call.positional.empty()) return PyError("map requires a filter argument");
  if (!call.positional[0].is_string()) return PyError("map's filter name must be a string");
  CallArgs rest;
  rest.positional.assign(call.positional.begin() + 1, call.positional.end());
  rest.keywords = call.keywords;
  for (Value& item : items) {
    ASSIGN_OR_RETURN(item, ApplyFilter(call.positional[0].str(), item, rest));
  }
  return Value::MakeList(std::move(items), ListKind::kIterator);
}

absl::StatusOr<Value> MinOrMax(const Value& v, const BoundArgs& args, bool max) {
  ASSIGN_OR_RETURN(std::vector<Value> items, Iterate(v));
  if (items.empty()) return Value::UndefinedWithMessage("No aggregated item, sequence was empty.");
  const bool case_sensitive = args[0] && Truthy(*args[0]);
  const Value attribute = ArgOr(args, 1, Value::None());
  size_t best = 0;
  Value best_key;
  for (size_t i = 0; i < items.size(); ++i) {
    ASSIGN_OR_RETURN(Value key, GetAttributePath(items[i], attribute, nullptr));
    if (!case_sensitive) key = IgnoreCase(key);
    if (i == 0) {
      best_key = key;
      continue;
    }
    ASSIGN_OR_RETURN(bool better, max ? Compare(key, CompareOp::kGt, best_key) : Less(key, best_key));
    if (better) {
      best = i;
      best_key = key;
    }
  }
  return items[best];
}

absl::StatusOr<Value> FilterMax(const Value& v, const BoundArgs& args) { return MinOrMax(v, args, true); }
absl::StatusOr<Value> FilterMin(const Value& v, const BoundArgs& args) { return MinOrMax(v, args, false); }

// select / reject / selectattr / rejectattr (jinja2's select_or_reject).
absl::StatusOr<Value> SelectOrReject(const Value& v, const BoundArgs& args, bool select, bool lookup_attr) {
  const CallArgs& call = args.call();
  if (!Truthy(v)) return EmptyIterator();
  ASSIGN_OR_RETURN(std::vector<Value> items, Iterate(v));
  size_t off = 0;
  Value attribute;
  if (lookup_attr) {
    if (call.positional.empty()) return PyError("Missing parameter for attribute name");
    attribute = call.positional[0];
    off = 1;
  }
  std::optional<std::string_view> test;
  CallArgs test_args;
  if (call.positional.size() > off) {
    if (!call.positional[off].is_string()) return PyError("the test name must be a string");
    test = call.positional[off].str();
    test_args.positional.assign(call.positional.begin() + off + 1, call.positional.end());
  }
  test_args.keywords = call.keywords;
  std::vector<Value> out;
  for (const Value& item : items) {
    Value subject = item;
    if (lookup_attr) {
      ASSIGN_OR_RETURN(subject, GetAttributePath(item, attribute, nullptr));
    }
    bool passed;
    if (test) {
      ASSIGN_OR_RETURN(passed, ApplyTest(*test, subject, test_args));
    } else {
      passed = Truthy(subject);
    }
    if (passed == select) out.push_back(item);
  }
  return Value::MakeList(std::move(out), ListKind::kIterator);
}

absl::StatusOr<Value> FilterSelect(const Value& v, const BoundArgs& a) { return SelectOrReject(v, a, true, false); }
absl::StatusOr<Value> FilterReject(const Value& v, const BoundArgs& a) { return SelectOrReject(v, a, false, false); }
absl::StatusOr<Value> FilterSelectAttr(const Value& v, const BoundArgs& a) { return SelectOrReject(v, a, true, true); }
absl::StatusOr<Value> FilterRejectAttr(const Value& v, const BoundArgs& a) { return SelectOrReject(v, a, false, true); }

absl::StatusOr<Value> FilterReplace(const Value& v, const BoundArgs& args) {
  ASSIGN_OR_RETURN(std::string s, StrOf(v));
  ASSIGN_OR_RETURN(std::string old_text, StrOf(*args[0]));
  ASSIGN_OR_RETURN(std::string new_text, StrOf(*args[1]));
  int64_t count = -1;
  if (args[2] && !args[2]->is_none()) {
    ASSIGN_OR_RETURN(count, IntArg(args, 2, -1, "count"));
  }
  std::string out = PyReplace(s, old_text, new_text, count);
  RETURN_IF_ERROR(CheckStringSize(out.size()));
  return Value::String(std::move(out));
}

absl::StatusOr<Value> FilterReverse(const Value& v, const BoundArgs&) {
  if (v.is_string()) {
    ASSIGN_OR_RETURN(std::vector<Value> chars, Iterate(v));
    std::string out;
    out.reserve(v.str().size());
    for (auto it = chars.rbegin(); it != chars.rend(); ++it) out.append(it->str());
    return Value::String(std::move(out));
  }
  if (std::optional<std::vector<Value>> items = Reversed(v)) {
    return Value::MakeList(*std::move(items), ListKind::kIterator);
  }
  // Not reversible: list(value) reversed, when it is iterable.
  absl::StatusOr<std::vector<Value>> items = Iterate(v);
  if (!items.ok()) return PyError("argument must be iterable");
  std::reverse(items->begin(), items->end());
  return Value::MakeList(*std::move(items));
}

absl::StatusOr<Value> FilterRound(const Value& v, const BoundArgs& args) {
  const Value method = ArgOr(args, 1, Value::Borrowed("common"));
  if (!method.is_string() || (method.str() != "common" && method.str() != "ceil" && method.str() != "floor")) {
    return PyError("method must be common, ceil or floor");
  }
  if (v.is_undefined()) return UndefinedError(v);
  if (!v.is_number()) return PyError(Cat("type ", TypeName(v), " doesn't define __round__ method"));
  ASSIGN_OR_RETURN(int64_t precision, IntArg(args, 0, 0, "precision"));
  if (method.str() == "common") {
    if (v.is_integral()) {
      if (precision >= 0) return Value::Int(v.int_value());
      if (precision < -18) return Value::Int(0);
      int64_t scale = 1;
      for (int64_t i = 0; i < -precision; ++i) scale *= 10;
      const int64_t x = v.int_value();
      int64_t q = x / scale, r = x % scale;
      if (r < 0) {
        r += scale;
        --q;
      }
      if (2 * r > scale || (2 * r == scale && (q & 1))) ++q;  // Half to even.
      return Value::Int(q * scale);
    }
    const double x = v.float_value();
    if (!std::isfinite(x) || precision > 323) return Value::Float(x);
    if (precision >= 0) {
      // Like CPython: correctly rounded decimal digits, then back to binary.
      std::vector<char> buf(400);
      std::snprintf(buf.data(), buf.size(), "%.*f", static_cast<int>(precision), x);
      return Value::Float(std::strtod(buf.data(), nullptr));
    }
    if (precision < -308) return Value::Float(std::copysign(0.0, x));
    const double scale = std::pow(10.0, static_cast<double>(-precision));
    return Value::Float(std::nearbyint(x / scale) * scale);
  }
  const double scale = std::pow(10.0, static_cast<double>(precision));
  const double scaled = v.AsDouble() * scale;
  const double rounded = method.str() == "ceil" ? std::ceil(scaled) : std::floor(scaled);
  return Value::Float(rounded / scale);
}

absl::StatusOr<Value> FilterSafe(const Value& v, const BoundArgs&) {
  if (v.is_markup()) return v;
  ASSIGN_OR_RETURN(std::string s, StrOf(v));
  return Value::Markup(std::move(s));
}

absl::StatusOr<Value> FilterSort(const Value& v, const BoundArgs& args) {
  const bool reverse = args[0] && Truthy(*args[0]);
  const bool case_sensitive = args[1] && Truthy(*args[1]);
  const Value attribute = ArgOr(args, 2, Value::None());
  ASSIGN_OR_RETURN(std::vector<Value> items, Iterate(v));
  std::vector<Value> keys;
  keys.reserve(items.size());
  for (const Value& item : items) {
    ASSIGN_OR_RETURN(Value key, SortKey(item, attribute, case_sensitive));
    keys.push_back(std::move(key));
  }
  RETURN_IF_ERROR(SortByKeys(&items, keys, reverse));
  return Value::MakeList(std::move(items));
}

absl::StatusOr<Value> FilterString(const Value& v, const BoundArgs&) {
  if (v.is_string()) return v;
  ASSIGN_OR_RETURN(std::string s, StrOf(v));
  return Value::String(std::move(s));
}

absl::StatusOr<Value> FilterSum(const Value& v, const BoundArgs& args) {
  ASSIGN_OR_RETURN(std::vector<Value> items, Iterate(v));
  Value total = ArgOr(args, 1, Value::Int(0));
  if (total.is_string()) return PyError("sum() can't sum strings [use ''.join(seq) instead]");
  for (const Value& item : items) {
    Value term = item;
    if (args[0] && !args[0]->is_none()) {
      ASSIGN_OR_RETURN(term, GetAttributePath(item, *args[0], nullptr));
    }
    ASSIGN_OR_RETURN(total, BinaryOperation(BinaryOp::kAdd, total, term));
  }
  return total;
}

// Jinja's title filter: each run between [-\s({[<] separators gets an
// upper-cased first character and lower-cased rest.
absl::StatusOr<Value> FilterTitle(const Value& v, const BoundArgs&) {
  ASSIGN_OR_RETURN(std::string s, StrOf(v));
  auto is_separator = [](char32_t c) {
    return c == '-' || c == '(' || c == '{' || c == '[' || c == '<' || IsPySpace(c);
  };
  std::string out;
  size_t pos = 0;
  while (pos < s.size()) {
    size_t at = pos;
    const bool separator = is_separator(NextCodePoint(s, &at));
    size_t end = at;
    while (end < s.size()) {
      size_t next = end;
      if (is_separator(NextCodePoint(s, &next)) != separator) break;
      end = next;
    }
    out += PyUpper(std::string_view(s).substr(pos, at - pos));
    out += PyLower(std::string_view(s).substr(at, end - at));
    pos = end;
  }
  return Value::String(std::move(out));
}

// transformers' tojson: json.dumps(x, ensure_ascii=False, indent=None,
// separators=None, sort_keys=False).
absl::StatusOr<Value> FilterToJson(const Value& v, const BoundArgs& args) {
  JsonDumpOptions options;
  options.ensure_ascii = args[0] && Truthy(*args[0]);
  if (args[1] && !args[1]->is_none()) {
    if (args[1]->is_string()) {
      options.indent = std::string(args[1]->str());
    } else if (args[1]->is_integral()) {
      options.indent = std::string(std::clamp<int64_t>(args[1]->int_value(), 0, 1000), ' ');
    } else {
      return PyError(Cat("can't multiply sequence by non-int of type '", TypeName(*args[1]), "'"));
    }
    options.item_separator = ",";
  }
  if (args[2] && !args[2]->is_none()) {
    const Value& seps = *args[2];
    if (!seps.is_list() || seps.list().items.size() != 2 || !seps.list().items[0].is_string() ||
        !seps.list().items[1].is_string()) {
      return PyError("separators must be an (item_separator, key_separator) pair of strings");
    }
    options.item_separator = std::string(seps.list().items[0].str());
    options.key_separator = std::string(seps.list().items[1].str());
  }
  options.sort_keys = args[3] && Truthy(*args[3]);
  std::string out;
  RETURN_IF_ERROR(DumpJson(v, options, &out));
  RETURN_IF_ERROR(CheckStringSize(out.size()));
  return Value::String(std::move(out));
}

absl::StatusOr<Value> FilterTrim(const Value& v, const BoundArgs& args) {
  ASSIGN_OR_RETURN(std::optional<std::string_view> chars, OptionalStrArg(args, 0, "strip"));
  if (v.is_string()) return Value::SubString(v, PyStrip(v.str(), chars, true, true));
  ASSIGN_OR_RETURN(std::string s, StrOf(v));
  return Value::String(std::string(PyStrip(s, chars, true, true)));
}

absl::StatusOr<Value> FilterTruncate(const Value& v, const BoundArgs& args) {
  ASSIGN_OR_RETURN(std::string s, StrOf(v));
  ASSIGN_OR_RETURN(int64_t length, IntArg(args, 0, 255, "length"));
  const bool killwords = args[1] && Truthy(*args[1]);
  ASSIGN_OR_RETURN(std::string end, StrOf(ArgOr(args, 2, Value::Borrowed("..."))));
  int64_t leeway = 5;
  if (args[3] && !args[3]->is_none()) {
    ASSIGN_OR_RETURN(leeway, IntArg(args, 3, 5, "leeway"));
  }
  const int64_t end_len = static_cast<int64_t>(CodePointCount(end));
  if (length < end_len) return PyError(Cat("expected length >= ", end_len, ", got ", length));
  if (leeway < 0) return PyError(Cat("expected leeway >= 0, got ", leeway));
  const std::vector<size_t> offsets = CodePointOffsets(s);
  const int64_t n = static_cast<int64_t>(offsets.size()) - 1;
  if (n <= length + leeway) return Value::String(std::move(s));
  std::string_view head = std::string_view(s).substr(0, offsets[length - end_len]);
  if (!killwords) {
    const size_t space = head.rfind(' ');
    if (space != std::string_view::npos) head = head.substr(0, space);
  }
  return Value::String(Cat(head, end));
}

absl::StatusOr<Value> FilterUnique(const Value& v, const BoundArgs& args) {
  const bool case_sensitive = args[0] && Truthy(*args[0]);
  const Value attribute = ArgOr(args, 1, Value::None());
  ASSIGN_OR_RETURN(std::vector<Value> items, Iterate(v));
  std::vector<Value> seen;
  std::vector<Value> out;
  for (const Value& item : items) {
    ASSIGN_OR_RETURN(Value key, GetAttributePath(item, attribute, nullptr));
    if (!case_sensitive) key = IgnoreCase(key);
    if (!IsHashable(key)) return PyError(Cat("unhashable type: '", TypeName(key), "'"));
    if (std::none_of(seen.begin(), seen.end(), [&](const Value& s) { return Equals(s, key); })) {
      seen.push_back(key);
      out.push_back(item);
    }
  }
  return Value::MakeList(std::move(out), ListKind::kIterator);
}

absl::StatusOr<Value> FilterWordCount(const Value& v, const BoundArgs&) {
  ASSIGN_OR_RETURN(std::string s, StrOf(v));
  int64_t words = 0;
  bool in_word = false;
  size_t pos = 0;
  while (pos < s.size()) {
    const bool word = IsPyWordChar(NextCodePoint(s, &pos));
    if (word && !in_word) ++words;
    in_word = word;
  }
  return Value::Int(words);
}

// ---------------------------------------------------------------------------
// Tests (jinja2/tests.py).

absl::StatusOr<Value> TestDefined(const Value& v, const BoundArgs&) { return Value::Bool(!v.is_undefined()); }
absl::StatusOr<Value> TestUndefined(const Value& v, const BoundArgs&) { return Value::Bool(v.is_undefined()); }
absl::StatusOr<Value> TestNone(const Value& v, const BoundArgs&) { return Value::Bool(v.is_none()); }
absl::StatusOr<Value> TestBoolean(const Value& v, const BoundArgs&) { return Value::Bool(v.is_bool()); }
absl::StatusOr<Value> TestFalse(const Value& v, const BoundArgs&) {
  return Value::Bool(v.is_bool() && !v.bool_value());
}
absl::StatusOr<Value> TestTrue(const Value& v, const BoundArgs&) { return Value::Bool(v.is_bool() && v.bool_value()); }
absl::StatusOr<Value> TestInteger(const Value& v, const BoundArgs&) { return Value::Bool(v.is_int()); }
absl::StatusOr<Value> TestFloat(const Value& v, const BoundArgs&) { return Value::Bool(v.is_float()); }
absl::StatusOr<Value> TestNumber(const Value& v, const BoundArgs&) { return Value::Bool(v.is_number()); }
absl::StatusOr<Value> TestString(const Value& v, const BoundArgs&) { return Value::Bool(v.is_string()); }
absl::StatusOr<Value> TestMapping(const Value& v, const BoundArgs&) { return Value::Bool(v.is_dict()); }
absl::StatusOr<Value> TestEscaped(const Value& v, const BoundArgs&) { return Value::Bool(v.is_markup()); }

absl::StatusOr<Value> TestIterable(const Value& v, const BoundArgs&) {
  const bool loop = v.is_object() && v.object().kind == Object::Kind::kLoop;
  return Value::Bool(v.is_undefined() || v.is_string() || v.is_list() || v.is_dict() || loop);
}

absl::StatusOr<Value> TestSequence(const Value& v, const BoundArgs&) {
  const bool indexable_list = v.is_list() && (v.list().kind == ListKind::kList || v.list().kind == ListKind::kTuple ||
                                              v.list().kind == ListKind::kRange);
  return Value::Bool(v.is_undefined() || v.is_string() || v.is_dict() || indexable_list);
}

absl::StatusOr<Value> TestCallable(const Value& v, const BoundArgs&) {
  return Value::Bool(v.is_undefined() || (v.is_object() && v.object().kind != Object::Kind::kNamespace));
}

absl::StatusOr<Value> TestSameAs(const Value& v, const BoundArgs& args) {
  const Value& other = *args[0];
  if (v.kind() != other.kind()) return Value::Bool(false);
  switch (v.kind()) {
    case Value::Kind::kNone:
      return Value::Bool(true);
    case Value::Kind::kBool:
      return Value::Bool(v.bool_value() == other.bool_value());
    case Value::Kind::kInt:  // CPython caches the small ints.
      return Value::Bool(v.int_value() == other.int_value() && v.int_value() >= -5 && v.int_value() <= 256);
    case Value::Kind::kString:
      return Value::Bool(v.str().data() == other.str().data() && v.str() == other.str());
    case Value::Kind::kList:
    case Value::Kind::kDict:
    case Value::Kind::kObject:
      return Value::Bool(v.identity() == other.identity());
    default:
      return Value::Bool(false);
  }
}

absl::StatusOr<Value> TestOddOrEven(const Value& v, int64_t remainder) {
  ASSIGN_OR_RETURN(Value mod, BinaryOperation(BinaryOp::kMod, v, Value::Int(2)));
  return Value::Bool(Equals(mod, Value::Int(remainder)));
}
absl::StatusOr<Value> TestOdd(const Value& v, const BoundArgs&) { return TestOddOrEven(v, 1); }
absl::StatusOr<Value> TestEven(const Value& v, const BoundArgs&) { return TestOddOrEven(v, 0); }

absl::StatusOr<Value> TestDivisibleBy(const Value& v, const BoundArgs& args) {
  ASSIGN_OR_RETURN(Value mod, BinaryOperation(BinaryOp::kMod, v, *args[0]));
  return Value::Bool(Equals(mod, Value::Int(0)));
}

absl::StatusOr<Value> TestLower(const Value& v, const BoundArgs&) {
  ASSIGN_OR_RETURN(std::string s, StrOf(v));
  return Value::Bool(PyIsLower(s));
}

absl::StatusOr<Value> TestUpper(const Value& v, const BoundArgs&) {
  ASSIGN_OR_RETURN(std::string s, StrOf(v));
  return Value::Bool(PyIsUpper(s));
}

absl::StatusOr<Value> TestIn(const Value& v, const BoundArgs& args) {
  ASSIGN_OR_RETURN(bool in, Contains(*args[0], v));
  return Value::Bool(in);
}

template <CompareOp op>
absl::StatusOr<Value> TestCompare(const Value& v, const BoundArgs& args) {
  ASSIGN_OR_RETURN(bool result, Compare(v, op, *args[0]));
  return Value::Bool(result);
}

absl::StatusOr<Value> TestFilter(const Value& v, const BoundArgs&) {
  return Value::Bool(v.is_string() && FindFilter(v.str()) >= 0);
}

absl::StatusOr<Value> TestTest(const Value& v, const BoundArgs&) {
  return Value::Bool(v.is_string() && FindTest(v.str()) >= 0);
}

// ---------------------------------------------------------------------------
// Global functions: Jinja2's range, namespace, dict and transformers'
// raise_exception and strftime_now.

absl::StatusOr<Value> GlobalRange(const Value&, const BoundArgs& args) {
  const CallArgs& call = args.call();
  if (!call.keywords.empty()) return PyError("range() takes no keyword arguments");
  if (call.positional.empty() || call.positional.size() > 3) {
    return PyError(Cat("range expected at most 3 arguments, got ", call.positional.size()));
  }
  int64_t values[3] = {0, 0, 0};
  for (size_t i = 0; i < call.positional.size(); ++i) {
    const Value& v = call.positional[i];
    if (v.is_undefined()) return UndefinedError(v);
    if (!v.is_integral()) {
      return PyError(Cat("'", TypeName(v), "' object cannot be interpreted as an integer"));
    }
    values[i] = v.int_value();
  }
  int64_t start = 0, stop, step = 1;
  if (call.positional.size() == 1) {
    stop = values[0];
  } else {
    start = values[0];
    stop = values[1];
    if (call.positional.size() == 3) step = values[2];
  }
  if (step == 0) return PyError("range() arg 3 must not be zero");
  const long double span = step > 0 ? static_cast<long double>(stop) - start : static_cast<long double>(start) - stop;
  const long double count = span <= 0 ? 0 : std::ceil(span / std::fabs(static_cast<long double>(step)));
  if (count > 100000) {  // jinja2.sandbox.MAX_RANGE
    return PyError("Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
  }
  auto range = std::make_shared<List>();
  range->kind = ListKind::kRange;
  range->range_args = {start, stop, step};
  range->items.reserve(static_cast<size_t>(count));
  for (int64_t i = 0, x = start; i < static_cast<int64_t>(count); ++i, x += step) range->items.push_back(Value::Int(x));
  return Value::FromList(std::move(range));
}

// dict(*args, **kwargs) as Python builds it.
absl::StatusOr<Dict> BuildDict(const CallArgs& call, std::string_view what) {
  if (call.positional.size() > 1) {
    return PyError(Cat(what, " expected at most 1 argument, got ", call.positional.size()));
  }
  Dict dict;
  if (!call.positional.empty()) {
    const Value& source = call.positional[0];
    if (source.is_dict()) {
      dict = source.dict();
    } else {
      ASSIGN_OR_RETURN(std::vector<Value> pairs, Iterate(source));
      for (const Value& pair : pairs) {
        ASSIGN_OR_RETURN(std::vector<Value> kv, Iterate(pair));
        if (kv.size() != 2) {
          return PyError(Cat("dictionary update sequence element has length ", kv.size(), "; 2 is required"));
        }
        if (!IsHashable(kv[0])) return PyError(Cat("unhashable type: '", TypeName(kv[0]), "'"));
        dict.Set(kv[0], kv[1]);
      }
    }
  }
  for (const auto& [name, value] : call.keywords) dict.Set(Value::String(std::string(name)), value);
  if (dict.depth > kMaxValueDepth) return PyError(Cat("values nested deeper than ", kMaxValueDepth, " levels"));
  return dict;
}

absl::StatusOr<Value> GlobalNamespace(const Value&, const BoundArgs& args) {
  ASSIGN_OR_RETURN(Dict attrs, BuildDict(args.call(), "Namespace"));
  auto ns = std::make_shared<Namespace>();
  ns->attrs = std::move(attrs);
  return Value::FromObject(std::move(ns));
}

absl::StatusOr<Value> GlobalDict(const Value&, const BoundArgs& args) {
  ASSIGN_OR_RETURN(Dict dict, BuildDict(args.call(), "dict"));
  return Value::FromDict(std::make_shared<const Dict>(std::move(dict)));
}

absl::StatusOr<Value> GlobalRaiseException(const Value&, const BoundArgs& args) {
  ASSIGN_OR_RETURN(std::string message, StrOf(*args[0]));
  // InvalidArgument, not the positionless kUnknown: the message reaches the
  // client exactly as the template wrote it.
  return absl::InvalidArgumentError(message);
}

absl::StatusOr<Value> GlobalStrftimeNow(const Value&, const BoundArgs& args) {
  ASSIGN_OR_RETURN(std::string_view format, StrArg(args, 0, "strftime() argument 1"));
  const std::time_t now = std::time(nullptr);
  std::tm local;
  localtime_r(&now, &local);
  const std::string fmt(format);
  for (size_t size = 256; size <= (size_t{1} << 20); size *= 4) {
    std::string buf(size, '\0');
    const size_t n = std::strftime(buf.data(), buf.size(), fmt.c_str(), &local);
    if (n > 0 || fmt.empty()) {
      buf.resize(n);
      return Value::String(std::move(buf));
    }
  }
  return Value::Borrowed("");  // Formats such as "%p" in some locales expand to nothing.
}

// ---------------------------------------------------------------------------
// Methods of str, dict, list/tuple and loop.

absl::StatusOr<Value> StrStrip(const Value& self, const BoundArgs& args, bool left, bool right) {
  ASSIGN_OR_RETURN(std::optional<std::string_view> chars, OptionalStrArg(args, 0, "strip"));
  return Value::SubString(self, PyStrip(self.str(), chars, left, right));
}
absl::StatusOr<Value> MethodStrip(const Value& s, const BoundArgs& a) { return StrStrip(s, a, true, true); }
absl::StatusOr<Value> MethodLStrip(const Value& s, const BoundArgs& a) { return StrStrip(s, a, true, false); }
absl::StatusOr<Value> MethodRStrip(const Value& s, const BoundArgs& a) { return StrStrip(s, a, false, true); }

// self[start:end] (code points) for the start/end arguments of find, count,
// startswith; nullopt when the window is out of range (start past the end
// or after `end`), where Python matches nothing, not even "".
absl::StatusOr<std::optional<std::string_view>> StrWindow(const Value& self, const BoundArgs& args, size_t start_index,
                                                          size_t* start_cp) {
  *start_cp = 0;
  auto bound = [&](size_t i) -> absl::StatusOr<std::optional<int64_t>> {
    if (!args[i] || args[i]->is_none()) return std::optional<int64_t>();
    if (!args[i]->is_integral()) return PyError("slice indices must be integers or None or have an __index__ method");
    return std::optional<int64_t>(args[i]->int_value());
  };
  ASSIGN_OR_RETURN(std::optional<int64_t> start, bound(start_index));
  ASSIGN_OR_RETURN(std::optional<int64_t> end, bound(start_index + 1));
  if (!start && !end) return std::optional<std::string_view>(self.str());
  const std::vector<size_t> offsets = CodePointOffsets(self.str());
  const int64_t n = static_cast<int64_t>(offsets.size()) - 1;
  int64_t lo = start.value_or(0), hi = end.value_or(n);
  if (lo < 0) lo = std::max<int64_t>(lo + n, 0);
  if (hi < 0) hi = std::max<int64_t>(hi + n, 0);
  hi = std::min(hi, n);
  if (lo > n || lo > hi) return std::optional<std::string_view>();
  *start_cp = static_cast<size_t>(lo);
  return std::optional<std::string_view>(self.str().substr(offsets[lo], offsets[hi] - offsets[lo]));
}

absl::StatusOr<Value> StartsOrEndsWith(const Value& self, const BoundArgs& args, bool ends) {
  size_t start_cp;
  ASSIGN_OR_RETURN(std::optional<std::string_view> window, StrWindow(self, args, 1, &start_cp));
  std::vector<Value> candidates;
  if (args[0]->is_string()) {
    candidates.push_back(*args[0]);
  } else if (args[0]->is_list() && args[0]->list().kind == ListKind::kTuple) {
    candidates = args[0]->list().items;
  } else {
    return PyError(
        Cat(ends ? "endswith" : "startswith", " first arg must be str or a tuple of str, not ", TypeName(*args[0])));
  }
  for (const Value& c : candidates) {
    if (!c.is_string()) return PyError("tuple for startswith/endswith must only contain str");
    const std::string_view p = c.str();
    if (window && window->size() >= p.size() &&
        (ends ? window->substr(window->size() - p.size()) : window->substr(0, p.size())) == p) {
      return Value::Bool(true);
    }
  }
  return Value::Bool(false);
}
absl::StatusOr<Value> MethodStartsWith(const Value& s, const BoundArgs& a) { return StartsOrEndsWith(s, a, false); }
absl::StatusOr<Value> MethodEndsWith(const Value& s, const BoundArgs& a) { return StartsOrEndsWith(s, a, true); }

absl::StatusOr<Value> SplitImpl(const Value& self, const BoundArgs& args, bool from_right) {
  ASSIGN_OR_RETURN(std::optional<std::string_view> sep, OptionalStrArg(args, 0, "sep"));
  if (sep && sep->empty()) return PyError("empty separator");
  ASSIGN_OR_RETURN(int64_t maxsplit, IntArg(args, 1, -1, "maxsplit"));
  const std::vector<std::string_view> parts =
      from_right ? PyRSplit(self.str(), sep, maxsplit) : PySplit(self.str(), sep, maxsplit);
  std::vector<Value> items;
  items.reserve(parts.size());
  for (std::string_view part : parts) items.push_back(Value::SubString(self, part));
  return Value::MakeList(std::move(items));
}
absl::StatusOr<Value> MethodSplit(const Value& s, const BoundArgs& a) { return SplitImpl(s, a, false); }
absl::StatusOr<Value> MethodRSplit(const Value& s, const BoundArgs& a) { return SplitImpl(s, a, true); }

absl::StatusOr<Value> MethodSplitLines(const Value& self, const BoundArgs& args) {
  const bool keepends = args[0] && Truthy(*args[0]);
  std::vector<Value> items;
  for (std::string_view line : PySplitLines(self.str(), keepends)) items.push_back(Value::SubString(self, line));
  return Value::MakeList(std::move(items));
}

absl::StatusOr<Value> MethodReplace(const Value& self, const BoundArgs& args) {
  ASSIGN_OR_RETURN(std::string_view old_text, StrArg(args, 0, "replace() argument 1"));
  ASSIGN_OR_RETURN(std::string_view new_text, StrArg(args, 1, "replace() argument 2"));
  ASSIGN_OR_RETURN(int64_t count, IntArg(args, 2, -1, "count"));
  std::string out = PyReplace(self.str(), old_text, new_text, count);
  RETURN_IF_ERROR(CheckStringSize(out.size()));
  return Value::String(std::move(out));
}

absl::StatusOr<Value> MethodUpper(const Value& s, const BoundArgs&) { return Value::String(PyUpper(s.str())); }
absl::StatusOr<Value> MethodLower(const Value& s, const BoundArgs&) { return Value::String(PyLower(s.str())); }
absl::StatusOr<Value> MethodTitle(const Value& s, const BoundArgs&) { return Value::String(PyTitle(s.str())); }
absl::StatusOr<Value> MethodCapitalize(const Value& s, const BoundArgs&) {
  return Value::String(PyCapitalize(s.str()));
}
absl::StatusOr<Value> MethodSwapCase(const Value& s, const BoundArgs&) { return Value::String(PySwapCase(s.str())); }

absl::StatusOr<Value> FindImpl(const Value& self, const BoundArgs& args, bool from_right, bool raise) {
  ASSIGN_OR_RETURN(std::string_view sub, StrArg(args, 0, "must be str"));
  size_t start_cp;
  ASSIGN_OR_RETURN(std::optional<std::string_view> window, StrWindow(self, args, 1, &start_cp));
  const size_t hit = !window ? std::string_view::npos : from_right ? window->rfind(sub) : window->find(sub);
  if (hit == std::string_view::npos) {
    if (raise) return PyError("substring not found");
    return Value::Int(-1);
  }
  return Value::Int(static_cast<int64_t>(start_cp + CodePointCount(window->substr(0, hit))));
}
absl::StatusOr<Value> MethodFind(const Value& s, const BoundArgs& a) { return FindImpl(s, a, false, false); }
absl::StatusOr<Value> MethodRFind(const Value& s, const BoundArgs& a) { return FindImpl(s, a, true, false); }
absl::StatusOr<Value> MethodIndex(const Value& s, const BoundArgs& a) { return FindImpl(s, a, false, true); }
absl::StatusOr<Value> MethodRIndex(const Value& s, const BoundArgs& a) { return FindImpl(s, a, true, true); }

absl::StatusOr<Value> MethodStrCount(const Value& self, const BoundArgs& args) {
  ASSIGN_OR_RETURN(std::string_view sub, StrArg(args, 0, "must be str"));
  size_t start_cp;
  ASSIGN_OR_RETURN(std::optional<std::string_view> window, StrWindow(self, args, 1, &start_cp));
  return Value::Int(window ? PyCount(*window, sub) : 0);
}

absl::StatusOr<Value> MethodJoin(const Value& self, const BoundArgs& args) {
  ASSIGN_OR_RETURN(std::vector<Value> items, Iterate(*args[0]));
  for (size_t i = 0; i < items.size(); ++i) {
    if (!items[i].is_string()) {
      return PyError(Cat("sequence item ", i, ": expected str instance, ", TypeName(items[i]), " found"));
    }
  }
  return JoinStrings(self.str(), items);
}

template <bool (*Pred)(std::string_view)>
absl::StatusOr<Value> MethodPredicate(const Value& s, const BoundArgs&) {
  return Value::Bool(Pred(s.str()));
}

absl::StatusOr<Value> JustifyMethod(const Value& self, const BoundArgs& args, char how) {
  ASSIGN_OR_RETURN(int64_t width, IntArg(args, 0, 0, "width"));
  std::string_view fill = " ";
  if (args[1]) {
    ASSIGN_OR_RETURN(fill, StrArg(args, 1, "fill character"));
  }
  return Justify(self.str(), width, fill, how);
}
absl::StatusOr<Value> MethodCenter(const Value& s, const BoundArgs& a) { return JustifyMethod(s, a, 'c'); }
absl::StatusOr<Value> MethodLJust(const Value& s, const BoundArgs& a) { return JustifyMethod(s, a, 'l'); }
absl::StatusOr<Value> MethodRJust(const Value& s, const BoundArgs& a) { return JustifyMethod(s, a, 'r'); }

absl::StatusOr<Value> MethodZFill(const Value& self, const BoundArgs& args) {
  ASSIGN_OR_RETURN(int64_t width, IntArg(args, 0, 0, "width"));
  const std::string_view s = self.str();
  const int64_t len = static_cast<int64_t>(CodePointCount(s));
  if (width <= len) return self;
  RETURN_IF_ERROR(CheckStringSize(width));
  const size_t sign = !s.empty() && (s[0] == '+' || s[0] == '-') ? 1 : 0;
  return Value::String(Cat(s.substr(0, sign), std::string(width - len, '0'), s.substr(sign)));
}

absl::StatusOr<Value> PartitionImpl(const Value& self, const BoundArgs& args, bool from_right) {
  ASSIGN_OR_RETURN(std::string_view sep, StrArg(args, 0, "sep"));
  if (sep.empty()) return PyError("empty separator");
  const std::string_view s = self.str();
  const size_t hit = from_right ? s.rfind(sep) : s.find(sep);
  if (hit == std::string_view::npos) {
    const Value empty = Value::Borrowed("");
    return Value::MakeList(from_right ? std::vector<Value>{empty, empty, self} : std::vector<Value>{self, empty, empty},
                           ListKind::kTuple);
  }
  return Value::MakeList({Value::SubString(self, s.substr(0, hit)), Value::SubString(self, s.substr(hit, sep.size())),
                          Value::SubString(self, s.substr(hit + sep.size()))},
                         ListKind::kTuple);
}
absl::StatusOr<Value> MethodPartition(const Value& s, const BoundArgs& a) { return PartitionImpl(s, a, false); }
absl::StatusOr<Value> MethodRPartition(const Value& s, const BoundArgs& a) { return PartitionImpl(s, a, true); }

absl::StatusOr<Value> MethodRemovePrefix(const Value& self, const BoundArgs& args) {
  ASSIGN_OR_RETURN(std::string_view p, StrArg(args, 0, "removeprefix() argument"));
  const std::string_view s = self.str();
  return s.substr(0, p.size()) == p ? Value::SubString(self, s.substr(p.size())) : self;
}

absl::StatusOr<Value> MethodRemoveSuffix(const Value& self, const BoundArgs& args) {
  ASSIGN_OR_RETURN(std::string_view p, StrArg(args, 0, "removesuffix() argument"));
  const std::string_view s = self.str();
  const bool has = !p.empty() && s.size() >= p.size() && s.substr(s.size() - p.size()) == p;
  return has ? Value::SubString(self, s.substr(0, s.size() - p.size())) : self;
}

absl::StatusOr<Value> MethodDictGet(const Value& self, const BoundArgs& args) {
  if (!IsHashable(*args[0])) return PyError(Cat("unhashable type: '", TypeName(*args[0]), "'"));
  if (const Value* v = self.dict().Find(*args[0])) return *v;
  return ArgOr(args, 1, Value::None());
}

absl::StatusOr<Value> DictView(const Value& self, ListKind kind) {
  std::vector<Value> items;
  items.reserve(self.dict().entries.size());
  for (const auto& [key, value] : self.dict().entries) {
    if (kind == ListKind::kDictKeys) {
      items.push_back(key);
    } else if (kind == ListKind::kDictValues) {
      items.push_back(value);
    } else {
      items.push_back(Value::MakeList({key, value}, ListKind::kTuple));
    }
  }
  return Value::MakeList(std::move(items), kind);
}
absl::StatusOr<Value> MethodDictItems(const Value& s, const BoundArgs&) { return DictView(s, ListKind::kDictItems); }
absl::StatusOr<Value> MethodDictKeys(const Value& s, const BoundArgs&) { return DictView(s, ListKind::kDictKeys); }
absl::StatusOr<Value> MethodDictValues(const Value& s, const BoundArgs&) { return DictView(s, ListKind::kDictValues); }

absl::StatusOr<Value> MethodListCount(const Value& self, const BoundArgs& args) {
  int64_t n = 0;
  for (const Value& item : self.list().items) n += Equals(item, *args[0]);
  return Value::Int(n);
}

absl::StatusOr<Value> MethodListIndex(const Value& self, const BoundArgs& args) {
  const auto& items = self.list().items;
  const int64_t n = static_cast<int64_t>(items.size());
  ASSIGN_OR_RETURN(int64_t start, IntArg(args, 1, 0, "start"));
  ASSIGN_OR_RETURN(int64_t stop, IntArg(args, 2, n, "stop"));
  if (start < 0) start = std::max<int64_t>(start + n, 0);
  if (stop < 0) stop = std::max<int64_t>(stop + n, 0);
  for (int64_t i = start; i < std::min(stop, n); ++i) {
    if (Equals(items[i], *args[0])) return Value::Int(i);
  }
  std::string shown;
  RETURN_IF_ERROR(AppendRepr(*args[0], &shown));
  return PyError(Cat(shown, " is not in list"));
}

absl::StatusOr<Value> MethodLoopCycle(const Value& self, const BoundArgs& args) {
  const CallArgs& call = args.call();
  if (!call.keywords.empty()) return PyError("cycle() takes no keyword arguments");
  if (call.positional.empty()) return PyError("no items for cycling given");
  const auto& loop = static_cast<const Loop&>(self.object());
  return call.positional[loop.index0 % static_cast<int64_t>(call.positional.size())];
}

absl::StatusOr<Value> MethodLoopChanged(const Value& self, const BoundArgs& args) {
  const CallArgs& call = args.call();
  if (!call.keywords.empty()) return PyError("changed() takes no keyword arguments");
  auto& loop = static_cast<Loop&>(self.object());
  const Value current = Value::MakeList(call.positional, ListKind::kTuple);
  if (loop.last_changed && Equals(*loop.last_changed, current)) return Value::Bool(false);
  loop.last_changed = current;
  return Value::Bool(true);
}

// ---------------------------------------------------------------------------
// Tables.

Signature Params(std::vector<std::string_view> params, size_t required = 0) {
  return Signature{std::move(params), required, false, true};
}
Signature PositionalOnly(std::vector<std::string_view> params, size_t required = 0) {
  return Signature{std::move(params), required, false, false};
}
Signature VarArgs() { return Signature{{}, 0, true, true}; }

const std::vector<Builtin>& Filters() {
  static const auto* filters = new std::vector<Builtin>{
      {"abs", FilterAbs, Params({})},
      {"attr", FilterAttr, Params({"name"}, 1)},
      {"capitalize", FilterCapitalize, Params({})},
      {"center", FilterCenter, Params({"width"})},
      {"count", FilterLength, Params({})},
      {"d", FilterDefault, Params({"default_value", "boolean"})},
      {"default", FilterDefault, Params({"default_value", "boolean"})},
      {"dictsort", FilterDictSort, Params({"case_sensitive", "by", "reverse"})},
      {"e", FilterEscape, Params({})},
      {"escape", FilterEscape, Params({})},
      {"first", FilterFirst, Params({})},
      {"float", FilterFloat, Params({"default"})},
      {"forceescape", FilterForceEscape, Params({})},
      {"format", FilterFormat, VarArgs()},
      {"indent", FilterIndent, Params({"width", "first", "blank"})},
      {"int", FilterInt, Params({"default", "base"})},
      {"items", FilterItems, Params({})},
      {"join", FilterJoin, Params({"d", "attribute"})},
      {"last", FilterLast, Params({})},
      {"length", FilterLength, Params({})},
      {"list", FilterList, Params({})},
      {"lower", FilterLower, Params({})},
      {"map", FilterMap, VarArgs()},
      {"max", FilterMax, Params({"case_sensitive", "attribute"})},
      {"min", FilterMin, Params({"case_sensitive", "attribute"})},
      {"reject", FilterReject, VarArgs()},
      {"rejectattr", FilterRejectAttr, VarArgs()},
      {"replace", FilterReplace, Params({"old", "new", "count"}, 2)},
      {"reverse", FilterReverse, Params({})},
      {"round", FilterRound, Params({"precision", "method"})},
      {"safe", FilterSafe, Params({})},
      {"select", FilterSelect, VarArgs()},
      {"selectattr", FilterSelectAttr, VarArgs()},
      {"sort", FilterSort, Params({"reverse", "case_sensitive", "attribute"})},
      {"string", FilterString, Params({})},
      {"sum", FilterSum, Params({"attribute", "start"})},
      {"title", FilterTitle, Params({})},
      {"tojson", FilterToJson, Params({"ensure_ascii", "indent", "separators", "sort_keys"})},
      {"trim", FilterTrim, Params({"chars"})},
      {"truncate", FilterTruncate, Params({"length", "killwords", "end", "leeway"})},
      {"unique", FilterUnique, Params({"case_sensitive", "attribute"})},
      {"upper", FilterUpper, Params({})},
      {"wordcount", FilterWordCount, Params({})},
  };
  return *filters;
}

const std::vector<Builtin>& Tests() {
  static const auto* tests = new std::vector<Builtin>{
      {"boolean", TestBoolean, Params({})},
      {"callable", TestCallable, PositionalOnly({})},
      {"defined", TestDefined, Params({})},
      {"divisibleby", TestDivisibleBy, Params({"num"}, 1)},
      {"eq", TestCompare<CompareOp::kEq>, PositionalOnly({"b"}, 1)},
      {"equalto", TestCompare<CompareOp::kEq>, PositionalOnly({"b"}, 1)},
      {"==", TestCompare<CompareOp::kEq>, PositionalOnly({"b"}, 1)},
      {"escaped", TestEscaped, Params({})},
      {"even", TestEven, Params({})},
      {"false", TestFalse, Params({})},
      {"filter", TestFilter, Params({})},
      {"float", TestFloat, Params({})},
      {"ge", TestCompare<CompareOp::kGe>, PositionalOnly({"b"}, 1)},
      {">=", TestCompare<CompareOp::kGe>, PositionalOnly({"b"}, 1)},
      {"gt", TestCompare<CompareOp::kGt>, PositionalOnly({"b"}, 1)},
      {"greaterthan", TestCompare<CompareOp::kGt>, PositionalOnly({"b"}, 1)},
      {">", TestCompare<CompareOp::kGt>, PositionalOnly({"b"}, 1)},
      {"in", TestIn, Params({"seq"}, 1)},
      {"integer", TestInteger, Params({})},
      {"iterable", TestIterable, Params({})},
      {"le", TestCompare<CompareOp::kLe>, PositionalOnly({"b"}, 1)},
      {"<=", TestCompare<CompareOp::kLe>, PositionalOnly({"b"}, 1)},
      {"lower", TestLower, Params({})},
      {"lt", TestCompare<CompareOp::kLt>, PositionalOnly({"b"}, 1)},
      {"lessthan", TestCompare<CompareOp::kLt>, PositionalOnly({"b"}, 1)},
      {"<", TestCompare<CompareOp::kLt>, PositionalOnly({"b"}, 1)},
      {"mapping", TestMapping, Params({})},
      {"ne", TestCompare<CompareOp::kNe>, PositionalOnly({"b"}, 1)},
      {"!=", TestCompare<CompareOp::kNe>, PositionalOnly({"b"}, 1)},
      {"none", TestNone, Params({})},
      {"number", TestNumber, Params({})},
      {"odd", TestOdd, Params({})},
      {"sameas", TestSameAs, Params({"other"}, 1)},
      {"sequence", TestSequence, Params({})},
      {"string", TestString, Params({})},
      {"test", TestTest, Params({})},
      {"true", TestTrue, Params({})},
      {"undefined", TestUndefined, Params({})},
      {"upper", TestUpper, Params({})},
  };
  return *tests;
}

const std::vector<Builtin>& Globals() {
  static const auto* globals = new std::vector<Builtin>{
      {"dict", GlobalDict, VarArgs()},
      {"namespace", GlobalNamespace, VarArgs()},
      {"raise_exception", GlobalRaiseException, Params({"message"}, 1)},
      {"range", GlobalRange, VarArgs()},
      {"strftime_now", GlobalStrftimeNow, Params({"format"}, 1)},
  };
  return *globals;
}

const std::vector<Builtin>& Methods() {
  static const auto* methods = new std::vector<Builtin>{
      // str
      {"strip", MethodStrip, PositionalOnly({"chars"})},
      {"lstrip", MethodLStrip, PositionalOnly({"chars"})},
      {"rstrip", MethodRStrip, PositionalOnly({"chars"})},
      {"startswith", MethodStartsWith, PositionalOnly({"prefix", "start", "end"}, 1)},
      {"endswith", MethodEndsWith, PositionalOnly({"suffix", "start", "end"}, 1)},
      {"split", MethodSplit, Params({"sep", "maxsplit"})},
      {"rsplit", MethodRSplit, Params({"sep", "maxsplit"})},
      {"splitlines", MethodSplitLines, Params({"keepends"})},
      {"replace", MethodReplace, PositionalOnly({"old", "new", "count"}, 2)},
      {"upper", MethodUpper, PositionalOnly({})},
      {"lower", MethodLower, PositionalOnly({})},
      {"title", MethodTitle, PositionalOnly({})},
      {"capitalize", MethodCapitalize, PositionalOnly({})},
      {"swapcase", MethodSwapCase, PositionalOnly({})},
      {"find", MethodFind, PositionalOnly({"sub", "start", "end"}, 1)},
      {"rfind", MethodRFind, PositionalOnly({"sub", "start", "end"}, 1)},
      {"index", MethodIndex, PositionalOnly({"sub", "start", "end"}, 1)},
      {"rindex", MethodRIndex, PositionalOnly({"sub", "start", "end"}, 1)},
      {"count", MethodStrCount, PositionalOnly({"sub", "start", "end"}, 1)},
      {"join", MethodJoin, PositionalOnly({"iterable"}, 1)},
      {"isdigit", MethodPredicate<PyIsDigit>, PositionalOnly({})},
      {"isalpha", MethodPredicate<PyIsAlpha>, PositionalOnly({})},
      {"isalnum", MethodPredicate<PyIsAlnum>, PositionalOnly({})},
      {"isdecimal", MethodPredicate<PyIsDecimal>, PositionalOnly({})},
      {"isnumeric", MethodPredicate<PyIsNumeric>, PositionalOnly({})},
      {"isspace", MethodPredicate<PyIsSpace>, PositionalOnly({})},
      {"islower", MethodPredicate<PyIsLower>, PositionalOnly({})},
      {"isupper", MethodPredicate<PyIsUpper>, PositionalOnly({})},
      {"center", MethodCenter, PositionalOnly({"width", "fillchar"}, 1)},
      {"ljust", MethodLJust, PositionalOnly({"width", "fillchar"}, 1)},
      {"rjust", MethodRJust, PositionalOnly({"width", "fillchar"}, 1)},
      {"zfill", MethodZFill, PositionalOnly({"width"}, 1)},
      {"partition", MethodPartition, PositionalOnly({"sep"}, 1)},
      {"rpartition", MethodRPartition, PositionalOnly({"sep"}, 1)},
      {"removeprefix", MethodRemovePrefix, PositionalOnly({"prefix"}, 1)},
      {"removesuffix", MethodRemoveSuffix, PositionalOnly({"suffix"}, 1)},
      // dict
      {"get", MethodDictGet, PositionalOnly({"key", "default"}, 1)},
      {"items", MethodDictItems, PositionalOnly({})},
      {"keys", MethodDictKeys, PositionalOnly({})},
      {"values", MethodDictValues, PositionalOnly({})},
      // list and tuple
      {"count", MethodListCount, PositionalOnly({"value"}, 1)},
      {"index", MethodListIndex, PositionalOnly({"value", "start", "stop"}, 1)},
      // loop
      {"cycle", MethodLoopCycle, VarArgs()},
      {"changed", MethodLoopChanged, VarArgs()},
  };
  return *methods;
}

// Python's attribute names per receiver type: implemented methods resolve
// to Methods() entries, the rest exist (so `x.format is defined`) but
// cannot be called; the sandbox's mutators are unsafe.
struct AttributeTable {
  std::vector<std::string_view> implemented;
  std::vector<std::string_view> other;
  std::vector<std::string_view> unsafe;
};

const AttributeTable& Attributes(Receiver receiver) {
  static const auto* tables = new std::vector<AttributeTable>{
      // kStr
      {{"strip",     "lstrip",     "rstrip",       "startswith",  "endswith",   "split",    "rsplit",  "splitlines",
        "replace",   "upper",      "lower",        "title",       "capitalize", "swapcase", "find",    "rfind",
        "index",     "rindex",     "count",        "join",        "isdigit",    "isalpha",  "isalnum", "isdecimal",
        "isnumeric", "isspace",    "islower",      "isupper",     "center",     "ljust",    "rjust",   "zfill",
        "partition", "rpartition", "removeprefix", "removesuffix"},
       {"casefold", "encode", "expandtabs", "format", "format_map", "isascii", "isidentifier", "isprintable", "istitle",
        "maketrans", "translate"},
       {}},
      // kDict
      {{"get", "items", "keys", "values"}, {"copy", "fromkeys"}, {"clear", "pop", "popitem", "setdefault", "update"}},
      // kList
      {{"count", "index"}, {"clear", "copy", "pop"}, {"append", "extend", "insert", "remove", "reverse", "sort"}},
      // kTuple
      {{"count", "index"}, {}, {}},
      // kLoop
      {{"cycle", "changed"}, {}, {}},
  };
  return (*tables)[static_cast<size_t>(receiver)];
}

int FindIn(const std::vector<Builtin>& table, std::string_view name) {
  for (size_t i = 0; i < table.size(); ++i) {
    if (table[i].name == name) return static_cast<int>(i);
  }
  return -1;
}

// The Methods() entry implementing `name` for `receiver` (str.count and
// list.count differ).
int MethodId(Receiver receiver, std::string_view name) {
  const std::vector<Builtin>& methods = Methods();
  const bool sequence = receiver == Receiver::kList || receiver == Receiver::kTuple;
  for (size_t i = 0; i < methods.size(); ++i) {
    if (methods[i].name != name) continue;
    const bool list_method = methods[i].fn == MethodListCount || methods[i].fn == MethodListIndex;
    if ((name == "count" || name == "index") && list_method != sequence) continue;
    return static_cast<int>(i);
  }
  return -1;
}

}  // namespace

std::string CalleeText(const Callee& callee) {
  if (callee.kind.empty()) return Cat(callee.name, "()");
  return Cat(callee.kind, " '", callee.name, "'");
}

absl::StatusOr<BoundArgs> Bind(const Callee& callee, const Signature& sig, const CallArgs& args) {
  BoundArgs bound;
  bound.call_ = &args;
  if (sig.varargs) return bound;
  if (args.positional.size() > sig.params.size()) {
    return PyError(Cat(CalleeText(callee), " takes at most ", sig.params.size(), " argument(s) (",
                       args.positional.size(), " given)"));
  }
  bound.slots_.assign(sig.params.size(), nullptr);
  for (size_t i = 0; i < args.positional.size(); ++i) bound.slots_[i] = &args.positional[i];
  for (const auto& [name, value] : args.keywords) {
    if (!sig.keywords) return PyError(Cat(CalleeText(callee), " takes no keyword arguments"));
    const auto it = std::find(sig.params.begin(), sig.params.end(), name);
    if (it == sig.params.end()) {
      return PyError(Cat(CalleeText(callee), " got an unexpected keyword argument '", name, "'"));
    }
    const size_t i = it - sig.params.begin();
    if (bound.slots_[i] != nullptr) {
      return PyError(Cat(CalleeText(callee), " got multiple values for argument '", name, "'"));
    }
    bound.slots_[i] = &value;
  }
  for (size_t i = 0; i < sig.required; ++i) {
    if (bound.slots_[i] == nullptr) {
      return PyError(Cat(CalleeText(callee), " missing required argument '", sig.params[i], "'"));
    }
  }
  return bound;
}

absl::Status CheckCallShape(const Callee& callee, const Signature& sig, size_t positional,
                            const std::vector<std::string_view>& keywords) {
  CallArgs args;
  args.positional.resize(positional);
  for (std::string_view k : keywords) args.keywords.emplace_back(k, Value());
  absl::StatusOr<BoundArgs> bound = Bind(callee, sig, args);
  if (!bound.ok()) return absl::InvalidArgumentError(bound.status().message());
  return absl::OkStatus();
}

int FindFilter(std::string_view name) { return FindIn(Filters(), name); }
int FindTest(std::string_view name) { return FindIn(Tests(), name); }
int FindGlobalFunction(std::string_view name) { return FindIn(Globals(), name); }
const Builtin& Filter(int index) { return Filters()[index]; }
const Builtin& Test(int index) { return Tests()[index]; }
const Builtin& GlobalFunction(int index) { return Globals()[index]; }
const Builtin& Method(int id) { return Methods()[id]; }

absl::StatusOr<Value> CallBuiltin(const Callee& callee, const Builtin& builtin, const Value& self,
                                  const CallArgs& args) {
  ASSIGN_OR_RETURN(BoundArgs bound, Bind(callee, builtin.signature, args));
  return builtin.fn(self, bound);
}

absl::StatusOr<Value> ApplyFilter(std::string_view name, const Value& value, const CallArgs& args) {
  const int i = FindFilter(name);
  if (i < 0) return PyError(Cat("No filter named '", name, "'."));
  return CallBuiltin(Callee{"filter", name}, Filter(i), value, args);
}

absl::StatusOr<bool> ApplyTest(std::string_view name, const Value& value, const CallArgs& args) {
  const int i = FindTest(name);
  if (i < 0) return PyError(Cat("No test named '", name, "'."));
  ASSIGN_OR_RETURN(Value result, CallBuiltin(Callee{"test", name}, Test(i), value, args));
  return Truthy(result);
}

MethodLookup LookupMethod(Receiver receiver, std::string_view name) {
  using Table = absl::flat_hash_map<std::string_view, MethodLookup>;
  static const auto* tables = [] {
    auto* t = new std::vector<Table>(5);
    for (size_t r = 0; r < t->size(); ++r) {
      const Receiver receiver = static_cast<Receiver>(r);
      const AttributeTable& names = Attributes(receiver);
      for (std::string_view n : names.implemented) (*t)[r][n] = MethodLookup{true, false, MethodId(receiver, n)};
      for (std::string_view n : names.other) (*t)[r][n] = MethodLookup{true, false, -1};
      for (std::string_view n : names.unsafe) (*t)[r][n] = MethodLookup{true, true, -1};
    }
    return t;
  }();
  const Table& table = (*tables)[static_cast<size_t>(receiver)];
  const auto it = table.find(name);
  return it == table.end() ? MethodLookup() : it->second;
}

bool IsImplementedMethodName(std::string_view name) { return FindIn(Methods(), name) >= 0; }

const Signature* MethodSignature(std::string_view name) {
  const int i = FindIn(Methods(), name);
  return i < 0 ? nullptr : &Methods()[i].signature;
}

}  // namespace tandem::router::jinja
