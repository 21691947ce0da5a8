// StopStrings: finds the client's stop strings in a stream of generated text
// that arrives in pieces, releasing text as early as it can. Text that could
// still be the start of a stop string is held back until the next piece
// decides it; a match ends the stream, and the stop string itself (and all
// after it) is never released, as OpenAI and vLLM do.
//
// Invariant: a stop string can only begin in held text. Whenever text is
// released, no suffix of it is a prefix of any stop string, so a match that
// starts in released text would have been found earlier.
//
// Thread safety: none; one per generated choice.
#ifndef TANDEM_ORCHESTRATOR_SERVER_STOP_STRINGS_H_
#define TANDEM_ORCHESTRATOR_SERVER_STOP_STRINGS_H_

#include <string>
#include <string_view>
#include <vector>

namespace tandem::router {

class StopStrings {
 public:
  // REQUIRES: no stop string is empty.
  explicit StopStrings(std::vector<std::string> stops);

  // Adds generated text; returns what may be released now. After a match
  // (stopped() turns true) the result ends before the stop string and later
  // calls return "".
  std::string Push(std::string_view text);
  // The held text, at the end of the generation (nothing after a match).
  std::string Flush();

  bool stopped() const { return stopped_; }
  // The stop string that matched; "" if none.
  const std::string& matched() const { return matched_; }

 private:
  std::vector<std::string> stops_;
  std::string held_;
  bool stopped_ = false;
  std::string matched_;
};

}  // namespace tandem::router

#endif  // TANDEM_ORCHESTRATOR_SERVER_STOP_STRINGS_H_
