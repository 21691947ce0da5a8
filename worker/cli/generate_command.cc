// `tandem generate`: a small gRPC client. It tokenizes a prompt (bytes, for
// the built-in models; or --prompt-ids), streams the worker's tokens and
// prints them as they arrive. `make run` uses it against a local worker.
#include <grpcpp/grpcpp.h>

#include <CLI/CLI.hpp>
#include <cstdio>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "tandem/v1/worker.grpc.pb.h"
#include "worker/cli/commands.h"
#include "worker/model/builtin_models.h"

namespace tandem::worker {
namespace {

struct GenerateOptions {
  std::string target = "127.0.0.1:50051";
  std::string prompt = "Hello, tandem!";
  std::string prompt_ids;
  int max_tokens = 64;
  float temperature = 0.0f;
  int64_t seed = -1;
  bool show_ids = false;
};

int RunGenerate(const GenerateOptions& opt) {
  auto channel = grpc::CreateChannel(opt.target, grpc::InsecureChannelCredentials());
  auto stub = tandem::v1::Worker::NewStub(channel);
  tandem::v1::GenerateRequest req;
  req.set_request_id("cli");
  if (!opt.prompt_ids.empty()) {
    for (absl::string_view part : absl::StrSplit(opt.prompt_ids, ',', absl::SkipWhitespace())) {
      int v;
      if (!absl::SimpleAtoi(part, &v)) {
        std::fprintf(stderr, "tandem generate: '%s' is not a token id\n", std::string(part).c_str());
        return 1;
      }
      req.add_prompt_token_ids(v);
    }
  } else {
    for (int id : EncodeBuiltinText(opt.prompt)) req.add_prompt_token_ids(id);
  }
  auto* s = req.mutable_sampling();
  s->set_max_tokens(opt.max_tokens);
  s->set_temperature(opt.temperature);
  if (opt.seed >= 0) s->set_seed(static_cast<uint64_t>(opt.seed));

  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(10));
  auto reader = stub->Generate(&ctx, req);
  tandem::v1::GenerateResponse resp;
  std::printf("%s", opt.prompt_ids.empty() ? opt.prompt.c_str() : "");
  std::vector<int> all;
  tandem::v1::GenerateResponse last;
  while (reader->Read(&resp)) {
    for (const auto& t : resp.tokens()) {
      all.push_back(t.token_id());
      if (opt.show_ids) {
        std::printf(" %d", t.token_id());
      } else {
        int id = t.token_id();
        std::printf("%s", DecodeBuiltinTokens(std::span<const int>(&id, 1)).c_str());
      }
      std::fflush(stdout);
    }
    if (resp.finish_reason() != tandem::v1::FINISH_REASON_UNSPECIFIED) last = resp;
  }
  grpc::Status st = reader->Finish();
  std::printf("\n");
  if (!st.ok()) {
    std::fprintf(stderr, "tandem generate: %s (code %d)\n", st.error_message().c_str(),
                 static_cast<int>(st.error_code()));
    return 1;
  }
  std::fprintf(stderr, "[%d prompt tokens (%d cached), %d generated, finish: %s]\n",
               last.usage().prompt_tokens(), last.usage().cached_prompt_tokens(),
               last.usage().completion_tokens(),
               tandem::v1::FinishReason_Name(last.finish_reason()).c_str());
  return 0;
}

}  // namespace

void AddGenerateCommand(CLI::App& app) {
  auto opt = std::make_shared<GenerateOptions>();
  CLI::App* cmd = app.add_subcommand("generate", "Generate from a prompt on a worker over gRPC");
  cmd->add_option("--target", opt->target, "Worker address host:port")->capture_default_str();
  cmd->add_option("--prompt", opt->prompt, "Prompt text (byte tokens of the built-in models)")
      ->capture_default_str();
  cmd->add_option("--prompt-ids", opt->prompt_ids, "Comma-separated prompt token ids instead");
  cmd->add_option("--max-tokens", opt->max_tokens, "Tokens to generate")->capture_default_str();
  cmd->add_option("--temperature", opt->temperature, "0: greedy")->capture_default_str();
  cmd->add_option("--seed", opt->seed, "Sampling seed (-1: random)")->capture_default_str();
  cmd->add_flag("--show-ids", opt->show_ids, "Print token ids instead of text");
  cmd->callback([opt] { std::exit(RunGenerate(*opt)); });
}

}  // namespace tandem::worker
