// `tandem bench attention`: times the CUDA paged-attention kernels
// (kernels/paged_attention.h, backend kCuda) on the shapes of issue 19, with
// baselines measured in the same run:
//   - prefill (causal and not): batch x seqlen = --tokens, head dim 128 with
//     16 heads and 64 with 32, TFLOP/s counted as FlashAttention counts them
//     (4*B*H*S*S*D, halved when causal), against PyTorch's
//     scaled_dot_product_attention with its cuDNN and flash backends on dense
//     contiguous tensors of the same shapes;
//   - decode (one query per sequence, GQA 8:1 with Llama-3-8B and -70B head
//     counts): achieved GB/s of KV read, against a device-to-device copy
//     (bytes read + written) and torch SDPA on the same shapes.
// Inputs are random bf16 (never zeros) in cudaMalloc'd pools read through
// shuffled block tables; each case warms up, then times every call with CUDA
// events and reports the median, rotating several input sets where one set
// would sit in L2. The torch numbers come from scripts/bench_attention_torch.py,
// run as a subprocess after our buffers are freed; without torch the table says
// so and the ratios stay blank. Without a usable GPU the command exits 2.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "kernels/paged_attention.h"
#include "worker/cli/commands.h"
#include "worker/cli/python_helper.h"

#if TANDEM_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace tandem::worker {
namespace {

using nlohmann::json;
namespace k = tandem::kernels;

struct AttnBenchOptions {
  std::string mode = "all";
  // Prefill.
  std::vector<int> seqlens = {1024, 2048, 4096, 8192, 16384};
  int tokens = 16384;
  std::vector<int> head_dims = {128, 64};
  int heads = 0;  // 0: 2048 / head_dim (16 at 128, 32 at 64)
  std::string causal = "both";
  int gqa = 1;
  int page_size = 64;
  double max_call_ms = 0;  // 0: no limit
  // Decode.
  std::vector<int> batches = {1, 4, 16, 64, 256};
  std::vector<int> contexts = {1024, 8192, 32768, 131072};
  std::vector<std::string> models = {"8b", "70b"};
  std::vector<int> decode_page_sizes = {16, 64};
  double max_kv_gib = 32;
  // Timing.
  int warmup = 3;
  int reps = 50;
  double max_case_seconds = 1.0;
  int64_t copy_bytes = int64_t{1} << 30;
  // Baselines and output.
  std::string torch_python = "python3";
  std::string torch_script;  // default: scripts/bench_attention_torch.py, found near cwd or the binary
  bool no_torch = false;
  std::string json_path;
};

constexpr int kExitNoGpu = 2;

std::string CommandLine() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  std::string raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::string> args;
  std::string cur;
  for (char c : raw) {
    if (c == '\0') {
      args.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  if (!cur.empty()) args.push_back(cur);
  return absl::StrJoin(args, " ");
}

absl::Status Validate(const AttnBenchOptions& o) {
  for (int s : o.seqlens) {
    if (s <= 0 || o.tokens % s != 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("--seqlens: %d does not divide --tokens %d (batch x seqlen = tokens)", s, o.tokens));
    }
  }
  for (int d : o.head_dims) {
    const int h = o.heads > 0 ? o.heads : 2048 / d;
    if (h % o.gqa != 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("--gqa: %d does not divide the %d query heads of head dim %d", o.gqa, h, d));
    }
  }
  if (o.copy_bytes < (int64_t{1} << 20)) {
    return absl::InvalidArgumentError("--copy-bytes: at least 1MiB (the issue asks for >= 1GiB)");
  }
  return absl::OkStatus();
}

int QHeadsOf(const std::string& model) { return model == "70b" ? 64 : 32; }
constexpr int kDecodeKvHeads = 8;
constexpr int kDecodeHeadDim = 128;

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Runs the torch helper on `shapes`; its JSON, or {"available": false, "why": ...}.
json RunTorch(const AttnBenchOptions& o, const json& shapes) {
  if (o.no_torch) return {{"available", false}, {"why", "--no-torch"}};
  const std::string script = FindHelperScript(o.torch_script, "bench_attention_torch.py");
  std::error_code ec;
  if (!std::filesystem::exists(script, ec)) {
    return {{"available", false},
            {"why", absl::StrCat("the torch helper ", script, " was not found (--torch-script)")}};
  }
  char tmpl[] = "/tmp/tandem-bench-attention.XXXXXX";
  const int fd = mkstemp(tmpl);
  if (fd < 0) return {{"available", false}, {"why", "mkstemp failed"}};
  close(fd);
  const std::string path = tmpl;
  {
    std::ofstream out(path);
    out << shapes.dump();
  }
  // stderr passes through (progress); stdout is the JSON answer.
  const std::string cmd = absl::StrCat(o.torch_python, " ", ShellQuote(script), " --shapes ", ShellQuote(path));
  std::fprintf(stderr, "bench attention: torch baselines: %s\n", cmd.c_str());
  json answer = RunJsonHelper(cmd);
  std::filesystem::remove(path, ec);
  return answer;
}

const json* FindById(const json& list, int id) {
  if (!list.is_array()) return nullptr;
  for (const json& e : list) {
    if (e.contains("id") && e["id"] == id) return &e;
  }
  return nullptr;
}

// Milliseconds of one torch backend's result, if it ran.
std::optional<double> TorchMs(const json* entry, const std::string& backend) {
  if (entry == nullptr || !entry->contains(backend)) return std::nullopt;
  const json& b = (*entry)[backend];
  if (!b.is_object() || !b.contains("ms") || !b["ms"].is_number()) return std::nullopt;
  return b["ms"].get<double>();
}

std::string Cell(std::optional<double> v, int precision) {
  return v ? absl::StrFormat("%.*f", precision, *v) : std::string("-");
}

struct Timing {
  double median_ms = 0;
  double min_ms = 0;
  int reps = 0;
};

#if TANDEM_HAVE_CUDA

absl::Status Cuda(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrFormat("%s: %s", what, cudaGetErrorString(e)));
}

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { Free(); }
  absl::Status Alloc(int64_t bytes) {
    Free();
    if (bytes <= 0) bytes = 256;
    RETURN_IF_ERROR(
        Cuda(cudaMalloc(&p_, static_cast<size_t>(bytes)), absl::StrFormat("cudaMalloc(%d bytes)", bytes).c_str()));
    bytes_ = bytes;
    return absl::OkStatus();
  }
  void Free() {
    if (p_ != nullptr) cudaFree(p_);
    p_ = nullptr;
    bytes_ = 0;
  }
  template <typename T = void>
  T* get() const {
    return static_cast<T*>(p_);
  }
  int64_t bytes() const { return bytes_; }

 private:
  void* p_ = nullptr;
  int64_t bytes_ = 0;
};

// Fills `bytes` of device memory with random bfloat16 values in [-1, 1]
// (none zero): a 16 MiB random host chunk, then doubling device copies.
absl::Status FillRandomBf16(void* dst, int64_t bytes, uint64_t seed, cudaStream_t stream) {
  const int64_t chunk = std::min<int64_t>(bytes, int64_t{16} << 20) / 2 * 2;
  std::vector<uint16_t> host(chunk / 2);
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (uint16_t& h : host) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    float f = static_cast<float>((x >> 40) & 0xFFFFFF) / float(1 << 23) - 1.0f;  // [-1, 1)
    if (std::fabs(f) < 1e-3f) f = 0.5f;
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u += 0x7FFF + ((u >> 16) & 1);  // round to nearest even
    h = static_cast<uint16_t>(u >> 16);
  }
  auto* d = static_cast<char*>(dst);
  RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(d, host.data(), chunk, cudaMemcpyHostToDevice, stream), "fill: upload"));
  int64_t done = chunk;
  while (done < bytes) {
    const int64_t n = std::min(done, bytes - done);
    RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(d + done, d, n, cudaMemcpyDeviceToDevice, stream), "fill: copy"));
    done += n;
  }
  return Cuda(cudaStreamSynchronize(stream), "fill: synchronize");
}

// Warms up, then times `call(set)` for each repetition with its own pair of
// events, rotating the input sets; the median of the per-call times.
absl::StatusOr<Timing> TimeCalls(const std::function<absl::Status(int)>& call, int sets, const AttnBenchOptions& o,
                                 cudaStream_t stream) {
  cudaEvent_t a, b;
  RETURN_IF_ERROR(Cuda(cudaEventCreate(&a), "cudaEventCreate"));
  RETURN_IF_ERROR(Cuda(cudaEventCreate(&b), "cudaEventCreate"));
  // One timed call to size the run.
  RETURN_IF_ERROR(Cuda(cudaEventRecord(a, stream), "cudaEventRecord"));
  RETURN_IF_ERROR(call(0));
  RETURN_IF_ERROR(Cuda(cudaEventRecord(b, stream), "cudaEventRecord"));
  RETURN_IF_ERROR(Cuda(cudaEventSynchronize(b), "cudaEventSynchronize"));
  float first = 0;
  RETURN_IF_ERROR(Cuda(cudaEventElapsedTime(&first, a, b), "cudaEventElapsedTime"));
  const double budget_ms = o.max_case_seconds * 1e3;
  const int fit = static_cast<int>(budget_ms / std::max(1e-3, double(first)));
  const int warmup = std::clamp(fit / 4, std::min(1, o.warmup), o.warmup);
  const int reps = std::clamp(fit, std::min(3, o.reps), o.reps);
  for (int i = 0; i < warmup; ++i) RETURN_IF_ERROR(call((i + 1) % sets));
  std::vector<cudaEvent_t> ev(2 * reps);
  for (auto& e : ev) RETURN_IF_ERROR(Cuda(cudaEventCreate(&e), "cudaEventCreate"));
  for (int r = 0; r < reps; ++r) {
    RETURN_IF_ERROR(Cuda(cudaEventRecord(ev[2 * r], stream), "cudaEventRecord"));
    RETURN_IF_ERROR(call(r % sets));
    RETURN_IF_ERROR(Cuda(cudaEventRecord(ev[2 * r + 1], stream), "cudaEventRecord"));
  }
  RETURN_IF_ERROR(Cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize"));
  std::vector<double> ms;
  for (int r = 0; r < reps; ++r) {
    float t = 0;
    RETURN_IF_ERROR(Cuda(cudaEventElapsedTime(&t, ev[2 * r], ev[2 * r + 1]), "cudaEventElapsedTime"));
    ms.push_back(t);
  }
  for (auto& e : ev) cudaEventDestroy(e);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  Timing t;
  t.median_ms = Median(ms);
  t.min_ms = *std::min_element(ms.begin(), ms.end());
  t.reps = reps;
  return t;
}

// One attention case: `num_seqs` sequences of `q_len` queries over `context`
// tokens each, in a pool of random data read through shuffled block tables.
struct AttnCase {
  int num_seqs = 0;
  int q_len = 0;
  int context = 0;
  int heads = 0;
  int kv_heads = 0;
  int head_dim = 0;
  int page = 0;
  bool causal = true;
};

int BlocksPerSeq(const AttnCase& c) { return (c.context + c.page - 1) / c.page; }
int64_t BlockBytes(const AttnCase& c) { return int64_t{c.page} * c.kv_heads * c.head_dim * 2 * 2; }
int64_t PoolBytes(const AttnCase& c) { return int64_t{c.num_seqs} * BlocksPerSeq(c) * BlockBytes(c); }
int64_t QBytes(const AttnCase& c) { return int64_t{c.num_seqs} * c.q_len * c.heads * c.head_dim * 2; }

// Input sets that rotate so that together they overflow L2 several times.
int SetsFor(const AttnCase& c, int64_t l2_bytes) {
  const int64_t one = PoolBytes(c) + QBytes(c);
  return static_cast<int>(std::clamp<int64_t>((4 * l2_bytes + one - 1) / one, 1, 8));
}

struct Bench {
  const AttnBenchOptions& opt;
  cudaStream_t stream = nullptr;
  int64_t l2_bytes = 50 << 20;
  DeviceBuffer arena;  // random bf16: every case's pools are views of it
  std::mt19937_64 rng{19};
};

// Times one case through k::PagedAttention; ms per call, or why not.
absl::StatusOr<Timing> RunCase(Bench& bench, const AttnCase& c) {
  const int sets = SetsFor(c, bench.l2_bytes);
  k::KvLayout L;
  L.num_layers = 1;
  L.num_kv_heads = c.kv_heads;
  L.head_dim = c.head_dim;
  L.block_size = c.page;
  L.dtype = k::DType::kBF16;
  L.num_blocks = bench.arena.bytes() / L.block_bytes();
  const int bps = BlocksPerSeq(c);
  const int64_t need = int64_t{sets} * c.num_seqs * bps;
  if (need > L.num_blocks) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("the case needs %d blocks, the arena holds %d (--max-kv-gib)", need, L.num_blocks));
  }
  // Shuffled block ids over the whole arena; set i takes its own slice.
  std::vector<int32_t> perm(L.num_blocks);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), bench.rng);
  const int tokens = c.num_seqs * c.q_len;
  std::vector<int> qs(c.num_seqs + 1), ctx(c.num_seqs, c.context);
  for (int s = 0; s <= c.num_seqs; ++s) qs[s] = s * c.q_len;

  DeviceBuffer q, out, ws, meta;
  const int64_t q_bytes = QBytes(c);
  RETURN_IF_ERROR(q.Alloc(q_bytes * sets));
  RETURN_IF_ERROR(FillRandomBf16(q.get(), q.bytes(), bench.rng(), bench.stream));
  RETURN_IF_ERROR(out.Alloc(q_bytes));
  const int64_t ws_bytes = k::cuda::WorkspaceBytes(tokens, c.heads, c.head_dim);
  RETURN_IF_ERROR(ws.Alloc(ws_bytes));
  RETURN_IF_ERROR(Cuda(cudaMemsetAsync(ws.get(), 0, ws_bytes, bench.stream), "memset workspace"));
  const int64_t table_elems = int64_t{c.num_seqs} * bps;
  const int64_t meta_bytes = (c.num_seqs + 1 + c.num_seqs) * 4 + table_elems * sets * 4;
  RETURN_IF_ERROR(meta.Alloc(meta_bytes));
  std::vector<int32_t> host_meta;
  host_meta.insert(host_meta.end(), qs.begin(), qs.end());
  host_meta.insert(host_meta.end(), ctx.begin(), ctx.end());
  host_meta.insert(host_meta.end(), perm.begin(), perm.begin() + table_elems * sets);
  RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(meta.get(), host_meta.data(), meta_bytes, cudaMemcpyHostToDevice, bench.stream),
                       "upload tables"));
  const int32_t* dmeta = meta.get<int32_t>();

  k::PagedAttentionParams p;
  p.backend = k::Backend::kCuda;
  p.q_stride_bytes = int64_t{c.heads} * c.head_dim * 2;
  p.out = out.get();
  p.kv_cache = bench.arena.get();
  p.layout = L;
  p.num_heads = c.heads;
  p.scale = 1.0f / std::sqrt(float(c.head_dim));
  p.causal = c.causal;
  p.num_seqs = c.num_seqs;
  p.query_start = dmeta;
  p.context_lens = dmeta + c.num_seqs + 1;
  p.max_blocks_per_seq = bps;
  p.host_query_start = qs.data();
  p.host_context_lens = ctx.data();
  p.stream = bench.stream;
  p.workspace = ws.get();
  p.workspace_bytes = ws_bytes;
  auto call = [&](int set) {
    p.q = q.get<char>() + set * q_bytes;
    p.block_tables = dmeta + 2 * c.num_seqs + 1 + set * table_elems;
    return k::PagedAttention(p);
  };
  ASSIGN_OR_RETURN(Timing t, TimeCalls(call, sets, bench.opt, bench.stream));
  RETURN_IF_ERROR(k::cuda::TakeError(ws.get(), bench.stream));
  RETURN_IF_ERROR(Cuda(cudaGetLastError(), "after the timed calls"));
  return t;
}

absl::StatusOr<Timing> TimeCopy(Bench& bench) {
  DeviceBuffer src, dst;
  RETURN_IF_ERROR(src.Alloc(bench.opt.copy_bytes));
  RETURN_IF_ERROR(dst.Alloc(bench.opt.copy_bytes));
  RETURN_IF_ERROR(FillRandomBf16(src.get(), src.bytes(), 7, bench.stream));
  auto call = [&](int) {
    return Cuda(cudaMemcpyAsync(dst.get(), src.get(), src.bytes(), cudaMemcpyDeviceToDevice, bench.stream),
                "cudaMemcpyAsync");
  };
  AttnBenchOptions o = bench.opt;
  o.reps = std::max(o.reps, 20);
  return TimeCalls(call, 1, o, bench.stream);
}

#endif  // TANDEM_HAVE_CUDA

struct PrefillRow {
  int id = 0;
  bool causal = true;
  int head_dim = 0, heads = 0, kv_heads = 0, seqlen = 0, batch = 0;
  double flops = 0;
  std::optional<double> ms;
  std::string note;  // why ours has no number
  int reps = 0, sets = 0;
};

struct DecodeRow {
  int id = 0, torch_id = 0;
  std::string model;
  int heads = 0, batch = 0, context = 0, page = 0;
  int64_t kv_bytes = 0;
  std::optional<double> ms;
  std::string note;
  int reps = 0, sets = 0;
};

absl::Status RunAttentionBench(const AttnBenchOptions& o) {
  const std::string command_line = CommandLine();
  const bool do_prefill = o.mode != "decode";
  const bool do_decode = o.mode != "prefill";

  // The case lists (ids join our rows to the torch answers).
  std::vector<PrefillRow> prefill;
  if (do_prefill) {
    for (int d : o.head_dims) {
      for (int causal = 1; causal >= 0; --causal) {
        if (o.causal == "causal" && !causal) continue;
        if (o.causal == "noncausal" && causal) continue;
        for (int s : o.seqlens) {
          PrefillRow r;
          r.id = static_cast<int>(prefill.size());
          r.causal = causal;
          r.head_dim = d;
          r.heads = o.heads > 0 ? o.heads : 2048 / d;
          r.kv_heads = r.heads / o.gqa;
          r.seqlen = s;
          r.batch = o.tokens / s;
          r.flops = 4.0 * r.batch * r.heads * double(s) * s * d / (causal ? 2 : 1);
          prefill.push_back(r);
        }
      }
    }
  }
  std::vector<DecodeRow> decode;
  json torch_decode_shapes = json::array();
  if (do_decode) {
    for (const std::string& m : o.models) {
      for (int page : o.decode_page_sizes) {
        for (int b : o.batches) {
          for (int ctx : o.contexts) {
            DecodeRow r;
            r.id = static_cast<int>(decode.size());
            r.model = m;
            r.heads = QHeadsOf(m);
            r.batch = b;
            r.context = ctx;
            r.page = page;
            r.kv_bytes = int64_t{b} * ctx * kDecodeKvHeads * kDecodeHeadDim * 2 * 2;
            if (r.kv_bytes > o.max_kv_gib * double(int64_t{1} << 30)) {
              r.note = absl::StrFormat("skipped: KV %.1f GiB > --max-kv-gib", r.kv_bytes / double(1 << 30));
            }
            // torch has no pages: one torch shape serves every page size.
            r.torch_id = -1;
            for (const json& t : torch_decode_shapes) {
              if (t["heads"] == r.heads && t["batch"] == b && t["context"] == ctx) r.torch_id = t["id"];
            }
            if (r.torch_id < 0 && r.note.empty()) {
              r.torch_id = static_cast<int>(torch_decode_shapes.size());
              torch_decode_shapes.push_back({{"id", r.torch_id},
                                             {"batch", b},
                                             {"heads", r.heads},
                                             {"kv_heads", kDecodeKvHeads},
                                             {"head_dim", kDecodeHeadDim},
                                             {"context", ctx}});
            }
            decode.push_back(r);
          }
        }
      }
    }
  }

  // Device.
  const char* why = nullptr;
  if (!k::cuda::Available(&why)) {
    std::fprintf(stderr,
                 "tandem bench attention: no usable GPU: %s\n"
                 "  (the benchmark times the CUDA kernels; run it on an H100/H200)\n",
                 why != nullptr ? why : "unknown");
    std::exit(kExitNoGpu);
  }
  json device = json::object();
  std::optional<Timing> copy;
  std::string copy_note;
#if TANDEM_HAVE_CUDA
  {
    int dev = 0;
    cudaGetDevice(&dev);
    cudaDeviceProp prop{};
    RETURN_IF_ERROR(Cuda(cudaGetDeviceProperties(&prop, dev), "cudaGetDeviceProperties"));
    int driver = 0, runtime = 0;
    cudaDriverGetVersion(&driver);
    cudaRuntimeGetVersion(&runtime);
    device = {{"name", prop.name},
              {"sms", prop.multiProcessorCount},
              {"l2_bytes", prop.l2CacheSize},
              {"memory_bytes", static_cast<int64_t>(prop.totalGlobalMem)},
              {"compute_capability", absl::StrFormat("%d.%d", prop.major, prop.minor)},
              {"cuda_driver", driver},
              {"cuda_runtime", runtime}};
    Bench bench{o};
    bench.l2_bytes = prop.l2CacheSize > 0 ? prop.l2CacheSize : bench.l2_bytes;
    RETURN_IF_ERROR(Cuda(cudaStreamCreateWithFlags(&bench.stream, cudaStreamNonBlocking), "cudaStreamCreate"));
    std::fprintf(stderr, "bench attention: %s, %d SMs\n", prop.name, prop.multiProcessorCount);

    // Baseline: device-to-device copy.
    if (do_decode) {
      absl::StatusOr<Timing> t = TimeCopy(bench);
      if (t.ok()) {
        copy = *t;
      } else {
        copy_note = std::string(t.status().message());
      }
    }

    // One arena, large enough for every case (with its rotation sets).
    auto case_of_prefill = [&](const PrefillRow& r) {
      return AttnCase{r.batch, r.seqlen, r.seqlen, r.heads, r.kv_heads, r.head_dim, o.page_size, r.causal};
    };
    auto case_of_decode = [&](const DecodeRow& r) {
      return AttnCase{r.batch, 1, r.context, r.heads, kDecodeKvHeads, kDecodeHeadDim, r.page, true};
    };
    int64_t arena = 0;
    for (const auto& r : prefill) {
      const AttnCase c = case_of_prefill(r);
      arena = std::max(arena, PoolBytes(c) * SetsFor(c, bench.l2_bytes));
    }
    for (const auto& r : decode) {
      if (!r.note.empty()) continue;
      const AttnCase c = case_of_decode(r);
      arena = std::max(arena, PoolBytes(c) * SetsFor(c, bench.l2_bytes));
    }
    arena += int64_t{4} << 20;  // slack for rounding to another block size
    std::fprintf(stderr, "bench attention: filling a %.2f GiB KV arena with random bf16\n",
                 arena / double(int64_t{1} << 30));
    RETURN_IF_ERROR(bench.arena.Alloc(arena));
    RETURN_IF_ERROR(FillRandomBf16(bench.arena.get(), arena, 19, bench.stream));

    // Prefill, shortest first per (head dim, causal) so --max-call-ms can
    // predict from the rate of the previous case.
    double last_rate = 0;  // FLOP/ms of the previous measured case of the group
    int group_dim = -1;
    bool group_causal = false;
    for (auto& r : prefill) {
      if (r.head_dim != group_dim || r.causal != group_causal) last_rate = 0;
      group_dim = r.head_dim;
      group_causal = r.causal;
      const AttnCase c = case_of_prefill(r);
      r.sets = SetsFor(c, bench.l2_bytes);
      if (o.max_call_ms > 0 && last_rate > 0 && r.flops / last_rate > o.max_call_ms) {
        r.note = absl::StrFormat("skipped: ~%.0f ms per call > --max-call-ms", r.flops / last_rate);
        continue;
      }
      absl::StatusOr<Timing> t = RunCase(bench, c);
      if (!t.ok()) {
        r.note = std::string(t.status().message());
        if (t.status().code() == absl::StatusCode::kInternal) return t.status();
        continue;
      }
      r.ms = t->median_ms;
      r.reps = t->reps;
      last_rate = r.flops / t->median_ms;
      std::fprintf(stderr, "  prefill %s d=%d S=%d: %.3f ms\n", r.causal ? "causal" : "full", r.head_dim, r.seqlen,
                   *r.ms);
    }
    for (auto& r : decode) {
      if (!r.note.empty()) continue;
      const AttnCase c = case_of_decode(r);
      r.sets = SetsFor(c, bench.l2_bytes);
      absl::StatusOr<Timing> t = RunCase(bench, c);
      if (!t.ok()) {
        r.note = std::string(t.status().message());
        if (t.status().code() == absl::StatusCode::kInternal) return t.status();
        continue;
      }
      r.ms = t->median_ms;
      r.reps = t->reps;
    }
    bench.arena.Free();
    cudaStreamDestroy(bench.stream);
  }
#endif

  // Torch baselines, after our memory is freed.
  json shapes = {{"warmup", o.warmup},
                 {"reps", o.reps},
                 {"max_case_seconds", o.max_case_seconds},
                 {"prefill", json::array()},
                 {"decode", torch_decode_shapes}};
  for (const auto& r : prefill) {
    shapes["prefill"].push_back({{"id", r.id},
                                 {"batch", r.batch},
                                 {"heads", r.heads},
                                 {"kv_heads", r.kv_heads},
                                 {"head_dim", r.head_dim},
                                 {"seqlen", r.seqlen},
                                 {"causal", r.causal}});
  }
  const json torch = RunTorch(o, shapes);
  const bool torch_ok = torch.value("available", false);
  // Held here: FindById points into them.
  const json torch_prefill = torch.value("prefill", json::array());
  const json torch_decode = torch.value("decode", json::array());

  // Results: JSON and the table.
  json j = {{"command", command_line}, {"device", device}, {"torch", json::object()}};
  j["torch"]["available"] = torch_ok;
  for (const char* key : {"why", "version", "cudnn_version", "device"}) {
    if (torch.contains(key)) j["torch"][key] = torch[key];
  }
  const double copy_gbps = copy ? 2.0 * o.copy_bytes / (copy->median_ms * 1e-3) / 1e9 : 0;
  j["copy"] = {{"bytes", o.copy_bytes},
               {"ms", copy ? json(copy->median_ms) : json(nullptr)},
               {"gbps_read_plus_write", copy ? json(copy_gbps) : json(nullptr)},
               {"note", copy_note}};
  std::printf("tandem bench attention on %s\n  command: %s\n", device.value("name", "?").c_str(), command_line.c_str());
  if (torch_ok) {
    std::printf("  torch %s, cuDNN %s\n", torch.value("version", "?").c_str(),
                torch.contains("cudnn_version") ? torch["cudnn_version"].dump().c_str() : "?");
  } else {
    std::printf("  torch baselines unavailable: %s (ratios blank)\n", torch.value("why", "?").c_str());
  }

  j["prefill"] = json::array();
  if (!prefill.empty()) {
    std::printf("\nprefill (bf16, page %d, GQA %d): TFLOP/s = 4*B*H*S*S*D (/2 causal) per second\n", o.page_size,
                o.gqa);
    std::printf("%-7s %4s %3s %6s %4s | %10s %8s | %8s %8s | %9s  %s\n", "mask", "D", "H", "S", "B", "ours ms",
                "TFLOP/s", "cuDNN", "flash", "ours/best", "note");
  }
  for (const auto& r : prefill) {
    const json* t = FindById(torch_prefill, r.id);
    auto tflops = [&](std::optional<double> ms) -> std::optional<double> {
      if (!ms) return std::nullopt;
      return r.flops / (*ms * 1e-3) / 1e12;
    };
    const std::optional<double> ours = tflops(r.ms), cudnn = tflops(TorchMs(t, "cudnn")),
                                flash = tflops(TorchMs(t, "flash"));
    std::optional<double> best;
    for (auto v : {cudnn, flash}) {
      if (v && (!best || *v > *best)) best = v;
    }
    std::optional<double> ratio;
    if (ours && best) ratio = *ours / *best;
    json row = {{"causal", r.causal},   {"head_dim", r.head_dim}, {"heads", r.heads},         {"kv_heads", r.kv_heads},
                {"seqlen", r.seqlen},   {"batch", r.batch},       {"page_size", o.page_size}, {"flops", r.flops},
                {"input_sets", r.sets}, {"reps", r.reps}};
    row["ours"] = {
        {"ms", r.ms ? json(*r.ms) : json(nullptr)}, {"tflops", ours ? json(*ours) : json(nullptr)}, {"note", r.note}};
    row["torch"] = json::object();
    for (const char* b : {"cudnn", "flash"}) {
      json e = {{"ms", nullptr}, {"tflops", nullptr}};
      if (t != nullptr && t->contains(b)) e = (*t)[b];
      const std::optional<double> tf = tflops(TorchMs(t, b));
      e["tflops"] = tf ? json(*tf) : json(nullptr);
      row["torch"][b] = e;
    }
    row["ratio_to_best_torch"] = ratio ? json(*ratio) : json(nullptr);
    j["prefill"].push_back(row);
    std::printf("%-7s %4d %3d %6d %4d | %10s %8s | %8s %8s | %9s  %s\n", r.causal ? "causal" : "full", r.head_dim,
                r.heads, r.seqlen, r.batch, Cell(r.ms, 3).c_str(), Cell(ours, 1).c_str(), Cell(cudnn, 1).c_str(),
                Cell(flash, 1).c_str(), Cell(ratio, 2).c_str(), r.note.c_str());
  }

  j["decode"] = json::array();
  if (!decode.empty()) {
    std::printf("\ndecode (bf16, 1 query per sequence, %d kv heads, head dim %d): GB/s of K and V read\n",
                kDecodeKvHeads, kDecodeHeadDim);
    std::printf("  device-to-device copy (%.2f GiB, read + write): %s GB/s%s\n",
                o.copy_bytes / double(int64_t{1} << 30),
                Cell(copy ? std::optional(copy_gbps) : std::nullopt, 0).c_str(),
                copy_note.empty() ? "" : (" (" + copy_note + ")").c_str());
    std::printf("%-4s %4s %6s %4s %9s | %9s %8s %6s | %9s %8s %9s  %s\n", "mdl", "B", "ctx", "page", "KV MiB",
                "ours us", "GB/s", "/copy", "torch us", "GB/s", "ours/torch", "note");
  }
  for (const auto& r : decode) {
    const json* t = FindById(torch_decode, r.torch_id);
    auto gbps = [&](std::optional<double> ms) -> std::optional<double> {
      if (!ms) return std::nullopt;
      return r.kv_bytes / (*ms * 1e-3) / 1e9;
    };
    const std::optional<double> ours = gbps(r.ms);
    std::optional<double> best_ms;
    std::string best_backend;
    json torch_rows = json::object();
    for (const char* b : {"default", "cudnn", "flash"}) {
      const std::optional<double> ms = TorchMs(t, b);
      json e = {{"ms", nullptr}};
      if (t != nullptr && t->contains(b)) e = (*t)[b];
      e["gbps"] = ms ? json(*gbps(ms)) : json(nullptr);
      torch_rows[b] = e;
      if (ms && (!best_ms || *ms < *best_ms)) {
        best_ms = ms;
        best_backend = b;
      }
    }
    std::optional<double> to_copy, to_torch;
    if (ours && copy) to_copy = *ours / copy_gbps;
    if (r.ms && best_ms) to_torch = *best_ms / *r.ms;
    json row = {
        {"model", r.model},     {"heads", r.heads},     {"kv_heads", kDecodeKvHeads}, {"head_dim", kDecodeHeadDim},
        {"batch", r.batch},     {"context", r.context}, {"page_size", r.page},        {"kv_bytes", r.kv_bytes},
        {"input_sets", r.sets}, {"reps", r.reps}};
    row["ours"] = {{"us", r.ms ? json(*r.ms * 1e3) : json(nullptr)},
                   {"gbps", ours ? json(*ours) : json(nullptr)},
                   {"note", r.note}};
    row["torch"] = torch_rows;
    row["torch_best_backend"] = best_backend;
    row["ratio_to_copy"] = to_copy ? json(*to_copy) : json(nullptr);
    row["ratio_to_torch"] = to_torch ? json(*to_torch) : json(nullptr);
    j["decode"].push_back(row);
    std::printf("%-4s %4d %6d %4d %9.1f | %9s %8s %6s | %9s %8s %9s  %s\n", r.model.c_str(), r.batch, r.context, r.page,
                r.kv_bytes / double(1 << 20), Cell(r.ms ? std::optional(*r.ms * 1e3) : std::nullopt, 1).c_str(),
                Cell(ours, 0).c_str(), Cell(to_copy, 2).c_str(),
                Cell(best_ms ? std::optional(*best_ms * 1e3) : std::nullopt, 1).c_str(),
                Cell(best_ms ? gbps(best_ms) : std::nullopt, 0).c_str(), Cell(to_torch, 2).c_str(),
                (r.note + (best_backend.empty() ? "" : " torch:" + best_backend)).c_str());
  }
  if (!decode.empty()) std::printf("  ours/torch > 1: ours is faster (torch time / our time, best torch backend)\n");

  if (!o.json_path.empty()) {
    std::ofstream out(o.json_path);
    if (!out) return absl::InvalidArgumentError(absl::StrCat("--json: cannot write ", o.json_path));
    out << j.dump(2) << "\n";
    if (!out) return absl::InternalError(absl::StrCat("--json: writing ", o.json_path, " failed"));
  }
  return absl::OkStatus();
}

}  // namespace

void AddAttentionBenchCommand(CLI::App& bench) {
  auto opt = std::make_shared<AttnBenchOptions>();
  CLI::App* cmd = bench.add_subcommand(
      "attention", "CUDA paged attention (prefill TFLOP/s, decode GB/s) against torch SDPA and a copy");
  cmd->add_option("--mode", opt->mode, "prefill, decode or all")
      ->check(CLI::IsMember({"prefill", "decode", "all"}))
      ->capture_default_str();
  cmd->add_option("--seqlens", opt->seqlens, "Prefill sequence lengths")
      ->delimiter(',')
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_option("--tokens", opt->tokens, "Prefill batch x seqlen")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--head-dims", opt->head_dims, "Prefill head dims (heads = 2048 / head dim unless --heads)")
      ->delimiter(',')
      ->check(CLI::IsMember({64, 128}))
      ->capture_default_str();
  cmd->add_option("--heads", opt->heads, "Prefill query heads (0: 2048 / head dim)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_option("--causal", opt->causal, "Prefill masks: both, causal or noncausal")
      ->check(CLI::IsMember({"both", "causal", "noncausal"}))
      ->capture_default_str();
  cmd->add_option("--gqa", opt->gqa, "Prefill query heads per kv head")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_option("--page-size", opt->page_size, "Prefill page size (tokens per block)")
      ->check(CLI::IsMember({16, 32, 64}))
      ->capture_default_str();
  cmd->add_option("--max-call-ms", opt->max_call_ms,
                  "Skip our prefill cases predicted (from the previous length) to take longer per call (0: never)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_option("--batches", opt->batches, "Decode batch sizes")
      ->delimiter(',')
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  cmd->add_option("--contexts", opt->contexts, "Decode context lengths")
      ->delimiter(',')
      ->check(CLI::Range(1, 1 << 22))
      ->capture_default_str();
  cmd->add_option("--models", opt->models, "Decode head counts: 8b (32 q / 8 kv heads), 70b (64 / 8)")
      ->delimiter(',')
      ->check(CLI::IsMember({"8b", "70b"}))
      ->capture_default_str();
  cmd->add_option("--decode-page-sizes", opt->decode_page_sizes, "Decode page sizes")
      ->delimiter(',')
      ->check(CLI::IsMember({16, 32, 64}))
      ->capture_default_str();
  cmd->add_option("--max-kv-gib", opt->max_kv_gib, "Skip decode cases whose KV exceeds this")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_option("--warmup", opt->warmup, "Warm-up calls per case")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_option("--reps", opt->reps, "Timed calls per case (median; fewer if over --max-case-seconds)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_option("--max-case-seconds", opt->max_case_seconds, "Time budget of one case's timed calls")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_option_function<std::string>(
      "--copy-bytes",
      [opt](const std::string& s) {
        absl::StatusOr<int64_t> v = ParseByteSize(s);
        if (!v.ok()) throw CLI::ValidationError("--copy-bytes", std::string(v.status().message()));
        opt->copy_bytes = *v;
      },
      "Bytes of the device-to-device copy baseline (default 1GiB)");
  cmd->add_option("--torch-python", opt->torch_python, "Python with torch for the SDPA baselines")
      ->capture_default_str();
  cmd->add_option("--torch-script", opt->torch_script,
                  "The torch helper (default: scripts/bench_attention_torch.py near cwd or the binary)");
  cmd->add_flag("--no-torch", opt->no_torch, "Skip the torch baselines");
  cmd->add_option("--json", opt->json_path, "Write every number to this JSON file");
  cmd->callback([opt] {
    if (absl::Status s = Validate(*opt); !s.ok()) ExitWithStatus("bench attention", s);
    ExitWithStatus("bench attention", RunAttentionBench(*opt));
  });
}

}  // namespace tandem::worker
