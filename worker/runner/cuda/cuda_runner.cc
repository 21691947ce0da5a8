// The "cuda" runner: a Llama-family forward pass on one NVIDIA GPU (Hopper),
// bfloat16 weights and activations, float32 accumulation and statistics.
//
// Per layer: the fused QKV product (cuBLASLt); bias, RoPE and the KV write in
// one kernel; paged attention (kernels::cuda); the output product; its add
// to the residual (with its bias) fused with the next RMSNorm; the fused
// gate/up product; SiLU-and-multiply; the down product; add and the next
// layer's input norm. The residual stream is float32 (Hugging Face keeps it
// in bfloat16): each product's bf16 output is added to it in float32 and the
// sum is never rounded, which keeps the GPU engine closer to the float32
// reference. Then the final norm gathers only the rows whose logits are
// wanted, and the LM head writes their float32 logits: plain greedy rows take
// their token from an argmax on the GPU, the others from the GPU sampler
// (gpu_sampler.h: penalties, masks, logprobs, top-k/p, min-p, the seeded
// draw; SampleToken's token bit for bit), or with --host-sampling the host
// sampler (SampleToken, one row a thread: ParallelSampler).
//
// Everything of a step runs on the runner's stream; the step's metadata goes
// up in one copy from pinned memory; a step synchronizes once, where the
// sampled ids, the host rows' logits and the kernels' error word arrive
// together (a second time for rows of the GPU sampler's full pass; the
// logits-only path synchronizes after the forward pass).
//
// Decode steps (every sequence one token, at most kMaxGraphBatch of them)
// replay a CUDA graph of the forward pass instead (EnqueueGraph): the batch is
// padded to a power-of-two bucket and the block tables to a power-of-two
// width, so that every buffer, size and kernel argument the graph holds is
// the bucket's; the attention's split plan is made for the longest context
// the width allows (splits past a sequence's keys are skipped). Padded rows
// write no KV (slot -1), attend one key of block 0, and are not sampled.
// Graphs are dropped when a buffer they use is reallocated.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <string_view>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/block_hash.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "kernels/paged_attention.h"
#include "worker/runner/builtin_runners.h"
#include "worker/runner/cuda/cuda_buffers.h"
#include "worker/runner/cuda/gpu_sampler.h"
#include "worker/runner/cuda/lt_gemm.h"
#include "worker/runner/cuda/model_kernels.h"
#include "worker/runner/llama_model.h"
#include "worker/sampling/parallel_sampler.h"

namespace tandem::worker {
namespace {

using cuda_util::Align16;
using cuda_util::Cuda;
using cuda_util::DeviceBuffer;
using cuda_util::Launch;
using cuda_util::Reserve;

cuda_ops::SrcType SrcTypeOf(WeightDtype d) {
  switch (d) {
    case WeightDtype::kF32:
      return cuda_ops::SrcType::kF32;
    case WeightDtype::kF16:
      return cuda_ops::SrcType::kF16;
    case WeightDtype::kBF16:
      return cuda_ops::SrcType::kBF16;
  }
  return cuda_ops::SrcType::kF32;
}
int64_t DtypeBytes(WeightDtype d) { return d == WeightDtype::kF32 ? 4 : 2; }

constexpr int64_t kGemmWorkspaceBytes = int64_t{32} << 20;

// TANDEM_CUDA_PROFILE=1: CUDA events between the forward pass's phases; the
// runner logs each phase's share of the GPU time, and the host's time
// around it, when it is destroyed. Off: every call is a no-op.
class StepProfile {
 public:
  StepProfile() {
    const char* env = std::getenv("TANDEM_CUDA_PROFILE");
    on_ = env != nullptr && *env != '\0' && std::string_view(env) != "0";
  }
  ~StepProfile() {
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
  }
  bool on() const { return on_; }
  void Mark(const char* phase, void* stream) {
    if (!on_) return;
    if (used_ == events_.size()) {
      cudaEvent_t e;
      if (cudaEventCreate(&e) != cudaSuccess) return;
      events_.push_back(e);
      phases_.push_back(nullptr);
    }
    cudaEventRecord(events_[used_], static_cast<cudaStream_t>(stream));
    phases_[used_++] = phase;
  }
  // After the step's stream is synchronized: adds its phases' times, and
  // the step's wall time `wall_ms`, to the totals of steps of its `kind`.
  void Collect(const std::string& kind, double wall_ms) {
    if (!on_ || used_ < 2) {
      used_ = 0;
      return;
    }
    Totals& t = kinds_[kind];
    for (size_t i = 1; i < used_; ++i) {
      float ms = 0;
      cudaEventElapsedTime(&ms, events_[i - 1], events_[i]);
      t.phases[phases_[i]] += ms;
      t.gpu_ms += ms;
    }
    t.wall_ms += wall_ms;
    ++t.steps;
    used_ = 0;
  }
  void Log(const std::string& what) const {
    for (const auto& [kind, t] : kinds_) {
      std::vector<std::pair<double, std::string>> rows;
      for (const auto& [phase, ms] : t.phases) rows.emplace_back(ms, phase);
      std::sort(rows.rbegin(), rows.rend());
      std::string text = absl::StrFormat("%s, %s steps: %d, %.3f ms a step on the GPU, %.3f ms wall:", what, kind,
                                         t.steps, t.gpu_ms / t.steps, t.wall_ms / t.steps);
      for (const auto& [ms, phase] : rows) {
        absl::StrAppendFormat(&text, " %s %.3f ms (%.0f%%);", phase, ms / t.steps, 100.0 * ms / t.gpu_ms);
      }
      LOG(INFO) << text;
    }
  }

 private:
  struct Totals {
    std::map<std::string, double> phases;
    double gpu_ms = 0, wall_ms = 0;
    int steps = 0;
  };
  bool on_ = false;
  std::vector<cudaEvent_t> events_;
  std::vector<const char*> phases_;
  size_t used_ = 0;
  std::map<std::string, Totals> kinds_;
};

class CudaRunner final : public ModelRunner {
 public:
  CudaRunner(ModelConfig config, const RunnerOptions& options)
      : ModelRunner(std::move(config)),
        device_(options.device),
        batch_invariant_(options.batch_invariant),
        cuda_graphs_(options.cuda_graphs),
        gpu_sampling_(options.gpu_sampling),
        bf16_logits_(options.bf16_logits) {}

  ~CudaRunner() override {
    cudaSetDevice(device_);
    profile_.Log("cuda runner profile");
    if (stream_ != nullptr) cudaStreamSynchronize(stream_);
    DropGraphs();
    gemm_.reset();
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    if (checksum_stream_ != nullptr) cudaStreamDestroy(checksum_stream_);
  }

  absl::Status Init(const TensorSource& tensors) {
    const ModelConfig& c = config();
    if (const char* why = nullptr; !kernels::cuda::Available(&why)) {
      return absl::FailedPreconditionError(absl::StrCat("--device cuda: ", why));
    }
    int count = 0;
    RETURN_IF_ERROR(Cuda(cudaGetDeviceCount(&count), "cudaGetDeviceCount"));
    if (device_ < 0 || device_ >= count) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "--device cuda:%d: this machine has %d CUDA device(s) (cuda:0..cuda:%d)", device_, count, count - 1));
    }
    RETURN_IF_ERROR(Cuda(cudaSetDevice(device_), "cudaSetDevice"));
    {
      // What this process takes from here on is its own (KvBudget).
      size_t free_bytes = 0, total = 0;
      RETURN_IF_ERROR(Cuda(cudaMemGetInfo(&free_bytes, &total), "cudaMemGetInfo"));
      free_at_init_ = int64_t(free_bytes);
    }
    if (c.hidden_size % 8 != 0 || c.intermediate_size % 8 != 0 || c.head_dim % 8 != 0 || c.head_dim > 256) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "the cuda runner needs hidden_size, intermediate_size and head_dim multiples of 8 (head_dim <= 256); the "
          "model has %d, %d and %d",
          c.hidden_size, c.intermediate_size, c.head_dim));
    }
    RETURN_IF_ERROR(Cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate"));
    {
      // Step buffers grow stream-ordered (cuda_buffers.h); the pool keeps
      // what they free for the next growth instead of giving it back to the
      // driver at every synchronization.
      cudaMemPool_t pool = nullptr;
      uint64_t keep = UINT64_MAX;
      RETURN_IF_ERROR(Cuda(cudaDeviceGetDefaultMemPool(&pool, device_), "cudaDeviceGetDefaultMemPool"));
      RETURN_IF_ERROR(Cuda(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep), "memory pool"));
    }
    ASSIGN_OR_RETURN(gemm_workspace_, DeviceBuffer::Allocate(kGemmWorkspaceBytes, "the cuBLASLt workspace"));
    ASSIGN_OR_RETURN(gemm_, LtGemm::Create(gemm_workspace_.get(), gemm_workspace_.bytes(), batch_invariant_));

    const std::vector<double> inv_freq = RopeInverseFrequencies(c);
    ASSIGN_OR_RETURN(inv_freq_, DeviceBuffer::Allocate(int64_t(inv_freq.size() * sizeof(double)), "RoPE"));
    RETURN_IF_ERROR(
        Cuda(cudaMemcpy(inv_freq_.get(), inv_freq.data(), inv_freq.size() * sizeof(double), cudaMemcpyHostToDevice),
             "upload RoPE frequencies"));

    DeviceBuffer staging;
    auto upload = [&](const WeightParts& parts) -> absl::StatusOr<DeviceBuffer> {
      std::vector<StoredTensor> stored;
      int64_t numel = 0;
      for (const std::string& name : parts.names) {
        ASSIGN_OR_RETURN(StoredTensor t, tensors.GetStored(name));
        int64_t n = 1;
        for (int64_t d : t.shape) n *= d;
        if (int64_t(t.bytes.size()) != n * DtypeBytes(t.dtype)) {
          return absl::DataLossError(absl::StrFormat("tensor '%s' in %s has %d bytes for %d elements", name,
                                                     tensors.Describe(), t.bytes.size(), n));
        }
        numel += n;
        stored.push_back(std::move(t));
      }
      ASSIGN_OR_RETURN(DeviceBuffer out, DeviceBuffer::Allocate(numel * 2, parts.names.front().c_str()));
      int64_t at = 0;
      for (const StoredTensor& t : stored) {
        const int64_t n = int64_t(t.bytes.size()) / DtypeBytes(t.dtype);
        char* dst = static_cast<char*>(out.get()) + at * 2;
        if (t.dtype == WeightDtype::kBF16) {
          RETURN_IF_ERROR(Cuda(cudaMemcpy(dst, t.bytes.data(), t.bytes.size(), cudaMemcpyHostToDevice), "upload"));
        } else {
          RETURN_IF_ERROR(Reserve(&staging, int64_t(t.bytes.size()), "weight conversion", nullptr));
          RETURN_IF_ERROR(
              Cuda(cudaMemcpy(staging.get(), t.bytes.data(), t.bytes.size(), cudaMemcpyHostToDevice), "upload"));
          RETURN_IF_ERROR(Launch(cuda_ops::LaunchToBf16(staging.get(), SrcTypeOf(t.dtype), dst, n, nullptr),
                                 "convert weights to bfloat16"));
          RETURN_IF_ERROR(Cuda(cudaDeviceSynchronize(), "convert weights to bfloat16"));
        }
        at += n;
      }
      weight_bytes_ += out.bytes();
      return out;
    };
    ASSIGN_OR_RETURN(w_, AssembleWeights<DeviceBuffer>(c, upload));
    // Uploads from pageable memory and legacy-stream work may still be in
    // flight: every step's stream must see them done.
    RETURN_IF_ERROR(Cuda(cudaDeviceSynchronize(), "upload the weights"));
    LOG(INFO) << "cuda runner: " << weight_bytes_ << " bytes of bfloat16 weights on cuda:" << device_;
    return absl::OkStatus();
  }

  std::string_view name() const override { return "cuda"; }

  kernels::KvLayout KvBlockLayout(int block_size) const override {
    kernels::KvLayout layout = HostKvLayout(config(), block_size);
    layout.dtype = kernels::DType::kBF16;
    return layout;
  }

  absl::Status CheckKvLayout(const kernels::KvLayout& layout) const override {
    if (layout.block_size != 16 && layout.block_size != 32 && layout.block_size != 64) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "the cuda runner takes KV blocks of 16, 32 or 64 tokens (--block-size), not %d", layout.block_size));
    }
    return absl::OkStatus();
  }

  KvStorage::Allocator KvAllocator() override {
    return [this](int64_t bytes) -> absl::StatusOr<KvMemory> {
      RETURN_IF_ERROR(Cuda(cudaSetDevice(device_), "cudaSetDevice"));
      ASSIGN_OR_RETURN(kv_pool_, DeviceBuffer::Allocate(bytes, "the KV cache (--kv-cache-memory)"));
      RETURN_IF_ERROR(Cuda(cudaMemset(kv_pool_.get(), 0, static_cast<size_t>(bytes)), "clear the KV cache"));
      // The memset runs on the legacy stream, which the runner's
      // non-blocking stream does not wait for: done before the first step.
      RETURN_IF_ERROR(Cuda(cudaDeviceSynchronize(), "clear the KV cache"));
      return KvMemory{.data = kv_pool_.get(),
                      .location = MemoryLocation::kDevice,
                      .checksums = [this](const void* pool, int64_t block_bytes, std::span<const int32_t> blocks) {
                        return KvChecksums(pool, block_bytes, blocks);
                      }};
    };
  }

  // The pool's block checksums on the GPU (LaunchKvChecksums), on a stream of
  // their own: called from hand-off threads, between steps' writes of other
  // blocks (the blocks asked for are a hand-off's and do not change).
  absl::StatusOr<std::vector<uint64_t>> KvChecksums(const void* pool, int64_t block_bytes,
                                                    std::span<const int32_t> blocks) {
    std::lock_guard<std::mutex> lock(checksum_mu_);
    RETURN_IF_ERROR(Cuda(cudaSetDevice(device_), "cudaSetDevice"));
    if (checksum_stream_ == nullptr) {
      unsigned char secret[192];
      DefaultHashSecret(secret);
      RETURN_IF_ERROR(Reserve(&checksum_secret_, sizeof(secret), "the checksum secret", nullptr));
      RETURN_IF_ERROR(Cuda(cudaMemcpy(checksum_secret_.get(), secret, sizeof(secret), cudaMemcpyHostToDevice),
                           "upload the checksum secret"));
      RETURN_IF_ERROR(Cuda(cudaStreamCreateWithFlags(&checksum_stream_, cudaStreamNonBlocking), "the checksum stream"));
    }
    const size_t n = blocks.size();
    const size_t ids_bytes = Align16(n * sizeof(int32_t));
    RETURN_IF_ERROR(
        Reserve(&checksum_io_, int64_t(ids_bytes + n * sizeof(uint64_t)), "block checksums", checksum_stream_));
    auto* d_ids = static_cast<int32_t*>(checksum_io_.get());
    auto* d_out = reinterpret_cast<uint64_t*>(static_cast<unsigned char*>(checksum_io_.get()) + ids_bytes);
    std::vector<uint64_t> sums(n);
    RETURN_IF_ERROR(
        Cuda(cudaMemcpyAsync(d_ids, blocks.data(), n * sizeof(int32_t), cudaMemcpyHostToDevice, checksum_stream_),
             "upload block ids"));
    RETURN_IF_ERROR(Launch(
        cuda_ops::LaunchKvChecksums(pool, block_bytes, d_ids, static_cast<int>(n),
                                    static_cast<const unsigned char*>(checksum_secret_.get()), d_out, checksum_stream_),
        "block checksums"));
    RETURN_IF_ERROR(
        Cuda(cudaMemcpyAsync(sums.data(), d_out, n * sizeof(uint64_t), cudaMemcpyDeviceToHost, checksum_stream_),
             "download block checksums"));
    RETURN_IF_ERROR(Cuda(cudaStreamSynchronize(checksum_stream_), "block checksums"));
    return sums;
  }

  absl::StatusOr<int64_t> KvBudget(double utilization, int max_batched_tokens, int max_seqs) override {
    RETURN_IF_ERROR(Cuda(cudaSetDevice(device_), "cudaSetDevice"));
    size_t free_bytes = 0, total = 0;
    RETURN_IF_ERROR(Cuda(cudaMemGetInfo(&free_bytes, &total), "cudaMemGetInfo"));
    // The utilization is this worker's share (vLLM's meaning): several
    // workers on one GPU take 0.45 each, say. What it uses: what it
    // allocated since its start (weights, workspaces; at least the weights,
    // should another process have freed memory meanwhile).
    const int64_t used = std::max(free_at_init_ - int64_t(free_bytes), weight_bytes_);
    int64_t activations = ActivationBytes(max_batched_tokens, std::min(max_seqs, max_batched_tokens));
    if (gpu_sampling_) {
      // The GPU sampler's full pass (its other buffers grow with the rows'
      // token lists and fall back to the host sampler when they cannot).
      activations += cuda_ops::SampleFullScratchBytes(config().vocab_size, cuda_ops::kSampleFullRows);
    }
    if (batch_invariant_) {
      activations += FixedSplitWorkspaceAtMost(max_batched_tokens, std::min(max_seqs, max_batched_tokens));
    }
    const int64_t allowed = static_cast<int64_t>(utilization * double(total));
    // And no more than the device has free (other processes' memory), less
    // a reserve for what is allocated later (CUDA graphs, checksum buffers,
    // the sampler's and the attention workspace's growth).
    constexpr int64_t kFreeReserve = int64_t{1} << 30;
    const int64_t budget = std::min(allowed - used, int64_t(free_bytes) - kFreeReserve) - activations;
    if (budget <= 0) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "--gpu-memory-utilization %g allows this worker %d bytes of cuda:%d's %d; it uses %d (%d of them this "
          "model's weights), %d are free, and a step's activations at %d tokens need %d: nothing is left for the "
          "KV cache (raise the utilization, lower --max-batched-tokens, or use a smaller model)",
          utilization, allowed, device_, total, used, weight_bytes_, free_bytes, max_batched_tokens, activations));
    }
    LOG(INFO) << "cuda runner: KV cache of " << budget << " bytes (" << utilization << " of " << total
              << " bytes; this worker uses " << used << ", " << free_bytes << " free, activations " << activations
              << ")";
    return budget;
  }

  // The step buffers at their largest (KvBudget counted them), so that
  // serving does not grow them. Left to grow: the GPU sampler's buffers for
  // rows past 64 listed tokens each (penalties over long outputs), and the
  // block checksums' (a hand-off's block list).
  absl::Status ReserveSteps(int max_batched_tokens, int max_seqs, int max_blocks_per_seq) override {
    RETURN_IF_ERROR(Cuda(cudaSetDevice(device_), "cudaSetDevice"));
    const int T = max_batched_tokens, S = std::min(max_seqs, max_batched_tokens);
    // A decode graph's step is padded to its bucket: B rows, tables W wide.
    const int B = cuda_graphs_ ? GraphBatch(std::min(S, kMaxGraphBatch)) : 0;
    const int W = GraphWidth(max_blocks_per_seq);
    reserved_tokens_ = std::max(T, B);
    reserved_rows_ = std::max(S, B);
    RETURN_IF_ERROR(ReserveActivations(reserved_tokens_, reserved_rows_));
    // The attention workspace of the longest runs (ReserveActivations sized
    // it for the runs of the last step: none yet).
    const ModelConfig& c = config();
    RETURN_IF_ERROR(
        ReserveAttentionWorkspace(std::max(kernels::cuda::WorkspaceBytes(std::max(T, B), c.num_heads, c.head_dim),
                                           batch_invariant_ ? FixedSplitWorkspaceAtMost(T, S) : 0)));
    // The step metadata at its largest (UploadMetadata's layout: tokens,
    // positions, slots and logits rows a token; query starts, context
    // lengths, runs' query starts and block tables a sequence; 16 bytes of
    // alignment an array); then the greedy and sampled rows'.
    auto meta = [](int64_t tokens, int64_t seqs, int64_t width) {
      return tokens * (4 + 4 + 8 + 4) + (seqs + 1) * 4 + seqs * 4 + 2 * seqs * 4 + seqs * width * 4 + 8 * 16;
    };
    RETURN_IF_ERROR(ReserveMetadata(std::max(meta(T, S, max_blocks_per_seq), meta(B, B, W))));
    RETURN_IF_ERROR(ReserveGreedyRows(S));
    if (gpu_sampling_) RETURN_IF_ERROR(gpu_sampler_.Reserve(S, S * 64, c.vocab_size, stream_));
    return Cuda(cudaStreamSynchronize(stream_), "reserve the step buffers");
  }

  // Every decode bucket's graph (batch B a power of two up to the largest
  // bucket of max_seqs, table width W a power of two from 8 to the bucket of
  // max_blocks_per_seq), each captured by a step of B one-token sequences
  // that write no KV (slot -1) and attend one key of block 0, as padded
  // rows do. A buffer that grew on the way drops the graphs before it: then
  // once more with every buffer at its size.
  //
  // First, every cuBLASLt kernel a step of up to the reserved rows can take
  // is launched once (PreloadProducts).
  absl::Status WarmUp(KvStorage& kv, int max_seqs, int max_blocks_per_seq) override {
    RETURN_IF_ERROR(PreloadProducts());
    if (!cuda_graphs_ || profile_.on() || max_seqs <= 0 || max_blocks_per_seq <= 0) return absl::OkStatus();
    const auto start = std::chrono::steady_clock::now();
    const int top_b = GraphBatch(std::min(max_seqs, kMaxGraphBatch));
    const int top_w = GraphWidth(max_blocks_per_seq);
    if (batch_invariant_) {
      // The top bucket's fixed-split partials (KvBudget counted them), up
      // front: growing on the way would drop the graphs captured before.
      const ModelConfig& c = config();
      RETURN_IF_ERROR(ReserveAttentionWorkspace(kernels::cuda::FixedSplitWorkspaceBytes(
          top_b, c.num_heads, c.head_dim, top_w * kv.layout().block_size, kDecodeKeysPerSplit)));
    }
    std::vector<std::pair<int, int>> buckets;  // (batch, width)
    for (int b = 1; b <= top_b; b *= 2) {
      for (int w = 8; w <= top_w; w *= 2) buckets.emplace_back(b, w);
    }
    const size_t want = buckets.size();
    for (int pass = 0; pass < 2 && graphs_.size() < want; ++pass) {
      for (const auto& [b, w] : buckets) {
        if (graphs_.contains(GraphKey(b, w))) continue;
        BatchInput in;
        in.Clear();
        in.tokens.assign(b, 0);
        in.positions.assign(b, 0);
        in.slot_mapping.assign(b, -1);
        in.context_lens.assign(b, 1);
        for (int s = 1; s <= b; ++s) in.query_start.push_back(s);  // (Clear left its 0)
        for (int s = 0; s < b; ++s) in.logits_rows.push_back(s);
        in.max_blocks_per_seq = w;
        in.block_tables.assign(size_t(b) * w, 0);
        in.decode_seqs = b;
        if (absl::Status st = Run(in, kv); !st.ok()) {
          return absl::Status(st.code(), absl::StrFormat("capturing the decode graph of %d sequences and %d blocks "
                                                         "each: %s",
                                                         b, w, st.message()));
        }
      }
    }
    if (graphs_.size() < want) {
      // (Serving still works: the missing buckets capture on first use.)
      LOG(WARNING) << "cuda runner: only " << graphs_.size() << " of " << want
                   << " decode graphs captured before serving (a bucket's step took the launched path)";
    }
    LOG(INFO) << "cuda runner: " << graphs_.size() << " decode graphs (batches up to " << top_b
              << ", block tables up to " << top_w << " wide) captured in "
              << std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() << " s";
    return absl::OkStatus();
  }
  int decode_graphs() const override { return static_cast<int>(graphs_.size()); }

  // The products' kernels for every row count up to what ReserveSteps sized
  // (LtGemm::Preload: a kernel's first launch waits for the whole device,
  // an NCCL receive posted until its peer sends included), on the step
  // buffers and the first layer's weights; what they write is scratch.
  absl::Status PreloadProducts() {
    if (reserved_tokens_ <= 0) return absl::OkStatus();
    RETURN_IF_ERROR(Cuda(cudaSetDevice(device_), "cudaSetDevice"));
    const auto start = std::chrono::steady_clock::now();
    const ModelConfig& c = config();
    const int T = reserved_tokens_, R = reserved_rows_, H = c.hidden_size, I = c.intermediate_size;
    const int q_size = c.q_size(), qkv_size = q_size + 2 * c.kv_size();
    const LayerWeightsOf<DeviceBuffer>& lw = w_.layers[0];
    struct Shape {
      const void* x;
      int rows, k;
      const void* w;
      int n;
      void* y;
      LtGemm::Out out;
    };
    const Shape shapes[] = {
        {h_.get(), T, H, lw.wqkv.get(), qkv_size, qkv_.get(), LtGemm::Out::kBF16},
        {attn_.get(), T, q_size, lw.wo.get(), H, h_.get(), LtGemm::Out::kBF16},
        {h_.get(), T, H, lw.w_gate_up.get(), 2 * I, gu_.get(), LtGemm::Out::kBF16},
        {act_.get(), T, I, lw.w_down.get(), H, h_.get(), LtGemm::Out::kBF16},
        {last_.get(), R, H, w_.output_matrix().get(), c.vocab_size, logits_.get(), LtGemm::Out::kF32}};
    int algorithms = 0;
    for (const Shape& sh : shapes) {
      ASSIGN_OR_RETURN(const int n, gemm_->Preload(sh.x, sh.rows, sh.k, sh.w, sh.n, sh.y, sh.out, stream_));
      algorithms += n;
    }
    RETURN_IF_ERROR(Cuda(cudaStreamSynchronize(stream_), "preload the products"));
    LOG(INFO) << "cuda runner: " << algorithms << " cuBLASLt algorithms launched for products of up to " << T
              << " rows in " << std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() << " s";
    return absl::OkStatus();
  }

  absl::Status Logits(const BatchInput& in, KvStorage& kv, std::vector<float>* logits) override {
    absl::Status status = Run(in, kv);
    profile_.Collect("logits", 0);
    RETURN_IF_ERROR(status);
    const size_t n = in.logits_rows.size() * size_t(config().vocab_size);
    logits->resize(n);
    if (n > 0) {
      RETURN_IF_ERROR(
          Cuda(cudaMemcpyAsync(logits->data(), logits_.get(), n * sizeof(float), cudaMemcpyDeviceToHost, stream_),
               "download logits"));
    }
    return Cuda(cudaStreamSynchronize(stream_), "synchronize");
  }

  // Rows that want the plain greedy token (no penalties, masks or logprobs)
  // take it from an argmax on the GPU, the others from the GPU sampler (or,
  // with --host-sampling, the host sampler: the same tokens).
  absl::Status Step(const BatchInput& in, std::span<const RowSampling> rows, KvStorage& kv,
                    std::vector<SampledToken>* sampled) override {
    const auto wall_start = std::chrono::steady_clock::now();
    absl::Status status = Sample(in, rows, kv, sampled);
    if (profile_.on()) {
      const char* kind = in.decode_seqs == 0 ? "prefill" : in.prefill_tokens == 0 ? "decode" : "mixed";
      profile_.Collect(
          absl::StrCat(kind, " (", in.num_seqs(), " seqs, ", in.num_tokens(), " tokens)"),
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - wall_start).count());
    }
    return status;
  }

  absl::Status Sample(const BatchInput& in, std::span<const RowSampling> rows, KvStorage& kv,
                      std::vector<SampledToken>* sampled) {
    sampled->clear();
    if (rows.size() != in.logits_rows.size()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%d sampling rows for %d logits rows", rows.size(), in.logits_rows.size()));
    }
    if (error_word_.empty()) {
      ASSIGN_OR_RETURN(error_word_, cuda_util::PinnedBuffer::Allocate(64, "the error word"));
    }
    int* error_word = static_cast<int*>(error_word_.get());
    *error_word = 0;
    RETURN_IF_ERROR(Run(in, kv, error_word));
    // After the step's synchronization: the forward pass's kernels' error
    // (a slot or block id past the pool), before any sample is used.
    auto forward_error = [&] { return kernels::cuda::ErrorFromWord(*error_word, attn_workspace_.get(), stream_); };
    const ModelConfig& c = config();
    const size_t vocab = size_t(c.vocab_size);
    if (rows.empty()) {
      RETURN_IF_ERROR(Cuda(cudaStreamSynchronize(stream_), "synchronize"));
      return forward_error();
    }
    greedy_rows_.clear();
    gpu_rows_.clear();
    host_rows_.clear();
    for (size_t i = 0; i < rows.size(); ++i) {
      const SamplingParams& p = *rows[i].params;
      const bool plain = p.temperature == 0.0f && p.logprobs < 0 && p.repetition_penalty == 1.0f &&
                         p.presence_penalty == 0.0f && p.frequency_penalty == 0.0f &&
                         static_cast<int>(rows[i].output.size()) >= p.min_tokens;
      (plain ? greedy_rows_ : gpu_sampling_ ? gpu_rows_ : host_rows_).push_back(static_cast<int>(i));
    }
    const size_t g = greedy_rows_.size();
    if (g > 0) {
      RETURN_IF_ERROR(ReserveGreedyRows(static_cast<int>(g)));
      std::memcpy(pinned_rows_.get(), greedy_rows_.data(), g * sizeof(int));
      int* d_rows = static_cast<int*>(sample_meta_.get());
      int32_t* d_ids = reinterpret_cast<int32_t*>(d_rows + g);
      RETURN_IF_ERROR(
          Cuda(cudaMemcpyAsync(d_rows, pinned_rows_.get(), g * sizeof(int), cudaMemcpyHostToDevice, stream_),
               "upload rows"));
      // (rows, ids, then the argmax's pairs: g * 8 bytes in, 8-byte aligned)
      RETURN_IF_ERROR(Launch(cuda_ops::LaunchArgmax(static_cast<const float*>(logits_.get()), d_rows, int(g),
                                                    c.vocab_size, d_rows + 2 * g, d_ids, stream_),
                             "argmax"));
      RETURN_IF_ERROR(
          Cuda(cudaMemcpyAsync(pinned_ids_.get(), d_ids, g * sizeof(int32_t), cudaMemcpyDeviceToHost, stream_), "ids"));
    }
    float* logits = static_cast<float*>(logits_.get());
    float* host_logits = static_cast<float*>(host_logits_.get());
    // The host sampler's rows' logits (every row's in one copy when all are).
    auto download = [&](std::span<const int> which) -> absl::Status {
      if (which.size() == rows.size()) {
        return Cuda(
            cudaMemcpyAsync(host_logits, logits, rows.size() * vocab * sizeof(float), cudaMemcpyDeviceToHost, stream_),
            "download logits");
      }
      for (int r : which) {
        RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(host_logits + r * vocab, logits + r * vocab, vocab * sizeof(float),
                                             cudaMemcpyDeviceToHost, stream_),
                             "download logits"));
      }
      return absl::OkStatus();
    };
    if (absl::Status st = gpu_sampler_.Enqueue(logits, c.vocab_size, rows, gpu_rows_, c.eos_token_ids, stream_);
        !st.ok()) {
      // Its buffers grow with the rows' token lists: without the memory,
      // the host sampler takes the rows (the same tokens).
      if (st.code() != absl::StatusCode::kResourceExhausted) return st;
      static std::once_flag said;
      std::call_once(said, [&] { LOG(WARNING) << "GPU sampling falls back to the host: " << st; });
      host_rows_.insert(host_rows_.end(), gpu_rows_.begin(), gpu_rows_.end());
      gpu_rows_.clear();
    }
    RETURN_IF_ERROR(download(host_rows_));
    RETURN_IF_ERROR(Cuda(cudaStreamSynchronize(stream_), "synchronize"));
    RETURN_IF_ERROR(forward_error());
    sampled->resize(rows.size());
    const auto* greedy_ids = static_cast<const int32_t*>(pinned_ids_.get());
    for (size_t j = 0; j < g; ++j) (*sampled)[greedy_rows_[j]].token_id = greedy_ids[j];
    // Rows whose walk went past the GPU sampler's candidates: its full pass.
    std::vector<int> late_host_rows;
    if (gpu_sampler_.Finish(rows, sampled)) {
      if (absl::Status st = gpu_sampler_.EnqueueRest(logits, c.vocab_size, stream_); !st.ok()) {
        if (st.code() != absl::StatusCode::kResourceExhausted) return st;
        static std::once_flag said;
        std::call_once(said, [&] { LOG(WARNING) << "GPU sampling's full pass falls back to the host: " << st; });
        late_host_rows = gpu_sampler_.PendingRows();  // their logits as the first pass left them
        RETURN_IF_ERROR(download(late_host_rows));
      }
      RETURN_IF_ERROR(Cuda(cudaStreamSynchronize(stream_), "synchronize"));
      if (late_host_rows.empty() && gpu_sampler_.Finish(rows, sampled)) {
        return absl::InternalError("cuda runner: the GPU sampler's full pass left rows unsampled");
      }
      host_rows_.insert(host_rows_.end(), late_host_rows.begin(), late_host_rows.end());
    }
    // The host rows on the sampler's threads (each row's token is
    // SampleToken's whatever the threads).
    sample_rows_.clear();
    for (int i : host_rows_) {
      const RowSampling& r = rows[i];
      sample_rows_.push_back({.logits = std::span<float>(host_logits + i * vocab, vocab),
                              .params = r.params,
                              .prompt = r.prompt,
                              .output = r.output,
                              .seed = r.seed,
                              .out = &(*sampled)[i]});
    }
    sampler_.Sample(sample_rows_, c.eos_token_ids);
    return absl::OkStatus();
  }

  double Flops(int64_t num_tokens, int64_t attended_keys, int64_t logits_rows) const override {
    return LlamaForwardFlops(config(), num_tokens, attended_keys, logits_rows);
  }

 private:
  // Metadata offsets in the packed upload (bytes, 16-aligned).
  struct MetaLayout {
    size_t tokens, positions, slots, query_start, context_lens, block_tables, logits_rows, run_query_starts, total;
  };

  // One forward pass, its logits rows in logits_ (device) when it returns.
  // With `error_word` (pinned), the kernels' error word is only queued for
  // reading into it: the caller synchronizes later (with the samples) and
  // checks it with kernels::cuda::ErrorFromWord; one synchronization a step.
  absl::Status Run(const BatchInput& in, KvStorage& kv, int* error_word = nullptr) {
    if (kv.location() != MemoryLocation::kDevice || kv.dtype() != kernels::DType::kBF16) {
      return absl::FailedPreconditionError(
          absl::StrCat("the cuda runner needs a bfloat16 KV pool in device memory, got ",
                       kernels::DTypeName(kv.dtype()), " in ", MemoryLocationName(kv.location()), " memory"));
    }
    RETURN_IF_ERROR(Cuda(cudaSetDevice(device_), "cudaSetDevice"));
    const ModelConfig& c = config();
    const int T = in.num_tokens();
    for (int r : in.logits_rows) {
      if (r < 0 || r >= T) return absl::InvalidArgumentError("logits row outside the batch");
    }
    if (T == 0) return absl::OkStatus();
    for (int t = 0; t < T; ++t) {
      if (in.tokens[t] < 0 || in.tokens[t] >= c.vocab_size) {
        return absl::InvalidArgumentError(absl::StrFormat("token id %d outside the vocabulary", in.tokens[t]));
      }
    }
    if (absl::Status st = GraphFits(in) ? EnqueueGraph(in, kv) : Enqueue(in, kv); !st.ok()) {
      // Kernels already queued may record a device error: cleared here, so
      // it is not the next step's.
      cudaStreamSynchronize(stream_);
      kernels::cuda::TakeError(attn_workspace_.get(), stream_).IgnoreError();
      return st;
    }
    if (error_word != nullptr) return kernels::cuda::ReadErrorAsync(attn_workspace_.get(), error_word, stream_);
    // Synchronizes the stream; a slot or block id past the pool is an error.
    return kernels::cuda::TakeError(attn_workspace_.get(), stream_);
  }

  // The step's metadata and forward pass, launched kernel by kernel.
  absl::Status Enqueue(const BatchInput& in, KvStorage& kv) {
    RETURN_IF_ERROR(UploadMetadata(in));
    RETURN_IF_ERROR(ReserveActivations(in.num_tokens(), static_cast<int>(in.logits_rows.size())));
    return Forward(in, kv);
  }

  absl::Status UploadMetadata(const BatchInput& in) {
    MetaLayout m{};
    size_t at = 0;
    auto place = [&](size_t bytes) {
      const size_t here = at;
      at += Align16(bytes);
      return here;
    };
    m.tokens = place(in.tokens.size() * sizeof(int32_t));
    m.positions = place(in.positions.size() * sizeof(int32_t));
    m.slots = place(in.slot_mapping.size() * sizeof(int64_t));
    m.query_start = place(in.query_start.size() * sizeof(int));
    m.context_lens = place(in.context_lens.size() * sizeof(int));
    m.block_tables = place(in.block_tables.size() * sizeof(int32_t));
    m.logits_rows = place(in.logits_rows.size() * sizeof(int));
    // Attention runs: consecutive sequences alike (decoding or prefilling),
    // each with its query_start rebased to 0.
    runs_.clear();
    run_query_starts_.clear();
    auto decoding = [&](int s) {
      return in.prefilling.empty() ? in.query_start[s + 1] - in.query_start[s] == 1 : in.prefilling[s] == 0;
    };
    for (int s0 = 0; s0 < in.num_seqs();) {
      int s1 = s0 + 1;
      while (s1 < in.num_seqs() && decoding(s1) == decoding(s0)) ++s1;
      AttentionRun run{.first_seq = s0, .num_seqs = s1 - s0, .decode = decoding(s0)};
      run.first_token = in.query_start[s0];
      run.num_tokens = in.query_start[s1] - in.query_start[s0];
      run.query_start_index = run_query_starts_.size();
      for (int s = s0; s <= s1; ++s) run_query_starts_.push_back(in.query_start[s] - in.query_start[s0]);
      for (int s = s0; s < s1; ++s) run.max_context = std::max(run.max_context, in.context_lens[s]);
      runs_.push_back(run);
      s0 = s1;
    }
    m.run_query_starts = place(run_query_starts_.size() * sizeof(int));
    m.total = at;
    // (The previous step's copy has finished: every step ends synchronized.)
    RETURN_IF_ERROR(ReserveMetadata(int64_t(m.total)));
    char* h = static_cast<char*>(host_meta_.get());
    auto put = [&](size_t off, const auto& v) { std::memcpy(h + off, v.data(), v.size() * sizeof(v[0])); };
    put(m.tokens, in.tokens);
    put(m.positions, in.positions);
    put(m.slots, in.slot_mapping);
    put(m.query_start, in.query_start);
    put(m.context_lens, in.context_lens);
    put(m.block_tables, in.block_tables);
    put(m.logits_rows, in.logits_rows);
    put(m.run_query_starts, run_query_starts_);
    RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(meta_.get(), host_meta_.get(), m.total, cudaMemcpyHostToDevice, stream_),
                         "upload metadata"));
    meta_layout_ = m;
    return absl::OkStatus();
  }

  template <typename T>
  const T* Meta(size_t offset) const {
    return reinterpret_cast<const T*>(static_cast<const char*>(meta_.get()) + offset);
  }

  // Device bytes of a step's activations at T tokens and R logits rows
  // (what ReserveActivations allocates, plus the attention workspace and
  // what the kernels and cuBLASLt keep).
  int64_t ActivationBytes(int T, int R) const {
    const ModelConfig& c = config();
    const int64_t qkv = c.q_size() + 2 * c.kv_size();
    const int64_t per_token =
        int64_t{c.hidden_size} * (4 + 2) + qkv * 2 + int64_t{c.q_size()} * 2 + int64_t{c.intermediate_size} * (4 + 2);
    const int64_t logits = int64_t{std::max(R, 1)} * (int64_t{c.vocab_size} * 4 + int64_t{c.hidden_size} * 2);
    const int64_t workspace = kernels::cuda::WorkspaceBytes(T, c.num_heads, c.head_dim);
    return int64_t{T} * per_token + logits + workspace + kGemmWorkspaceBytes + (int64_t{256} << 20);
  }

  absl::Status ReserveActivations(int T, int R) {
    const ModelConfig& c = config();
    const int64_t qkv = c.q_size() + 2 * c.kv_size();
    RETURN_IF_ERROR(Reserve(&x_, int64_t{T} * c.hidden_size * 4, "the residual stream", stream_));
    RETURN_IF_ERROR(Reserve(&h_, int64_t{T} * c.hidden_size * 2, "activations", stream_));
    RETURN_IF_ERROR(Reserve(&qkv_, int64_t{T} * qkv * 2, "activations", stream_));
    RETURN_IF_ERROR(Reserve(&attn_, int64_t{T} * c.q_size() * 2, "activations", stream_));
    RETURN_IF_ERROR(Reserve(&gu_, int64_t{T} * 2 * c.intermediate_size * 2, "activations", stream_));
    RETURN_IF_ERROR(Reserve(&act_, int64_t{T} * c.intermediate_size * 2, "activations", stream_));
    RETURN_IF_ERROR(Reserve(&last_, int64_t{std::max(R, 1)} * c.hidden_size * 2, "activations", stream_));
    const int64_t logits_bytes = int64_t{std::max(R, 1)} * c.vocab_size * int64_t{sizeof(float)};
    RETURN_IF_ERROR(Reserve(&logits_, logits_bytes, "logits", stream_));
    RETURN_IF_ERROR(Reserve(&host_logits_, logits_bytes, "pinned logits buffer"));
    int64_t ws = kernels::cuda::kErrorWordBytes;
    for (const AttentionRun& r : runs_) {  // (a graph's run has its width's longest context)
      ws = std::max(ws, FixedSplits(r) ? kernels::cuda::FixedSplitWorkspaceBytes(r.num_tokens, c.num_heads, c.head_dim,
                                                                                 r.max_context, kDecodeKeysPerSplit)
                                       : kernels::cuda::WorkspaceBytes(r.num_tokens, c.num_heads, c.head_dim));
    }
    return ReserveAttentionWorkspace(ws);
  }

  // The attention workspace of at least `ws` bytes, zeroed where it grew
  // (the error word and the kernels' counters; they keep it so).
  absl::Status ReserveAttentionWorkspace(int64_t ws) {
    if (attn_workspace_.bytes() >= ws) return absl::OkStatus();
    RETURN_IF_ERROR(Reserve(&attn_workspace_, ws, "attention workspace", stream_));
    return Cuda(cudaMemsetAsync(attn_workspace_.get(), 0, attn_workspace_.bytes(), stream_),
                "clear the attention workspace");
  }

  // The fixed-split (--batch-invariant) workspace at its largest: every
  // row's partials over the longest context (decode rows; prompt rows too
  // where the prefill kernel does not take the head size), for steps of up
  // to T tokens and S sequences.
  // A decode graph's step counts as its bucket: GraphBatch(S) rows over the
  // padded context, GraphWidth blocks of the largest block size (64; the
  // padded context of a smaller one is no longer).
  int64_t FixedSplitWorkspaceAtMost(int T, int S) const {
    const ModelConfig& c = config();
    int64_t ws = kernels::cuda::FixedSplitWorkspaceBytes(PrefillKernelTakes() ? S : T, c.num_heads, c.head_dim,
                                                         c.max_position_embeddings, kDecodeKeysPerSplit);
    if (cuda_graphs_) {
      const int padded = GraphWidth((c.max_position_embeddings + 63) / 64) * 64;
      ws = std::max(ws, kernels::cuda::FixedSplitWorkspaceBytes(GraphBatch(std::min(S, kMaxGraphBatch)), c.num_heads,
                                                                c.head_dim, padded, kDecodeKeysPerSplit));
    }
    return ws;
  }

  // The step metadata's pinned and device buffers for `bytes` (twice that
  // where they grow).
  absl::Status ReserveMetadata(int64_t bytes) {
    if (host_meta_.bytes() < bytes) RETURN_IF_ERROR(Reserve(&host_meta_, bytes * 2, "pinned metadata buffer"));
    return Reserve(&meta_, host_meta_.bytes(), "step metadata", stream_);
  }

  // The greedy rows' buffers for `g` rows (their indices and argmax ids).
  absl::Status ReserveGreedyRows(int g) {
    RETURN_IF_ERROR(Reserve(&pinned_rows_, int64_t{g} * int64_t{sizeof(int)}, "pinned rows"));
    RETURN_IF_ERROR(Reserve(&pinned_ids_, int64_t{g} * int64_t{sizeof(int32_t)}, "pinned ids"));
    return Reserve(&sample_meta_, int64_t{g} * 8 + cuda_ops::ArgmaxWorkspaceBytes(g), "sampling", stream_);
  }

  absl::Status Forward(const BatchInput& in, KvStorage& kv) {
    const ModelConfig& c = config();
    const int T = in.num_tokens();
    const int R = static_cast<int>(in.logits_rows.size());
    const int H = c.hidden_size, I = c.intermediate_size;
    const int q_size = c.q_size(), kv_size = c.kv_size(), qkv_size = q_size + 2 * kv_size;
    const MetaLayout& m = meta_layout_;
    void* s = stream_;
    const kernels::KvLayout& layout = kv.layout();

    profile_.Mark("begin", s);
    RETURN_IF_ERROR(Launch(cuda_ops::LaunchEmbed(Meta<int32_t>(m.tokens), T, w_.embed.get(), H, X(), s), "embed"));
    profile_.Mark("embed", s);

    kernels::PagedAttentionParams attn{.backend = kernels::Backend::kCuda,
                                       .q = qkv_.get(),
                                       .q_stride_bytes = int64_t{qkv_size} * 2,
                                       .out = attn_.get(),
                                       .kv_cache = kv.data(),
                                       .layout = layout,
                                       .layer = 0,
                                       .num_heads = c.num_heads,
                                       .scale = static_cast<float>(1.0 / std::sqrt(double(c.head_dim))),
                                       .num_seqs = in.num_seqs(),
                                       .query_start = Meta<int>(m.query_start),
                                       .context_lens = Meta<int>(m.context_lens),
                                       .block_tables = Meta<int32_t>(m.block_tables),
                                       .max_blocks_per_seq = in.max_blocks_per_seq,
                                       .host_query_start = in.query_start.data(),
                                       .host_context_lens = in.context_lens.data(),
                                       .stream = s,
                                       .workspace = attn_workspace_.get(),
                                       .workspace_bytes = attn_workspace_.bytes()};
    cuda_ops::RopeWriteArgs rope{.qkv = qkv_.get(),
                                 .num_tokens = T,
                                 .qkv_stride = qkv_size,
                                 .positions = Meta<int32_t>(m.positions),
                                 .inv_freq = static_cast<const double*>(inv_freq_.get()),
                                 .num_heads = c.num_heads,
                                 .num_kv_heads = c.num_kv_heads,
                                 .head_dim = c.head_dim,
                                 .slot_mapping = Meta<int64_t>(m.slots),
                                 .error = static_cast<int*>(attn_workspace_.get())};
    const float eps = c.rms_norm_eps;
    auto opt = [](const DeviceBuffer& b) -> const void* { return b.empty() ? nullptr : b.get(); };
    if (T >= 1 && T <= fused_rows_ && int64_t{T} * H <= cuda_ops::kMaxGemvNormWidth) {
      // One token (or up to fused_rows_): the fused products fold the norms,
      // the residual adds, SiLU-and-multiply, RoPE and the KV write in (five
      // kernels a layer, attention one of them, instead of ten). From
      // fused_norm_rows_ tokens on, the norms run as kernels of their own
      // (into h_) and the products read their x: a product that norms its
      // own x does so in every CTA, for every token.
      const bool norm_apart = T >= fused_norm_rows_;
      // The QKV or gate/up product's x: the normed residual (`weight`), by
      // the product itself or by a norm kernel before it.
      auto normed = [&](const DeviceBuffer& weight, cuda_ops::GemvFusion f,
                        const void** x) -> absl::StatusOr<cuda_ops::GemvFusion> {
        if (!norm_apart) {
          f.norm_x = X();
          f.norm_weight = weight.get();
          f.eps = eps;
          *x = nullptr;
          return f;
        }
        RETURN_IF_ERROR(Launch(
            cuda_ops::LaunchAddRmsNorm(X(), nullptr, T, H, nullptr, nullptr, weight.get(), eps, h_.get(), s), "norm"));
        *x = h_.get();
        return f;
      };
      for (int l = 0; l < c.num_layers; ++l) {
        const LayerWeightsOf<DeviceBuffer>& lw = w_.layers[l];
        rope.bias = opt(lw.bqkv);
        rope.pool = kernels::cuda::internal::ViewOf(layout, kv.data(), l);
        const void* x = nullptr;
        if (fused_rope_) {  // the QKV product with RoPE and the KV write in its epilogue
          ASSIGN_OR_RETURN(const cuda_ops::GemvFusion f, normed(lw.input_norm, {.bias = rope.bias, .rope = rope}, &x));
          RETURN_IF_ERROR(
              Fused(T, x, H, lw.wqkv.get(), qkv_size / 2, nullptr, cuda_ops::GemvEpilogue::kRopeWriteKv, f, s));
        } else {
          ASSIGN_OR_RETURN(const cuda_ops::GemvFusion f, normed(lw.input_norm, {}, &x));
          RETURN_IF_ERROR(Fused(T, x, H, lw.wqkv.get(), qkv_size, qkv_.get(), cuda_ops::GemvEpilogue::kStore, f, s));
          RETURN_IF_ERROR(Launch(cuda_ops::LaunchRopeWriteKv(rope, s), "rope and KV write"));
        }
        profile_.Mark("qkv product + rope + KV write", s);
        attn.layer = l;
        RETURN_IF_ERROR(Attention(in, attn));
        profile_.Mark("attention", s);
        RETURN_IF_ERROR(Fused(T, attn_.get(), q_size, lw.wo.get(), H, nullptr, cuda_ops::GemvEpilogue::kResidual,
                              {.residual = X(), .bias = opt(lw.bo)}, s));
        profile_.Mark("o product", s);
        ASSIGN_OR_RETURN(const cuda_ops::GemvFusion gu, normed(lw.post_norm, {.bias = opt(lw.b_gate_up)}, &x));
        RETURN_IF_ERROR(Fused(T, x, H, lw.w_gate_up.get(), I, act_.get(), cuda_ops::GemvEpilogue::kSiluMul, gu, s));
        profile_.Mark("gate/up product", s);
        RETURN_IF_ERROR(Fused(T, act_.get(), I, lw.w_down.get(), H, nullptr, cuda_ops::GemvEpilogue::kResidual,
                              {.residual = X(), .bias = opt(lw.b_down)}, s));
        profile_.Mark("down product", s);
      }
      return FinalNormAndHead(R, m, s, /*one_row=*/true);
    }
    // h = the first layer's normed input; afterwards each product's output
    // (bf16, in h_) is added to the residual by the kernel that norms it for
    // the next product.
    RETURN_IF_ERROR(Launch(cuda_ops::LaunchAddRmsNorm(X(), nullptr, T, H, nullptr, nullptr,
                                                      w_.layers[0].input_norm.get(), eps, h_.get(), s),
                           "norm"));
    profile_.Mark("norms", s);
    // Steps of a few tokens: the QKV and gate/up products on the tensor
    // cores with RoPE and the KV write, or the bias and SiLU-and-multiply, in
    // their epilogues (two kernels a layer fewer).
    const bool mma_fused = mma_fused_ && T <= mma_rows_;
    for (int l = 0; l < c.num_layers; ++l) {
      const LayerWeightsOf<DeviceBuffer>& lw = w_.layers[l];
      rope.bias = opt(lw.bqkv);
      rope.pool = kernels::cuda::internal::ViewOf(layout, kv.data(), l);
      if (mma_fused && cuda_ops::GemvMmaFusedSupports(h_.get(), T, H, lw.wqkv.get(), qkv_size / 2,
                                                      cuda_ops::GemvEpilogue::kRopeWriteKv)) {
        RETURN_IF_ERROR(Launch(
            cuda_ops::LaunchGemvMmaFused(h_.get(), T, H, lw.wqkv.get(), qkv_size / 2, nullptr,
                                         cuda_ops::GemvEpilogue::kRopeWriteKv, {.bias = rope.bias, .rope = rope}, s),
            "qkv product with rope"));
        profile_.Mark("qkv product + rope + KV write", s);
      } else {
        RETURN_IF_ERROR(Product(h_.get(), T, H, lw.wqkv.get(), qkv_size, qkv_.get(), LtGemm::Out::kBF16, s));
        profile_.Mark("qkv product", s);
        RETURN_IF_ERROR(Launch(cuda_ops::LaunchRopeWriteKv(rope, s), "rope and KV write"));
        profile_.Mark("rope + KV write", s);
      }
      attn.layer = l;
      RETURN_IF_ERROR(Attention(in, attn));
      profile_.Mark("attention", s);
      RETURN_IF_ERROR(Product(attn_.get(), T, q_size, lw.wo.get(), H, h_.get(), LtGemm::Out::kBF16, s));
      profile_.Mark("o product", s);
      RETURN_IF_ERROR(Launch(
          cuda_ops::LaunchAddRmsNorm(X(), nullptr, T, H, h_.get(), opt(lw.bo), lw.post_norm.get(), eps, h_.get(), s),
          "add and norm"));
      profile_.Mark("norms", s);
      if (mma_fused &&
          cuda_ops::GemvMmaFusedSupports(h_.get(), T, H, lw.w_gate_up.get(), I, cuda_ops::GemvEpilogue::kSiluMul)) {
        RETURN_IF_ERROR(
            Launch(cuda_ops::LaunchGemvMmaFused(h_.get(), T, H, lw.w_gate_up.get(), I, act_.get(),
                                                cuda_ops::GemvEpilogue::kSiluMul, {.bias = opt(lw.b_gate_up)}, s),
                   "gate/up product with silu"));
        profile_.Mark("gate/up product + silu", s);
      } else {
        RETURN_IF_ERROR(Product(h_.get(), T, H, lw.w_gate_up.get(), 2 * I, gu_.get(), LtGemm::Out::kBF16, s));
        profile_.Mark("gate/up product", s);
        if (!lw.b_gate_up.empty()) {
          RETURN_IF_ERROR(Launch(cuda_ops::LaunchAddBias(gu_.get(), T, 2 * I, lw.b_gate_up.get(), s), "mlp bias"));
        }
        RETURN_IF_ERROR(Launch(cuda_ops::LaunchSiluMul(gu_.get(), T, I, act_.get(), s), "silu"));
        profile_.Mark("silu", s);
      }
      RETURN_IF_ERROR(Product(act_.get(), T, I, lw.w_down.get(), H, h_.get(), LtGemm::Out::kBF16, s));
      profile_.Mark("down product", s);
      const bool last = l + 1 == c.num_layers;
      RETURN_IF_ERROR(
          Launch(cuda_ops::LaunchAddRmsNorm(X(), nullptr, T, H, h_.get(), opt(lw.b_down),
                                            last ? nullptr : w_.layers[l + 1].input_norm.get(), eps, h_.get(), s),
                 "add and norm"));
      profile_.Mark("norms", s);
    }
    return FinalNormAndHead(R, m, s, /*one_row=*/false);
  }

  // The logits rows' final norm and the LM head (R rows wanted; `one_row`:
  // the fused one-row path's step, whose LM head is the one-row GEMV).
  absl::Status FinalNormAndHead(int R, const MetaLayout& m, void* s, bool one_row) {
    if (R == 0) return absl::OkStatus();
    const ModelConfig& c = config();
    const int H = c.hidden_size;
    RETURN_IF_ERROR(Launch(cuda_ops::LaunchAddRmsNorm(X(), Meta<int>(m.logits_rows), R, H, nullptr, nullptr,
                                                      w_.final_norm.get(), c.rms_norm_eps, last_.get(), s),
                           "final norm"));
    if (one_row && R == 1) {
      RETURN_IF_ERROR(Launch(cuda_ops::LaunchGemv(last_.get(), 1, H, w_.output_matrix().get(), c.vocab_size,
                                                  logits_.get(), /*f32=*/true, s),
                             "LM head gemv"));
    } else {
      RETURN_IF_ERROR(
          Product(last_.get(), R, H, w_.output_matrix().get(), c.vocab_size, logits_.get(), LtGemm::Out::kF32, s));
    }
    if (bf16_logits_) {
      RETURN_IF_ERROR(
          Launch(cuda_ops::LaunchRoundToBf16(static_cast<float*>(logits_.get()), int64_t{R} * c.vocab_size, s),
                 "round logits"));
    }
    profile_.Mark("final norm + LM head", s);
    return absl::OkStatus();
  }

  // A fused product over the step's `rows` tokens.
  absl::Status Fused(int rows, const void* x, int k, const void* w, int n, void* y, cuda_ops::GemvEpilogue epi,
                     cuda_ops::GemvFusion f, void* s) {
    f.rows = rows;
    return Launch(cuda_ops::LaunchGemvFused(x, k, w, n, y, epi, f, s), "fused gemv");
  }

  float* X() const { return static_cast<float*>(x_.get()); }

  // y = x . w^T: at up to mma_rows_ rows the tensor-core product of a few
  // rows (LaunchGemvMma, where the shape allows), else cuBLASLt; at up to
  // gemv_rows_ rows the CUDA-core GEMV instead (TANDEM_GEMV=N: an A/B
  // experiment). Neither in the batch-invariant mode, whose single-pass
  // products must not change with m.
  absl::Status Product(const void* x, int m, int k, const void* w, int n, void* y, LtGemm::Out out, void* s) {
    const bool f32 = out == LtGemm::Out::kF32;
    if (m <= gemv_rows_) return Launch(cuda_ops::LaunchGemv(x, m, k, w, n, y, f32, s), "gemv");
    if (m <= mma_rows_ && cuda_ops::GemvMmaSupports(x, m, k, w, n)) {
      return Launch(cuda_ops::LaunchGemvMma(x, m, k, w, n, y, f32, s), "gemv mma");
    }
    return gemm_->Gemm(x, m, k, w, n, 0.0f, y, out, s);
  }

  // One layer's attention, a call per run of alike sequences: decoding ones
  // through the split-KV kernel, prefilling ones (whatever their chunk's
  // length) through the prefill kernel, or, with --batch-invariant, through
  // the split-KV kernel with fixed splits where the prefill kernel does not
  // take the head size. With --batch-invariant a row's result depends
  // neither on the other sequences of the step nor on how its prompt was
  // chunked.
  absl::Status Attention(const BatchInput& in, kernels::PagedAttentionParams p) {
    const ModelConfig& c = config();
    const int qkv_size = c.q_size() + 2 * c.kv_size();
    for (const AttentionRun& r : runs_) {
      p.q = static_cast<const char*>(qkv_.get()) + int64_t{r.first_token} * qkv_size * 2;
      p.out = static_cast<char*>(attn_.get()) + int64_t{r.first_token} * c.q_size() * 2;
      p.num_seqs = r.num_seqs;
      p.query_start = Meta<int>(meta_layout_.run_query_starts) + r.query_start_index;
      p.context_lens = Meta<int>(meta_layout_.context_lens) + r.first_seq;
      p.block_tables = Meta<int32_t>(meta_layout_.block_tables) + int64_t{r.first_seq} * in.max_blocks_per_seq;
      p.host_query_start = run_query_starts_.data() + r.query_start_index;
      // Captured into a graph: planned for the longest context the graph's
      // block tables hold (the device reads each sequence's own).
      p.host_context_lens =
          graph_contexts_.empty() ? in.context_lens.data() + r.first_seq : graph_contexts_.data() + r.first_seq;
      p.keys_per_split = FixedSplits(r) ? kDecodeKeysPerSplit : 0;
      p.kernel = r.decode || FixedSplits(r) ? kernels::AttentionKernel::kSplitKv : kernels::AttentionKernel::kPrefill;
      RETURN_IF_ERROR(kernels::PagedAttention(p));
    }
    return absl::OkStatus();
  }

  // A decode step a graph can take: every sequence one token, in order,
  // each its own logits row, at most kMaxGraphBatch of them.
  bool GraphFits(const BatchInput& in) const {
    const int S = in.num_seqs();
    if (!cuda_graphs_ || profile_.on() || S == 0 || S > kMaxGraphBatch || in.num_tokens() != S) return false;
    if (static_cast<int>(in.logits_rows.size()) != S) return false;
    for (int s = 0; s < S; ++s) {
      if (in.query_start[s] != s || in.logits_rows[s] != s) return false;
      if (!in.prefilling.empty() && in.prefilling[s] != 0) return false;
    }
    return in.query_start[S] == S;
  }
  static int Bucket(int n, int least) {
    int b = least;
    while (b < n) b *= 2;
    return b;
  }
  // A decode graph's padding: the batch to a power of two (S <=
  // kMaxGraphBatch), the block tables to a power-of-two width of at least
  // 8; a graph is held under its (batch, width) key.
  static int GraphBatch(int seqs) { return Bucket(seqs, 1); }
  static int GraphWidth(int blocks) { return Bucket(std::max(blocks, 1), 8); }
  static int64_t GraphKey(int batch, int width) { return (int64_t{batch} << 32) | width; }

  // The decode step `in` through the graph of its bucket (captured first
  // if there is none), as Enqueue does.
  absl::Status EnqueueGraph(const BatchInput& in, KvStorage& kv) {
    const int S = in.num_seqs();
    const int B = GraphBatch(S);
    const int W = GraphWidth(in.max_blocks_per_seq);
    const int bs = kv.layout().block_size;
    // The padded step.
    BatchInput& g = graph_in_;
    auto pad = [&](auto& dst, const auto& src, auto fill) {
      dst.assign(src.begin(), src.end());
      dst.resize(B, fill);
    };
    pad(g.tokens, in.tokens, 0);
    pad(g.positions, in.positions, 0);
    pad(g.slot_mapping, in.slot_mapping, int64_t{-1});
    pad(g.context_lens, in.context_lens, 1);
    g.query_start.resize(B + 1);
    g.logits_rows.resize(B);
    for (int s = 0; s <= B; ++s) g.query_start[s] = s;
    for (int s = 0; s < B; ++s) g.logits_rows[s] = s;
    g.prefilling.clear();
    g.max_blocks_per_seq = W;
    g.block_tables.assign(size_t(B) * W, 0);
    for (int s = 0; s < S; ++s) {
      std::copy_n(in.block_tables.begin() + int64_t{s} * in.max_blocks_per_seq, in.max_blocks_per_seq,
                  g.block_tables.begin() + int64_t{s} * W);
    }
    g.prefill_tokens = 0;
    g.decode_seqs = B;
    RETURN_IF_ERROR(UploadMetadata(g));
    if (runs_.size() != 1 || !runs_[0].decode) return absl::InternalError("cuda runner: a graph step is not decode");
    runs_[0].max_context = W * bs;
    graph_contexts_.assign(B, W * bs);
    absl::Status st = ReserveActivations(B, B);
    if (st.ok()) {
      // Every pointer a graph holds: a reallocated buffer drops them all.
      const std::vector<const void*> buffers = {
          meta_.get(), x_.get(),   h_.get(),    qkv_.get(),    attn_.get(),
          gu_.get(),   act_.get(), last_.get(), logits_.get(), attn_workspace_.get(),
          kv.data()};
      if (buffers != graph_buffers_) {
        DropGraphs();
        graph_buffers_ = buffers;
      }
      st = LaunchGraph(g, kv, GraphKey(B, W));
    }
    graph_contexts_.clear();
    return st;
  }

  absl::Status LaunchGraph(const BatchInput& g, KvStorage& kv, int64_t key) {
    auto it = graphs_.find(key);
    if (it == graphs_.end()) {
      RETURN_IF_ERROR(Cuda(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeRelaxed), "begin graph capture"));
      const absl::Status forward = Forward(g, kv);
      cudaGraph_t graph = nullptr;
      const cudaError_t ended = cudaStreamEndCapture(stream_, &graph);
      if (!forward.ok()) {
        if (graph != nullptr) cudaGraphDestroy(graph);
        return forward;
      }
      RETURN_IF_ERROR(Cuda(ended, "end graph capture"));
      cudaGraphExec_t exec = nullptr;
      const cudaError_t made = cudaGraphInstantiate(&exec, graph, 0);
      cudaGraphDestroy(graph);
      RETURN_IF_ERROR(Cuda(made, "instantiate the decode graph"));
      it = graphs_.emplace(key, exec).first;
    }
    return Cuda(cudaGraphLaunch(it->second, stream_), "launch the decode graph");
  }

  void DropGraphs() {
    for (auto& [key, exec] : graphs_) cudaGraphExecDestroy(exec);
    graphs_.clear();
  }

  // Consecutive sequences of a step that attend alike.
  struct AttentionRun {
    int first_seq = 0, num_seqs = 0;
    bool decode = false;  // one query each
    int first_token = 0, num_tokens = 0;
    size_t query_start_index = 0;  // into run_query_starts_
    int max_context = 0;
  };
  // The prefill kernel's head sizes.
  bool PrefillKernelTakes() const { return config().head_dim == 64 || config().head_dim == 128; }
  // A run whose keys are split in fixed runs of kDecodeKeysPerSplit
  // (--batch-invariant): decoding ones, and prompts of head sizes the
  // prefill kernel does not take.
  bool FixedSplits(const AttentionRun& r) const { return batch_invariant_ && (r.decode || !PrefillKernelTakes()); }

  // Decode attention splits each sequence's keys in runs of this many,
  // whatever the batch (see PagedAttentionParams::keys_per_split).
  static constexpr int kDecodeKeysPerSplit = 512;
  // The largest decode batch a graph takes.
  static constexpr int kMaxGraphBatch = 256;

  const int device_;
  const bool batch_invariant_;
  const bool cuda_graphs_;
  int reserved_tokens_ = 0, reserved_rows_ = 0;  // ReserveSteps' sizes (PreloadProducts)
  const bool gpu_sampling_;
  const bool bf16_logits_;  // --logits-dtype bfloat16
  const int gemv_rows_ = [this] {
    const char* e = std::getenv("TANDEM_GEMV");
    const int rows = e != nullptr ? std::atoi(e) : 0;
    return batch_invariant_ ? 0 : std::clamp(rows, 0, cuda_ops::kMaxGemvRows);
  }();
  // Products of up to this many rows run on LaunchGemvMma
  // (TANDEM_MMA_GEMV=N sets it, up to kMaxGemvMmaRows; 0 turns it off).
  // Eight by default: on an H200 (8B, two rounds each) steps of 3 / 4 / 8
  // tokens took 4.68-4.69 / 4.66-4.70 / 4.81-4.83 ms with it against
  // 4.96-5.00 / 4.96-4.98 / 5.01-5.02 through cuBLASLt, and 16 tokens 5.08
  // against 5.04-5.05.
  const int mma_rows_ = [this] {
    const char* e = std::getenv("TANDEM_MMA_GEMV");
    const int rows = e != nullptr ? std::atoi(e) : 8;
    return batch_invariant_ ? 0 : std::clamp(rows, 0, cuda_ops::kMaxGemvMmaRows);
  }();
  // ... with the QKV and gate/up products' epilogues fused in
  // (LaunchGemvMmaFused; TANDEM_MMA_FUSED=0: their own kernels, an A/B).
  const bool mma_fused_ = [] {
    const char* e = std::getenv("TANDEM_MMA_FUSED");
    return e == nullptr || std::string_view(e) != "0";
  }();
  // Steps of one token run the fused one-row products (LaunchGemvFused);
  // TANDEM_FUSED_GEMV=0 turns them off (A/B), as does --batch-invariant
  // (whose rows must not depend on the batch).
  // Steps of two tokens too, by default (TANDEM_FUSED_ROWS=N, N <=
  // kMaxFusedRows, sets the most; each token's sums are in the order of its
  // own one-token launch). On an H200 (8B, 2026-11-29, two rounds each) a
  // two-token step took 4.63 ms that way (with the norm apart, below)
  // against 4.92-4.96 through cuBLASLt; three or four tokens 5.75-5.78
  // against 4.95-4.99 (the products at three and four rows are issue-bound),
  // so steps of three or more run unfused (their products on LaunchGemvMma
  // up to mma_rows_ rows, else cuBLASLt).
  const int fused_rows_ = [this] {
    const char* e = std::getenv("TANDEM_FUSED_GEMV");
    if (batch_invariant_ || (e != nullptr && std::string_view(e) == "0")) return 0;
    const char* rows = std::getenv("TANDEM_FUSED_ROWS");
    return rows != nullptr ? std::clamp(std::atoi(rows), 1, cuda_ops::kMaxFusedRows) : 2;
  }();
  // Fused steps of this many tokens or more norm the residual in a kernel of
  // its own before the QKV and gate/up products instead of in every CTA of
  // them (TANDEM_FUSED_NORM_ROWS=N sets it; 0: never). Two by default: with
  // the norm in every CTA a two-token step took 4.92-4.93 ms (H200, 8B), with
  // the norm apart 4.63; one token is as fast either way (4.29-4.32).
  const int fused_norm_rows_ = [] {
    const char* e = std::getenv("TANDEM_FUSED_NORM_ROWS");
    if (e == nullptr) return 2;
    const int rows = std::atoi(e);
    return rows >= 1 ? rows : std::numeric_limits<int>::max();
  }();
  // ... with RoPE and the KV write in the QKV product (TANDEM_FUSED_ROPE=0:
  // their own kernel; A/B).
  const bool fused_rope_ = [] {
    const char* e = std::getenv("TANDEM_FUSED_ROPE");
    return e == nullptr || std::string_view(e) != "0";
  }();
  StepProfile profile_;
  std::vector<AttentionRun> runs_;
  std::vector<int> run_query_starts_;
  cudaStream_t stream_ = nullptr;
  std::mutex checksum_mu_;
  cudaStream_t checksum_stream_ = nullptr;      // guarded by checksum_mu_
  DeviceBuffer checksum_secret_, checksum_io_;  // guarded by checksum_mu_
  cuda_util::PinnedBuffer error_word_;          // Sample's read of the kernels' error word
  DeviceBuffer gemm_workspace_;
  std::unique_ptr<LtGemm> gemm_;
  DeviceBuffer inv_freq_;
  ModelWeightsOf<DeviceBuffer> w_;
  int64_t weight_bytes_ = 0;
  int64_t free_at_init_ = 0;  // the device's free bytes when Init began
  DeviceBuffer kv_pool_;
  // Per step, grown as needed.
  cuda_util::PinnedBuffer host_meta_;
  MetaLayout meta_layout_{};
  DeviceBuffer meta_, x_, h_, qkv_, attn_, gu_, act_, last_, logits_, attn_workspace_;
  cuda_util::PinnedBuffer host_logits_;
  // Sampling: which rows take the GPU's greedy pick, and its answers.
  std::vector<int> greedy_rows_, host_rows_;
  ParallelSampler sampler_;
  GpuSampler gpu_sampler_;
  std::vector<int> gpu_rows_;
  std::vector<ParallelSampler::Row> sample_rows_;
  // Decode graphs by (batch bucket << 32 | table width), the buffers they
  // hold, the padded step, and while one is captured its planning contexts.
  std::map<int64_t, cudaGraphExec_t> graphs_;
  std::vector<const void*> graph_buffers_;
  BatchInput graph_in_;
  std::vector<int> graph_contexts_;
  DeviceBuffer sample_meta_;
  cuda_util::PinnedBuffer pinned_rows_, pinned_ids_;  // the greedy rows and their argmax ids
};

}  // namespace

absl::StatusOr<std::unique_ptr<ModelRunner>> NewCudaRunner(ModelConfig config,
                                                           std::shared_ptr<const TensorSource> tensors,
                                                           const RunnerOptions& options) {
  auto runner = std::make_unique<CudaRunner>(std::move(config), options);
  RETURN_IF_ERROR(runner->Init(*tensors));
  return std::unique_ptr<ModelRunner>(std::move(runner));
}

}  // namespace tandem::worker
