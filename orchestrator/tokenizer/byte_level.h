// The GPT-2 "byte-level" alphabet: each of the 256 byte values is mapped to a
// printable Unicode character, so that a vocabulary of byte strings can be
// stored as JSON text. Printable Latin-1 bytes map to themselves; the others
// (controls, space, ...) to U+0100 onwards, e.g. ' ' -> 'Ġ', '\n' -> 'Ċ'.
// Contract: ByteLevelEncode and ByteLevelDecode are inverse on byte strings;
// ByteLevelDecode passes characters outside the alphabet through as UTF-8,
// as Hugging Face's ByteLevel decoder does. Pure functions, thread-safe.
#ifndef TANDEM_ORCHESTRATOR_TOKENIZER_BYTE_LEVEL_H_
#define TANDEM_ORCHESTRATOR_TOKENIZER_BYTE_LEVEL_H_

#include <string>
#include <string_view>

namespace tandem::router {

// Appends the byte-level characters (UTF-8) for every byte of `bytes`.
void ByteLevelEncode(std::string_view bytes, std::string* out);

// Appends the bytes that the byte-level text `text` stands for.
void ByteLevelDecode(std::string_view text, std::string* out);

}  // namespace tandem::router

#endif  // TANDEM_ORCHESTRATOR_TOKENIZER_BYTE_LEVEL_H_
