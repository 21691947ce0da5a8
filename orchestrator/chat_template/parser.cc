#include "orchestrator/chat_template/parser.h"

#include <algorithm>
#include <initializer_list>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "common/status_macros.h"
#include "orchestrator/chat_template/builtins.h"
#include "orchestrator/chat_template/lexer.h"
#include "orchestrator/chat_template/str_cat.h"

namespace tandem::router::jinja {
namespace {

// Deeper nesting than any real template, shallow enough for the stack.
constexpr int kMaxNesting = 200;

std::string Describe(const Token& t) {
  switch (t.type) {
    case TokenType::kData:
      return "template data";
    case TokenType::kVariableBegin:
      return "begin of print statement";
    case TokenType::kVariableEnd:
      return "end of print statement";
    case TokenType::kBlockBegin:
      return "begin of statement block";
    case TokenType::kBlockEnd:
      return "end of statement block";
    case TokenType::kName:
      return t.text;
    case TokenType::kString:
      return "string";
    case TokenType::kInteger:
      return "integer";
    case TokenType::kFloat:
      return "float";
    case TokenType::kOperator:
      return t.text;
    case TokenType::kEof:
      return "end of template";
  }
  return "token";
}

ExprPtr MakeExpr(ExprKind kind, size_t offset) {
  auto e = std::make_unique<Expr>();
  e->kind = kind;
  e->offset = offset;
  return e;
}

class Parser {
 public:
  Parser(std::string source, std::vector<Token> tokens) : tokens_(std::move(tokens)) {
    tpl_ = std::make_unique<Template>();
    tpl_->source = std::move(source);
  }

  absl::StatusOr<std::unique_ptr<Template>> Run() {
    ASSIGN_OR_RETURN(tpl_->body, Subparse({}));
    if (Cur().type != TokenType::kEof) return Fail(Cur(), Cat("unexpected '", Describe(Cur()), "'"));
    for (const auto& [name, offset] : called_names_) {
      if (macro_names_.count(name) == 0) {
        return SyntaxError(tpl_->source, offset,
                           Cat("unknown function '", name,
                               "' (only range, namespace, dict, raise_exception, strftime_now and the "
                               "template's macros can be called)"));
      }
    }
    return std::move(tpl_);
  }

 private:
  // --- Token stream -------------------------------------------------------

  const Token& Cur() const { return tokens_[pos_]; }
  const Token& Look() const { return tokens_[std::min(pos_ + 1, tokens_.size() - 1)]; }
  const Token& Next() {
    const Token& t = tokens_[pos_];
    if (pos_ + 1 < tokens_.size()) ++pos_;
    return t;
  }
  bool IsName(const Token& t, std::string_view name) const { return t.type == TokenType::kName && t.text == name; }
  bool IsOp(const Token& t, std::string_view op) const { return t.type == TokenType::kOperator && t.text == op; }
  bool SkipName(std::string_view name) {
    if (!IsName(Cur(), name)) return false;
    Next();
    return true;
  }
  bool SkipOp(std::string_view op) {
    if (!IsOp(Cur(), op)) return false;
    Next();
    return true;
  }

  // Raises `parent`'s height for a subtree of `child`'s; fails past the cap.
  absl::Status Grow(Expr& parent, const Expr& child) const {
    parent.height = std::max(parent.height, child.height + 1);
    if (parent.height > kMaxNesting) return Fail(parent.offset, "expression nested too deeply");
    return absl::OkStatus();
  }
  // Every child goes through here (a null one is an omitted slice bound).
  absl::Status AddChild(Expr& parent, ExprPtr child) const {
    if (child != nullptr) RETURN_IF_ERROR(Grow(parent, *child));
    parent.children.push_back(std::move(child));
    return absl::OkStatus();
  }

  absl::Status Fail(const Token& at, std::string_view message) const {
    return SyntaxError(tpl_->source, at.offset, message);
  }
  absl::Status Fail(size_t offset, std::string_view message) const {
    return SyntaxError(tpl_->source, offset, message);
  }
  absl::Status Expected(std::string_view what) const {
    return Fail(Cur(), Cat("expected '", what, "', got '", Describe(Cur()), "'"));
  }
  absl::Status ExpectType(TokenType type, std::string_view what) {
    if (Cur().type != type) return Expected(what);
    Next();
    return absl::OkStatus();
  }
  absl::Status ExpectOp(std::string_view op) {
    if (!IsOp(Cur(), op)) return Expected(op);
    Next();
    return absl::OkStatus();
  }
  absl::Status ExpectName(std::string_view name) {
    if (!IsName(Cur(), name)) return Expected(name);
    Next();
    return absl::OkStatus();
  }
  absl::StatusOr<std::string> ExpectAnyName() {
    if (Cur().type != TokenType::kName) return Expected("name");
    return Next().text;
  }

  int Intern(const std::string& name) {
    auto [it, inserted] = name_ids_.try_emplace(name, static_cast<int>(tpl_->names.size()));
    if (inserted) tpl_->names.push_back(name);
    return it->second;
  }

  // A nesting guard: expressions and statements recurse.
  struct DepthGuard {
    explicit DepthGuard(int* depth) : depth(depth) { ++*depth; }
    ~DepthGuard() { --*depth; }
    int* depth;
  };
  absl::Status CheckDepth(const Token& at) const {
    if (depth_ > kMaxNesting) return Fail(at, "template nested too deeply");
    return absl::OkStatus();
  }

  // --- Statements ---------------------------------------------------------

  // Jinja's subparse: statements up to a {% tag %} whose name is in
  // `end_names` (left as the current token) or the end of the template.
  absl::StatusOr<Body> Subparse(std::initializer_list<std::string_view> end_names) {
    Body body;
    while (true) {
      const Token& t = Cur();
      if (t.type == TokenType::kEof) return body;
      if (t.type == TokenType::kData) {
        body.push_back(Stmt{t.offset, TextStmt{t.text}});
        Next();
      } else if (t.type == TokenType::kVariableBegin) {
        Next();
        ASSIGN_OR_RETURN(ExprPtr expr, ParseTuple(/*simplified=*/false, /*with_condexpr=*/true, {}, false));
        RETURN_IF_ERROR(ExpectType(TokenType::kVariableEnd, "end of print statement"));
        body.push_back(Stmt{t.offset, OutputStmt{std::move(expr)}});
      } else if (t.type == TokenType::kBlockBegin) {
        Next();
        for (std::string_view end : end_names) {
          if (IsName(Cur(), end)) return body;
        }
        RETURN_IF_ERROR(ParseStatement(&body));
        RETURN_IF_ERROR(ExpectType(TokenType::kBlockEnd, "end of statement block"));
      } else {
        return Fail(t, Cat("unexpected '", Describe(t), "'"));
      }
    }
  }

  // Jinja's parse_statements: the rest of the opening tag, the body, and
  // the closing tag's name (consumed when `drop_needle`).
  absl::StatusOr<Body> ParseStatements(std::initializer_list<std::string_view> end_names, bool drop_needle,
                                       std::string_view opener) {
    SkipOp(":");
    RETURN_IF_ERROR(ExpectType(TokenType::kBlockEnd, "end of statement block"));
    ASSIGN_OR_RETURN(Body body, Subparse(end_names));
    if (Cur().type == TokenType::kEof) {
      std::string expected;
      for (std::string_view end : end_names) AppendCat(&expected, expected.empty() ? "" : " or ", "'", end, "'");
      return Fail(Cur(), Cat("unexpected end of template: the '", opener, "' tag needs ", expected));
    }
    if (drop_needle) Next();
    return body;
  }

  absl::Status ParseStatement(Body* body) {
    const Token& t = Cur();
    if (t.type != TokenType::kName) return Fail(t, "tag name expected");
    DepthGuard guard(&depth_);
    RETURN_IF_ERROR(CheckDepth(t));
    const std::string& tag = t.text;
    if (tag == "if") return ParseIf(body);
    if (tag == "for") return ParseFor(body);
    if (tag == "set") return ParseSet(body);
    if (tag == "macro") return ParseMacro(body);
    if (tag == "filter") return ParseFilterBlock(body);
    if (tag == "with") return ParseWith(body);
    if (tag == "print") return ParsePrint(body);
    if (tag == "generation") return ParseGeneration(body);
    if (tag == "break" || tag == "continue") {
      if (loop_depth_ == 0) return Fail(t, Cat("'", tag, "' outside loop"));
      body->push_back(Stmt{t.offset, LoopControlStmt{tag == "break"}});
      Next();
      return absl::OkStatus();
    }
    static constexpr std::string_view kUnsupported[] = {"include", "extends", "block",      "import",
                                                        "from",    "call",    "autoescape", "do"};
    if (std::find(std::begin(kUnsupported), std::end(kUnsupported), tag) != std::end(kUnsupported)) {
      return Fail(t, Cat("the '", tag, "' tag is not supported in chat templates"));
    }
    return Fail(t, Cat("unknown tag '", tag, "'"));
  }

  absl::Status ParseIf(Body* body) {
    const size_t offset = Next().offset;
    IfStmt node;
    while (true) {
      ASSIGN_OR_RETURN(ExprPtr test, ParseTuple(false, /*with_condexpr=*/false, {}, false));
      ASSIGN_OR_RETURN(Body branch, ParseStatements({"elif", "else", "endif"}, false, "if"));
      node.branches.emplace_back(std::move(test), std::move(branch));
      const Token& end = Next();
      if (end.text == "elif") continue;
      if (end.text == "else") {
        ASSIGN_OR_RETURN(node.else_body, ParseStatements({"endif"}, true, "if"));
      }
      break;
    }
    body->push_back(Stmt{offset, std::move(node)});
    return absl::OkStatus();
  }

  absl::Status ParseFor(Body* body) {
    const size_t offset = Next().offset;
    ForStmt node;
    ASSIGN_OR_RETURN(node.target, ParseAssignTarget(/*with_namespace=*/false, {"in"}));
    RETURN_IF_ERROR(ExpectName("in"));
    ASSIGN_OR_RETURN(node.iter, ParseTuple(false, /*with_condexpr=*/false, {"recursive"}, false));
    if (SkipName("if")) {
      ASSIGN_OR_RETURN(node.filter, ParseExpression(true));
    }
    if (IsName(Cur(), "recursive")) return Fail(Cur(), "recursive loops are not supported");
    ++loop_depth_;
    absl::StatusOr<Body> loop_body = ParseStatements({"endfor", "else"}, false, "for");
    --loop_depth_;
    if (!loop_body.ok()) return loop_body.status();
    node.body = *std::move(loop_body);
    if (Next().text == "else") {
      // The else body runs after the loop: break/continue there belong to an outer loop.
      ASSIGN_OR_RETURN(node.else_body, ParseStatements({"endfor"}, true, "for"));
    }
    body->push_back(Stmt{offset, std::move(node)});
    return absl::OkStatus();
  }

  absl::Status ParseSet(Body* body) {
    const size_t offset = Next().offset;
    ASSIGN_OR_RETURN(Target target, ParseAssignTarget(/*with_namespace=*/true, {}));
    if (SkipOp("=")) {
      ASSIGN_OR_RETURN(ExprPtr value, ParseTuple(false, true, {}, false));
      body->push_back(Stmt{offset, SetStmt{std::move(target), std::move(value)}});
      return absl::OkStatus();
    }
    SetBlockStmt node;
    node.target = std::move(target);
    ASSIGN_OR_RETURN(node.filter, ParseFilterChain(nullptr, /*start_inline=*/false));
    ASSIGN_OR_RETURN(node.body, ParseStatements({"endset"}, true, "set"));
    body->push_back(Stmt{offset, std::move(node)});
    return absl::OkStatus();
  }

  absl::Status ParseMacro(Body* body) {
    const size_t offset = Next().offset;
    MacroStmt node;
    ASSIGN_OR_RETURN(node.name, ExpectAnyName());
    node.name_id = Intern(node.name);
    RETURN_IF_ERROR(ExpectOp("("));
    while (!IsOp(Cur(), ")")) {
      if (!node.param_names.empty()) RETURN_IF_ERROR(ExpectOp(","));
      ASSIGN_OR_RETURN(std::string param, ExpectAnyName());
      node.param_ids.push_back(Intern(param));
      node.param_names.push_back(std::move(param));
      if (SkipOp("=")) {
        ASSIGN_OR_RETURN(ExprPtr value, ParseExpression(true));
        node.defaults.push_back(std::move(value));
      } else if (!node.defaults.empty()) {
        return Fail(Cur(), "non-default argument follows default argument");
      }
    }
    Next();
    // A macro body is a function of its own: break/continue cannot reach
    // the loops around the definition.
    const int saved = loop_depth_;
    loop_depth_ = 0;
    absl::StatusOr<Body> macro_body = ParseStatements({"endmacro"}, true, "macro");
    loop_depth_ = saved;
    if (!macro_body.ok()) return macro_body.status();
    node.body = *std::move(macro_body);
    macro_names_.insert(node.name);
    body->push_back(Stmt{offset, std::move(node)});
    return absl::OkStatus();
  }

  absl::Status ParseFilterBlock(Body* body) {
    const size_t offset = Next().offset;
    FilterBlockStmt node;
    ASSIGN_OR_RETURN(node.filter, ParseFilterChain(nullptr, /*start_inline=*/true));
    ASSIGN_OR_RETURN(node.body, ParseStatements({"endfilter"}, true, "filter"));
    body->push_back(Stmt{offset, std::move(node)});
    return absl::OkStatus();
  }

  absl::Status ParseWith(Body* body) {
    const size_t offset = Next().offset;
    ScopeStmt node;
    while (Cur().type != TokenType::kBlockEnd) {
      if (!node.assignments.empty()) RETURN_IF_ERROR(ExpectOp(","));
      ASSIGN_OR_RETURN(Target target, ParseAssignTarget(false, {}));
      RETURN_IF_ERROR(ExpectOp("="));
      ASSIGN_OR_RETURN(ExprPtr value, ParseExpression(true));
      node.assignments.emplace_back(std::move(target), std::move(value));
    }
    ASSIGN_OR_RETURN(node.body, ParseStatements({"endwith"}, true, "with"));
    body->push_back(Stmt{offset, std::move(node)});
    return absl::OkStatus();
  }

  absl::Status ParsePrint(Body* body) {
    const size_t offset = Next().offset;
    bool first = true;
    while (Cur().type != TokenType::kBlockEnd) {
      if (!first) RETURN_IF_ERROR(ExpectOp(","));
      first = false;
      ASSIGN_OR_RETURN(ExprPtr expr, ParseExpression(true));
      body->push_back(Stmt{offset, OutputStmt{std::move(expr)}});
    }
    return absl::OkStatus();
  }

  // transformers' {% generation %}: a call block, so its body is a scope of
  // its own and break/continue cannot leave it.
  absl::Status ParseGeneration(Body* body) {
    const size_t offset = Next().offset;
    ScopeStmt node;
    const int saved = loop_depth_;
    loop_depth_ = 0;
    absl::StatusOr<Body> inner = ParseStatements({"endgeneration"}, true, "generation");
    loop_depth_ = saved;
    if (!inner.ok()) return inner.status();
    node.body = *std::move(inner);
    body->push_back(Stmt{offset, std::move(node)});
    return absl::OkStatus();
  }

  // Jinja's parse_assign_target: `name`, `a, b`, or (for set) `ns.attr`.
  absl::StatusOr<Target> ParseAssignTarget(bool with_namespace, std::initializer_list<std::string_view> end_names) {
    Target target;
    if (with_namespace && Cur().type == TokenType::kName && IsOp(Look(), ".")) {
      target.name_ids.push_back(Intern(Next().text));
      Next();
      ASSIGN_OR_RETURN(target.attr, ExpectAnyName());
      return target;
    }
    const Token& start = Cur();
    ASSIGN_OR_RETURN(ExprPtr expr, ParseTuple(/*simplified=*/true, false, end_names, false));
    auto add = [&](const Expr& e) -> absl::Status {
      if (e.kind != ExprKind::kName) return Fail(start, "can only assign to names");
      target.name_ids.push_back(e.name_id);
      return absl::OkStatus();
    };
    if (expr->kind == ExprKind::kTuple) {
      target.is_tuple = true;
      for (const ExprPtr& item : expr->children) RETURN_IF_ERROR(add(*item));
    } else {
      RETURN_IF_ERROR(add(*expr));
    }
    return target;
  }

  // --- Expressions --------------------------------------------------------

  bool IsTupleEnd(std::initializer_list<std::string_view> end_names) const {
    const Token& t = Cur();
    if (t.type == TokenType::kVariableEnd || t.type == TokenType::kBlockEnd || IsOp(t, ")")) return true;
    for (std::string_view end : end_names) {
      if (IsName(t, end)) return true;
    }
    return false;
  }

  absl::StatusOr<ExprPtr> ParseTuple(bool simplified, bool with_condexpr,
                                     std::initializer_list<std::string_view> end_names, bool explicit_parentheses) {
    const size_t offset = Cur().offset;
    std::vector<ExprPtr> items;
    bool is_tuple = false;
    while (true) {
      if (!items.empty()) RETURN_IF_ERROR(ExpectOp(","));
      if (IsTupleEnd(end_names)) break;
      absl::StatusOr<ExprPtr> item = simplified ? ParsePrimary() : ParseExpression(with_condexpr);
      if (!item.ok()) return item.status();
      items.push_back(*std::move(item));
      if (IsOp(Cur(), ",")) {
        is_tuple = true;
      } else {
        break;
      }
    }
    if (!is_tuple) {
      if (!items.empty()) return std::move(items[0]);
      if (!explicit_parentheses) {
        return Fail(Cur(), Cat("expected an expression, got '", Describe(Cur()), "'"));
      }
    }
    ExprPtr tuple = MakeExpr(ExprKind::kTuple, offset);
    for (ExprPtr& item : items) RETURN_IF_ERROR(AddChild(*tuple, std::move(item)));
    return tuple;
  }

  absl::StatusOr<ExprPtr> ParseExpression(bool with_condexpr) {
    DepthGuard guard(&depth_);
    RETURN_IF_ERROR(CheckDepth(Cur()));
    return with_condexpr ? ParseCondExpr() : ParseOr();
  }

  absl::StatusOr<ExprPtr> ParseCondExpr() {
    ASSIGN_OR_RETURN(ExprPtr expr, ParseOr());
    while (IsName(Cur(), "if")) {
      const size_t offset = Next().offset;
      ExprPtr cond = MakeExpr(ExprKind::kCond, offset);
      ASSIGN_OR_RETURN(ExprPtr test, ParseOr());
      ExprPtr otherwise;
      if (SkipName("else")) {
        ASSIGN_OR_RETURN(otherwise, ParseCondExpr());
      }
      RETURN_IF_ERROR(AddChild(*cond, std::move(expr)));
      RETURN_IF_ERROR(AddChild(*cond, std::move(test)));
      RETURN_IF_ERROR(AddChild(*cond, std::move(otherwise)));
      expr = std::move(cond);
    }
    return expr;
  }

  absl::StatusOr<ExprPtr> ParseOr() {
    ASSIGN_OR_RETURN(ExprPtr left, ParseAnd());
    while (IsName(Cur(), "or")) {
      ExprPtr node = MakeExpr(ExprKind::kOr, Next().offset);
      ASSIGN_OR_RETURN(ExprPtr right, ParseAnd());
      RETURN_IF_ERROR(AddChild(*node, std::move(left)));
      RETURN_IF_ERROR(AddChild(*node, std::move(right)));
      left = std::move(node);
    }
    return left;
  }

  absl::StatusOr<ExprPtr> ParseAnd() {
    ASSIGN_OR_RETURN(ExprPtr left, ParseNot());
    while (IsName(Cur(), "and")) {
      ExprPtr node = MakeExpr(ExprKind::kAnd, Next().offset);
      ASSIGN_OR_RETURN(ExprPtr right, ParseNot());
      RETURN_IF_ERROR(AddChild(*node, std::move(left)));
      RETURN_IF_ERROR(AddChild(*node, std::move(right)));
      left = std::move(node);
    }
    return left;
  }

  absl::StatusOr<ExprPtr> ParseNot() {
    if (IsName(Cur(), "not")) {
      DepthGuard guard(&depth_);
      RETURN_IF_ERROR(CheckDepth(Cur()));
      ExprPtr node = MakeExpr(ExprKind::kNot, Next().offset);
      ASSIGN_OR_RETURN(ExprPtr operand, ParseNot());
      RETURN_IF_ERROR(AddChild(*node, std::move(operand)));
      return node;
    }
    return ParseCompare();
  }

  absl::StatusOr<ExprPtr> ParseCompare() {
    const size_t offset = Cur().offset;
    ASSIGN_OR_RETURN(ExprPtr first, ParseMath1());
    ExprPtr node;
    while (true) {
      CompareKind kind;
      const Token& t = Cur();
      if (IsOp(t, "=="))
        kind = CompareKind::kEq;
      else if (IsOp(t, "!="))
        kind = CompareKind::kNe;
      else if (IsOp(t, "<"))
        kind = CompareKind::kLt;
      else if (IsOp(t, "<="))
        kind = CompareKind::kLe;
      else if (IsOp(t, ">"))
        kind = CompareKind::kGt;
      else if (IsOp(t, ">="))
        kind = CompareKind::kGe;
      else if (IsName(t, "in"))
        kind = CompareKind::kIn;
      else if (IsName(t, "not") && IsName(Look(), "in")) {
        kind = CompareKind::kNotIn;
        Next();
      } else {
        break;
      }
      Next();
      if (!node) {
        node = MakeExpr(ExprKind::kCompare, offset);
        RETURN_IF_ERROR(AddChild(*node, std::move(first)));
      }
      ASSIGN_OR_RETURN(ExprPtr operand, ParseMath1());
      node->compare_ops.push_back(kind);
      RETURN_IF_ERROR(AddChild(*node, std::move(operand)));
    }
    return node ? std::move(node) : std::move(first);
  }

  absl::StatusOr<ExprPtr> Binary(BinaryOp op, size_t offset, ExprPtr left, ExprPtr right) {
    ExprPtr node = MakeExpr(ExprKind::kBinary, offset);
    node->binary_op = op;
    RETURN_IF_ERROR(AddChild(*node, std::move(left)));
    RETURN_IF_ERROR(AddChild(*node, std::move(right)));
    return node;
  }

  absl::StatusOr<ExprPtr> ParseMath1() {
    ASSIGN_OR_RETURN(ExprPtr left, ParseConcat());
    while (IsOp(Cur(), "+") || IsOp(Cur(), "-")) {
      const Token& op = Next();
      ASSIGN_OR_RETURN(ExprPtr right, ParseConcat());
      ASSIGN_OR_RETURN(
          left, Binary(op.text == "+" ? BinaryOp::kAdd : BinaryOp::kSub, op.offset, std::move(left), std::move(right)));
    }
    return left;
  }

  absl::StatusOr<ExprPtr> ParseConcat() {
    const size_t offset = Cur().offset;
    ASSIGN_OR_RETURN(ExprPtr first, ParseMath2());
    if (!IsOp(Cur(), "~")) return first;
    ExprPtr node = MakeExpr(ExprKind::kConcat, offset);
    RETURN_IF_ERROR(AddChild(*node, std::move(first)));
    while (SkipOp("~")) {
      ASSIGN_OR_RETURN(ExprPtr next, ParseMath2());
      RETURN_IF_ERROR(AddChild(*node, std::move(next)));
    }
    return node;
  }

  absl::StatusOr<ExprPtr> ParseMath2() {
    ASSIGN_OR_RETURN(ExprPtr left, ParsePow());
    while (true) {
      BinaryOp op;
      if (IsOp(Cur(), "*"))
        op = BinaryOp::kMul;
      else if (IsOp(Cur(), "/"))
        op = BinaryOp::kDiv;
      else if (IsOp(Cur(), "//"))
        op = BinaryOp::kFloorDiv;
      else if (IsOp(Cur(), "%"))
        op = BinaryOp::kMod;
      else
        break;
      const size_t offset = Next().offset;
      ASSIGN_OR_RETURN(ExprPtr right, ParsePow());
      ASSIGN_OR_RETURN(left, Binary(op, offset, std::move(left), std::move(right)));
    }
    return left;
  }

  absl::StatusOr<ExprPtr> ParsePow() {
    ASSIGN_OR_RETURN(ExprPtr left, ParseUnary(true));
    while (IsOp(Cur(), "**")) {
      const size_t offset = Next().offset;
      ASSIGN_OR_RETURN(ExprPtr right, ParseUnary(true));
      ASSIGN_OR_RETURN(left, Binary(BinaryOp::kPow, offset, std::move(left), std::move(right)));
    }
    return left;
  }

  absl::StatusOr<ExprPtr> ParseUnary(bool with_filter) {
    DepthGuard guard(&depth_);
    RETURN_IF_ERROR(CheckDepth(Cur()));
    ExprPtr node;
    if (IsOp(Cur(), "-") || IsOp(Cur(), "+")) {
      const Token& op = Next();
      node = MakeExpr(op.text == "-" ? ExprKind::kNeg : ExprKind::kPos, op.offset);
      ASSIGN_OR_RETURN(ExprPtr operand, ParseUnary(false));
      RETURN_IF_ERROR(AddChild(*node, std::move(operand)));
    } else {
      ASSIGN_OR_RETURN(node, ParsePrimary());
    }
    ASSIGN_OR_RETURN(node, ParsePostfix(std::move(node)));
    if (with_filter) {
      ASSIGN_OR_RETURN(node, ParseFilterExpr(std::move(node)));
    }
    return node;
  }

  absl::StatusOr<ExprPtr> ParsePrimary() {
    const Token& t = Cur();
    ExprPtr node;
    switch (t.type) {
      case TokenType::kName:
        if (t.text == "true" || t.text == "True" || t.text == "false" || t.text == "False") {
          node = MakeExpr(ExprKind::kConst, t.offset);
          node->constant = Value::Bool(t.text == "true" || t.text == "True");
        } else if (t.text == "none" || t.text == "None") {
          node = MakeExpr(ExprKind::kConst, t.offset);
          node->constant = Value::None();
        } else {
          node = MakeExpr(ExprKind::kName, t.offset);
          node->name = t.text;
          node->name_id = Intern(t.text);
        }
        Next();
        return node;
      case TokenType::kString: {
        node = MakeExpr(ExprKind::kConst, t.offset);
        while (Cur().type == TokenType::kString) node->name += Next().text;  // Adjacent literals concatenate.
        node->constant = Value::Borrowed(node->name);
        return node;
      }
      case TokenType::kInteger:
        node = MakeExpr(ExprKind::kConst, t.offset);
        node->constant = Value::Int(t.int_value);
        Next();
        return node;
      case TokenType::kFloat:
        node = MakeExpr(ExprKind::kConst, t.offset);
        node->constant = Value::Float(t.float_value);
        Next();
        return node;
      case TokenType::kOperator:
        if (t.text == "(") {
          Next();
          ASSIGN_OR_RETURN(node, ParseTuple(false, true, {}, /*explicit_parentheses=*/true));
          RETURN_IF_ERROR(ExpectOp(")"));
          return node;
        }
        if (t.text == "[") return ParseList();
        if (t.text == "{") return ParseDict();
        break;
      default:
        break;
    }
    return Fail(t, Cat("unexpected '", Describe(t), "'"));
  }

  absl::StatusOr<ExprPtr> ParseList() {
    ExprPtr node = MakeExpr(ExprKind::kList, Next().offset);
    while (!IsOp(Cur(), "]")) {
      if (!node->children.empty()) RETURN_IF_ERROR(ExpectOp(","));
      if (IsOp(Cur(), "]")) break;
      ASSIGN_OR_RETURN(ExprPtr item, ParseExpression(true));
      RETURN_IF_ERROR(AddChild(*node, std::move(item)));
    }
    RETURN_IF_ERROR(ExpectOp("]"));
    return node;
  }

  absl::StatusOr<ExprPtr> ParseDict() {
    ExprPtr node = MakeExpr(ExprKind::kDict, Next().offset);
    while (!IsOp(Cur(), "}")) {
      if (!node->children.empty()) RETURN_IF_ERROR(ExpectOp(","));
      if (IsOp(Cur(), "}")) break;
      ASSIGN_OR_RETURN(ExprPtr key, ParseExpression(true));
      RETURN_IF_ERROR(ExpectOp(":"));
      ASSIGN_OR_RETURN(ExprPtr value, ParseExpression(true));
      RETURN_IF_ERROR(AddChild(*node, std::move(key)));
      RETURN_IF_ERROR(AddChild(*node, std::move(value)));
    }
    RETURN_IF_ERROR(ExpectOp("}"));
    return node;
  }

  absl::StatusOr<ExprPtr> ParsePostfix(ExprPtr node) {
    while (true) {
      if (IsOp(Cur(), ".") || IsOp(Cur(), "[")) {
        ASSIGN_OR_RETURN(node, ParseSubscript(std::move(node)));
      } else if (IsOp(Cur(), "(")) {
        ASSIGN_OR_RETURN(node, ParseCall(std::move(node)));
      } else {
        return node;
      }
    }
  }

  absl::StatusOr<ExprPtr> ParseFilterExpr(ExprPtr node) {
    while (true) {
      if (IsOp(Cur(), "|")) {
        ASSIGN_OR_RETURN(node, ParseFilterChain(std::move(node), false));
      } else if (IsName(Cur(), "is")) {
        ASSIGN_OR_RETURN(node, ParseTest(std::move(node)));
      } else if (IsOp(Cur(), "(")) {
        ASSIGN_OR_RETURN(node, ParseCall(std::move(node)));
      } else {
        return node;
      }
    }
  }

  absl::StatusOr<ExprPtr> ParseSubscript(ExprPtr node) {
    const Token& t = Next();
    if (t.text == ".") {
      const Token& attr = Cur();
      if (attr.type == TokenType::kName) {
        ExprPtr e = MakeExpr(ExprKind::kGetattr, t.offset);
        e->name = Next().text;
        RETURN_IF_ERROR(AddChild(*e, std::move(node)));
        return e;
      }
      if (attr.type != TokenType::kInteger) return Fail(attr, "expected name or number");
      ExprPtr key = MakeExpr(ExprKind::kConst, attr.offset);
      key->constant = Value::Int(Next().int_value);
      ExprPtr e = MakeExpr(ExprKind::kGetitem, t.offset);
      RETURN_IF_ERROR(AddChild(*e, std::move(node)));
      RETURN_IF_ERROR(AddChild(*e, std::move(key)));
      return e;
    }
    // "[": one index or slice; several make a tuple key (never found).
    std::vector<ExprPtr> args;
    std::vector<bool> is_slice;
    ExprPtr slice_parts[3];
    while (!IsOp(Cur(), "]")) {
      if (!args.empty()) RETURN_IF_ERROR(ExpectOp(","));
      ExprPtr start;
      if (!IsOp(Cur(), ":")) {
        ASSIGN_OR_RETURN(start, ParseExpression(true));
        if (!IsOp(Cur(), ":")) {
          args.push_back(std::move(start));
          is_slice.push_back(false);
          continue;
        }
      }
      Next();  // ':'
      ExprPtr stop, step;
      if (!IsOp(Cur(), "]") && !IsOp(Cur(), ",") && !IsOp(Cur(), ":")) {
        ASSIGN_OR_RETURN(stop, ParseExpression(true));
      }
      if (SkipOp(":")) {
        if (!IsOp(Cur(), "]") && !IsOp(Cur(), ",")) {
          ASSIGN_OR_RETURN(step, ParseExpression(true));
        }
      }
      slice_parts[0] = std::move(start);
      slice_parts[1] = std::move(stop);
      slice_parts[2] = std::move(step);
      args.push_back(nullptr);
      is_slice.push_back(true);
    }
    RETURN_IF_ERROR(ExpectOp("]"));
    if (args.size() == 1 && is_slice[0]) {
      ExprPtr e = MakeExpr(ExprKind::kSlice, t.offset);
      RETURN_IF_ERROR(AddChild(*e, std::move(node)));
      for (ExprPtr& part : slice_parts) RETURN_IF_ERROR(AddChild(*e, std::move(part)));
      return e;
    }
    if (std::count(is_slice.begin(), is_slice.end(), true) > 0) {
      return Fail(t, "slices inside a tuple subscript are not supported");
    }
    if (args.empty()) return Fail(t, "expected a subscript expression");
    ExprPtr e = MakeExpr(ExprKind::kGetitem, t.offset);
    RETURN_IF_ERROR(AddChild(*e, std::move(node)));
    if (args.size() == 1) {
      RETURN_IF_ERROR(AddChild(*e, std::move(args[0])));
    } else {
      ExprPtr tuple = MakeExpr(ExprKind::kTuple, t.offset);
      for (ExprPtr& arg : args) RETURN_IF_ERROR(AddChild(*tuple, std::move(arg)));
      RETURN_IF_ERROR(AddChild(*e, std::move(tuple)));
    }
    return e;
  }

  // Call arguments into `node` (children after the first, kwargs).
  absl::Status ParseCallArgs(Expr* node) {
    const Token& open = Cur();
    RETURN_IF_ERROR(ExpectOp("("));
    bool require_comma = false;
    while (!IsOp(Cur(), ")")) {
      if (require_comma) {
        RETURN_IF_ERROR(ExpectOp(","));
        if (IsOp(Cur(), ")")) break;
      }
      if (IsOp(Cur(), "*") || IsOp(Cur(), "**")) {
        return Fail(Cur(), "*args and **kwargs in calls are not supported");
      }
      if (Cur().type == TokenType::kName && IsOp(Look(), "=")) {
        std::string key = Next().text;
        Next();
        ASSIGN_OR_RETURN(ExprPtr value, ParseExpression(true));
        RETURN_IF_ERROR(Grow(*node, *value));
        node->kwargs.push_back(Keyword{std::move(key), std::move(value)});
      } else {
        if (!node->kwargs.empty()) return Fail(open, "invalid syntax for function call expression");
        ASSIGN_OR_RETURN(ExprPtr value, ParseExpression(true));
        RETURN_IF_ERROR(AddChild(*node, std::move(value)));
      }
      require_comma = true;
    }
    Next();
    return absl::OkStatus();
  }

  std::vector<std::string_view> KeywordNames(const Expr& node) const {
    std::vector<std::string_view> names;
    for (const Keyword& k : node.kwargs) names.push_back(k.name);
    return names;
  }

  absl::Status CheckShape(const Expr& node, const Callee& callee, const Signature& sig) const {
    absl::Status s = CheckCallShape(callee, sig, node.children.size() - 1, KeywordNames(node));
    if (!s.ok()) return Fail(node.offset, std::string(s.message()));
    return absl::OkStatus();
  }

  absl::StatusOr<ExprPtr> ParseCall(ExprPtr callee) {
    ExprPtr node = MakeExpr(ExprKind::kCall, Cur().offset);
    RETURN_IF_ERROR(AddChild(*node, std::move(callee)));
    RETURN_IF_ERROR(ParseCallArgs(node.get()));
    const Expr& target = *node->children[0];
    if (target.kind == ExprKind::kName) {
      node->builtin = FindGlobalFunction(target.name);
      if (node->builtin >= 0) {
        RETURN_IF_ERROR(CheckShape(*node, Callee{"", target.name}, GlobalFunction(node->builtin).signature));
      } else {
        called_names_.emplace_back(target.name, target.offset);
      }
    } else if (target.kind == ExprKind::kGetattr) {
      if (!IsImplementedMethodName(target.name)) {
        const bool mutator = target.name == "append" || target.name == "extend" || target.name == "insert" ||
                             target.name == "remove" || target.name == "sort" || target.name == "pop" ||
                             target.name == "update" || target.name == "clear" || target.name == "setdefault";
        return Fail(target.offset,
                    mutator ? Cat("method '", target.name, "' is not supported: the sandbox forbids mutating values")
                            : Cat("unsupported method '", target.name, "'"));
      }
      RETURN_IF_ERROR(CheckShape(*node, Callee{"", target.name}, *MethodSignature(target.name)));
    } else {
      return Fail(node->offset, "only functions, macros and methods can be called");
    }
    return node;
  }

  // A constant string argument naming a filter or test must exist.
  absl::Status CheckNamedBuiltin(const Expr& node, size_t arg, bool is_filter) const {
    if (node.children.size() <= arg + 1) return absl::OkStatus();
    const Expr& name = *node.children[arg + 1];
    if (name.kind != ExprKind::kConst || !name.constant.is_string()) return absl::OkStatus();
    const std::string_view n = name.constant.str();
    if (is_filter ? FindFilter(n) >= 0 : FindTest(n) >= 0) return absl::OkStatus();
    return Fail(name.offset, Cat("no ", is_filter ? "filter" : "test", " named '", n, "'"));
  }

  // `| f(args) | g` after `node` (null for filter blocks and set blocks);
  // with start_inline the first filter has no leading pipe.
  absl::StatusOr<ExprPtr> ParseFilterChain(ExprPtr node, bool start_inline) {
    while (IsOp(Cur(), "|") || start_inline) {
      if (!start_inline) Next();
      start_inline = false;
      const Token& name_token = Cur();
      ASSIGN_OR_RETURN(std::string name, ExpectAnyName());
      while (SkipOp(".")) {
        ASSIGN_OR_RETURN(std::string part, ExpectAnyName());
        AppendCat(&name, ".", part);
      }
      ExprPtr filter = MakeExpr(ExprKind::kFilter, name_token.offset);
      filter->name = name;
      RETURN_IF_ERROR(AddChild(*filter, std::move(node)));
      if (IsOp(Cur(), "(")) RETURN_IF_ERROR(ParseCallArgs(filter.get()));
      filter->builtin = FindFilter(name);
      if (filter->builtin < 0) return Fail(name_token, Cat("no filter named '", name, "'"));
      RETURN_IF_ERROR(CheckShape(*filter, Callee{"filter", name}, Filter(filter->builtin).signature));
      if (name == "map") RETURN_IF_ERROR(CheckNamedBuiltin(*filter, 0, true));
      if (name == "select" || name == "reject") RETURN_IF_ERROR(CheckNamedBuiltin(*filter, 0, false));
      if (name == "selectattr" || name == "rejectattr") RETURN_IF_ERROR(CheckNamedBuiltin(*filter, 1, false));
      node = std::move(filter);
    }
    return node;
  }

  absl::StatusOr<ExprPtr> ParseTest(ExprPtr node) {
    const size_t offset = Next().offset;  // "is"
    const bool negated = SkipName("not");
    const Token& name_token = Cur();
    ASSIGN_OR_RETURN(std::string name, ExpectAnyName());
    while (SkipOp(".")) {
      ASSIGN_OR_RETURN(std::string part, ExpectAnyName());
      AppendCat(&name, ".", part);
    }
    ExprPtr test = MakeExpr(ExprKind::kTest, offset);
    test->name = name;
    RETURN_IF_ERROR(AddChild(*test, std::move(node)));
    const Token& t = Cur();
    if (IsOp(t, "(")) {
      RETURN_IF_ERROR(ParseCallArgs(test.get()));
    } else if ((t.type == TokenType::kName || t.type == TokenType::kString || t.type == TokenType::kInteger ||
                t.type == TokenType::kFloat || IsOp(t, "(") || IsOp(t, "[") || IsOp(t, "{")) &&
               !IsName(t, "else") && !IsName(t, "or") && !IsName(t, "and")) {
      if (IsName(t, "is")) return Fail(t, "You cannot chain multiple tests with is");
      ASSIGN_OR_RETURN(ExprPtr arg, ParsePrimary());
      ASSIGN_OR_RETURN(arg, ParsePostfix(std::move(arg)));
      RETURN_IF_ERROR(AddChild(*test, std::move(arg)));
    }
    test->builtin = FindTest(name);
    if (test->builtin < 0) return Fail(name_token, Cat("no test named '", name, "'"));
    RETURN_IF_ERROR(CheckShape(*test, Callee{"test", name}, Test(test->builtin).signature));
    if (!negated) return test;
    ExprPtr neg = MakeExpr(ExprKind::kNot, offset);
    RETURN_IF_ERROR(AddChild(*neg, std::move(test)));
    return neg;
  }

  std::vector<Token> tokens_;
  size_t pos_ = 0;
  std::unique_ptr<Template> tpl_;
  absl::flat_hash_map<std::string, int> name_ids_;
  std::set<std::string> macro_names_;
  std::vector<std::pair<std::string, size_t>> called_names_;
  int loop_depth_ = 0;
  int depth_ = 0;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Template>> ParseTemplate(std::string_view source) {
  std::string normalized = NormalizeSource(source);
  ASSIGN_OR_RETURN(std::vector<Token> tokens, Tokenize(normalized));
  return Parser(std::move(normalized), std::move(tokens)).Run();
}

}  // namespace tandem::router::jinja
