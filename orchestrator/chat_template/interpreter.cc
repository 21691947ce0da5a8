#include "orchestrator/chat_template/interpreter.h"

#include <algorithm>
#include <memory>
#include <utility>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "common/status_macros.h"
#include "orchestrator/chat_template/builtins.h"
#include "orchestrator/chat_template/lexer.h"
#include "orchestrator/chat_template/operations.h"
#include "orchestrator/chat_template/str_cat.h"

namespace tandem::router::jinja {
namespace {

// One scope. Lookups walk to the parent; the root frame holds the
// template's top-level variables (and caches context lookups).
struct Frame {
  explicit Frame(Frame* p) : parent(p) {}
  Frame* parent;
  absl::InlinedVector<std::pair<int, Value>, 4> vars;

  const Value* Find(int id) const {
    for (const auto& [k, v] : vars) {
      if (k == id) return &v;
    }
    return nullptr;
  }
  void Set(int id, Value value) {
    for (auto& [k, v] : vars) {
      if (k == id) {
        v = std::move(value);
        return;
      }
    }
    vars.emplace_back(id, std::move(value));
  }
};

CompareOp ToCompareOp(CompareKind kind) {
  switch (kind) {
    case CompareKind::kEq:
      return CompareOp::kEq;
    case CompareKind::kNe:
      return CompareOp::kNe;
    case CompareKind::kLt:
      return CompareOp::kLt;
    case CompareKind::kLe:
      return CompareOp::kLe;
    case CompareKind::kGt:
      return CompareOp::kGt;
    default:
      return CompareOp::kGe;
  }
}

// Jinja2 globals that exist but cannot be called here; `is defined` sees them.
bool IsUncallableGlobal(std::string_view name) { return name == "lipsum" || name == "cycler" || name == "joiner"; }

class Renderer {
 public:
  Renderer(const Template& tpl, ContextLookup context, const RenderLimits& limits)
      : tpl_(tpl), context_(context), limits_(limits), root_(nullptr) {}

  // A template can make reference cycles (a namespace holding itself, a
  // loop over a list holding its loop); Python's GC collects them, shared
  // pointers would not. Every object a render makes dies with it.
  ~Renderer() {
    for (const std::shared_ptr<Object>& object : objects_) {
      switch (object->kind) {
        case Object::Kind::kNamespace:
          static_cast<Namespace&>(*object).attrs = Dict();
          break;
        case Object::Kind::kLoop:
          static_cast<Loop&>(*object).items.clear();
          static_cast<Loop&>(*object).last_changed.reset();
          break;
        case Object::Kind::kMacro:
          static_cast<Macro&>(*object).closure.clear();
          break;
        default:
          break;
      }
    }
  }

  absl::StatusOr<std::string> Run() {
    std::string out;
    out_ = &out;
    RETURN_IF_ERROR(ExecBody(tpl_.body, root_));
    return out;
  }

 private:
  enum class Flow { kNormal, kBreak, kContinue };

  // kUnknown (positionless) errors get the line of `offset`.
  absl::Status Locate(absl::Status status, size_t offset) const {
    if (status.code() != absl::StatusCode::kUnknown) return status;
    return absl::InvalidArgumentError(Cat("chat template: line ", LineOf(tpl_.source, offset), ": ", status.message()));
  }

  absl::Status Emit(std::string_view text) {
    if (out_->size() + text.size() > limits_.max_output_bytes) return OutputTooLarge();
    out_->append(text);
    return absl::OkStatus();
  }

  absl::Status OutputTooLarge() const {
    return PyError(Cat("output exceeds the chat template limit of ", limits_.max_output_bytes, " bytes"));
  }

  // --- Statements ---------------------------------------------------------

  // Counts the nesting of evaluation (RenderLimits::max_nesting) while alive.
  class NestingGuard {
   public:
    explicit NestingGuard(int* nesting) : nesting_(nesting) { ++*nesting_; }
    ~NestingGuard() { --*nesting_; }
    NestingGuard(const NestingGuard&) = delete;
    NestingGuard& operator=(const NestingGuard&) = delete;

   private:
    int* nesting_;
  };
  absl::Status CheckNesting() const {
    if (nesting_ > limits_.max_nesting) {
      return PyError(Cat("the template nests evaluation more than ", limits_.max_nesting, " deep"));
    }
    return absl::OkStatus();
  }

  absl::Status ExecBody(const Body& body, Frame& frame) {
    NestingGuard guard(&nesting_);
    RETURN_IF_ERROR(CheckNesting());
    for (const Stmt& stmt : body) {
      absl::Status s = Exec(stmt, frame);
      if (!s.ok()) return Locate(std::move(s), stmt.offset);
      if (flow_ != Flow::kNormal) return absl::OkStatus();
    }
    return absl::OkStatus();
  }

  absl::Status Exec(const Stmt& stmt, Frame& frame) {
    return std::visit([&](const auto& node) { return Exec(node, frame); }, stmt.node);
  }

  absl::Status Exec(const TextStmt& node, Frame&) { return Emit(node.text); }

  absl::Status Exec(const OutputStmt& node, Frame& frame) {
    ASSIGN_OR_RETURN(Value v, Eval(*node.expr, frame));
    if (v.is_string()) return Emit(v.str());
    RETURN_IF_ERROR(Locate(AppendStr(v, out_), node.expr->offset));
    if (out_->size() > limits_.max_output_bytes) return OutputTooLarge();
    return absl::OkStatus();
  }

  absl::Status Exec(const IfStmt& node, Frame& frame) {
    for (const auto& [test, body] : node.branches) {
      ASSIGN_OR_RETURN(Value v, Eval(*test, frame));
      if (Truthy(v)) return ExecBody(body, frame);
    }
    return ExecBody(node.else_body, frame);
  }

  absl::Status Exec(const ForStmt& node, Frame& frame) {
    ASSIGN_OR_RETURN(Value iterable, Eval(*node.iter, frame));
    ASSIGN_OR_RETURN(std::vector<Value> items, Iterate(iterable));
    if (node.filter) {
      std::vector<Value> kept;
      for (Value& item : items) {
        RETURN_IF_ERROR(CountIteration());
        Frame scope(&frame);
        RETURN_IF_ERROR(Assign(scope, node.target, item));
        ASSIGN_OR_RETURN(Value keep, Eval(*node.filter, scope));
        if (Truthy(keep)) kept.push_back(std::move(item));
      }
      items = std::move(kept);
    }
    if (items.empty()) return ExecBody(node.else_body, frame);
    auto loop = std::make_shared<Loop>();
    objects_.push_back(loop);
    loop->items = std::move(items);
    const Value loop_value = Value::FromObject(loop);
    const int loop_id = LoopNameId();
    for (size_t i = 0; i < loop->items.size(); ++i) {
      RETURN_IF_ERROR(CountIteration());
      loop->index0 = static_cast<int64_t>(i);
      Frame scope(&frame);
      if (loop_id >= 0) scope.Set(loop_id, loop_value);
      RETURN_IF_ERROR(Assign(scope, node.target, loop->items[i]));
      RETURN_IF_ERROR(ExecBody(node.body, scope));
      if (flow_ == Flow::kBreak) {
        flow_ = Flow::kNormal;
        break;
      }
      flow_ = Flow::kNormal;
    }
    return absl::OkStatus();
  }

  absl::Status Exec(const SetStmt& node, Frame& frame) {
    ASSIGN_OR_RETURN(Value v, Eval(*node.value, frame));
    return Assign(frame, node.target, std::move(v));
  }

  absl::Status Exec(const SetBlockStmt& node, Frame& frame) {
    Frame scope(&frame);
    ASSIGN_OR_RETURN(std::string text, Capture(node.body, scope));
    if (flow_ != Flow::kNormal) return absl::OkStatus();
    Value v = Value::String(std::move(text));
    if (node.filter) {
      ASSIGN_OR_RETURN(v, EvalFilter(*node.filter, frame, &v));
    }
    return Assign(frame, node.target, std::move(v));
  }

  absl::Status Exec(const MacroStmt& node, Frame& frame) {
    auto macro = std::make_shared<Macro>();
    objects_.push_back(macro);
    macro->definition = &node;
    macro->name = node.name;
    for (Frame* f = &frame; f != &root_; f = f->parent) {  // Innermost first: it shadows.
      for (const auto& [id, value] : f->vars) {
        const bool shadowed = std::any_of(macro->closure.begin(), macro->closure.end(),
                                          [id = id](const auto& entry) { return entry.first == id; });
        if (!shadowed) macro->closure.emplace_back(id, value);
      }
    }
    frame.Set(node.name_id, Value::FromObject(std::move(macro)));
    return absl::OkStatus();
  }

  absl::Status Exec(const FilterBlockStmt& node, Frame& frame) {
    Frame scope(&frame);
    ASSIGN_OR_RETURN(std::string text, Capture(node.body, scope));
    if (flow_ != Flow::kNormal) return absl::OkStatus();
    Value v = Value::String(std::move(text));
    ASSIGN_OR_RETURN(Value result, EvalFilter(*node.filter, frame, &v));
    if (result.is_string()) return Emit(result.str());
    ASSIGN_OR_RETURN(std::string s, Str(result));
    return Emit(s);
  }

  absl::Status Exec(const LoopControlStmt& node, Frame&) {
    flow_ = node.is_break ? Flow::kBreak : Flow::kContinue;
    return absl::OkStatus();
  }

  absl::Status Exec(const ScopeStmt& node, Frame& frame) {
    Frame scope(&frame);
    for (const auto& [target, expr] : node.assignments) {
      ASSIGN_OR_RETURN(Value v, Eval(*expr, frame));  // Values come from the outer scope.
      RETURN_IF_ERROR(Assign(scope, target, std::move(v)));
    }
    return ExecBody(node.body, scope);
  }

  // Renders `body` into a string instead of the output.
  absl::StatusOr<std::string> Capture(const Body& body, Frame& frame) {
    std::string buffer;
    std::string* saved = out_;
    out_ = &buffer;
    absl::Status s = ExecBody(body, frame);
    out_ = saved;
    RETURN_IF_ERROR(s);
    return buffer;
  }

  // Literals are where a loop could nest values without bound.
  static absl::Status CheckDepth(const Value& v) {
    if (Depth(v) > kMaxValueDepth) return PyError(Cat("values nested deeper than ", kMaxValueDepth, " levels"));
    return absl::OkStatus();
  }

  absl::Status CountIteration() {
    if (++iterations_ > limits_.max_loop_iterations) {
      return PyError(Cat("more than ", limits_.max_loop_iterations, " loop iterations"));
    }
    return absl::OkStatus();
  }

  int LoopNameId() {
    if (loop_name_id_ == -2) {
      loop_name_id_ = -1;
      for (size_t i = 0; i < tpl_.names.size(); ++i) {
        if (tpl_.names[i] == "loop") loop_name_id_ = static_cast<int>(i);
      }
    }
    return loop_name_id_;
  }

  absl::Status Assign(Frame& frame, const Target& target, Value value) {
    if (!target.attr.empty()) {
      const Value ns = Lookup(target.name_ids[0], frame);
      if (!ns.is_object() || ns.object().kind != Object::Kind::kNamespace) {
        return PyError("cannot assign attribute on non-namespace object");
      }
      static_cast<Namespace&>(ns.object()).attrs.Set(Value::String(target.attr), std::move(value));
      return absl::OkStatus();
    }
    if (!target.is_tuple) {
      frame.Set(target.name_ids[0], std::move(value));
      return absl::OkStatus();
    }
    ASSIGN_OR_RETURN(std::vector<Value> parts, Iterate(value));
    const size_t n = target.name_ids.size();
    if (parts.size() > n) return PyError(Cat("too many values to unpack (expected ", n, ")"));
    if (parts.size() < n) {
      return PyError(Cat("not enough values to unpack (expected ", n, ", got ", parts.size(), ")"));
    }
    for (size_t i = 0; i < n; ++i) frame.Set(target.name_ids[i], std::move(parts[i]));
    return absl::OkStatus();
  }

  Value Lookup(int id, Frame& frame) {
    for (Frame* f = &frame; f != nullptr; f = f->parent) {
      if (const Value* v = f->Find(id)) return *v;
    }
    const std::string& name = tpl_.names[id];
    Value v;
    if (context_(name, &v)) {
      root_.Set(id, v);
      return v;
    }
    const int global = FindGlobalFunction(name);
    if (global >= 0 || IsUncallableGlobal(name)) {
      auto fn = std::make_shared<Callable>(Object::Kind::kFunction);
      fn->name = global >= 0 ? GlobalFunction(global).name : std::string_view(name);
      fn->id = global;
      v = Value::FromObject(std::move(fn));
    } else {
      v = Value::UndefinedWithMessage(Cat("'", name, "' is undefined"));
    }
    // Cached as if set at the top level: a later top-level set replaces it,
    // and inner scopes shadow it, as they would the real variable.
    root_.Set(id, v);
    return v;
  }

  // --- Expressions --------------------------------------------------------

  absl::StatusOr<Value> Eval(const Expr& e, Frame& frame) {
    NestingGuard guard(&nesting_);
    if (absl::Status s = CheckNesting(); !s.ok()) return Locate(std::move(s), e.offset);
    absl::StatusOr<Value> v = EvalNode(e, frame);
    if (!v.ok()) return Locate(v.status(), e.offset);
    if (absl::Status s = Charge(*v); !s.ok()) return Locate(std::move(s), e.offset);
    return v;
  }

  // Counts a value an expression yielded against limits_.max_work.
  absl::Status Charge(const Value& v) {
    size_t size = 0;
    if (v.is_string()) {
      size = v.str().size();
    } else if (v.is_list()) {
      size = v.list().items.size();
    } else if (v.is_dict()) {
      size = v.dict().entries.size();
    }
    work_ += 1 + static_cast<int64_t>(size);
    if (work_ <= limits_.max_work) return absl::OkStatus();
    return PyError(Cat("the chat template did more than ", limits_.max_work,
                       " units of work (one per expression, and per string byte or item it yields)"));
  }

  absl::StatusOr<CallArgs> EvalArgs(const Expr& e, Frame& frame) {
    CallArgs args;
    args.positional.reserve(e.children.size() - 1);
    for (size_t i = 1; i < e.children.size(); ++i) {
      ASSIGN_OR_RETURN(Value v, Eval(*e.children[i], frame));
      args.positional.push_back(std::move(v));
    }
    for (const Keyword& k : e.kwargs) {
      ASSIGN_OR_RETURN(Value v, Eval(*k.value, frame));
      args.keywords.emplace_back(k.name, std::move(v));
    }
    return args;
  }

  // A filter node; `block_input` replaces the null input of a filter block.
  absl::StatusOr<Value> EvalFilter(const Expr& e, Frame& frame, const Value* block_input) {
    Value input;
    if (e.children[0]) {
      if (e.children[0]->kind == ExprKind::kFilter) {
        ASSIGN_OR_RETURN(input, EvalFilter(*e.children[0], frame, block_input));
        RETURN_IF_ERROR(Charge(input));
      } else {
        ASSIGN_OR_RETURN(input, Eval(*e.children[0], frame));
      }
    } else if (block_input != nullptr) {
      input = *block_input;
    }
    ASSIGN_OR_RETURN(CallArgs args, EvalArgs(e, frame));
    absl::StatusOr<Value> result = CallBuiltin(Callee{"filter", e.name}, Filter(e.builtin), input, args);
    if (!result.ok()) return Locate(result.status(), e.offset);
    return result;
  }

  absl::StatusOr<Value> EvalNode(const Expr& e, Frame& frame) {
    switch (e.kind) {
      case ExprKind::kConst:
        return e.constant;
      case ExprKind::kName:
        return Lookup(e.name_id, frame);
      case ExprKind::kGetattr: {
        ASSIGN_OR_RETURN(Value obj, Eval(*e.children[0], frame));
        return GetAttr(obj, e.name);
      }
      case ExprKind::kGetitem: {
        ASSIGN_OR_RETURN(Value obj, Eval(*e.children[0], frame));
        ASSIGN_OR_RETURN(Value key, Eval(*e.children[1], frame));
        return GetItem(obj, key);
      }
      case ExprKind::kSlice: {
        ASSIGN_OR_RETURN(Value obj, Eval(*e.children[0], frame));
        Value parts[3] = {Value::None(), Value::None(), Value::None()};
        for (int i = 0; i < 3; ++i) {
          if (e.children[i + 1]) {
            ASSIGN_OR_RETURN(parts[i], Eval(*e.children[i + 1], frame));
          }
        }
        return GetSlice(obj, parts[0], parts[1], parts[2]);
      }
      case ExprKind::kCall:
        return EvalCall(e, frame);
      case ExprKind::kFilter:
        return EvalFilter(e, frame, nullptr);
      case ExprKind::kTest: {
        ASSIGN_OR_RETURN(Value subject, Eval(*e.children[0], frame));
        ASSIGN_OR_RETURN(CallArgs args, EvalArgs(e, frame));
        ASSIGN_OR_RETURN(Value result, CallBuiltin(Callee{"test", e.name}, Test(e.builtin), subject, args));
        return Value::Bool(Truthy(result));
      }
      case ExprKind::kNeg: {
        ASSIGN_OR_RETURN(Value v, Eval(*e.children[0], frame));
        return Negate(v);
      }
      case ExprKind::kPos: {
        ASSIGN_OR_RETURN(Value v, Eval(*e.children[0], frame));
        return UnaryPlus(v);
      }
      case ExprKind::kNot: {
        ASSIGN_OR_RETURN(Value v, Eval(*e.children[0], frame));
        return Value::Bool(!Truthy(v));
      }
      case ExprKind::kBinary: {
        ASSIGN_OR_RETURN(Value a, Eval(*e.children[0], frame));
        ASSIGN_OR_RETURN(Value b, Eval(*e.children[1], frame));
        return BinaryOperation(e.binary_op, a, b);
      }
      case ExprKind::kConcat: {
        std::string out;
        for (const ExprPtr& child : e.children) {
          ASSIGN_OR_RETURN(Value v, Eval(*child, frame));
          RETURN_IF_ERROR(AppendStr(v, &out));
          RETURN_IF_ERROR(CheckStringSize(out.size()));
        }
        return Value::String(std::move(out));
      }
      case ExprKind::kCompare: {
        ASSIGN_OR_RETURN(Value left, Eval(*e.children[0], frame));
        for (size_t i = 0; i < e.compare_ops.size(); ++i) {
          ASSIGN_OR_RETURN(Value right, Eval(*e.children[i + 1], frame));
          bool result;
          switch (e.compare_ops[i]) {
            case CompareKind::kIn: {
              ASSIGN_OR_RETURN(result, Contains(right, left));
              break;
            }
            case CompareKind::kNotIn: {
              ASSIGN_OR_RETURN(bool in, Contains(right, left));
              result = !in;
              break;
            }
            default: {
              ASSIGN_OR_RETURN(result, Compare(left, ToCompareOp(e.compare_ops[i]), right));
            }
          }
          if (!result) return Value::Bool(false);
          left = std::move(right);
        }
        return Value::Bool(true);
      }
      case ExprKind::kAnd: {
        ASSIGN_OR_RETURN(Value a, Eval(*e.children[0], frame));
        if (!Truthy(a)) return a;
        return Eval(*e.children[1], frame);
      }
      case ExprKind::kOr: {
        ASSIGN_OR_RETURN(Value a, Eval(*e.children[0], frame));
        if (Truthy(a)) return a;
        return Eval(*e.children[1], frame);
      }
      case ExprKind::kCond: {
        ASSIGN_OR_RETURN(Value test, Eval(*e.children[1], frame));
        if (Truthy(test)) return Eval(*e.children[0], frame);
        if (e.children[2]) return Eval(*e.children[2], frame);
        return Value::UndefinedWithMessage(Cat("the inline if-expression on line ", LineOf(tpl_.source, e.offset),
                                               " evaluated to false and no else section was defined."));
      }
      case ExprKind::kList:
      case ExprKind::kTuple: {
        std::vector<Value> items;
        items.reserve(e.children.size());
        for (const ExprPtr& child : e.children) {
          ASSIGN_OR_RETURN(Value v, Eval(*child, frame));
          items.push_back(std::move(v));
        }
        Value list = Value::MakeList(std::move(items), e.kind == ExprKind::kList ? ListKind::kList : ListKind::kTuple);
        RETURN_IF_ERROR(CheckDepth(list));
        return list;
      }
      case ExprKind::kDict: {
        auto dict = std::make_shared<Dict>();
        for (size_t i = 0; i + 1 < e.children.size(); i += 2) {
          ASSIGN_OR_RETURN(Value key, Eval(*e.children[i], frame));
          ASSIGN_OR_RETURN(Value value, Eval(*e.children[i + 1], frame));
          if (!IsHashable(key)) return PyError(Cat("unhashable type: '", TypeName(key), "'"));
          dict->Set(std::move(key), std::move(value));
        }
        Value result = Value::FromDict(std::move(dict));
        RETURN_IF_ERROR(CheckDepth(result));
        return result;
      }
    }
    return Value();
  }

  absl::StatusOr<Value> EvalCall(const Expr& e, Frame& frame) {
    const Expr& callee = *e.children[0];
    Value fn;
    if (callee.kind == ExprKind::kGetattr) {
      ASSIGN_OR_RETURN(Value self, Eval(*callee.children[0], frame));
      ASSIGN_OR_RETURN(fn, GetAttr(self, callee.name));
    } else {
      ASSIGN_OR_RETURN(fn, Eval(callee, frame));
    }
    ASSIGN_OR_RETURN(CallArgs args, EvalArgs(e, frame));
    if (fn.is_undefined()) return UndefinedError(fn);
    if (fn.is_object()) {
      Object& object = fn.object();
      if (object.kind == Object::Kind::kMacro) return CallMacro(static_cast<const Macro&>(object), args);
      if (object.kind == Object::Kind::kFunction || object.kind == Object::Kind::kMethod) {
        const auto& callable = static_cast<const Callable&>(object);
        if (callable.id < 0) return PyError(Cat("'", callable.name, "' is not supported in chat templates"));
        const bool method = object.kind == Object::Kind::kMethod;
        const Builtin& builtin = method ? Method(callable.id) : GlobalFunction(callable.id);
        ASSIGN_OR_RETURN(Value result,
                         CallBuiltin(Callee{"", callable.name}, builtin, method ? callable.self : Value(), args));
        if (result.is_object()) objects_.push_back(result.object_ptr());  // namespace()
        return result;
      }
    }
    return PyError(Cat("'", TypeName(fn), "' object is not callable"));
  }

  absl::StatusOr<Value> CallMacro(const Macro& macro, const CallArgs& args) {
    const MacroStmt& def = *macro.definition;
    if (call_depth_ >= limits_.max_call_depth) {
      return PyError(Cat("macro calls nested more than ", limits_.max_call_depth, " deep"));
    }
    if (++macro_calls_ > limits_.max_macro_calls) {
      return PyError(Cat("more than ", limits_.max_macro_calls, " macro calls in one render"));
    }
    const size_t n = def.param_ids.size();
    if (args.positional.size() > n) {
      return PyError(Cat("macro '", def.name, "' takes not more than ", n, " argument(s)"));
    }
    Frame closure(&root_);
    for (const auto& [id, value] : macro.closure) closure.Set(id, value);
    Frame scope(&closure);
    std::vector<bool> bound(n, false);
    for (size_t i = 0; i < args.positional.size(); ++i) {
      scope.Set(def.param_ids[i], args.positional[i]);
      bound[i] = true;
    }
    for (const auto& [name, value] : args.keywords) {
      const auto it = std::find(def.param_names.begin(), def.param_names.end(), name);
      if (it == def.param_names.end()) {
        return PyError(Cat("macro '", def.name, "' takes no keyword argument '", name, "'"));
      }
      const size_t i = it - def.param_names.begin();
      if (bound[i]) return PyError(Cat("macro '", def.name, "' got multiple values for argument '", name, "'"));
      scope.Set(def.param_ids[i], value);
      bound[i] = true;
    }
    const size_t first_default = n - def.defaults.size();
    for (size_t i = 0; i < n; ++i) {
      if (bound[i]) continue;
      if (i >= first_default) {
        ASSIGN_OR_RETURN(Value v, Eval(*def.defaults[i - first_default], scope));
        scope.Set(def.param_ids[i], std::move(v));
      } else {
        scope.Set(def.param_ids[i],
                  Value::UndefinedWithMessage(Cat("parameter '", def.param_names[i], "' was not provided")));
      }
    }
    ++call_depth_;
    absl::StatusOr<std::string> text = Capture(def.body, scope);
    --call_depth_;
    if (!text.ok()) return text.status();
    return Value::String(*std::move(text));
  }

  const Template& tpl_;
  ContextLookup context_;
  const RenderLimits& limits_;
  Frame root_;
  std::string* out_ = nullptr;
  Flow flow_ = Flow::kNormal;
  int64_t iterations_ = 0;
  int call_depth_ = 0;
  int nesting_ = 0;
  int64_t macro_calls_ = 0;
  int64_t work_ = 0;                              // Against limits_.max_work.
  int loop_name_id_ = -2;                         // -2: not looked up yet; -1: the template never says `loop`.
  std::vector<std::shared_ptr<Object>> objects_;  // Namespaces, loops and macros made by this render.
};

}  // namespace

absl::StatusOr<std::string> Render(const Template& tpl, ContextLookup context, const RenderLimits& limits) {
  return Renderer(tpl, context, limits).Run();
}

}  // namespace tandem::router::jinja
