#include "orchestrator/bench/grpc_floor.h"

#include <grpcpp/grpcpp.h>
#include <signal.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "common/file_util.h"
#include "common/grpc_poller.h"
#include "common/logging.h"
#include "common/signals.h"
#include "common/status_macros.h"
#include "common/thread_util.h"
#include "nlohmann/json.hpp"
#include "orchestrator/bench/report.h"
#include "orchestrator/cluster/worker_client.h"
#include "tandem/v1/worker.grpc.pb.h"
#include "worker/cli/commands.h"

namespace tandem::bench {
namespace {

using Clock = std::chrono::steady_clock;
using tandem::v1::GenerateRequest;
using tandem::v1::GenerateResponse;

struct FloorOptions {
  bool serve = false;              // run the server, not the client
  std::string host = "127.0.0.1";  // server: the address to listen on
  int port = 0;                    // server: 0 picks a free port
  std::string ready_file;          // server: host:port is written here once listening
  bool handoff = false;            // server: first writes come from a second thread
  bool minimal_stack = false;      // both: gRPC's minimal stack, latency target
  std::string target;              // client: the server's host:port
  double request_rate = 50;        // client: calls per second (Poisson), or inf
  int num_prompts = 400;           // client: calls measured
  int warmups = 20;                // client: calls before the measured ones
  int input_len = 128;             // client: prompt token ids per call
  int max_tokens = 16;             // client: tokens each call streams back
  uint64_t seed = 0;               // client: arrivals and prompt
  std::string json;                // client: results file (ms), if set
};

// ---- The server ----------------------------------------------------------

class FloorCall;

// --handoff: the thread that writes each call's first message, as a
// worker's engine thread does after its poller hands it the request.
class Writer {
 public:
  Writer() : thread_([this] { Run(); }) {}
  ~Writer() { Stop(); }
  // Writes what was posted, then ends the thread. Post refuses calls from
  // then on.
  void Stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_one();
    if (thread_.joinable()) thread_.join();
  }
  // Queues `call` for the thread; false once stopping (the caller writes).
  bool Post(FloorCall* call) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) return false;
      calls_.push_back(call);
    }
    cv_.notify_one();
    return true;
  }

 private:
  void Run();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<FloorCall*> calls_;
  bool stop_ = false;
  std::thread thread_;  // last: starts after the rest exists
};

// One Generate call: accepted, a first message of one token, then the rest
// with the finish reason, and the end of the stream.
class FloorCall {
 public:
  FloorCall(tandem::v1::Worker::AsyncService* service, grpc::ServerCompletionQueue* cq, Writer* writer)
      : service_(service), cq_(cq), writer_(writer), stream_(&ctx_) {
    service_->RequestGenerate(&ctx_, &request_, &stream_, cq_, cq_, &accept_tag_);
  }

  // The first message (on the poller thread, or the writer's with --handoff).
  void WriteFirst() {
    first_.add_tokens()->set_token_id(1);
    stream_.Write(first_, &op_tag_);
  }

 private:
  void OnAccepted(bool ok) {
    if (!ok) {  // shutting down
      delete this;
      return;
    }
    new FloorCall(service_, cq_, writer_);  // the next one
    if (writer_ == nullptr || !writer_->Post(this)) WriteFirst();
  }

  // The first write completed (or failed), or the stream's last operation did.
  void OnOpDone(bool ok) {
    if (finishing_) {
      delete this;
      return;
    }
    finishing_ = true;
    if (!ok) {  // the client went away
      stream_.Finish(grpc::Status(grpc::StatusCode::CANCELLED, "client gone"), &op_tag_);
      return;
    }
    const int n = request_.sampling().max_tokens();
    for (int i = 1; i < n; ++i) last_.add_tokens()->set_token_id(1);
    last_.set_finish_reason(tandem::v1::FINISH_REASON_LENGTH);
    last_.mutable_usage()->set_prompt_tokens(request_.prompt_token_ids_size());
    last_.mutable_usage()->set_completion_tokens(n);
    stream_.WriteAndFinish(last_, grpc::WriteOptions(), grpc::Status::OK, &op_tag_);
  }

  tandem::v1::Worker::AsyncService* const service_;
  grpc::ServerCompletionQueue* const cq_;
  Writer* const writer_;
  grpc::ServerContext ctx_;
  GenerateRequest request_;
  grpc::ServerAsyncWriter<GenerateResponse> stream_;
  GenerateResponse first_, last_;
  bool finishing_ = false;
  MemberTag<FloorCall> accept_tag_{this, &FloorCall::OnAccepted};
  MemberTag<FloorCall> op_tag_{this, &FloorCall::OnOpDone};
};

void Writer::Run() {
  SetThreadName("floor_writer");
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return stop_ || !calls_.empty(); });
    if (calls_.empty()) return;  // stopping, and nothing left to write
    FloorCall* call = calls_.front();
    calls_.pop_front();
    lock.unlock();
    call->WriteFirst();
    lock.lock();
  }
}

absl::Status Serve(const FloorOptions& opt) {
  RETURN_IF_ERROR(InstallSignalHandlers({SIGINT, SIGTERM}));
  tandem::v1::Worker::AsyncService service;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(absl::StrFormat("%s:%d", opt.host, opt.port), grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  // As a worker does (worker_command.cc): the router's channel arguments
  // send keepalive pings every few seconds.
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 1000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  if (opt.minimal_stack) {
    builder.AddChannelArgument(GRPC_ARG_MINIMAL_STACK, 1);
    builder.AddChannelArgument(GRPC_ARG_OPTIMIZATION_TARGET, std::string("latency"));
  }
  std::unique_ptr<grpc::ServerCompletionQueue> cq = builder.AddCompletionQueue();
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    return absl::UnavailableError(absl::StrFormat("cannot listen on %s:%d", opt.host, opt.port));
  }
  std::unique_ptr<Writer> writer = opt.handoff ? std::make_unique<Writer>() : nullptr;
  absl::Status status;
  {
    GrpcPoller poller(cq.get());
    new FloorCall(&service, cq.get(), writer.get());
    const std::string address = absl::StrFormat("%s:%d", opt.host, port);
    LOG(INFO) << "grpc-floor: serving Generate on " << address
              << (opt.handoff ? " (handing each call to a writer thread)" : " (on the poller)");
    if (!opt.ready_file.empty()) status = WriteFileAtomically(opt.ready_file, address + "\n");
    if (status.ok()) WaitForSignal();
    // The writer writes what it holds and stops: calls accepted from now on
    // are written on the poller. Calls still running get half a second, then
    // are cancelled (as a client that keeps its connection would otherwise
    // hold Shutdown for ever); the queue shuts down only after that.
    if (writer != nullptr) writer->Stop();
    server->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
  }  // the poller drains the queue: every call ends and is deleted
  return status;
}

// ---- The client ----------------------------------------------------------

struct Timing {
  Clock::time_point start, first, end;
  bool ok = false;
};

// The calls of one RunCalls not yet ended.
struct Pending {
  std::mutex mu;
  std::condition_variable cv;
  int left ABSL_GUARDED_BY(mu) = 0;
};

class FloorReader final : public GrpcReader<GenerateResponse> {
 public:
  FloorReader(Timing* timing, int max_tokens, Pending* pending)
      : timing_(timing), max_tokens_(max_tokens), pending_(pending) {}

  void Start(tandem::v1::Worker::Stub& stub, const GenerateRequest& request) {
    // A server that never answers fails the call instead of hanging the run.
    ctx_.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    timing_->start = Clock::now();
    StartReading(stub.PrepareAsyncGenerate(&ctx_, request, GrpcPoller::Shared().cq()));
  }

 private:
  bool OnMessage(const GenerateResponse& message) override {
    if (!seen_first_) {
      seen_first_ = true;
      timing_->first = Clock::now();
    }
    tokens_ += message.tokens_size();
    finished_ = message.finish_reason() != tandem::v1::FINISH_REASON_UNSPECIFIED;
    return true;
  }
  void OnEnd(const grpc::Status& status) override {
    timing_->end = Clock::now();
    // A call counts when it streamed every token it asked for and ended.
    timing_->ok = status.ok() && finished_ && tokens_ == max_tokens_;
    {
      // Under the lock: RunCalls (and *pending_) may end once it is released.
      std::lock_guard<std::mutex> lock(pending_->mu);
      if (--pending_->left == 0) pending_->cv.notify_all();
    }
    delete this;
  }

  Timing* const timing_;
  const int max_tokens_;
  Pending* const pending_;
  grpc::ClientContext ctx_;
  bool seen_first_ = false;
  bool finished_ = false;
  int tokens_ = 0;
};

// Runs `timings.size()` calls at the options' rate and waits for them all.
void RunCalls(tandem::v1::Worker::Stub& stub, const GenerateRequest& request, double rate, uint64_t seed,
              std::vector<Timing>& timings) {
  Pending pending;
  pending.left = static_cast<int>(timings.size());
  std::mt19937_64 rng(seed);
  std::exponential_distribution<double> gap(std::isfinite(rate) ? rate : 1.0);
  Clock::time_point at = Clock::now();
  for (Timing& t : timings) {
    std::this_thread::sleep_until(at);
    (new FloorReader(&t, request.sampling().max_tokens(), &pending))->Start(stub, request);
    if (std::isfinite(rate)) {
      at += std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(gap(rng)));
    }
  }
  std::unique_lock<std::mutex> lock(pending.mu);
  pending.cv.wait(lock, [&] { return pending.left == 0; });
}

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

absl::Status RunClient(const FloorOptions& opt) {
  if (opt.target.empty()) return absl::InvalidArgumentError("--target (host:port) is required");
  if (opt.num_prompts < 1) return absl::InvalidArgumentError("--num-prompts must be at least 1");
  if (opt.input_len < 1) return absl::InvalidArgumentError("--input-len must be at least 1");
  if (opt.max_tokens < 2) return absl::InvalidArgumentError("--max-tokens must be at least 2");
  if (!(opt.request_rate > 0)) return absl::InvalidArgumentError("--request-rate must be > 0");
  SetThreadName("floor_client");
  // The router's channel arguments and poller.
  grpc::ChannelArguments args = router::WorkerClient::ChannelArgs();
  if (opt.minimal_stack) {
    args.SetInt(GRPC_ARG_MINIMAL_STACK, 1);
    args.SetString(GRPC_ARG_OPTIMIZATION_TARGET, "latency");
  }
  std::unique_ptr<tandem::v1::Worker::Stub> stub =
      tandem::v1::Worker::NewStub(grpc::CreateCustomChannel(opt.target, grpc::InsecureChannelCredentials(), args));
  GenerateRequest request;
  std::mt19937 rng(static_cast<uint32_t>(opt.seed));
  for (int i = 0; i < opt.input_len; ++i) request.add_prompt_token_ids(static_cast<int>(rng() % 32000));
  request.mutable_sampling()->set_max_tokens(opt.max_tokens);

  std::vector<Timing> warm(opt.warmups);
  RunCalls(*stub, request, 100, opt.seed + 1, warm);
  std::vector<Timing> timings(opt.num_prompts);
  const Clock::time_point begin = Clock::now();
  RunCalls(*stub, request, opt.request_rate, opt.seed, timings);
  const double duration_s = std::chrono::duration<double>(Clock::now() - begin).count();

  std::vector<double> first, end;
  int failed = 0;
  for (const Timing& t : timings) {
    if (!t.ok) {
      ++failed;
      continue;
    }
    first.push_back(Ms(t.first - t.start));
    end.push_back(Ms(t.end - t.start));
  }
  const Distribution f = Distribute(first), e = Distribute(end);
  std::printf("grpc-floor: %zu calls ok, %d failed in %.1f s (%s)\n", first.size(), failed, duration_s,
              opt.target.c_str());
  std::printf("  first message ms: mean %.3f  p50 %.3f  p90 %.3f  p99 %.3f\n", f.mean, f.median, f.p90, f.p99);
  std::printf("  stream end ms:    mean %.3f  p50 %.3f  p90 %.3f  p99 %.3f\n", e.mean, e.median, e.p90, e.p99);
  if (!opt.json.empty()) {
    const nlohmann::json j = {{"completed", static_cast<int>(first.size())},
                              {"failed", failed},
                              {"duration_s", duration_s},
                              {"first_ms", DistributionJson(f)},
                              {"end_ms", DistributionJson(e)}};
    RETURN_IF_ERROR(WriteFileAtomically(opt.json, j.dump() + "\n"));
  }
  if (failed > 0) return absl::UnavailableError(absl::StrFormat("%d calls failed", failed));
  return absl::OkStatus();
}

}  // namespace

void AddGrpcFloorCommand(CLI::App& bench) {
  auto opt = std::make_shared<FloorOptions>();
  CLI::App* cmd = bench.add_subcommand(
      "grpc-floor", "The cost of one bare streamed gRPC call (no model, no router): --serve, then a client");
  CLI::Option* serve = cmd->add_flag("--serve", opt->serve, "Serve Generate (instant answers) instead of calling");
  // The server's options need --serve; the client's exclude it.
  const std::vector<CLI::Option*> server_options = {
      cmd->add_option("--host", opt->host, "--serve: address to listen on")->capture_default_str(),
      cmd->add_option("--port", opt->port, "--serve: port (0: pick a free one)")
          ->check(CLI::Range(0, 65535))
          ->capture_default_str(),
      cmd->add_option("--ready-file", opt->ready_file, "--serve: write host:port here once listening"),
      cmd->add_flag("--handoff", opt->handoff,
                    "--serve: write from a second thread, as a worker's engine thread does")};
  cmd->add_flag("--minimal-stack", opt->minimal_stack,
                "gRPC's minimal stack and latency optimization target (give it to both sides)");
  const std::vector<CLI::Option*> client_options = {
      cmd->add_option("--target", opt->target, "The server's host:port"),
      cmd->add_option("--request-rate", opt->request_rate, "Calls per second (Poisson), or inf")->capture_default_str(),
      cmd->add_option("--num-prompts", opt->num_prompts, "Calls measured")->capture_default_str(),
      cmd->add_option("--warmups", opt->warmups, "Calls before the measured ones")
          ->check(CLI::NonNegativeNumber)
          ->capture_default_str(),
      cmd->add_option("--input-len", opt->input_len, "Prompt token ids per call")->capture_default_str(),
      cmd->add_option("--max-tokens", opt->max_tokens, "Tokens streamed back (in two messages)")->capture_default_str(),
      cmd->add_option("--seed", opt->seed, "Seed of the arrivals and prompt")->capture_default_str(),
      cmd->add_option("--json", opt->json, "Write the results (ms) here as JSON")};
  for (CLI::Option* o : server_options) o->needs(serve);
  for (CLI::Option* o : client_options) o->excludes(serve);
  cmd->callback([opt] { worker::ExitWithStatus("bench grpc-floor", opt->serve ? Serve(*opt) : RunClient(*opt)); });
}

}  // namespace tandem::bench
