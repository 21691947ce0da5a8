// `tandem bench mock-server`: an instant OpenAI-compatible server with no
// model behind it, on tandem's own HttpServer. It is the baseline of the
// router-overhead benchmark (scripts/bench_overhead.sh): the bench client
// against it alone, then behind a reverse proxy (nginx) or the router's
// place, so what is added is the proxy's cost only.
//
// Contract:
//  - GET /health: 200 {"status": "ok"}. GET /v1/models: one model, --model.
//  - POST /v1/completions and /v1/chat/completions are parsed and validated
//    by the router's own parser (orchestrator/openai), so a bad body gets the
//    same 400 with OpenAI's error JSON; an unknown model is a 404. The answer
//    comes at once: max_tokens (or max_completion_tokens; default 16) tokens
//    of " tok" per choice, finish_reason "length". Streams send one SSE event
//    per token and choice (chat: the first carries the role), then the usage
//    chunk when stream_options.include_usage, then [DONE]; other responses
//    are the whole JSON with usage. prompt_tokens is the length of a token-id
//    prompt, or the number of whitespace-separated words of a text prompt
//    (chat: of every message's content): a cheap stand-in for a tokenizer.
//    logprobs, echo, stop and sampling fields are accepted and ignored.
//  - A response is at most kMaxMockOutputTokens tokens (max_tokens x n);
//    larger asks are a 400, so one request cannot make it queue gigabytes.
//  - Serves until SIGINT or SIGTERM, then stops (in-flight responses finish)
//    and exits 0.
//
// Thread safety: handlers run on the HTTP server's I/O threads and share
// only immutable state and an atomic id counter.
#ifndef TANDEM_ORCHESTRATOR_BENCH_MOCK_SERVER_H_
#define TANDEM_ORCHESTRATOR_BENCH_MOCK_SERVER_H_

#include <cstdint>

namespace CLI {
class App;
}

namespace tandem::bench {

inline constexpr int64_t kMaxMockOutputTokens = 1 << 16;

// Registers `mock-server` under `bench`, the `tandem bench` parent command.
void AddMockServerCommand(CLI::App& bench);

}  // namespace tandem::bench

#endif  // TANDEM_ORCHESTRATOR_BENCH_MOCK_SERVER_H_
