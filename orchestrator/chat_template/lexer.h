// The chat-template lexer: splits a template into text and tag tokens as
// Jinja2's lexer does with transformers' settings (trim_blocks,
// lstrip_blocks, default delimiters, keep_trailing_newline off), applying
// all whitespace control here so that the parser and interpreter only see
// final text:
//   - newlines (\r\n, \r) become \n and one trailing newline is dropped;
//   - {%- / {{- / {#- strip all whitespace before the tag, -%} / -}} / -#}
//     all whitespace after it;
//   - lstrip_blocks: spaces and tabs between the start of a line and a
//     {% or {# tag are removed, unless the tag opens with {%+;
//   - trim_blocks: the first newline after %} or #} is removed, unless the
//     tag closes with +%};
//   - {% raw %}...{% endraw %} becomes text; comments disappear.
// Thread-compatible: pure functions.
#ifndef TANDEM_ORCHESTRATOR_CHAT_TEMPLATE_LEXER_H_
#define TANDEM_ORCHESTRATOR_CHAT_TEMPLATE_LEXER_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tandem::router::jinja {

enum class TokenType : uint8_t {
  kData,           // Template text: `text`.
  kVariableBegin,  // {{
  kVariableEnd,    // }}
  kBlockBegin,     // {%
  kBlockEnd,       // %}
  kName,           // `text`
  kString,         // `text`, escapes decoded
  kInteger,        // `int_value`
  kFloat,          // `float_value`
  kOperator,       // `text`: "+", "//", "(", ...
  kEof,
};

struct Token {
  TokenType type;
  size_t offset;  // Into the normalized source.
  std::string text;
  int64_t int_value = 0;
  double float_value = 0;
};

// Newline normalization and the dropped trailing newline; token offsets
// refer to this text.
std::string NormalizeSource(std::string_view source);

// Tokenizes a normalized source; the last token is kEof. Syntax errors are
// InvalidArgument "chat template: line L col C: ...".
absl::StatusOr<std::vector<Token>> Tokenize(std::string_view source);

// InvalidArgument "chat template: line L col C: <message>" for `offset`
// of the normalized source (1-based line, column in code points).
absl::Status SyntaxError(std::string_view source, size_t offset, std::string_view message);
// The 1-based line of `offset`.
int LineOf(std::string_view source, size_t offset);

}  // namespace tandem::router::jinja

#endif  // TANDEM_ORCHESTRATOR_CHAT_TEMPLATE_LEXER_H_
