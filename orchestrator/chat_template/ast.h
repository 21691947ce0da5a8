// The parsed form of a chat template: expressions and statements as Jinja2's
// parser builds them (jinja2/nodes.py), after validation (every filter,
// test, function and method that a template names is one the interpreter
// implements). Immutable once parsed; shared by concurrent renders.
#ifndef TANDEM_ORCHESTRATOR_CHAT_TEMPLATE_AST_H_
#define TANDEM_ORCHESTRATOR_CHAT_TEMPLATE_AST_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "orchestrator/chat_template/value.h"

namespace tandem::router::jinja {

enum class ExprKind : uint8_t {
  kConst,    // `constant`
  kName,     // `name`, `name_id`
  kGetattr,  // children[0].name
  kGetitem,  // children[0][children[1]]
  kSlice,    // children[0][children[1]:children[2]:children[3]] (null: omitted)
  kCall,     // children[0](children[1..], kwargs)
  kFilter,   // children[0] | name(children[1..], kwargs); children[0] null in a filter block
  kTest,     // children[0] is name(children[1..], kwargs)
  kNeg,      // -children[0]
  kPos,      // +children[0]
  kNot,      // not children[0]
  kBinary,   // children[0] `binary_op` children[1]
  kConcat,   // children[0] ~ children[1] ~ ...
  kCompare,  // children[0] compare_ops[0] children[1] compare_ops[1] children[2] ...
  kAnd,      // children[0] and children[1]
  kOr,       // children[0] or children[1]
  kCond,     // children[0] if children[1] else children[2] (null: no else)
  kList,     // [children...]
  kTuple,    // (children...)
  kDict,     // {children[0]: children[1], ...}
};

enum class BinaryOp : uint8_t { kAdd, kSub, kMul, kDiv, kFloorDiv, kMod, kPow };
enum class CompareKind : uint8_t { kEq, kNe, kLt, kLe, kGt, kGe, kIn, kNotIn };

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Keyword {
  std::string name;
  ExprPtr value;
};

struct Expr {
  ExprKind kind;
  size_t offset = 0;  // Source offset, for error lines.
  Value constant;     // kConst (strings borrow `name`).
  std::string name;   // kName, kGetattr, kFilter, kTest; kConst string storage.
  int name_id = -1;   // kName: index into Template::names.
  int builtin = -1;   // kFilter/kTest: table index; kCall of a name: global function or -1 for a macro.
  BinaryOp binary_op = BinaryOp::kAdd;
  std::vector<CompareKind> compare_ops;
  std::vector<ExprPtr> children;
  std::vector<Keyword> kwargs;
  // Nodes on the longest path down to a leaf. The parser caps it: evaluation
  // and destruction recurse over the tree, and a chain such as 1+1+...+1 or
  // x|f|f|...|f is parsed by a loop, not by recursion its guard would see.
  int height = 1;
};

// An assignment target: one name, a tuple of names, or `ns.attr`.
struct Target {
  std::vector<int> name_ids;
  bool is_tuple = false;
  std::string attr;  // Non-empty: {% set name.attr = ... %}.
};

struct Stmt;
using Body = std::vector<Stmt>;

struct TextStmt {
  std::string text;
};
struct OutputStmt {
  ExprPtr expr;
};
struct IfStmt {
  std::vector<std::pair<ExprPtr, Body>> branches;  // if / elif
  Body else_body;
};
struct ForStmt {
  Target target;
  ExprPtr iter;
  ExprPtr filter;  // {% for x in xs if filter %}; may be null.
  Body body;
  Body else_body;
};
struct SetStmt {
  Target target;
  ExprPtr value;
};
// {% set x | filters %}body{% endset %}
struct SetBlockStmt {
  Target target;
  ExprPtr filter;  // Filter chain whose innermost input is the body; may be null.
  Body body;
};
struct MacroStmt {
  std::string name;
  int name_id = -1;
  std::vector<int> param_ids;
  std::vector<std::string> param_names;
  std::vector<ExprPtr> defaults;  // For the last defaults.size() params.
  Body body;
};
// {% filter f %}body{% endfilter %}
struct FilterBlockStmt {
  ExprPtr filter;
  Body body;
};
struct LoopControlStmt {
  bool is_break = false;
};
// A body rendered in its own scope: {% generation %} (a caller, as
// transformers' AssistantTracker renders it) and {% with %}.
struct ScopeStmt {
  std::vector<std::pair<Target, ExprPtr>> assignments;  // {% with a = 1 %}
  Body body;
};

struct Stmt {
  size_t offset = 0;
  std::variant<TextStmt, OutputStmt, IfStmt, ForStmt, SetStmt, SetBlockStmt, MacroStmt, FilterBlockStmt,
               LoopControlStmt, ScopeStmt>
      node;
};

struct Template {
  std::string source;              // Normalized; offsets refer to it.
  std::vector<std::string> names;  // Interned identifiers; Expr::name_id indexes it.
  Body body;
};

}  // namespace tandem::router::jinja

#endif  // TANDEM_ORCHESTRATOR_CHAT_TEMPLATE_AST_H_
