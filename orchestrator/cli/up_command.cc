// `tandem up`: a local cluster in one command. It starts N prefill and M
// decode workers (or K aggregated ones) and a router as child processes of
// this `tandem` binary, waits until the router's /health is ready, prefixes
// every child's log lines with its name, and shuts everything down in order
// (router first, then workers) on Ctrl-C or SIGTERM, or when the router dies.
//
// A worker that dies is restarted on its port after a backoff (0.5 s,
// doubling up to 30 s; logged), so the router readmits it at its next health
// checks; the others serve meanwhile (without --config, requests that find no
// healthy worker wait up to 10 s for one: retries.wait_for_worker_s). One
// that dies --max-restarts times in a row, each within a minute of starting,
// is given up on (logged), and the cluster serves with the rest; with no
// decode worker left it stops.
// --max-restarts 0 restores stopping the whole cluster when any child dies.
//
// The router's config is the --config file (or the defaults) with its pools
// replaced by the workers started here; flags override the file. --api-key
// (or $TANDEM_API_KEY, as vLLM's --api-key / VLLM_API_KEY) adds an admin API
// key: the router then wants `Authorization: Bearer KEY`; its digest, never
// the key, goes into the router's config file. Without --config the
// cluster is a development one: its router shows worker addresses
// (debug.worker_details).
//
// Trust: the cluster runs over mutual TLS with a throwaway CA made at start
// (a temporary directory removed when `up` exits), unless --insecure; the
// file's own tls section is replaced either way.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/certificates.h"
#include "common/file_util.h"
#include "common/logging.h"
#include "common/sha256.h"
#include "common/signals.h"
#include "common/status_macros.h"
#include "kernels/paged_attention.h"
#include "kvtransfer/transport.h"
#include "orchestrator/cli/router_command.h"
#include "orchestrator/config/router_config.h"
#include "orchestrator/http/http_server.h"
#include "worker/cli/commands.h"
#include "worker/model/builtin_models.h"
#include "worker/runner/model_runner.h"

namespace tandem::router {
namespace {

using Clock = std::chrono::steady_clock;

struct UpOptions {
  std::string config;
  std::string model = "builtin:tiny";
  std::string served_model_name;  // empty: the config file's, else --model
  int prefill = 1;
  int decode = 1;
  int aggregated = 0;
  std::string policy;
  std::string disaggregation;
  int port = 8000;
  std::string host = "127.0.0.1";
  std::string ready_file;
  int worker_threads = 0;
  std::string kv_cache_memory;
  std::vector<std::string> worker_args;
  std::string run_dir;
  std::string engine;                 // empty: the workers' default (real)
  std::string device;                 // empty: cpu; cuda: worker k on cuda:k; cuda:N: all on N
  std::string kv_transport;           // split clusters; empty: ucx on the CPU, cuda_ipc on GPUs
  double gpu_memory_utilization = 0;  // each GPU worker's share; 0: 0.9 split among a GPU's workers
  int max_restarts = 5;               // per worker, in a row; 0: a dead worker stops the cluster
  bool insecure = false;              // plain TCP between router and workers
  std::string api_key;                // empty: $TANDEM_API_KEY, if set
};

// A directory removed (with its contents) when this goes out of scope.
struct TempDir {
  std::string path;
  ~TempDir() {
    std::error_code ignored;
    if (!path.empty()) std::filesystem::remove_all(path, ignored);
  }
};

// A worker restarted after a run this long starts its restart count afresh.
constexpr std::chrono::seconds kStableRun(60);
constexpr std::chrono::milliseconds kFirstBackoff(500);
constexpr std::chrono::milliseconds kMaxBackoff(30000);
// The default config's retries.wait_for_worker_s: requests that find no
// healthy worker (one restarting) wait this long for it.
constexpr int kWaitForWorkerS = 10;

std::mutex g_log_mu;

// A child process whose stdout and stderr come back through a pipe, copied
// to our stdout line by line behind "[name] ".
struct Child {
  std::string name;
  pid_t pid = -1;
  int status = 0;
  bool exited = false;
  std::thread pump;
};

absl::StatusOr<std::unique_ptr<Child>> Spawn(const std::string& name, const std::vector<std::string>& argv) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return absl::InternalError("pipe failed");
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) return absl::InternalError("fork failed");
  if (pid == 0) {
    // The child: its own process group (the terminal's Ctrl-C reaches only
    // `up`, which stops the children in order), and SIGTERM if `up` dies.
    setpgid(0, 0);
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) _exit(1);
    dup2(fds[1], STDOUT_FILENO);
    dup2(fds[1], STDERR_FILENO);
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execv("/proc/self/exe", args.data());
    _exit(127);
  }
  close(fds[1]);
  auto child = std::make_unique<Child>();
  child->name = name;
  child->pid = pid;
  const int fd = fds[0];
  child->pump = std::thread([fd, name] {
    FILE* in = fdopen(fd, "r");
    char* line = nullptr;
    size_t cap = 0;
    ssize_t n;
    while ((n = getline(&line, &cap, in)) > 0) {
      std::lock_guard<std::mutex> lock(g_log_mu);
      std::fprintf(stdout, "[%s] %.*s", name.c_str(), static_cast<int>(n), line);
      if (line[n - 1] != '\n') std::fputc('\n', stdout);
      std::fflush(stdout);
    }
    free(line);
    fclose(in);
  });
  return child;
}

void Say(const std::string& text) {
  std::lock_guard<std::mutex> lock(g_log_mu);
  std::fprintf(stdout, "[up] %s\n", text.c_str());
  std::fflush(stdout);
}

// Reaps any exited children; returns the first that exited now.
Child* Reap(std::vector<std::unique_ptr<Child>>& children) {
  Child* first = nullptr;
  for (auto& c : children) {
    if (c->exited) continue;
    int status = 0;
    if (waitpid(c->pid, &status, WNOHANG) == c->pid) {
      c->exited = true;
      c->status = status;
      if (first == nullptr) first = c.get();
    }
  }
  return first;
}

std::string DescribeExit(int status) {
  if (WIFEXITED(status)) return absl::StrFormat("exited with status %d", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return absl::StrFormat("was killed by signal %d", WTERMSIG(status));
  return "ended";
}

// SIGTERM to each running child of `group`, then SIGKILL after `grace`.
void StopAll(std::vector<std::unique_ptr<Child>>& children, const std::vector<Child*>& group,
             std::chrono::seconds grace) {
  for (Child* c : group) {
    if (!c->exited) kill(c->pid, SIGTERM);
  }
  const auto deadline = Clock::now() + grace;
  while (Clock::now() < deadline) {
    Reap(children);
    bool all = true;
    for (Child* c : group) all = all && c->exited;
    if (all) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  for (Child* c : group) {
    if (!c->exited) {
      Say(absl::StrCat(c->name, " did not stop in time: killing it"));
      kill(c->pid, SIGKILL);
      waitpid(c->pid, &c->status, 0);
      c->exited = true;
    }
  }
}

absl::StatusOr<std::string> ReadWhenPresent(const std::string& path, Child& child,
                                            std::vector<std::unique_ptr<Child>>& children,
                                            std::chrono::seconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
    std::ifstream in(path);
    std::string text;
    if (in && std::getline(in, text) && !text.empty()) return text;
    Reap(children);
    if (child.exited) {
      return absl::UnavailableError(absl::StrCat(child.name, " ", DescribeExit(child.status), " before it was ready"));
    }
    if (WaitForSignalFor(50) != 0) return absl::CancelledError("interrupted");
  }
  return absl::DeadlineExceededError(absl::StrFormat("%s was not ready within %d s", child.name, timeout.count()));
}

// One HTTP/1.1 GET on 127.0.0.1; the status code, or -1.
int HttpGetStatus(const std::string& host, int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, host == "0.0.0.0" ? "127.0.0.1" : host.c_str(), &addr.sin_addr);
  int code = -1;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) {
    const std::string req = absl::StrCat("GET ", path, " HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
    if (write(fd, req.data(), req.size()) == static_cast<ssize_t>(req.size())) {
      char buf[64] = {};
      const ssize_t n = read(fd, buf, sizeof buf - 1);
      if (n > 12) code = std::atoi(buf + 9);  // "HTTP/1.1 200"
    }
  }
  close(fd);
  return code;
}

// The router's config file: `c` with the started workers as its pools (the
// keys of a keys file are in it by digest: the file is not read again).
std::string RouterYaml(RouterConfig c, const std::vector<std::string>& prefill,
                       const std::vector<std::string>& decode) {
  if (c.prefill.has_value()) {
    if (prefill.empty()) {
      c.prefill.reset();
    } else {
      c.prefill->workers = prefill;
      c.prefill->discovery.reset();
    }
  }
  c.decode->workers = decode;
  c.decode->discovery.reset();
  c.auth.keys_file.clear();
  return SerializeRouterConfig(c);
}

// What the children would refuse after loading their models, refused before
// any starts, naming the flag: the model, the KV cache size, the routing
// policy (the router config as it will be, with placeholder workers), and a
// router port that is taken.
absl::Status CheckBeforeStarting(const UpOptions& opt, const RouterConfig& config) {
  if (opt.model.rfind("builtin:", 0) == 0) {
    const std::vector<std::string>& names = worker::BuiltinModelNames();
    if (std::find(names.begin(), names.end(), opt.model.substr(8)) == names.end()) {
      return absl::InvalidArgumentError(absl::StrFormat("--model: no built-in model '%s' (builtin:%s)", opt.model,
                                                        absl::StrJoin(names, ", builtin:")));
    }
  } else {
    std::error_code ec;
    if (!std::filesystem::is_regular_file(std::filesystem::path(opt.model) / "config.json", ec)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("--model: '%s' is neither a built-in model (builtin:%s) nor a checkpoint directory with a "
                          "config.json",
                          opt.model, absl::StrJoin(worker::BuiltinModelNames(), ", builtin:")));
    }
  }
  if (!opt.kv_cache_memory.empty()) {
    absl::StatusOr<int64_t> bytes = worker::ParseByteSize(opt.kv_cache_memory);
    if (!bytes.ok()) return absl::InvalidArgumentError(absl::StrCat("--kv-cache-memory: ", bytes.status().message()));
  }
  RouterConfig check = config;
  check.tls = TlsConfig{.mode = TlsMode::kInsecure};  // up makes the certificates later
  for (std::optional<PoolConfig>* p : {&check.prefill, &check.decode}) {
    if (p->has_value()) {
      (*p)->workers = {"127.0.0.1:1"};
      (*p)->discovery.reset();
    }
  }
  if (absl::Status s = ValidateRouterConfig(check); !s.ok()) {
    if (!opt.policy.empty() && absl::StrContains(s.message(), ".policy")) {
      return absl::InvalidArgumentError(absl::StrCat("--policy ", opt.policy, ": ", s.message()));
    }
    return absl::InvalidArgumentError(
        absl::StrCat(opt.config.empty() ? "" : absl::StrCat("--config ", opt.config, ": "), s.message()));
  }
  if (opt.port != 0) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(opt.port));
    const bool numeric = inet_pton(AF_INET, opt.host.c_str(), &addr.sin_addr) == 1;
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    const bool taken =
        fd >= 0 && numeric && bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 && errno == EADDRINUSE;
    if (fd >= 0) close(fd);
    if (taken) {
      return absl::InvalidArgumentError(
          absl::StrFormat("--port %d: %s:%d is in use (--port 0 picks a free one)", opt.port, opt.host, opt.port));
    }
  }
  return absl::OkStatus();
}

absl::Status Up(UpOptions opt) {
  // A ready file left by an earlier run must not announce this one before it serves.
  if (!opt.ready_file.empty() && unlink(opt.ready_file.c_str()) != 0 && errno != ENOENT) {
    return absl::InvalidArgumentError(
        absl::StrCat("--ready-file: cannot remove the old ", opt.ready_file, ": ", strerror(errno)));
  }
  // The router config: the file's, or defaults for a local cluster.
  RouterConfig config;
  if (!opt.config.empty()) {
    absl::StatusOr<RouterConfig> loaded = LoadRouterConfig(opt.config);
    // The file's tls section is replaced below, so a file may leave it out.
    if (!loaded.ok() && absl::StrContains(loaded.status().message(), "tls: required")) {
      ASSIGN_OR_RETURN(std::string text, ReadFile(opt.config));
      loaded = ParseRouterConfig(text + "\ntls: {mode: insecure}\n", opt.config);
    }
    ASSIGN_OR_RETURN(config, std::move(loaded));
  } else {
    config.model.served_name = opt.model;
    config.disaggregation.mode = DisaggregationMode::kAlways;
    config.decode = PoolConfig{};
    config.decode->policy.name = "kv_cache_aware";
    config.prefill = PoolConfig{};
    config.prefill->policy.name = "kv_cache_aware";
    config.health.interval_s = 1;
    config.health.timeout_s = 1;
    config.retries.wait_for_worker_s = kWaitForWorkerS;
    config.debug.worker_details = true;  // a development cluster
  }
  if (!opt.served_model_name.empty()) config.model.served_name = opt.served_model_name;
  if (opt.api_key.empty()) {
    if (const char* env = std::getenv("TANDEM_API_KEY"); env != nullptr) opt.api_key = env;
  }
  if (!opt.api_key.empty()) {
    for (char ch : opt.api_key) {
      if (ch < 0x21 || ch > 0x7e) {
        return absl::InvalidArgumentError(
            "--api-key (or TANDEM_API_KEY) must be visible ASCII characters without spaces");
      }
    }
    ApiKeyConfig key{.name = "api-key", .sha256 = Sha256Hex(opt.api_key), .admin = true};
    for (const ApiKeyConfig& k : config.auth.keys) {
      if (k.name == key.name) key.name = "tandem-up-api-key";
    }
    config.auth.keys.push_back(std::move(key));
  }
  config.listener.host = opt.host;
  config.listener.port = opt.port;
  if (opt.config.empty() || opt.model != "builtin:tiny") {
    // The model's own tokenizer: a checkpoint's, or the built-in one padded
    // to the preset's vocabulary (LoadModelAssets reads "builtin:NAME").
    config.model.tokenizer = opt.model;
  }
  if (!opt.disaggregation.empty()) {
    const std::optional<DisaggregationMode> mode = ParseDisaggregationMode(opt.disaggregation);
    if (!mode.has_value()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("--disaggregation must be never, always or auto, got '%s'", opt.disaggregation));
    }
    config.disaggregation.mode = *mode;
  }
  if (opt.aggregated > 0) config.disaggregation.mode = DisaggregationMode::kNever;
  if (!config.decode.has_value()) config.decode = PoolConfig{};
  const bool split = config.disaggregation.mode != DisaggregationMode::kNever;
  if (split && !config.prefill.has_value()) {
    config.prefill = PoolConfig{};
    config.prefill->policy = config.decode->policy;
  }
  if (!split) config.prefill.reset();
  if (!opt.policy.empty()) {
    for (std::optional<PoolConfig>* p : {&config.prefill, &config.decode}) {
      if (p->has_value()) (*p)->policy = PolicyConfig{.name = opt.policy};
    }
  }
  const bool gpu = !opt.device.empty() && opt.device != "cpu";
  if (split && opt.kv_transport == "nccl" && opt.device != "cuda") {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--kv-transport nccl joins the prefill and decode workers' GPUs, which must differ: --device cuda (worker k "
        "on GPU k), not %s",
        gpu ? opt.device : "cpu"));
  }
  worker::RunnerOptions gpu_options;  // the device's index for cuda:N
  if (gpu) {
    std::string runner;
    if (absl::Status s = worker::SelectDevice(opt.device, &runner, &gpu_options); !s.ok()) return s;
  }
  // The split's KV transport: one that moves the workers' pools (GPU or host memory).
  const std::string kv_transport = !opt.kv_transport.empty() ? opt.kv_transport : gpu ? "cuda_ipc" : "ucx";
  // A send/receive transport takes part on both sides only through the push
  // handshake: its workers push.
  bool kv_push = false;
  if (split) {
    const kvtransfer::TransportCapabilities* caps = kvtransfer::TransportRegistry::Builtin().Capabilities(kv_transport);
    if (caps == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--kv-transport must be one of ", absl::StrJoin(kvtransfer::TransportRegistry::Builtin().names(), ", "),
          ", got '", opt.kv_transport, "'"));
    }
    const kvtransfer::MemoryType pools = gpu ? kvtransfer::MemoryType::kCuda : kvtransfer::MemoryType::kHost;
    if (!caps->Moves(pools)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("--kv-transport %s cannot move the KV cache of %s workers (%s memory): use --kv-transport %s",
                          kv_transport, gpu ? opt.device : "cpu", gpu ? "GPU" : "host", gpu ? "cuda_ipc" : "ucx"));
    }
    kv_push = caps->needs_pairing;
  } else if (!opt.kv_transport.empty()) {
    return absl::InvalidArgumentError("--kv-transport is for disaggregated clusters (--prefill P --decode D)");
  }
  if (opt.gpu_memory_utilization != 0 &&
      (!gpu || !(opt.gpu_memory_utilization > 0 && opt.gpu_memory_utilization <= 1))) {
    return absl::InvalidArgumentError(
        gpu ? absl::StrFormat("--gpu-memory-utilization must be in (0, 1], got %g", opt.gpu_memory_utilization)
            : std::string("--gpu-memory-utilization is for GPU workers (--device cuda or cuda:N)"));
  }
  if (opt.gpu_memory_utilization != 0 && !opt.kv_cache_memory.empty()) {
    return absl::InvalidArgumentError(
        "--gpu-memory-utilization and --kv-cache-memory exclude each other (a share of the GPU, or a KV size)");
  }
  const int num_decode = split ? opt.decode : (opt.aggregated > 0 ? opt.aggregated : opt.decode);
  const int num_prefill = split ? opt.prefill : 0;
  const int num_workers = num_decode + num_prefill;
  if (num_decode < 1 || num_prefill < 0 || (split && num_prefill < 1)) {
    return absl::InvalidArgumentError(
        "a cluster needs at least one decode (or aggregated) worker, and one prefill worker when "
        "disaggregated");
  }
  // Workers that share one GPU (--device cuda:N), and each one's share of it.
  const int gpu_sharing = opt.device == "cuda" ? 1 : num_workers;
  const double gpu_share = opt.gpu_memory_utilization > 0 ? opt.gpu_memory_utilization : 0.9 / gpu_sharing;
  if (gpu) {
    if (const char* why = nullptr; !kernels::cuda::Available(&why)) {
      return absl::FailedPreconditionError(absl::StrFormat("--device %s: %s", opt.device, why));
    }
    // Every worker's GPU exists, and a split's GPUs reach each other.
    const int first = opt.device == "cuda" ? 0 : gpu_options.device;
    const int last = opt.device == "cuda" ? num_workers - 1 : gpu_options.device;
    const int count = kernels::cuda::DeviceCount();
    if (last >= count) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "--device %s: %d workers need GPUs 0..%d, and this machine has %d (use --device cuda:N to share one)",
          opt.device, num_workers, last, count));
    }
    for (int a = first; split && a <= last; ++a) {
      for (int b = first; b <= last; ++b) {
        if (!kernels::cuda::CanAccessPeer(a, b)) {
          return absl::FailedPreconditionError(absl::StrFormat(
              "--device %s: GPU %d cannot reach GPU %d's memory (no peer access), so cuda_ipc cannot move KV "
              "between their workers: use --device cuda:N (one GPU) or --aggregated K",
              opt.device, a, b));
        }
      }
    }
    if (opt.gpu_memory_utilization > 0 && gpu_share * gpu_sharing > 1.0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("--gpu-memory-utilization %g for each of %d workers on GPU %s is more than the whole GPU",
                          gpu_share, gpu_sharing, opt.device.substr(5)));
    }
  }
  RETURN_IF_ERROR(CheckBeforeStarting(opt, config));

  std::string dir = opt.run_dir;
  if (dir.empty()) {
    char tmpl[] = "/tmp/tandem-up.XXXXXX";
    if (mkdtemp(tmpl) == nullptr) return absl::InternalError("cannot create a run directory");
    dir = tmpl;
  } else {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec) {
      return absl::InvalidArgumentError(absl::StrCat("cannot create the run directory ", dir, ": ", ec.message()));
    }
  }
  RETURN_IF_ERROR(InstallSignalHandlers({SIGINT, SIGTERM}));

  // A throwaway CA and certificates for this cluster only.
  TempDir certs;
  std::vector<std::string> worker_trust = {"--insecure"};
  if (opt.insecure) {
    config.tls = TlsConfig{.mode = TlsMode::kInsecure};
    Say("WARNING: --insecure: the router and workers talk plain TCP; any local process can call "
        "the workers");
  } else {
    char tmpl[] = "/tmp/tandem-certs.XXXXXX";
    if (mkdtemp(tmpl) == nullptr) return absl::InternalError("cannot create a certificate directory");
    certs.path = tmpl;
    ASSIGN_OR_RETURN(tls::ClusterFiles files, tls::WriteClusterCertificates(certs.path, 2));
    config.tls =
        TlsConfig{.mode = TlsMode::kMutual, .ca = files.router.ca, .cert = files.router.cert, .key = files.router.key};
    worker_trust = {"--tls-ca", files.worker.ca, "--tls-cert", files.worker.cert, "--tls-key", files.worker.key};
  }

  std::vector<std::unique_ptr<Child>> children;
  std::vector<Child*> workers;  // the live process of each worker (shutdown stops them)
  Child* router = nullptr;
  absl::Status result = absl::OkStatus();
  auto shutdown = [&](const absl::Status& why) {
    if (!why.ok()) Say(std::string(why.message()));
    Say("stopping");
    if (router != nullptr) StopAll(children, {router}, std::chrono::seconds(15));
    StopAll(children, workers, std::chrono::seconds(15));
    for (auto& c : children) {
      if (c->pump.joinable()) c->pump.join();
    }
    return why;
  };

  // Workers.
  std::vector<std::string> prefill_addrs, decode_addrs;
  // One worker across its restarts.
  struct Slot {
    std::string name, role, ready_file;
    int port = 0;                                 // 0 until it first bound one
    size_t index = 0;                             // in `workers`
    Clock::time_point started;                    // of its current process
    int restarts = 0;                             // in a row (reset after kStableRun)
    std::optional<Clock::time_point> restart_at;  // dead, waiting for its backoff
    bool back = true;                             // its current process wrote its address
    bool given_up = false;
  };
  std::vector<Slot> slots;
  auto spawn_worker = [&](Slot& slot) -> absl::Status {
    unlink(slot.ready_file.c_str());
    std::vector<std::string> argv = {"tandem",       "worker",       "--model",   opt.model, "--role",
                                     slot.role,      "--host",       "127.0.0.1", "--port",  std::to_string(slot.port),
                                     "--ready-file", slot.ready_file};
    argv.insert(argv.end(), worker_trust.begin(), worker_trust.end());
    argv.insert(argv.end(), {"--served-model-name", config.model.served_name});
    if (split) {
      argv.insert(argv.end(), {"--kv-transport", kv_transport});
      if (kv_transport == "ucx" || kv_transport == "ucx_staged") {
        argv.insert(argv.end(), {"--kv-transport-tls", "shm"});
      }
      if (kv_push) argv.insert(argv.end(), {"--kv-delivery", "push"});
    }
    if (opt.worker_threads > 0) {
      argv.push_back("--threads");
      argv.push_back(std::to_string(opt.worker_threads));
    }
    if (!opt.kv_cache_memory.empty()) {
      argv.push_back("--kv-cache-memory");
      argv.push_back(opt.kv_cache_memory);
    }
    if (!opt.engine.empty()) {
      argv.push_back("--engine");
      argv.push_back(opt.engine);
    }
    if (!opt.device.empty()) {
      // "cuda": one GPU per worker, in order.
      argv.push_back("--device");
      argv.push_back(opt.device == "cuda" ? absl::StrCat("cuda:", slot.index) : opt.device);
    }
    if (gpu && opt.kv_cache_memory.empty()) {
      // The GPU's memory shared among the workers on it (vLLM's meaning of
      // the utilization: each worker's own share).
      argv.insert(argv.end(), {"--gpu-memory-utilization", absl::StrFormat("%g", gpu_share)});
    }
    argv.insert(argv.end(), opt.worker_args.begin(), opt.worker_args.end());
    ASSIGN_OR_RETURN(std::unique_ptr<Child> c, Spawn(slot.name, argv));
    children.push_back(std::move(c));
    workers[slot.index] = children.back().get();
    slot.started = Clock::now();
    return absl::OkStatus();
  };
  auto start_worker = [&](const std::string& name, const std::string& role) -> absl::StatusOr<std::string> {
    slots.push_back(
        Slot{.name = name, .role = role, .ready_file = absl::StrCat(dir, "/", name, ".addr"), .index = workers.size()});
    workers.push_back(nullptr);
    Slot& slot = slots.back();
    if (absl::Status st = spawn_worker(slot); !st.ok()) {
      workers.pop_back();
      slots.pop_back();
      return st;
    }
    ASSIGN_OR_RETURN(std::string addr,
                     ReadWhenPresent(slot.ready_file, *workers[slot.index], children, std::chrono::seconds(300)));
    // Restarts bind the same port, so the router's address for it holds.
    slot.port = std::atoi(addr.substr(addr.rfind(':') + 1).c_str());
    return addr;
  };
  for (int i = 0; i < num_prefill && result.ok(); ++i) {
    absl::StatusOr<std::string> a = start_worker(absl::StrCat("prefill-", i), "prefill");
    if (a.ok())
      prefill_addrs.push_back(*a);
    else
      result = a.status();
  }
  for (int i = 0; i < num_decode && result.ok(); ++i) {
    const std::string name = split ? absl::StrCat("decode-", i) : absl::StrCat("worker-", i);
    absl::StatusOr<std::string> a = start_worker(name, split ? "decode" : "both");
    if (a.ok())
      decode_addrs.push_back(*a);
    else
      result = a.status();
  }
  if (!result.ok()) return shutdown(result);

  // The router.
  const std::string router_yaml = absl::StrCat(dir, "/router.yaml");
  const std::string yaml = RouterYaml(config, prefill_addrs, decode_addrs);
  if (absl::StatusOr<RouterConfig> check = ParseRouterConfig(yaml, router_yaml); !check.ok()) {
    return shutdown(check.status());
  }
  RETURN_IF_ERROR(WriteFile(router_yaml, yaml));
  const std::string router_ready = absl::StrCat(dir, "/router.addr");
  unlink(router_ready.c_str());
  {
    absl::StatusOr<std::unique_ptr<Child>> c =
        Spawn("router", {"tandem", "router", "--config", router_yaml, "--ready-file", router_ready});
    if (!c.ok()) return shutdown(c.status());
    children.push_back(*std::move(c));
    router = children.back().get();
  }
  absl::StatusOr<std::string> router_addr = ReadWhenPresent(router_ready, *router, children, std::chrono::seconds(60));
  if (!router_addr.ok()) return shutdown(router_addr.status());
  const int port = std::atoi(router_addr->substr(router_addr->rfind(':') + 1).c_str());
  // Ready once /health says a decode worker is healthy.
  const auto deadline = Clock::now() + std::chrono::seconds(60);
  while (HttpGetStatus(config.listener.host, port, "/health") != 200) {
    Reap(children);
    if (router->exited) return shutdown(absl::UnavailableError("the router exited"));
    if (Clock::now() > deadline) {
      return shutdown(absl::DeadlineExceededError("the router was not healthy within 60 s"));
    }
    if (WaitForSignalFor(100) != 0) return shutdown(absl::OkStatus());
  }
  const std::string url = http::BaseUrl(config.listener.host, port);
  Say(absl::StrFormat("ready: %s (%d prefill, %d %s workers, disaggregation %s, %s); config %s", url, num_prefill,
                      num_decode, split ? "decode" : "aggregated", DisaggregationModeName(config.disaggregation.mode),
                      opt.insecure ? "INSECURE plain TCP" : "mutual TLS (throwaway CA)", router_yaml));
  Say(absl::StrFormat(
      "try: curl -s %s/v1/chat/completions -H 'Content-Type: application/json' "
      "-d '{\"model\": \"%s\", \"messages\": [{\"role\": \"user\", \"content\": "
      "\"Hello!\"}], \"max_tokens\": 32}'%s",
      url, config.model.served_name, config.auth.enabled() ? " -H 'Authorization: Bearer <your key>'" : ""));
  Say("Ctrl-C stops the cluster");
  if (!opt.ready_file.empty()) RETURN_IF_ERROR(WriteFileAtomically(opt.ready_file, url + "\n"));

  while (true) {
    const int sig = WaitForSignalFor(200);
    if (sig != 0) return shutdown(absl::OkStatus());
    Child* dead = Reap(children);
    if (router->exited) {
      return shutdown(
          absl::UnavailableError(absl::StrCat("router ", DescribeExit(router->status), ": stopping the cluster")));
    }
    if (dead != nullptr && opt.max_restarts == 0) {
      return shutdown(
          absl::UnavailableError(absl::StrCat(dead->name, " ", DescribeExit(dead->status), ": stopping the cluster")));
    }
    const Clock::time_point now = Clock::now();
    for (Slot& slot : slots) {
      Child* child = workers[slot.index];
      if (slot.given_up) continue;
      if (!slot.restart_at.has_value() && child->exited) {
        if (now - slot.started >= kStableRun) slot.restarts = 0;
        if (slot.restarts >= opt.max_restarts) {
          slot.given_up = true;
          Say(
              absl::StrFormat("%s %s again after %d restart(s): giving up on it (port %d); the "
                              "cluster serves with the other workers",
                              slot.name, DescribeExit(child->status), slot.restarts, slot.port));
          continue;
        }
        const auto backoff =
            std::min<std::chrono::milliseconds>(kMaxBackoff, kFirstBackoff * (1 << std::min(slot.restarts, 10)));
        ++slot.restarts;
        slot.restart_at = now + backoff;
        Say(
            absl::StrFormat("%s %s: restarting it on port %d in %.1f s (restart %d of at most %d "
                            "in a row)",
                            slot.name, DescribeExit(child->status), slot.port,
                            std::chrono::duration<double>(backoff).count(), slot.restarts, opt.max_restarts));
      }
      if (slot.restart_at.has_value() && now >= *slot.restart_at) {
        slot.restart_at.reset();
        slot.back = false;
        if (absl::Status st = spawn_worker(slot); !st.ok()) {
          Say(absl::StrCat("cannot restart ", slot.name, ": ", st.message()));
          slot.given_up = true;
        }
        continue;
      }
      if (!slot.back && !child->exited) {
        std::ifstream in(slot.ready_file);
        std::string addr;
        if (in && std::getline(in, addr) && !addr.empty()) {
          slot.back = true;
          Say(absl::StrCat(slot.name, " is back on ", addr));
        }
      }
    }
    bool decode_left = false;
    for (const Slot& slot : slots) decode_left |= slot.role != "prefill" && !slot.given_up;
    if (!decode_left) {
      return shutdown(absl::UnavailableError("no decode worker left: stopping the cluster"));
    }
  }
}

}  // namespace

void AddUpCommand(CLI::App& app) {
  auto opt = std::make_shared<UpOptions>();
  CLI::App* cmd =
      app.add_subcommand("up", "Start a local cluster: prefill and decode workers plus the router, as children");
  cmd->add_option("--config", opt->config, "Router configuration (YAML); its pools are replaced");
  cmd->add_option("--model", opt->model,
                  "builtin:NAME (tiny, small, llama-3.2-1b, llama-3.1-8b) or a checkpoint directory")
      ->capture_default_str();
  cmd->add_option("--served-model-name", opt->served_model_name,
                  "The model's name to clients (default: the --config file's, else --model)");
  cmd->add_option("--prefill", opt->prefill, "Prefill workers")->capture_default_str();
  cmd->add_option("--decode", opt->decode, "Decode workers")->capture_default_str();
  cmd->add_option("--aggregated", opt->aggregated,
                  "K workers of role both and no disaggregation (instead of prefill/decode)");
  cmd->add_option("--policy", opt->policy, "Routing policy of both pools");
  cmd->add_option("--disaggregation", opt->disaggregation, "never, always or auto");
  cmd->add_option("--host", opt->host, "Router address")->capture_default_str();
  cmd->add_option("--port", opt->port, "Router port (0: pick a free one)")->capture_default_str();
  cmd->add_option("--ready-file", opt->ready_file, "Write the router's URL here once ready");
  cmd->add_option("--worker-threads", opt->worker_threads, "BLAS threads per worker (0: all)");
  cmd->add_option("--kv-cache-memory", opt->kv_cache_memory, "Each worker's KV cache budget");
  cmd->add_option("--engine", opt->engine,
                  "Workers' engine: real, or sim (a simulator for routing experiments; "
                  "see tandem worker --help)");
  cmd->add_option("--device", opt->device, "Workers' device: cpu, cuda (worker k on GPU k) or cuda:N (all on GPU N)");
  cmd->add_option("--kv-transport", opt->kv_transport,
                  "Disaggregated clusters' KV transport: ucx (host memory), ucx_staged (any memory through host "
                  "staging; the workers push), cuda_ipc (GPU memory, one host) or nccl (GPU memory, worker k on GPU "
                  "k with --device cuda; the workers push); default: the one for --device");
  cmd->add_option("--gpu-memory-utilization", opt->gpu_memory_utilization,
                  "GPU workers: each worker's share of its GPU's memory (default: 0.9 divided among the workers "
                  "on one GPU, unless --kv-cache-memory is given)");
  cmd->add_option("--worker-arg", opt->worker_args, "Extra flag for every worker (repeatable)");
  cmd->add_option("--run-dir", opt->run_dir, "Where addresses and the router config go");
  cmd->add_option("--max-restarts", opt->max_restarts,
                  absl::StrCat("Restarts of a worker that dies, in a row, before it is given up on (0: a "
                               "worker that dies stops the cluster); meanwhile requests wait up to ",
                               kWaitForWorkerS, " s for a worker (retries.wait_for_worker_s, without --config)"))
      ->capture_default_str()
      ->check(CLI::Range(0, 1000));
  cmd->add_flag("--insecure", opt->insecure,
                "Plain TCP between router and workers (default: mutual TLS with a throwaway CA "
                "made for this cluster and removed at exit)");
  cmd->add_option("--api-key", opt->api_key,
                  "Require this API key (Authorization: Bearer KEY) on the router; an admin key "
                  "(also /metrics, /tokenize). Default: $TANDEM_API_KEY; neither: open");
  cmd->callback([opt] {
    const absl::Status s = Up(*opt);
    // Interrupted by the user: a clean stop.
    worker::ExitWithStatus("up", s.code() == absl::StatusCode::kCancelled ? absl::OkStatus() : s);
  });
}

}  // namespace tandem::router
