#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <signal.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <string_view>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/file_util.h"
#include "common/grpc_poller.h"
#include "common/listen_host.h"
#include "common/logging.h"
#include "common/metrics.h"
#include "common/signals.h"
#include "common/status_macros.h"
#include "common/tls.h"
#include "kvtransfer/loopback/fault_injecting_transport.h"
#include "kvtransfer/transport.h"
#include "orchestrator/http/http_server.h"
#include "worker/cli/commands.h"
#include "worker/engine/engine.h"
#include "worker/model/model_loader.h"
#include "worker/server/worker_metrics.h"
#include "worker/server/worker_service.h"

namespace tandem::worker {
namespace {

struct WorkerOptions {
  std::string model = "builtin:tiny";  // builtin:NAME (BuiltinModelNames()) or a checkpoint directory
  std::string served_model_name;       // name reported to clients; default: the model's
  std::string role = "both";           // prefill, decode or both
  std::string host = "127.0.0.1";
  int port = 50051;             // 0 picks a free port (see --ready-file)
  double drain_timeout_s = 30;  // SIGTERM: finish in-flight requests for this long at most
  int metrics_port = -1;        // plain HTTP /metrics, /healthz, /readyz; -1: none, 0: any
  std::string ready_file;       // written with "host:port" once serving
  std::string kv_cache_memory;  // "": 256MiB, or on a GPU 0.9 of its memory (gpu_memory_utilization)
  bool no_prefix_caching = false;
  std::string kv_transport = "none";             // none or ucx: moves KV blocks between workers
  std::string kv_transport_tls = "auto";         // ucx: auto, shm (one host) or tcp
  std::string kv_net_devices;                    // ucx tcp: devices, e.g. eth0 (empty: $UCX_NET_DEVICES or lo)
  int kv_receive_timeout_ms = 30000;             // decode: a reservation's wait for its KV (default)
  int kv_receive_timeout_max_ms = 60000;         // decode: the longest wait a request may ask for
  int64_t kv_reserve_max_blocks_per_caller = 0;  // decode: 0 = half the KV pool
  std::string kv_peer_allow;                     // prefill: CIDR blocks SEND may dial (empty: mode's default)
  std::string tls_ca, tls_cert, tls_key;         // mutual TLS identity (common/tls.h)
  bool insecure = false;                         // no TLS: trust every caller
  int kv_hold_timeout_ms = 10000;                // prefill: blocks held for a decode worker at most
  std::string kv_fallback = "local";             // decode, KV never came: local (prefill here) or error
  bool no_kv_checksums = false;                  // prefill: send no per-block checksums
  std::string kv_delivery = "pull";              // pull or push (KvHandoffConfig::push)
  int kv_staging_slots = kvtransfer::TransportOptions{}.staging_slots;  // ucx_staged: slots of the staging ring
  std::string kv_staging_slot_size =  // ucx_staged: bytes a slot (the transport's default, whole MiB)
      absl::StrCat(kvtransfer::TransportOptions{}.staging_slot_bytes >> 20, "MiB");
  int64_t kv_staging_slot_bytes = 0;     // parsed from kv_staging_slot_size
  int kv_quarantine_ms = 2000;           // decode: a failed transfer's blocks stay unused this long
  std::string kv_fault;                  // testing: faults injected into the KV transport
  std::string kv_domain;                 // "": the transport's (ModelInfo.kv_domain)
  std::string engine_kind = "real";      // real, or sim (simulated compute, for routing experiments)
  std::string device = "cpu";            // real: cpu, cuda or cuda:N
  std::string logits_dtype = "float32";  // real, --device cuda: float32 or bfloat16
  SimTiming sim;                         // --engine sim's timing model
  EngineConfig engine;
};

// The KV transport for disaggregation (null for "none") and the allocator of
// the engine's KV pool: the transport's own, where it has one, so that a peer
// on this host copies straight from the pool's shared memory (UCX 1.13: about
// 2x the pull rate of a pool it can only register, `tandem bench transfer
// --pool`).
struct KvTransport {
  std::unique_ptr<kvtransfer::Transport> transport;
  KvStorage::Allocator pool_allocator;
};

absl::StatusOr<KvTransport> MakeKvTransport(const WorkerOptions& opt) {
  if (opt.kv_transport == "none") return KvTransport{};
  ASSIGN_OR_RETURN(std::unique_ptr<kvtransfer::Transport> t,
                   kvtransfer::TransportRegistry::Builtin().Create(opt.kv_transport,
                                                                   {.transports = opt.kv_transport_tls,
                                                                    .net_devices = opt.kv_net_devices,
                                                                    .device = opt.engine.runner_options.device,
                                                                    .staging_slots = opt.kv_staging_slots,
                                                                    .staging_slot_bytes = opt.kv_staging_slot_bytes}));
  KvStorage::Allocator allocate;
  if (t->capabilities().own_pool_memory) {
    kvtransfer::Transport* raw = t.get();
    allocate = [raw](int64_t bytes) -> absl::StatusOr<KvMemory> {
      ASSIGN_OR_RETURN(void* data, raw->AllocatePool(bytes));
      if (data == nullptr) return absl::InternalError("the KV transport gave no pool memory");
      return KvMemory{.data = data, .location = MemoryLocation::kHost};
    };
  }
  if (!opt.kv_fault.empty()) {
    ASSIGN_OR_RETURN(kvtransfer::Faults faults, kvtransfer::ParseFaults(opt.kv_fault));
    auto faulty = std::make_unique<kvtransfer::FaultInjectingTransport>(std::move(t));
    faulty->SetFaults(faults);
    LOG(WARNING) << "KV transport faults injected: " << opt.kv_fault;
    t = std::move(faulty);
  }
  return KvTransport{.transport = std::move(t), .pool_allocator = std::move(allocate)};
}

// ModelInfo.kv_domain: --kv-domain, the transport's own domain, or both
// where the transport reaches only its host (cuda_ipc, UCX over shm): two
// hosts named one rack must not be paired over a transport that cannot
// leave either, so the named domain narrows to "NAME/host:<boot id>".
std::string KvDomain(const std::string& flag, const std::string& transport_domain) {
  if (flag.empty()) return transport_domain;
  if (transport_domain.empty()) return flag;
  return absl::StrCat(flag, "/", transport_domain);
}

// Who may call this worker and whom it dials: mutual TLS from --tls-*, or
// --insecure by name (never by omission).
absl::StatusOr<WorkerSecurity> MakeSecurity(const WorkerOptions& opt, std::optional<tls::TlsMaterial>* material) {
  const bool tls_given = !opt.tls_ca.empty() || !opt.tls_cert.empty() || !opt.tls_key.empty();
  if (opt.insecure && tls_given) {
    return absl::InvalidArgumentError("--insecure and --tls-ca/--tls-cert/--tls-key exclude each other");
  }
  if (!opt.insecure && !tls_given) {
    return absl::InvalidArgumentError(
        "no TLS identity: give --tls-ca, --tls-cert and --tls-key (mutual TLS with the router "
        "and the other workers; `tandem certs --out DIR` makes a CA and certificates), or "
        "--insecure to accept calls from anyone who can reach the port");
  }
  WorkerSecurity security;
  if (tls_given) {
    ASSIGN_OR_RETURN(tls::TlsMaterial m,
                     tls::LoadTlsMaterial({.ca = opt.tls_ca, .cert = opt.tls_cert, .key = opt.tls_key},
                                          {.ca = "--tls-ca", .cert = "--tls-cert", .key = "--tls-key"}));
    security.mutual_tls = true;
    security.channels = tls::ChannelFactory::Mutual(m);
    security.kv_peer_allow = PeerAllowList::Any();
    *material = std::move(m);
  }
  if (!opt.kv_peer_allow.empty()) {
    ASSIGN_OR_RETURN(security.kv_peer_allow, PeerAllowList::Parse(opt.kv_peer_allow, "--kv-peer-allow"));
  }
  return security;
}

// A graceful stop (SIGTERM from Kubernetes, Ctrl-C): the worker refuses new
// requests and reports NOT_SERVING, so routers move new work elsewhere, and
// waits up to `timeout_s` for what it runs, waits for, or holds for a decode
// worker to finish, and for those requests' streams to end (the server's
// shutdown would cancel a stream whose last message is still on its way, and
// a router cannot tell that from a failure). A second signal ends the wait.
void Drain(const Engine& engine, WorkerService& service, grpc::Server& server, int sig, double timeout_s) {
  service.StartDrain();
  if (grpc::HealthCheckServiceInterface* health = server.GetHealthCheckService()) {
    health->SetServingStatus(false);  // grpc.health.v1: NOT_SERVING
  }
  const auto busy = [&engine, &service] {
    const LoadSnapshot l = engine.GetLoad();
    return l.running + l.waiting + l.reserved + l.prefilled + service.open_generate_streams();
  };
  LOG(INFO) << "signal " << sig << ": draining (" << busy() << " requests in flight, at most " << timeout_s
            << " s; a second signal stops at once)";
  const auto deadline =
      std::chrono::steady_clock::now() +
      std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(timeout_s));
  int64_t left = busy();
  while (left > 0 && std::chrono::steady_clock::now() < deadline) {
    if (const int again = WaitForSignalFor(50); again != 0) {
      LOG(WARNING) << "signal " << again << " while draining: stopping now";
      break;
    }
    left = busy();
  }
  if (left > 0) {
    LOG(WARNING) << "stopping with " << left << " requests still in flight (aborted)";
  } else {
    LOG(INFO) << "drained: shutting down";
  }
}

// Plain HTTP beside the gRPC port, for Prometheus and Kubernetes probes
// (which cannot present the client certificate mutual TLS asks of callers).
absl::StatusOr<std::unique_ptr<http::HttpServer>> StartMetricsServer(const std::string& host, int port,
                                                                     const MetricsRegistry& registry,
                                                                     const WorkerService& service) {
  auto server = std::make_unique<http::HttpServer>(http::HttpServer::Options{
      .host = host, .port = port, .threads = 1, .max_body_bytes = 1024, .max_connections = 64});
  using Writer = std::shared_ptr<http::ResponseWriter>;
  server->Route("GET", "/metrics", [&registry](const http::Request&, Writer w) {
    w->Send(200, kPrometheusTextContentType, registry.Render());
  });
  server->Route("GET", "/healthz", [](const http::Request&, Writer w) { w->Send(200, "text/plain", "ok\n"); });
  server->Route("GET", "/readyz", [&service](const http::Request&, Writer w) {
    if (service.serving()) {
      w->Send(200, "text/plain", "ready\n");
    } else {
      w->Send(503, "text/plain", service.draining() ? "draining\n" : "not running\n");
    }
  });
  RETURN_IF_ERROR(server->Start());
  return server;
}

absl::Status RunWorker(WorkerOptions opt) {
  ASSIGN_OR_RETURN(const WorkerRole role, ParseWorkerRole(opt.role));
  if (opt.kv_fallback != "local" && opt.kv_fallback != "error") {
    return absl::InvalidArgumentError(
        absl::StrFormat("--kv-fallback must be local or error, got '%s'", opt.kv_fallback));
  }
  if (opt.kv_receive_timeout_ms < 1 || opt.kv_hold_timeout_ms < 1) {
    return absl::InvalidArgumentError("--kv-receive-timeout-ms and --kv-hold-timeout-ms must be >= 1");
  }
  if (opt.kv_receive_timeout_max_ms < opt.kv_receive_timeout_ms) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--kv-receive-timeout-max-ms (%d) must be at least --kv-receive-timeout-ms (%d)",
                        opt.kv_receive_timeout_max_ms, opt.kv_receive_timeout_ms));
  }
  if (opt.kv_reserve_max_blocks_per_caller < 0) {
    return absl::InvalidArgumentError("--kv-reserve-max-blocks-per-caller must be >= 0 (0: half the KV pool)");
  }
  const kvtransfer::TransportCapabilities* caps =
      kvtransfer::TransportRegistry::Builtin().Capabilities(opt.kv_transport);
  if (caps != nullptr && caps->needs_pairing && opt.kv_delivery != "push") {
    // The receiver takes part in every transfer: only the push handshake
    // (JOIN / PUSHED) has it post its receive.
    return absl::InvalidArgumentError(
        absl::StrFormat("--kv-transport %s sends and receives in pairs: it needs --kv-delivery push (got %s)",
                        opt.kv_transport, opt.kv_delivery));
  }
  if (absl::StatusOr<int64_t> slot = ParseByteSize(opt.kv_staging_slot_size); slot.ok()) {
    opt.kv_staging_slot_bytes = *slot;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("--kv-staging-slot-size: ", slot.status().message()));
  }
  const kvtransfer::TransportOptions transport_defaults;
  if ((opt.kv_staging_slots != transport_defaults.staging_slots ||
       opt.kv_staging_slot_bytes != transport_defaults.staging_slot_bytes) &&
      opt.kv_transport != "ucx_staged") {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--kv-staging-slots and --kv-staging-slot-size apply to --kv-transport ucx_staged only (got --kv-transport %s)",
        opt.kv_transport));
  }
  if (opt.kv_staging_slots < 2 || opt.kv_staging_slots > 1024 || opt.kv_staging_slot_bytes < (int64_t{64} << 10)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--kv-staging-slots must be in [2, 1024] and --kv-staging-slot-size at least 64KiB (got %d, %s)",
        opt.kv_staging_slots, opt.kv_staging_slot_size));
  }
  if (opt.kv_delivery == "push") {
    if (caps == nullptr || !caps->push) {  // "none" has no capabilities
      return absl::InvalidArgumentError(absl::StrFormat(
          "--kv-delivery push needs a --kv-transport that writes into a peer's pool (got --kv-transport %s)",
          opt.kv_transport));
    }
  }
  opt.engine.local_prefill_fallback = opt.kv_fallback == "local";
  if (opt.kv_quarantine_ms < 0) return absl::InvalidArgumentError("--kv-quarantine-ms must be >= 0");
  if (opt.kv_domain.size() > 128 ||
      opt.kv_domain.find_first_not_of("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._:-") !=
          std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--kv-domain must be at most 128 letters, digits and . _ : -, got '%s'", opt.kv_domain));
  }
  opt.engine.transfer_quarantine_s = opt.kv_quarantine_ms / 1000.0;
  const bool kv_memory_given = !opt.kv_cache_memory.empty();
  ASSIGN_OR_RETURN(opt.engine.kv_cache_bytes, ParseByteSize(kv_memory_given ? opt.kv_cache_memory : "256MiB"));
  opt.engine.enable_prefix_caching = !opt.no_prefix_caching;
  // The GPU runner's switches would be ignored elsewhere: refused, by name.
  if (opt.device.rfind("cuda", 0) != 0) {
    const RunnerOptions& r = opt.engine.runner_options;
    const std::pair<bool, const char*> gpu_only[] = {{!r.cuda_graphs, "--enforce-eager"},
                                                     {r.batch_invariant, "--batch-invariant"},
                                                     {!r.gpu_sampling, "--host-sampling"}};
    for (const auto& [set, flag] : gpu_only) {
      if (set) {
        return absl::InvalidArgumentError(
            absl::StrFormat("%s applies to --device cuda only (this worker runs on --device %s)", flag, opt.device));
      }
    }
  }
  // The runner: "real" is the forward pass on --device, "sim" the timing model.
  if (opt.engine_kind == "sim") {
    if (opt.device != "cpu") {
      return absl::InvalidArgumentError(absl::StrFormat(
          "--device %s: the simulator (--engine sim) computes nothing; --device is for --engine real", opt.device));
    }
    opt.engine.runner = "sim";
    opt.engine.runner_options.sim = opt.sim;
    RETURN_IF_ERROR(SelectLogitsDtype(opt.logits_dtype, "sim", opt.device, &opt.engine.runner_options));
  } else if (opt.engine_kind == "real") {
    RETURN_IF_ERROR(SelectDevice(opt.device, &opt.engine.runner, &opt.engine.runner_options));
    RETURN_IF_ERROR(SelectLogitsDtype(opt.logits_dtype, opt.engine.runner, opt.device, &opt.engine.runner_options));
    // Checked here, before the model loads: the transport must move the
    // memory the pool is in (a GPU's, or the host's).
    if (opt.kv_transport != "none") {
      const kvtransfer::TransportCapabilities* caps =
          kvtransfer::TransportRegistry::Builtin().Capabilities(opt.kv_transport);
      const bool gpu = opt.engine.runner != "cpu";
      if (caps != nullptr && gpu && !caps->Moves(kvtransfer::MemoryType::kCuda)) {
        return absl::InvalidArgumentError(
            absl::StrFormat("--device %s keeps the KV cache in GPU memory, which --kv-transport %s cannot move: use "
                            "--kv-transport cuda_ipc (GPUs of one host), nccl (two GPUs) or none",
                            opt.device, opt.kv_transport));
      }
      if (caps != nullptr && !gpu && !caps->Moves(kvtransfer::MemoryType::kHost)) {
        return absl::InvalidArgumentError(
            absl::StrFormat("--kv-transport %s moves GPU memory, and --device %s keeps the KV cache in host memory: "
                            "use --kv-transport ucx, or --device cuda",
                            opt.kv_transport, opt.device));
      }
    }
    // The NCCL transport keeps a receive posted on the GPU while a hand-off
    // is open, and it finishes only when the peer sends. With CUDA's default
    // lazy module loading, the first launch of a kernel (ours at a new
    // shape, a cuBLASLt product's, NCCL's) loads it, and loading waits for
    // the whole device: such a step would stall until the next push came
    // (CudaRunnerTest.StepsNeverWaitForOtherStreamsWork, on an H200). So
    // this worker loads every kernel when CUDA starts, unless the operator
    // chose a mode (before anything here initializes CUDA).
    if (opt.engine.runner == "cuda" && opt.kv_transport == "nccl") {
      const char* mode = std::getenv("CUDA_MODULE_LOADING");
      if (mode == nullptr) {
        setenv("CUDA_MODULE_LOADING", "EAGER", 0);
      } else if (std::string_view(mode) != "EAGER") {
        LOG(WARNING) << "CUDA_MODULE_LOADING=" << mode
                     << " with --kv-transport nccl: a step that loads a kernel may wait for a posted receive until "
                        "its peer sends (EAGER avoids it)";
      }
    }
    // A GPU worker's KV cache takes what the weights and activations leave of
    // 0.9 of the GPU's memory (vLLM's default), unless a size is given.
    if (opt.engine.runner != "cpu" && !kv_memory_given && opt.engine.gpu_memory_utilization == 0) {
      opt.engine.gpu_memory_utilization = 0.9;
    }
  } else {
    return absl::InvalidArgumentError(absl::StrFormat("--engine must be real or sim, got '%s'", opt.engine_kind));
  }
  RETURN_IF_ERROR(opt.engine.Validate());
  std::optional<tls::TlsMaterial> tls_material;
  ASSIGN_OR_RETURN(WorkerSecurity security, MakeSecurity(opt, &tls_material));

  // SIGTERM/SIGINT start a graceful shutdown whichever thread receives them
  // (OpenBLAS starts threads before main); a second one exits at once.
  RETURN_IF_ERROR(InstallSignalHandlers({SIGINT, SIGTERM}));

  LOG(INFO) << "loading model " << opt.model;
  ASSIGN_OR_RETURN(LoadedModel model, LoadModel(opt.model));
  if (!opt.served_model_name.empty()) model.name = opt.served_model_name;
  // The transport comes first: it may provide the KV pool's memory, so it
  // is destroyed after the engine.
  ASSIGN_OR_RETURN(KvTransport kv_transport, MakeKvTransport(opt));
  ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine,
                   Engine::Create(opt.engine, std::move(model), kv_transport.pool_allocator));
  kvtransfer::Transport* transport = kv_transport.transport.get();
  if (transport != nullptr) {
    RETURN_IF_ERROR(transport->RegisterPool(engine->pool_layout(), engine->kv_data()));
  }
  engine->Start();
  const int64_t caller_cap = opt.kv_reserve_max_blocks_per_caller > 0
                                 ? opt.kv_reserve_max_blocks_per_caller
                                 : std::max<int64_t>(1, engine->total_blocks() / 2);
  const KvHandoffConfig kv{.receive_timeout = std::chrono::milliseconds(opt.kv_receive_timeout_ms),
                           .receive_timeout_max = std::chrono::milliseconds(opt.kv_receive_timeout_max_ms),
                           .max_reserved_blocks_per_caller = caller_cap,
                           .hold_timeout = std::chrono::milliseconds(opt.kv_hold_timeout_ms),
                           .checksums = !opt.no_kv_checksums,
                           .push = opt.kv_delivery == "push",
                           .domain = KvDomain(opt.kv_domain, transport != nullptr ? transport->Domain() : "")};
  // The standard grpc.health.v1 service (SERVING; NOT_SERVING once draining),
  // for load balancers and Kubernetes' gRPC probes where TLS is off.
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  int bound_port = 0;
  builder.AddListeningPort(
      absl::StrFormat("%s:%d", opt.host, opt.port),
      tls_material.has_value() ? tls::ServerCredentials(*tls_material) : grpc::InsecureServerCredentials(),
      &bound_port);
  builder.SetMaxReceiveMessageSize(64 << 20);
  // Routers ping every few seconds (keepalive) to notice a frozen worker
  // fast; gRPC's server default would answer pings that often, after two, by
  // closing the connection (too_many_pings).
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 1000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  std::unique_ptr<grpc::ServerCompletionQueue> cq = builder.AddCompletionQueue();
  // Declared after the transport: destroyed first, so no transfer callback
  // outlives it.
  const std::string kv_peers = security.kv_peer_allow.ToString();
  WorkerService service(engine.get(), role, cq.get(), transport, kv, std::move(security));
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  // Every call of this process runs on this one thread (grpc_poller.h);
  // destroyed first, after the server's shutdown: it drains the queue.
  GrpcPoller poller(cq.get());
  if (server == nullptr || bound_port == 0) {
    engine->Stop();
    return absl::UnavailableError(absl::StrFormat("cannot listen on %s:%d", opt.host, opt.port));
  }
  service.Serve();
  MetricsRegistry metrics;
  RegisterWorkerMetrics(metrics, *engine, service);
  std::unique_ptr<http::HttpServer> metrics_server;
  if (opt.metrics_port >= 0) {
    absl::StatusOr<std::unique_ptr<http::HttpServer>> started =
        StartMetricsServer(opt.host, opt.metrics_port, metrics, service);
    if (!started.ok()) {
      engine->Stop();
      server->Shutdown(std::chrono::system_clock::now());
      service.Shutdown();
      return absl::UnavailableError(absl::StrCat("--metrics-port: ", started.status().message()));
    }
    metrics_server = *std::move(started);
    LOG(INFO) << "metrics and probes on http://" << opt.host << ":" << metrics_server->port()
              << " (/metrics, /healthz, /readyz)";
  }
  if (engine->simulated()) {
    LOG(WARNING) << absl::StrFormat(
        "SIMULATED engine (--engine sim): compute is a timing model (step %g ms + %g us per "
        "prefill token + %g us per decoding sequence + %g ns per attended KV token); outputs are "
        "not the model's",
        opt.sim.step_ms, opt.sim.prefill_us_per_token, opt.sim.decode_us_per_seq, opt.sim.context_ns_per_token);
  }
  if (opt.insecure) {
    LOG(WARNING) << absl::StrFormat(
        "INSECURE (--insecure): no TLS; any process that can reach %s:%d may call this worker "
        "(generate, read other users' prompt tokens from its KV events, clear its cache, hold "
        "its KV blocks); its KV hand-offs dial only %s (--kv-peer-allow)",
        opt.host, bound_port, kv_peers);
  } else {
    LOG(INFO) << "mutual TLS: callers need a certificate of the CA in " << opt.tls_ca
              << "; KV hand-offs dial workers of that CA" << (kv_peers == "any" ? "" : " in ")
              << (kv_peers == "any" ? "" : kv_peers);
  }
  const LoadSnapshot load = engine->GetLoad();
  LOG(INFO) << "worker " << service.instance_id() << " (" << opt.role << ") serving " << engine->model_name() << " on "
            << opt.host << ":" << bound_port << ", " << load.total_blocks << " KV blocks of " << opt.engine.block_size
            << " tokens, context " << engine->max_model_len();
  if (!opt.ready_file.empty()) {
    RETURN_IF_ERROR(WriteFileAtomically(opt.ready_file, absl::StrFormat("%s:%d\n", opt.host, bound_port)));
  }

  const int sig = WaitForSignal();
  Drain(*engine, service, *server, sig, opt.drain_timeout_s);
  engine->Stop();  // aborts what is still in flight, so those streams finish at once
  // gRPC waits out the whole deadline while any client keeps a connection
  // open, even an idle one; every generation has ended already, so the
  // deadline only bounds the KV event streams, which are cancelled.
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
  service.Shutdown();
  if (metrics_server != nullptr) metrics_server->Stop();
  return absl::OkStatus();
}

}  // namespace

void ExitWithStatus(const char* command, const absl::Status& status) {
  if (status.ok()) std::exit(0);
  std::fprintf(stderr, "tandem %s: %s\n", command, std::string(status.message()).c_str());
  std::exit(1);
}

absl::StatusOr<int64_t> ParseByteSize(const std::string& text) {
  std::string t = absl::AsciiStrToLower(text);
  struct Unit {
    const char* suffix;
    double scale;
  };
  static const Unit kUnits[] = {{"kib", 1024.0},     {"mib", 1048576.0}, {"gib", 1073741824.0}, {"kb", 1e3},
                                {"mb", 1e6},         {"gb", 1e9},        {"k", 1024.0},         {"m", 1048576.0},
                                {"g", 1073741824.0}, {"b", 1.0}};
  double scale = 1.0;
  for (const Unit& u : kUnits) {
    if (absl::EndsWith(t, u.suffix)) {
      t = t.substr(0, t.size() - std::string(u.suffix).size());
      scale = u.scale;
      break;
    }
  }
  double v = 0;
  if (!absl::SimpleAtod(t, &v) || !(v > 0) || !std::isfinite(v * scale) || v * scale > 9e18) {
    return absl::InvalidArgumentError(absl::StrFormat("'%s' is not a size (e.g. 512MiB, 2GiB, 1000000)", text));
  }
  return static_cast<int64_t>(v * scale);
}

void AddWorkerCommand(CLI::App& app) {
  auto opt = std::make_shared<WorkerOptions>();
  CLI::App* cmd = app.add_subcommand("worker", "Serve the worker gRPC API (an inference engine)");
  cmd->add_option("--model", opt->model,
                  "builtin:NAME (tiny, small, llama-3.2-1b, llama-3.1-8b) or a Hugging Face checkpoint directory")
      ->capture_default_str();
  cmd->add_option("--served-model-name", opt->served_model_name, "Model name reported to clients");
  cmd->add_option("--role", opt->role, "prefill, decode or both")->capture_default_str();
  cmd->add_option("--host", opt->host,
                  absl::StrCat("Address to listen on (default: $", kListenHostEnv, ", else 127.0.0.1)"))
      ->envname(kListenHostEnv)
      ->capture_default_str();
  cmd->add_option("--port", opt->port, "gRPC port (0: pick a free one)")->capture_default_str();
  cmd->add_option("--ready-file", opt->ready_file, "Write host:port here once serving");
  cmd->add_option("--kv-cache-memory", opt->kv_cache_memory,
                  "Memory budget of the KV cache (default 256MiB; with --device cuda and neither this nor "
                  "--gpu-memory-utilization, the KV cache gets what the model leaves of 0.9 of the GPU's memory)");
  cmd->add_option("--engine", opt->engine_kind,
                  "real, or sim: a simulator (real scheduler, KV pool, prefix cache and events; "
                  "compute replaced by a timing model) for routing experiments at scale")
      ->capture_default_str();
  cmd->add_option("--gpu-memory-utilization", opt->engine.gpu_memory_utilization,
                  "--device cuda: the fraction of the GPU's memory this worker may use; the KV cache gets what the "
                  "weights and activations leave (0: --kv-cache-memory decides; neither given: 0.9)")
      ->capture_default_str();
  cmd->add_flag_function(
      "--enforce-eager", [opt](int64_t) { opt->engine.runner_options.cuda_graphs = false; },
      "--device cuda: launch every decode step's kernels from the host instead of replaying CUDA graphs");
  cmd->add_flag_function(
      "--host-sampling", [opt](int64_t) { opt->engine.runner_options.gpu_sampling = false; },
      "--device cuda: sample rows on the host (SampleToken on threads) instead of the GPU; the same tokens");
  cmd->add_option("--logits-dtype", opt->logits_dtype,
                  "--device cuda: float32, or bfloat16: the logits rounded to bfloat16 as transformers and vLLM leave "
                  "them (their logprobs' precision)")
      ->capture_default_str();
  cmd->add_flag("--batch-invariant", opt->engine.runner_options.batch_invariant,
                "--device cuda: a sequence's tokens do not depend on what it is batched with (single-pass matrix "
                "products, fixed attention splits; slower decode at small batches)");
  cmd->add_option("--device", opt->device,
                  "Where the model runs: cpu, cuda (GPU 0) or cuda:N (bfloat16 weights and KV cache in GPU memory; "
                  "--kv-transport cuda_ipc or none)")
      ->capture_default_str();
  cmd->add_option("--sim-step-ms", opt->sim.step_ms, "sim: fixed cost of a step (ms)")->capture_default_str();
  cmd->add_option("--sim-prefill-us-per-token", opt->sim.prefill_us_per_token,
                  "sim: cost per prompt token computed (us)")
      ->capture_default_str();
  cmd->add_option("--sim-decode-us-per-seq", opt->sim.decode_us_per_seq,
                  "sim: cost per sequence decoding in a step (us)")
      ->capture_default_str();
  cmd->add_option("--sim-context-ns-per-token", opt->sim.context_ns_per_token,
                  "sim: cost per KV token attended in a step (ns)")
      ->capture_default_str();
  cmd->add_option("--block-size", opt->engine.block_size, "Tokens per KV block")->capture_default_str();
  cmd->add_option("--max-batched-tokens", opt->engine.max_batched_tokens,
                  "Tokens per engine step (the prefill chunk budget)")
      ->capture_default_str();
  cmd->add_option("--max-running", opt->engine.max_running, "Sequences decoding at once")->capture_default_str();
  cmd->add_option("--max-waiting", opt->engine.max_waiting, "Queued requests before RESOURCE_EXHAUSTED")
      ->capture_default_str();
  cmd->add_option("--watermark", opt->engine.watermark, "Fraction of KV blocks admission keeps free")
      ->capture_default_str();
  cmd->add_option("--max-model-len", opt->engine.max_model_len,
                  "Context limit (0: the model's; with --engine sim it may exceed it)")
      ->capture_default_str();
  cmd->add_flag("--no-prefix-caching", opt->no_prefix_caching, "Disable the prefix cache");
  cmd->add_option("--kv-transport", opt->kv_transport,
                  "KV block transport between workers: none, ucx (host memory, across hosts), ucx_staged (any "
                  "pool through host staging, send/receive: GPU memory across hosts; needs --kv-delivery push), "
                  "cuda_ipc (GPU memory, GPUs of one host) or nccl (GPU memory between two GPUs, send/receive; "
                  "needs --kv-delivery push; libnccl.so.2 from the loader path or $TANDEM_NCCL; the worker then "
                  "loads every CUDA kernel at start: CUDA_MODULE_LOADING=EAGER unless set)")
      ->capture_default_str();
  cmd->add_option("--kv-transport-tls", opt->kv_transport_tls, "UCX transports: auto, shm (one host) or tcp")
      ->capture_default_str();
  cmd->add_option("--kv-net-devices", opt->kv_net_devices,
                  "UCX tcp: network devices, e.g. eth0 (default: $UCX_NET_DEVICES, else lo)");
  cmd->add_option("--kv-staging-slots", opt->kv_staging_slots,
                  "ucx_staged: host staging slots on each side (at least 2: sends keep one for receives)")
      ->capture_default_str();
  cmd->add_option("--kv-staging-slot-size", opt->kv_staging_slot_size,
                  "ucx_staged: bytes a staging slot (whole KV blocks; at least one block, at least 64KiB)")
      ->capture_default_str();
  cmd->add_option("--kv-receive-timeout-ms", opt->kv_receive_timeout_ms,
                  "Decode: how long a reservation waits for its KV (unless the request says)")
      ->capture_default_str();
  cmd->add_option("--kv-receive-timeout-max-ms", opt->kv_receive_timeout_max_ms,
                  "Decode: the longest a reservation may wait; a request asking more is capped")
      ->capture_default_str();
  cmd->add_option("--kv-reserve-max-blocks-per-caller", opt->kv_reserve_max_blocks_per_caller,
                  "Decode: KV blocks one caller's waiting reservations may hold (the certificate's "
                  "name with TLS, the IP address without); beyond: RESOURCE_EXHAUSTED. 0: half "
                  "the KV pool")
      ->capture_default_str();
  cmd->add_option("--kv-peer-allow", opt->kv_peer_allow,
                  "Prefill: CIDR blocks a SEND request's decode_address may be in, comma-separated, "
                  "or 'any' (default: any with TLS, where the peer must prove a worker "
                  "certificate; 127.0.0.0/8,::1 with --insecure)");
  cmd->add_option("--tls-ca", opt->tls_ca,
                  "Mutual TLS: the cluster CA's certificate (PEM); callers and called workers "
                  "must hold certificates it issued")
      ->group("Security");
  cmd->add_option("--tls-cert", opt->tls_cert,
                  "Mutual TLS: this worker's certificate (PEM, worker role; `tandem certs`)")
      ->group("Security");
  cmd->add_option("--tls-key", opt->tls_key, "Mutual TLS: this worker's private key (PEM)")->group("Security");
  cmd->add_flag("--insecure", opt->insecure,
                "No TLS: accept calls from anyone who can reach the port (tests, a trusted "
                "host); required when no --tls-* is given")
      ->group("Security");
  cmd->add_option("--kv-hold-timeout-ms", opt->kv_hold_timeout_ms,
                  "Prefill: how long prefilled blocks wait for the decode worker to take them")
      ->capture_default_str();
  cmd->add_option("--kv-fallback", opt->kv_fallback, "Decode, when the KV never comes: local (prefill here) or error")
      ->capture_default_str();
  cmd->add_option("--kv-quarantine-ms", opt->kv_quarantine_ms,
                  "Decode: blocks of a failed KV transfer stay out of use this long (late bytes)")
      ->capture_default_str();
  cmd->add_flag("--no-kv-checksums", opt->no_kv_checksums, "Prefill: send no per-block checksums with the KV");
  cmd->add_option("--kv-delivery", opt->kv_delivery,
                  "How the KV moves: pull (the decode worker reads it) or push (the prefill worker writes it "
                  "into the reservation once the decode worker joined; both workers must say push, else it "
                  "is pulled)")
      ->check(CLI::IsMember({"pull", "push"}))
      ->capture_default_str();
  cmd->add_option("--kv-domain", opt->kv_domain,
                  "Where this worker's KV reaches, for the router's pairing of prefill and decode workers: only "
                  "workers of one domain hand each other KV (e.g. a rack or an NVLink domain; letters, digits and "
                  ". _ : -). Default: the transport's (this host for cuda_ipc and UCX over shm; none over tcp); "
                  "with a transport bound to one host, the named domain is narrowed to this host within it");
  cmd->add_option("--kv-fault", opt->kv_fault,
                  "Testing: inject KV transport faults (drop, corrupt, fail_submit, fail_pair, delay_ms=N, "
                  "fail_after_blocks=N; comma-separated)")
      ->group("Testing");
  cmd->add_option("--block-hash-seed", opt->engine.block_hash_seed, "Parent hash of a sequence's first KV block")
      ->capture_default_str();
  cmd->add_option("--threads", opt->engine.threads, "BLAS threads (0: all cores)")->capture_default_str();
  cmd->add_option("--metrics-port", opt->metrics_port,
                  "Plain HTTP port (on --host) for Prometheus /metrics and the probes /healthz "
                  "(alive) and /readyz (serving: 503 while loading or draining); -1: none, 0: any")
      ->check(CLI::Range(-1, 65535))
      ->capture_default_str();
  cmd->add_option("--drain-timeout", opt->drain_timeout_s,
                  "Seconds a SIGTERM waits for in-flight requests (new ones are refused with "
                  "UNAVAILABLE, Health says NOT_SERVING) before stopping; a second signal stops "
                  "at once; 0: stop at once")
      ->check(CLI::Range(0.0, 86400.0))
      ->capture_default_str();
  cmd->add_option("--log-stats-interval", opt->engine.log_stats_interval_s,
                  "Seconds between engine stats lines while busy (0: none)")
      ->capture_default_str();
  cmd->callback([opt] { ExitWithStatus("worker", RunWorker(*opt)); });
}

}  // namespace tandem::worker
