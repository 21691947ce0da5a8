// `tandem generate`: a small gRPC client. It tokenizes a prompt (bytes, for
// the built-in models; or --prompt-ids), streams the worker's tokens and
// prints them as they arrive. `make run` uses it against local workers.
//
// With --decode it splits the request as the router does: a RECEIVE stream
// on the decode worker (which answers with a reservation), then a SEND
// stream on --target (the prefill worker), which prints the first token;
// the rest comes from the decode worker.
//
// Workers serving mutual TLS need --tls-ca/--tls-cert/--tls-key (a router
// certificate: Generate is the router's; `tandem certs`).
#include <grpcpp/grpcpp.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <random>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/tls.h"
#include "tandem/v1/worker.grpc.pb.h"
#include "worker/cli/commands.h"
#include "worker/model/builtin_models.h"

namespace tandem::worker {
namespace {

struct GenerateOptions {
  std::string target = "127.0.0.1:50051";
  std::string decode;  // disaggregated: the decode worker (then target prefills)
  std::string prompt = "Hello, tandem!";
  std::string prompt_ids;
  int max_tokens = 64;
  float temperature = 0.0f;
  int64_t seed = -1;
  bool show_ids = false;
  std::string tls_ca, tls_cert, tls_key;  // mutual TLS (a router certificate)
};

int RunGenerate(const GenerateOptions& opt) {
  std::shared_ptr<const tls::ChannelFactory> channels = tls::ChannelFactory::Insecure();
  if (!opt.tls_ca.empty() || !opt.tls_cert.empty() || !opt.tls_key.empty()) {
    absl::StatusOr<tls::TlsMaterial> m =
        tls::LoadTlsMaterial({.ca = opt.tls_ca, .cert = opt.tls_cert, .key = opt.tls_key},
                             {.ca = "--tls-ca", .cert = "--tls-cert", .key = "--tls-key"});
    if (!m.ok()) {
      std::fprintf(stderr, "tandem generate: %s\n", std::string(m.status().message()).c_str());
      return 1;
    }
    channels = tls::ChannelFactory::Mutual(*m);
  }
  auto channel = channels->Create(opt.target);
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
  if (opt.seed >= 0) {
    s->set_seed(static_cast<uint64_t>(opt.seed));
  } else if (!opt.decode.empty()) {
    // Both workers must sample alike (the decode worker may prefill itself).
    s->set_seed(std::random_device{}());
  }

  std::printf("%s", opt.prompt_ids.empty() ? opt.prompt.c_str() : "");
  auto print_tokens = [&](const tandem::v1::GenerateResponse& resp) {
    for (const auto& t : resp.tokens()) {
      if (opt.show_ids) {
        std::printf(" %d", t.token_id());
      } else {
        int id = t.token_id();
        std::printf("%s", DecodeBuiltinTokens(std::span<const int>(&id, 1)).c_str());
      }
      std::fflush(stdout);
    }
  };
  auto fail = [](const char* what, const grpc::Status& st) {
    std::printf("\n");
    std::fprintf(stderr, "tandem generate: %s: %s (code %d)\n", what, st.error_message().c_str(),
                 static_cast<int>(st.error_code()));
    return 1;
  };
  const auto deadline = std::chrono::system_clock::now() + std::chrono::minutes(10);

  // Disaggregated: reserve on the decode worker first.
  std::unique_ptr<tandem::v1::Worker::Stub> decode_stub;
  grpc::ClientContext decode_ctx;
  std::unique_ptr<grpc::ClientReader<tandem::v1::GenerateResponse>> decode_reader;
  tandem::v1::GenerateResponse resp;
  std::string kv_error;
  if (!opt.decode.empty()) {
    decode_stub = tandem::v1::Worker::NewStub(channels->Create(opt.decode));
    tandem::v1::GenerateRequest receive = req;
    receive.mutable_kv_transfer()->set_mode(tandem::v1::KvTransferParams::RECEIVE);
    decode_ctx.set_deadline(deadline);
    decode_reader = decode_stub->Generate(&decode_ctx, receive);
    if (!decode_reader->Read(&resp) || !resp.has_reservation()) {
      return fail("no reservation from the decode worker", decode_reader->Finish());
    }
    tandem::v1::KvTransferParams* kv = req.mutable_kv_transfer();
    kv->set_mode(tandem::v1::KvTransferParams::SEND);
    kv->set_decode_address(opt.decode);
    kv->set_reservation_id(resp.reservation().reservation_id());
    kv->set_decode_cached_tokens(resp.reservation().cached_tokens());
    kv->set_decode_instance_id(resp.reservation().instance_id());
    kv->set_reservation_token(resp.reservation().reservation_token());
    *kv->mutable_reservation() = resp.reservation();
  }

  grpc::ClientContext ctx;
  ctx.set_deadline(deadline);
  auto reader = stub->Generate(&ctx, req);
  tandem::v1::GenerateResponse last;
  bool first_shown = false;
  while (reader->Read(&resp)) {
    print_tokens(resp);
    first_shown = first_shown || resp.tokens_size() > 0;
    if (resp.finish_reason() != tandem::v1::FINISH_REASON_UNSPECIFIED) last = resp;
  }
  grpc::Status st = reader->Finish();
  if (!st.ok()) return fail(opt.decode.empty() ? "generate" : "prefill", st);
  kv_error = last.kv_transfer_error();
  const int64_t kv_bytes = last.kv_transfer_bytes();
  const double kv_seconds = last.kv_transfer_seconds();
  if (decode_reader != nullptr) {
    while (decode_reader->Read(&resp)) {
      // The decode worker prefilled itself before the KV came: its stream
      // starts with its own first token, which replaces nothing shown yet
      // only if the prefill showed none.
      if (resp.includes_first_token() && first_shown && resp.tokens_size() > 0) {
        resp.mutable_tokens()->erase(resp.mutable_tokens()->begin());
      }
      print_tokens(resp);
      if (resp.finish_reason() != tandem::v1::FINISH_REASON_UNSPECIFIED) last = resp;
    }
    st = decode_reader->Finish();
    if (!st.ok()) return fail("decode", st);
  }
  std::printf("\n");
  std::fprintf(stderr, "[%d prompt tokens (%d cached), %d generated, finish: %s%s]\n", last.usage().prompt_tokens(),
               last.usage().cached_prompt_tokens(), last.usage().completion_tokens(),
               tandem::v1::FinishReason_Name(last.finish_reason()).c_str(),
               opt.decode.empty() ? ""
               : kv_error.empty() ? absl::StrFormat("; KV handed from prefill to decode: %.2f MiB pulled in %.3f ms",
                                                    kv_bytes / 1048576.0, kv_seconds * 1e3)
                                        .c_str()
                                  : (std::string("; KV not handed off: ") + kv_error).c_str());
  if (!last.error_message().empty()) {
    std::fprintf(stderr, "tandem generate: %s\n", last.error_message().c_str());
    return 1;
  }
  return 0;
}

}  // namespace

void AddGenerateCommand(CLI::App& app) {
  auto opt = std::make_shared<GenerateOptions>();
  CLI::App* cmd = app.add_subcommand("generate", "Generate from a prompt on a worker over gRPC");
  cmd->add_option("--target", opt->target, "Worker address host:port (the prefill worker with --decode)")
      ->capture_default_str();
  cmd->add_option("--decode", opt->decode, "Disaggregated: the decode worker's host:port (as --target reaches it)");
  cmd->add_option("--prompt", opt->prompt, "Prompt text (byte tokens of the built-in models)")->capture_default_str();
  cmd->add_option("--prompt-ids", opt->prompt_ids, "Comma-separated prompt token ids instead");
  cmd->add_option("--max-tokens", opt->max_tokens, "Tokens to generate")->capture_default_str();
  cmd->add_option("--temperature", opt->temperature, "0: greedy")->capture_default_str();
  cmd->add_option("--seed", opt->seed, "Sampling seed (-1: random)")->capture_default_str();
  cmd->add_flag("--show-ids", opt->show_ids, "Print token ids instead of text");
  cmd->add_option("--tls-ca", opt->tls_ca, "Mutual TLS: the cluster CA certificate (PEM)");
  cmd->add_option("--tls-cert", opt->tls_cert, "Mutual TLS: a router-role certificate (PEM; `tandem certs`)");
  cmd->add_option("--tls-key", opt->tls_key, "Mutual TLS: its private key (PEM)");
  cmd->callback([opt] { std::exit(RunGenerate(*opt)); });
}

}  // namespace tandem::worker
