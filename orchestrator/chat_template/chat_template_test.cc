// ChatTemplate against the reference, Jinja2 itself: every case of
// testdata/snippets.txt (one feature each) and testdata/conversations.json
// (real and model-style templates x conversations) is rendered by
// testdata/render_reference.py with transformers' Jinja2 setup and must come
// out byte-for-byte the same here, or fail the same way. The rest checks
// what Jinja2 cannot tell us: Create-time rejection with positions, limits,
// concurrency and speed.
#include "orchestrator/chat_template/chat_template.h"

#include <cctype>
#include <chrono>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "worker/model/builtin_models.h"

namespace tandem::router {
namespace {

using nlohmann::ordered_json;
using ::testing::EndsWith;
using ::testing::HasSubstr;
using ::testing::StartsWith;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// absl::Status::message() is Debian Abseil's own string_view; matchers want std::string.
std::string Msg(const absl::Status& s) { return std::string(s.message()); }

std::string TestData(const std::string& name) { return std::string(TANDEM_CHAT_TEMPLATE_TESTDATA) + "/" + name; }

std::string Today() {
  const std::time_t now = std::time(nullptr);
  std::tm local;
  localtime_r(&now, &local);
  char buf[16];
  std::strftime(buf, sizeof(buf), "%Y-%m-%d", &local);
  return buf;
}

// ---------------------------------------------------------------------------
// Cases rendered by Jinja2 (testdata/render_reference.py) and by us.

struct Case {
  std::string name;  // "snippet_name" or "template/conversation"
  std::string source;
  ordered_json context;
};

// The expansion of render_reference.py's load_snippets.
std::vector<Case> LoadSnippets() {
  std::vector<Case> cases;
  std::vector<std::string> lines;
  std::istringstream in(ReadFile(TestData("snippets.txt")));
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  size_t i = 0;
  while (i < lines.size() && lines[i].rfind("=== ", 0) != 0) ++i;
  while (i + 1 < lines.size()) {
    Case c;
    c.name = lines[i].substr(4);
    c.context = ordered_json::parse(lines[i + 1]);
    size_t j = i + 2;
    while (j < lines.size() && lines[j].rfind("=== ", 0) != 0) {
      if (j > i + 2) c.source += "\n";
      c.source += lines[j++];
    }
    cases.push_back(std::move(c));
    i = j;
  }
  return cases;
}

// The expansion of render_reference.py's load_conversations.
std::vector<Case> LoadConversations() {
  const ordered_json spec = ordered_json::parse(ReadFile(TestData("conversations.json")));
  std::vector<Case> cases;
  for (const ordered_json& conversation : spec["conversations"]) {
    std::vector<std::string> names;
    if (conversation["templates"] == "*") {
      for (const auto& [name, defaults] : spec["templates"].items()) names.push_back(name);
    } else {
      names = conversation["templates"].get<std::vector<std::string>>();
    }
    for (const std::string& name : names) {
      Case c;
      c.name = name + "/" + conversation["name"].get<std::string>();
      c.source = ReadFile(TestData("templates/" + name + ".jinja"));
      c.context = spec["templates"][name];
      for (const auto& [key, value] : conversation["context"].items()) c.context[key] = value;
      cases.push_back(std::move(c));
    }
  }
  return cases;
}

bool RunReferenceScript() {
  const std::string command = std::string(TANDEM_PYTHON) + " " + TestData("render_reference.py") + " " +
                              TANDEM_CHAT_TEMPLATE_TESTDATA + " " + TANDEM_CHAT_TEMPLATE_REFERENCE;
  return std::system(command.c_str()) == 0;
}

// Jinja2's results, from the chat_template_reference fixture; regenerated
// here when missing or stale (run outside ctest, cases edited, or a
// reference from another day: strftime_now renders the date).
const ordered_json& Reference() {
  static const ordered_json* reference = [] {
    auto load = []() -> ordered_json {
      const std::string text = ReadFile(TANDEM_CHAT_TEMPLATE_REFERENCE);
      return text.empty() ? ordered_json() : ordered_json::parse(text);
    };
    auto current = [](const ordered_json& ref) {
      if (!ref.is_object() || ref.value("today", "") != Today()) return false;
      std::vector<Case> all = LoadSnippets();
      for (Case& c : LoadConversations()) all.push_back(std::move(c));
      for (const Case& c : all) {
        const auto it = ref["cases"].find(c.name);
        if (it == ref["cases"].end() || (*it)["template"] != c.source || (*it)["context"] != c.context) return false;
      }
      return true;
    };
    ordered_json ref = load();
    if (!current(ref)) {
      if (!RunReferenceScript()) {
        std::cerr << "could not run " << TestData("render_reference.py")
                  << " with " TANDEM_PYTHON " (python3-jinja2: scripts/install_deps.sh)\n";
      }
      ref = load();
    }
    return new ordered_json(std::move(ref));
  }();
  return *reference;
}

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

std::string ParamName(const ::testing::TestParamInfo<Case>& info) {
  std::string name = info.param.name;
  for (char& c : name) {
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  }
  return name;
}

class JinjaReferenceTest : public ::testing::TestWithParam<Case> {};

TEST_P(JinjaReferenceTest, MatchesJinja2) {
  const Case& c = GetParam();
  const ordered_json& reference = Reference();
  ASSERT_TRUE(reference.is_object() && reference["cases"].contains(c.name))
      << "no Jinja2 reference for " << c.name << " (run the chat_template_reference test)";
  const ordered_json& entry = reference["cases"][c.name];
  ASSERT_EQ(entry["template"], c.source) << "stale reference";
  const ordered_json& expected = entry["result"];

  absl::StatusOr<std::unique_ptr<ChatTemplate>> tmpl = ChatTemplate::Create(c.source);
  if (expected.contains("syntax_error")) {
    ASSERT_FALSE(tmpl.ok()) << "Jinja2 rejects the template: " << expected["syntax_error"];
    EXPECT_EQ(tmpl.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(Msg(tmpl.status()), StartsWith("chat template: line "));
    return;
  }
  ASSERT_TRUE(tmpl.ok()) << tmpl.status();
  absl::StatusOr<std::string> out = (*tmpl)->Render(c.context);
  if (expected.contains("output")) {
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_EQ(*out, expected["output"].get<std::string>());
    return;
  }
  const std::string error = expected["error"].get<std::string>();
  const std::string message = expected["message"].get<std::string>();
  ASSERT_FALSE(out.ok()) << "Jinja2 raises " << error << ": " << message << "\nbut we rendered:\n" << *out;
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
  if (error == "TemplateError") {
    // raise_exception: the template's own message, unchanged.
    EXPECT_EQ(Msg(out.status()), message);
  } else {
    // Python's error, with the template line: "chat template: line 3: <message>".
    EXPECT_THAT(Msg(out.status()), StartsWith("chat template: line "));
    EXPECT_THAT(Msg(out.status()), EndsWith(": " + message));
  }
}

INSTANTIATE_TEST_SUITE_P(Snippets, JinjaReferenceTest, ::testing::ValuesIn(LoadSnippets()), ParamName);
INSTANTIATE_TEST_SUITE_P(Conversations, JinjaReferenceTest, ::testing::ValuesIn(LoadConversations()), ParamName);

// transformers requires Jinja2 >= 3.1; Debian 12 ships 3.1.2.
TEST(JinjaReferenceVersionTest, RenderedByJinja2_3_1) {
  ASSERT_TRUE(Reference().is_object()) << "no Jinja2 reference";
  EXPECT_THAT(Reference()["jinja2_version"].get<std::string>(), StartsWith("3.1."));
}

// ---------------------------------------------------------------------------
// Create: what Jinja2 accepts but we do not, and error positions.

absl::Status CreateStatus(std::string_view source) { return ChatTemplate::Create(source).status(); }

TEST(ChatTemplateCreateTest, UnknownFilterNamesLineAndColumn) {
  const absl::Status s = CreateStatus("hello\n{{ x | nosuchfilter }}");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Msg(s), "chat template: line 2 col 8: no filter named 'nosuchfilter'");
}

TEST(ChatTemplateCreateTest, UnknownTestNamesLineAndColumn) {
  EXPECT_EQ(Msg(CreateStatus("{% if x is nosuchtest %}{% endif %}")),
            "chat template: line 1 col 12: no test named 'nosuchtest'");
}

TEST(ChatTemplateCreateTest, UnknownFunctionFailsAtCreate) {
  // Jinja2 would fail only when the call runs; a chat template fails at startup.
  EXPECT_THAT(Msg(CreateStatus("{% if false %}\n  {{ nosuchfunc() }}\n{% endif %}")),
              StartsWith("chat template: line 2 col 6: unknown function 'nosuchfunc'"));
}

TEST(ChatTemplateCreateTest, UnsupportedTagsFail) {
  EXPECT_EQ(Msg(CreateStatus("{% include 'x' %}")),
            "chat template: line 1 col 4: the 'include' tag is not supported in chat templates");
  for (const char* source : {"{% extends 'base' %}", "{% block b %}{% endblock %}", "{% import 'm' as m %}",
                             "{% from 'm' import x %}", "{% macro m() %}{% endmacro %}{% call m() %}{% endcall %}",
                             "{% autoescape true %}{% endautoescape %}", "{% do x %}"}) {
    const absl::Status s = CreateStatus(source);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << source;
    EXPECT_THAT(Msg(s), HasSubstr("not supported")) << source;
  }
}

TEST(ChatTemplateCreateTest, UnsupportedMethodsFail) {
  EXPECT_EQ(Msg(CreateStatus("{{ '{}'.format(1) }}")), "chat template: line 1 col 8: unsupported method 'format'");
  EXPECT_THAT(Msg(CreateStatus("{{ xs.append(1) }}")), HasSubstr("the sandbox forbids mutating values"));
  EXPECT_THAT(Msg(CreateStatus("{{ d.update({}) }}")), HasSubstr("the sandbox forbids mutating values"));
}

TEST(ChatTemplateCreateTest, UnsupportedConstructsFail) {
  EXPECT_THAT(Msg(CreateStatus("{% for x in xs recursive %}{{ loop(x) }}{% endfor %}")),
              HasSubstr("recursive loops are not supported"));
  EXPECT_THAT(Msg(CreateStatus("{{ range(*xs) }}")), HasSubstr("*args and **kwargs"));
  EXPECT_THAT(Msg(CreateStatus("{{ xs[0]() }}")), HasSubstr("only functions, macros and methods can be called"));
  EXPECT_THAT(Msg(CreateStatus("{{ 99999999999999999999 }}")), HasSubstr("integer literal too large"));
}

TEST(ChatTemplateCreateTest, BuiltinArgumentsAreChecked) {
  EXPECT_THAT(Msg(CreateStatus("{{ 'x'|trim('a', 'b') }}")), HasSubstr("takes at most 1 argument"));
  EXPECT_THAT(Msg(CreateStatus("{{ x|tojson(indentation=2) }}")),
              HasSubstr("unexpected keyword argument 'indentation'"));
  EXPECT_THAT(Msg(CreateStatus("{{ raise_exception() }}")), HasSubstr("missing required argument 'message'"));
  EXPECT_THAT(Msg(CreateStatus("{{ s.strip(chars='x') }}")), HasSubstr("takes no keyword arguments"));
  EXPECT_THAT(Msg(CreateStatus("{{ xs|map('nosuch')|list }}")), HasSubstr("no filter named 'nosuch'"));
  EXPECT_THAT(Msg(CreateStatus("{{ xs|selectattr('role', 'nosuch') }}")), HasSubstr("no test named 'nosuch'"));
}

TEST(ChatTemplateCreateTest, BreakOutsideLoopFails) {
  EXPECT_THAT(Msg(CreateStatus("{% for x in xs %}{% macro m() %}{% break %}{% endmacro %}{% endfor %}")),
              HasSubstr("'break' outside loop"));
  EXPECT_THAT(Msg(CreateStatus("{% for x in xs %}{% else %}{% continue %}{% endfor %}")),
              HasSubstr("'continue' outside loop"));
}

TEST(ChatTemplateCreateTest, DeepNestingFailsInsteadOfOverflowingTheStack) {
  const std::string deep = "{{ " + std::string(5000, '(') + "1" + std::string(5000, ')') + " }}";
  EXPECT_THAT(Msg(CreateStatus(deep)), HasSubstr("nested too deeply"));
}

// ---------------------------------------------------------------------------
// Render.

std::string MustRender(std::string_view source, const ordered_json& context) {
  absl::StatusOr<std::unique_ptr<ChatTemplate>> tmpl = ChatTemplate::Create(source);
  EXPECT_TRUE(tmpl.ok()) << tmpl.status();
  if (!tmpl.ok()) return "";
  absl::StatusOr<std::string> out = (*tmpl)->Render(context);
  EXPECT_TRUE(out.ok()) << out.status();
  return out.ok() ? *out : "";
}

std::string Repeat(std::string_view piece, int times) {
  std::string out;
  for (int i = 0; i < times; ++i) out += piece;
  return out;
}

absl::Status RenderStatus(std::string_view source, const ordered_json& context) {
  absl::StatusOr<std::unique_ptr<ChatTemplate>> tmpl = ChatTemplate::Create(source);
  if (!tmpl.ok()) return tmpl.status();
  return (*tmpl)->Render(context).status();
}

TEST(ChatTemplateRenderTest, RaiseExceptionMessageIsExact) {
  const absl::Status s =
      RenderStatus("{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}",
                   ordered_json::object());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Msg(s), "Conversation roles must alternate user/assistant/user/assistant/...");
}

TEST(ChatTemplateRenderTest, RuntimeErrorsNameTheLine) {
  const absl::Status s = RenderStatus("a\n{% set x = 1 %}\n{{ 'n=' + x }}", ordered_json::object());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Msg(s), "chat template: line 3: can only concatenate str (not \"int\") to str");
  EXPECT_EQ(Msg(RenderStatus("\n\n{{ m.foo.bar }}", {{"m", ordered_json::object()}})),
            "chat template: line 3: 'dict object' has no attribute 'foo'");
}

TEST(ChatTemplateRenderTest, ContextMustBeAnObject) {
  absl::StatusOr<std::unique_ptr<ChatTemplate>> tmpl = ChatTemplate::Create("x");
  ASSERT_TRUE(tmpl.ok());
  EXPECT_EQ((*tmpl)->Render(ordered_json::array()).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ChatTemplateRenderTest, OrderedJsonKeepsKeyOrderAndJsonSortsIt) {
  const char* source = "{{ tool|tojson }}|{% for k in tool %}{{ k }}{% endfor %}";
  ordered_json ordered = {{"tool", {{"name", "f"}, {"description", "d"}}}};
  EXPECT_EQ(MustRender(source, ordered), "{\"name\": \"f\", \"description\": \"d\"}|namedescription");
  absl::StatusOr<std::unique_ptr<ChatTemplate>> tmpl = ChatTemplate::Create(source);
  ASSERT_TRUE(tmpl.ok());
  const nlohmann::json sorted = {{"tool", {{"name", "f"}, {"description", "d"}}}};
  absl::StatusOr<std::string> out = (*tmpl)->Render(sorted);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(*out, "{\"description\": \"d\", \"name\": \"f\"}|descriptionname");
}

TEST(ChatTemplateRenderTest, StrftimeNowUsesLocalTime) {
  char expected[32];
  const std::time_t now = std::time(nullptr);
  std::tm local;
  localtime_r(&now, &local);
  std::strftime(expected, sizeof(expected), "%d %b %Y", &local);
  EXPECT_EQ(MustRender("{{ strftime_now('%d %b %Y') }}", ordered_json::object()), expected);
}

// A context whose size allows the work (chat_template.cc's allowance grows
// with it) to reach the cap a test is about.
ordered_json RoomForWork() { return {{"padding", std::string(size_t{4} << 20, ' ')}}; }

TEST(ChatTemplateRenderTest, OutputSizeIsCapped) {
  const absl::Status s = RenderStatus("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", RoomForWork());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(s), HasSubstr("output exceeds the chat template limit"));
}

TEST(ChatTemplateRenderTest, StringGrowthIsCapped) {
  const absl::Status s = RenderStatus(
      "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", RoomForWork());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(s), HasSubstr("exceeds the chat template limit"));
}

TEST(ChatTemplateRenderTest, LoopIterationsAreCapped) {
  const absl::Status s =
      RenderStatus("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", RoomForWork());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(s), HasSubstr("loop iterations"));
}

TEST(ChatTemplateRenderTest, MacroRecursionIsCapped) {
  const absl::Status s = RenderStatus("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", ordered_json::object());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(s), HasSubstr("macro calls nested more than"));
}

TEST(ChatTemplateRenderTest, MacroCallsAreCappedOverTheWholeRender) {
  // Within the depth cap, but 2^40 calls (found by chat_template_fuzzer, whose
  // template of this shape ran for minutes).
  const absl::Status s =
      RenderStatus("{% macro f(n) %}{% if n < 40 %}{{ f(n + 1) }}{{ f(n + 1) }}{% endif %}{% endmacro %}{{ f(0) }}",
                   ordered_json::object());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(s), HasSubstr("macro calls in one render"));
}

TEST(ChatTemplateRenderTest, PercentFormatOfFloatsAsIntegersMatchesPython) {
  // Python's int() has no limit: a float past int64 prints its exact integer
  // value (the cast was undefined behaviour; found by chat_template_fuzzer).
  EXPECT_EQ(MustRender("{{ '%d' % 3.9 }}|{{ '%d' % -3.9 }}|{{ '%i' % -0.5 }}", ordered_json::object()), "3|-3|0");
  EXPECT_EQ(MustRender("{{ '%d' % 999999999999999999993.9 }}|{{ '%d' % -1e19 }}", ordered_json::object()),
            "1000000000000000000000|-10000000000000000000");
  EXPECT_EQ(MustRender("{{ '%25d' % 1e20 }}", ordered_json::object()), "    100000000000000000000");
  EXPECT_THAT(Msg(RenderStatus("{{ '%d' % (1e308 * 10) }}", ordered_json::object())),
              HasSubstr("cannot convert float infinity or NaN to integer"));
}

TEST(ChatTemplateRenderTest, ExpressionChainsAreCappedAtParse) {
  // Loops build these left-deep (1+1+...+1): evaluating or freeing 100k
  // levels overflowed the stack (found by chat_template_fuzzer).
  for (const std::string& chain :
       {"1" + Repeat("+1", 100000), "x" + Repeat("|string", 100000), "x" + Repeat(".a", 100000),
        "x" + Repeat("[0]", 100000), "x" + Repeat(" and x", 100000), "x" + Repeat(" or x", 100000)}) {
    const absl::StatusOr<std::unique_ptr<ChatTemplate>> tpl = ChatTemplate::Create("{{ " + chain + " }}");
    ASSERT_FALSE(tpl.ok()) << chain.substr(0, 20);
    EXPECT_EQ(tpl.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(Msg(tpl.status()), HasSubstr("expression nested too deeply"));
  }
  // 150 levels stay legal; ~ chains are one node with many children.
  EXPECT_TRUE(ChatTemplate::Create("{{ 'a'" + Repeat(" ~ 'a'", 100000) + " }}").ok());
  EXPECT_EQ(MustRender("{{ 1" + Repeat("+1", 150) + " }}", ordered_json::object()), "151");
}

TEST(ChatTemplateRenderTest, EvaluationNestingIsCappedAcrossMacroCalls) {
  // 50 nested calls (within max_call_depth) through 100 negations each: 5,000
  // levels of evaluation overflowed an 8 MB stack before the cap.
  const absl::Status s = RenderStatus(
      "{% macro f(n) %}{% if n < 50 %}{{ " + Repeat("-", 100) + "f(n + 1)|int }}{% endif %}{% endmacro %}{{ f(0) }}",
      ordered_json::object());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(s), HasSubstr("nests evaluation more than 400 deep"));
  // A recursive macro of ordinary depth still renders.
  EXPECT_EQ(MustRender("{% macro f(n) %}{% if n < 20 %}{{ n }}{{ f(n + 1) }}{% endif %}{% endmacro %}{{ f(15) }}",
                       ordered_json::object()),
            "1516171819");
}

TEST(ChatTemplateRenderTest, NestingIsCapped) {
  // Wrapping a list in a list in a loop would make printing or freeing it overflow the stack.
  EXPECT_THAT(Msg(RenderStatus("{% set ns = namespace(x=[]) %}{% for i in range(100000) %}{% set ns.x = [ns.x] %}"
                               "{% endfor %}{{ ns.x }}",
                               ordered_json::object())),
              HasSubstr("values nested deeper than"));
  EXPECT_THAT(Msg(RenderStatus("{% set ns = namespace(x=[]) %}{% for i in range(100000) %}{% set ns.x = dict(a=ns.x) %}"
                               "{% endfor %}{{ ns.x }}",
                               ordered_json::object())),
              HasSubstr("values nested deeper than"));
  // A namespace holding itself: Python prints {...}; we refuse rather than recurse forever.
  EXPECT_THAT(Msg(RenderStatus("{% set ns = namespace() %}{% set ns.me = ns %}{{ ns }}", ordered_json::object())),
              HasSubstr("nested too deeply"));
  ordered_json deep = "leaf";
  for (int i = 0; i < 100000; ++i) deep = ordered_json::array({std::move(deep)});
  EXPECT_THAT(Msg(RenderStatus("{{ x }}", {{"x", std::move(deep)}})), HasSubstr("nests deeper than"));
}

TEST(ChatTemplateRenderTest, IntegerOverflowIsAnError) {
  EXPECT_THAT(Msg(RenderStatus("{{ 2 ** 64 }}", ordered_json::object())), HasSubstr("integer overflow"));
}

ordered_json Conversation(int turns) {
  ordered_json messages = ordered_json::array();
  messages.push_back({{"role", "system"}, {"content", "You are a helpful assistant."}});
  for (int i = 0; i < turns; ++i) {
    messages.push_back({{"role", "user"}, {"content", "Question " + std::to_string(i) + ": how do llamas sleep?"}});
    messages.push_back(
        {{"role", "assistant"},
         {"content", "<think>\nRecall.\n</think>\n\nLlamas sleep lying down, answer " + std::to_string(i) + "."}});
  }
  messages.push_back({{"role", "user"}, {"content", "Thanks!"}});
  return {{"messages", messages}, {"add_generation_prompt", true}, {"tools", nullptr}, {"documents", nullptr}};
}

TEST(ChatTemplateRenderTest, WorkIsCappedRelativeToTheContext) {
  // Each pass hands a 10 kB string to |int: within the loop cap, a billion
  // units of work; the allowance is about 17 million for this context.
  const ordered_json context = {{"s", std::string(10000, 'x')}};
  const absl::Status s = RenderStatus("{% for i in range(100000) %}{% if s|int %}{% endif %}{% endfor %}", context);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(s), HasSubstr("units of work"));
  // The same string read a few times is well within it.
  EXPECT_EQ(MustRender("{% for i in range(10) %}{{ s|int }}{% endfor %}", context), "0000000000");
}

// A long conversation (4,001 messages) and long messages (every content 64 kB)
// render with every real template: the work allowance grows with the context.
TEST(ChatTemplateRenderTest, WorkAllowanceFitsRealTemplates) {
  const ordered_json spec = ordered_json::parse(ReadFile(TestData("conversations.json")));
  for (const auto& [name, defaults] : spec["templates"].items()) {
    absl::StatusOr<std::unique_ptr<ChatTemplate>> tmpl =
        ChatTemplate::Create(ReadFile(TestData("templates/" + name + ".jinja")));
    ASSERT_TRUE(tmpl.ok()) << name << ": " << tmpl.status();
    ordered_json context = Conversation(1);
    for (const auto& [key, value] : defaults.items()) context[key] = value;
    if (!(*tmpl)->Render(context).ok()) continue;  // no system turn (mistral_v01)
    context["messages"] = Conversation(2000)["messages"];
    const absl::StatusOr<std::string> text = (*tmpl)->Render(context);
    ASSERT_TRUE(text.ok()) << name << ": " << text.status();
    EXPECT_THAT(*text, HasSubstr("Question 1999: how do llamas sleep?")) << name;
  }
  for (Case& c : LoadConversations()) {
    absl::StatusOr<std::unique_ptr<ChatTemplate>> tmpl = ChatTemplate::Create(c.source);
    ASSERT_TRUE(tmpl.ok()) << c.name << ": " << tmpl.status();
    if (!(*tmpl)->Render(c.context).ok()) continue;  // A conversation the template refuses on purpose.
    for (ordered_json& message : c.context["messages"]) {
      if (!message.contains("content") || !message["content"].is_string()) continue;
      std::string content = message["content"];
      while (!content.empty() && content.size() < 65536) content += content;
      message["content"] = content;
    }
    const absl::StatusOr<std::string> text = (*tmpl)->Render(c.context);
    EXPECT_TRUE(text.ok()) << c.name << ": " << text.status();
  }
}

TEST(ChatTemplateRenderTest, ConcurrentRendersAgree) {
  absl::StatusOr<std::unique_ptr<ChatTemplate>> tmpl =
      ChatTemplate::Create(ReadFile(TestData("templates/qwen3.jinja")));
  ASSERT_TRUE(tmpl.ok()) << tmpl.status();
  const ordered_json context = Conversation(5);
  absl::StatusOr<std::string> expected = (*tmpl)->Render(context);
  ASSERT_TRUE(expected.ok()) << expected.status();
  std::vector<std::thread> threads;
  std::vector<int> mismatches(8, 0);
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i) {
        absl::StatusOr<std::string> out = (*tmpl)->Render(context);
        if (!out.ok() || *out != *expected) ++mismatches[t];
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int t = 0; t < 8; ++t) EXPECT_EQ(mismatches[t], 0) << "thread " << t;
}

// A typical request renders in tens of microseconds in an optimized build
// (the bound leaves an order of magnitude for slow machines); debug and
// sanitizer builds only report their time.
#if defined(NDEBUG) && !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
constexpr bool kOptimizedBuild = true;
#else
constexpr bool kOptimizedBuild = false;
#endif

TEST(ChatTemplateRenderTest, RenderIsFast) {
  for (const char* name : {"qwen3", "llama32", "mistral_v03"}) {
    absl::StatusOr<std::unique_ptr<ChatTemplate>> tmpl =
        ChatTemplate::Create(ReadFile(TestData(std::string("templates/") + name + ".jinja")));
    ASSERT_TRUE(tmpl.ok()) << tmpl.status();
    ordered_json context = Conversation(5);
    context["bos_token"] = "<s>";
    context["eos_token"] = "</s>";
    ASSERT_TRUE((*tmpl)->Render(context).ok()) << name << ": " << (*tmpl)->Render(context).status();
    const int renders = kOptimizedBuild ? 2000 : 100;
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < renders; ++i) ASSERT_TRUE((*tmpl)->Render(context).ok());
    const double us =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count() / renders;
    std::cout << name << ": " << us << " us per render of 12 messages\n";
    if (kOptimizedBuild) {
      EXPECT_LT(us, 500.0) << name;
    }
  }
}

TEST(ChatTemplateBuiltinModelTest, TestdataCopyMatchesBuiltinTemplate) {
  EXPECT_EQ(ReadFile(TestData("templates/tandem_builtin.jinja")), worker::BuiltinChatTemplate());
}

TEST(ChatTemplateBuiltinModelTest, BuiltinTemplateRenders) {
  const ordered_json context = {{"bos_token", "<|begin_of_text|>"},
                                {"add_generation_prompt", true},
                                {"messages", {{{"role", "user"}, {"content", "  Hi  "}}}}};
  EXPECT_EQ(MustRender(worker::BuiltinChatTemplate(), context),
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
}

}  // namespace
}  // namespace tandem::router
