// GPU sampling: sampling_kernels.h describes the contract. One CTA of 1024
// threads per row; every step mirrors worker/sampling/sampler.cc, whose
// comments give the reasons for each rule.
#include <cuda_runtime.h>

#include <cfloat>
#include <climits>
#include <cstdint>

#include "worker/runner/cuda/clean_logit.cuh"
#include "worker/runner/cuda/sampling_kernels.h"
#include "worker/sampling/sampling_math.h"

namespace tandem::worker::cuda_ops {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kLanes = 8;        // the host's LaneSum lanes
constexpr int kSumChunk = 1024;  // numerators staged per round (a multiple of kLanes)

struct Shared {
  unsigned hist[256];
  union {
    struct {
      unsigned long long cand[kSampleCandidates];  // order key << 32 | ~id: larger comes first
      double w[kSampleCandidates];
    };
    unsigned offs[kWarps][256];  // the full sort's per-warp digit counts, then positions
  };
  double buf[kSumChunk];
  double lanes[kLanes];
  float red_f[kWarps];
  int red_i[kWarps];
  int warp_count[kWarps];
  unsigned sel_bin;
  int sel_rem;
  int n_greater;
  int token;
  double total;
};

// A float's place in the order as an unsigned (larger float, larger key);
// -0 counts as +0, as the host's comparisons see them.
__device__ __forceinline__ unsigned OrderKey(float v) {
  if (v == 0.0f) v = 0.0f;
  const unsigned b = __float_as_uint(v);
  return (b & 0x80000000u) != 0 ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ unsigned long long Packed(unsigned key, int id) {
  return (static_cast<unsigned long long>(key) << 32) | static_cast<unsigned>(~static_cast<unsigned>(id));
}
__device__ __forceinline__ int PackedId(unsigned long long p) { return static_cast<int>(~static_cast<unsigned>(p)); }

// The largest of x[0, n). Every thread gets it.
__device__ float BlockMax(const float* x, int n, Shared& s) {
  float m = -INFINITY;
  for (int i = threadIdx.x; i < n; i += kThreads) m = fmaxf(m, x[i]);
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (threadIdx.x % 32 == 0) s.red_f[threadIdx.x / 32] = m;
  __syncthreads();
  m = s.red_f[0];
  for (int w = 1; w < kWarps; ++w) m = fmaxf(m, s.red_f[w]);
  __syncthreads();
  return m;
}

// The first index of the largest of x[0, n) (-0 == +0). Every thread gets it.
__device__ int BlockArgmax(const float* x, int n, Shared& s) {
  float best = -INFINITY;
  int best_id = INT_MAX;
  for (int i = threadIdx.x; i < n; i += kThreads) {
    if (best_id == INT_MAX || x[i] > best) {  // ids grow along a thread's walk
      best = x[i];
      best_id = i;
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    const float v = __shfl_xor_sync(0xffffffffu, best, o);
    const int id = __shfl_xor_sync(0xffffffffu, best_id, o);
    if (id != INT_MAX && (best_id == INT_MAX || v > best || (v == best && id < best_id))) {
      best = v;
      best_id = id;
    }
  }
  if (threadIdx.x % 32 == 0) {
    s.red_f[threadIdx.x / 32] = best;
    s.red_i[threadIdx.x / 32] = best_id;
  }
  __syncthreads();
  best = s.red_f[0];
  best_id = s.red_i[0];
  for (int w = 1; w < kWarps; ++w) {
    const float v = s.red_f[w];
    const int id = s.red_i[w];
    if (id != INT_MAX && (best_id == INT_MAX || v > best || (v == best && id < best_id))) {
      best = v;
      best_id = id;
    }
  }
  __syncthreads();
  return best_id == INT_MAX ? 0 : best_id;
}

// Sum over the vocabulary of e^((x[i] - mx) / temperature), in the host's
// LaneSum order: eight running sums (element i to sum i % 8) over the whole
// groups of eight, added in lane order, then the remaining elements one by
// one. The numerators are staged a chunk at a time; eight threads add.
__device__ double WholeTotal(const float* x, int n, float mx, double temperature, Shared& s) {
  using sampling_math::SamplingExp;
  const int whole = n - n % kLanes;
  double acc = 0.0;
  for (int base = 0; base < whole; base += kSumChunk) {
    const int m = min(kSumChunk, whole - base);
    for (int j = threadIdx.x; j < m; j += kThreads) {
      s.buf[j] =
          SamplingExp(__ddiv_rn(__dsub_rn(static_cast<double>(x[base + j]), static_cast<double>(mx)), temperature));
    }
    __syncthreads();
    if (threadIdx.x < kLanes) {
      for (int j = threadIdx.x; j < m; j += kLanes) acc = __dadd_rn(acc, s.buf[j]);
    }
    __syncthreads();
  }
  if (threadIdx.x < kLanes) s.lanes[threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    double sum = 0.0;
    for (int l = 0; l < kLanes; ++l) sum = __dadd_rn(sum, s.lanes[l]);
    for (int i = whole; i < n; ++i) {
      sum = __dadd_rn(
          sum, SamplingExp(__ddiv_rn(__dsub_rn(static_cast<double>(x[i]), static_cast<double>(mx)), temperature)));
    }
    s.total = sum;
  }
  __syncthreads();
  const double total = s.total;
  __syncthreads();
  return total;
}

// s.cand[0, count) = the first `count` = min(want, n) elements of x in the
// sampling order (larger first, ties by lower id), sorted. want <= kSampleCandidates.
__device__ int BlockTopOrder(const float* x, int n, int want, Shared& s) {
  const int count = min(want, n);
  if (count <= 0) return 0;
  const int tid = threadIdx.x;
  // Radix select, most significant byte first: the count-th largest key.
  unsigned prefix = 0, mask = 0;
  int remaining = count;
  for (int shift = 24; shift >= 0; shift -= 8) {
    if (tid < 256) s.hist[tid] = 0;
    __syncthreads();
    for (int i = tid; i < n; i += kThreads) {
      const unsigned k = OrderKey(x[i]);
      if ((k & mask) == prefix) atomicAdd(&s.hist[(k >> shift) & 255u], 1u);
    }
    __syncthreads();
    if (tid == 0) {
      int above = 0;
      for (int b = 255; b >= 0; --b) {
        const int h = static_cast<int>(s.hist[b]);
        if (above + h >= remaining) {
          s.sel_bin = static_cast<unsigned>(b);
          s.sel_rem = remaining - above;
          break;
        }
        above += h;
      }
      s.n_greater = 0;
    }
    __syncthreads();
    prefix |= s.sel_bin << shift;
    mask |= 255u << shift;
    remaining = s.sel_rem;
    __syncthreads();
  }
  // Keys above the threshold go to [0, count - remaining) in any order; the
  // `remaining` lowest ids equal to it fill [count - remaining, count).
  const unsigned threshold = prefix;
  const int first_equal = count - remaining;
  const int lane = tid % 32, warp = tid / 32;
  int equal_before = 0;  // equal keys at lower ids than this round's
  for (int base = 0; base < n; base += kThreads) {
    const int i = base + tid;
    const unsigned k = i < n ? OrderKey(x[i]) : 0u;
    const bool greater = i < n && k > threshold;
    const bool equal = i < n && k == threshold;
    if (greater) s.cand[atomicAdd(&s.n_greater, 1)] = Packed(k, i);
    const unsigned ballot = __ballot_sync(0xffffffffu, equal);
    if (lane == 0) s.warp_count[warp] = __popc(ballot);
    __syncthreads();
    int rank = equal_before + __popc(ballot & ((1u << lane) - 1u));
    int round_total = 0;
    for (int w = 0; w < kWarps; ++w) {
      if (w < warp) rank += s.warp_count[w];
      round_total += s.warp_count[w];
    }
    if (equal && rank < remaining) s.cand[first_equal + rank] = Packed(k, i);
    equal_before += round_total;
    __syncthreads();
  }
  // Bitonic sort of the (padded) candidates, descending.
  if (tid >= count && tid < kSampleCandidates) s.cand[tid] = 0ull;
  __syncthreads();
  for (int size = 2; size <= kSampleCandidates; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      const int other = tid ^ stride;
      if (tid < kSampleCandidates && other > tid) {
        const unsigned long long a = s.cand[tid], b = s.cand[other];
        const bool descending = (tid & size) == 0;
        if (descending ? a < b : a > b) {
          s.cand[tid] = b;
          s.cand[other] = a;
        }
      }
      __syncthreads();
    }
  }
  return count;
}

// The full sampling order of x[0, n) (larger first, ties by lower id) in
// a[0, n), packed as BlockTopOrder's; b is scratch of n. A stable LSD radix
// sort on the order key, one byte a pass, from a list in id order: each
// warp owns a contiguous segment and walks it in order, so equal keys keep
// their id order. (For a walk past kSampleCandidates: a flat distribution.)
__device__ void FullOrder(const float* x, int n, unsigned long long* a, unsigned long long* b, Shared& s) {
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  for (int i = tid; i < n; i += kThreads) a[i] = Packed(OrderKey(x[i]), i);
  const int seg = (n + kWarps - 1) / kWarps;
  const int begin = min(n, warp * seg), end = min(n, begin + seg);
  const unsigned lower = (1u << lane) - 1u;
  for (int shift = 0; shift < 32; shift += 8) {
    // Descending keys: ascending digits of the complement.
    auto digit = [shift](unsigned long long v) { return 255u - ((static_cast<unsigned>(v >> 32) >> shift) & 255u); };
    for (int j = tid; j < kWarps * 256; j += kThreads) (&s.offs[0][0])[j] = 0;
    __syncthreads();
    for (int base = begin; base < end; base += 32) {
      const int i = base + lane;
      const unsigned d = i < end ? digit(a[i]) : 256u + lane;
      const unsigned peers = __match_any_sync(0xffffffffu, d);
      if (i < end && (peers & lower) == 0) s.offs[warp][d] += __popc(peers);
      __syncwarp();
    }
    __syncthreads();
    if (tid < 256) {
      unsigned total = 0;
      for (int w = 0; w < kWarps; ++w) total += s.offs[w][tid];
      s.hist[tid] = total;
    }
    __syncthreads();
    if (tid == 0) {
      unsigned run = 0;
      for (int d = 0; d < 256; ++d) {
        const unsigned c = s.hist[d];
        s.hist[d] = run;
        run += c;
      }
    }
    __syncthreads();
    if (tid < 256) {
      unsigned run = s.hist[tid];
      for (int w = 0; w < kWarps; ++w) {
        const unsigned c = s.offs[w][tid];
        s.offs[w][tid] = run;
        run += c;
      }
    }
    __syncthreads();
    for (int base = begin; base < end; base += 32) {
      const int i = base + lane;
      const unsigned long long v = i < end ? a[i] : 0ull;
      const unsigned d = i < end ? digit(v) : 256u + lane;
      const unsigned peers = __match_any_sync(0xffffffffu, d);
      if (i < end) b[s.offs[warp][d] + __popc(peers & lower)] = v;
      __syncwarp();
      if (i < end && (peers & lower) == 0) s.offs[warp][d] += __popc(peers);
      __syncwarp();
    }
    __syncthreads();
    unsigned long long* t = a;
    a = b;
    b = t;
  }
  // Four passes: the order is back in the first buffer.
}

// PickInOrder's view of the sorted candidates.
struct CandidateOrder {
  const double* w;
  int64_t listed;
  TANDEM_HD bool KeepFirst(int64_t n) const { return n <= listed; }
  TANDEM_HD bool Has(int64_t i) const { return i < listed; }
  TANDEM_HD double WeightAt(int64_t i) const { return w[i]; }
};

// Calls f(k, token) for every token entry k of the row's lists (an index
// into ids and saved), this thread's share.
template <typename F>
__device__ void ForEachListed(const SampleRowArgs& a, const int32_t* ids, F f) {
  for (int j = threadIdx.x; j < a.rep_count; j += kThreads) f(a.rep_begin + j, ids[a.rep_begin + j]);
  for (int j = threadIdx.x; j < a.freq_count; j += kThreads) f(a.freq_begin + 2 * j, ids[a.freq_begin + 2 * j]);
  for (int j = threadIdx.x; j < a.mask_count; j += kThreads) f(a.mask_begin + j, ids[a.mask_begin + j]);
}

// kFull: the candidates are the whole sorted vocabulary (FullOrder, in
// `full`: 2 * vocab packed entries per CTA) instead of the first
// kSampleCandidates; no row falls back.
template <bool kFull>
__global__ void __launch_bounds__(kThreads)
    SampleKernel(float* logits, int vocab, const SampleRowArgs* rows, const int32_t* ids, float* saved,
                 SampleRowResult* out, unsigned long long* full) {
  __shared__ Shared s;
  const int tid = threadIdx.x;
  const SampleRowArgs a = rows[blockIdx.x];
  float* x = logits + int64_t{a.logits_row} * vocab;
  SampleRowResult* r = out + blockIdx.x;
  for (int i = tid; i < vocab; i += kThreads) {
    const float v = x[i];
    if (!(v >= -FLT_MAX && v <= FLT_MAX) && v != -INFINITY) x[i] = CleanLogit(v);  // NaN or +inf
  }
  __syncthreads();
  // The listed tokens' (cleaned) logits, put back at the end: the row leaves
  // as it came, but for the cleaning, for the host's fallback.
  ForEachListed(a, ids, [&](int k, int t) { saved[k] = x[t]; });
  __syncthreads();

  // The raw distribution, before any processing.
  double log_norm = 0.0;
  if (a.logprobs >= 0) {
    const float mx = BlockMax(x, vocab, s);
    const double total = mx == -INFINITY ? 0.0 : WholeTotal(x, vocab, mx, 1.0, s);
    log_norm = mx == -INFINITY ? static_cast<double>(INFINITY) : static_cast<double>(mx) + log(total);
    const int n = BlockTopOrder(x, vocab, a.logprobs, s);
    if (tid < n) {
      const int id = PackedId(s.cand[tid]);
      r->top_ids[tid] = id;
      r->top_logprobs[tid] = static_cast<float>(__dsub_rn(static_cast<double>(x[id]), log_norm));
    }
    if (tid == 0) r->num_top = n;
    __syncthreads();
  } else if (tid == 0) {
    r->num_top = 0;
  }

  // Penalties and the mask, each a pass over its own list (distinct tokens
  // within a list: no two threads write one logit).
  for (int j = tid; j < a.rep_count; j += kThreads) {
    const int t = ids[a.rep_begin + j];
    const float v = x[t];
    x[t] = v > 0.0f ? fminf(__fdiv_rn(v, a.repetition_penalty), FLT_MAX) : __fmul_rn(v, a.repetition_penalty);
  }
  __syncthreads();
  for (int j = tid; j < a.freq_count; j += kThreads) {
    const int t = ids[a.freq_begin + 2 * j];
    const int c = ids[a.freq_begin + 2 * j + 1];
    float v = x[t];
    v = __fsub_rn(v, __fmul_rn(a.frequency_penalty, static_cast<float>(c)));
    v = __fsub_rn(v, a.presence_penalty);
    x[t] = v;
  }
  __syncthreads();
  for (int j = tid; j < a.mask_count; j += kThreads) x[ids[a.mask_begin + j]] = -INFINITY;
  __syncthreads();

  int token = 0;
  bool fallback = false;
  if (a.temperature == 0.0f) {
    token = BlockArgmax(x, vocab, s);
  } else {
    const float mx = BlockMax(x, vocab, s);
    if (mx != -INFINITY) {
      const int listed = kFull ? vocab : min(vocab, kSampleCandidates);
      const bool cut = a.top_k > 0 && a.top_k < vocab;
      if (cut && a.top_k > listed) {
        fallback = true;
      } else {
        const unsigned long long* cand = s.cand;
        double* w = s.w;
        if constexpr (kFull) {
          unsigned long long* order = full + int64_t{blockIdx.x} * 2 * vocab;
          FullOrder(x, vocab, order, order + vocab, s);
          cand = order;
          w = reinterpret_cast<double*>(order + vocab);
        } else {
          BlockTopOrder(x, vocab, listed, s);
        }
        const double temperature = static_cast<double>(a.temperature);
        for (int i = tid; i < listed; i += kThreads) {
          const double logit = static_cast<double>(x[PackedId(cand[i])]);
          w[i] = sampling_math::SamplingExp(__ddiv_rn(__dsub_rn(logit, static_cast<double>(mx)), temperature));
        }
        const double whole = cut ? 0.0 : WholeTotal(x, vocab, mx, temperature, s);
        __syncthreads();
        if (tid == 0) {
          CandidateOrder order{w, listed};
          const int64_t pick =
              sampling_math::PickInOrder(order, vocab, a.top_k, a.top_p, a.min_p, a.uniform, [whole] { return whole; });
          s.token = pick < 0 ? -1 : PackedId(cand[pick]);
        }
        __syncthreads();
        token = s.token;
        fallback = token < 0;
        if (fallback) token = 0;
      }
    }
  }
  ForEachListed(a, ids, [&](int k, int t) { x[t] = saved[k]; });  // overlapping lists write the same value
  __syncthreads();
  if (tid == 0) {
    r->token = token;
    r->fallback = fallback ? 1 : 0;
    r->logprob =
        a.logprobs >= 0 && !fallback ? static_cast<float>(__dsub_rn(static_cast<double>(x[token]), log_norm)) : 0.0f;
  }
}

}  // namespace

int LaunchSample(float* logits, int vocab, const SampleRowArgs* rows, int num_rows, const int32_t* ids, float* saved,
                 SampleRowResult* out, unsigned long long* full, void* stream) {
  if (num_rows == 0) return 0;
  const auto st = static_cast<cudaStream_t>(stream);
  if (full != nullptr) {
    SampleKernel<true><<<num_rows, kThreads, 0, st>>>(logits, vocab, rows, ids, saved, out, full);
  } else {
    SampleKernel<false><<<num_rows, kThreads, 0, st>>>(logits, vocab, rows, ids, saved, out, nullptr);
  }
  return static_cast<int>(cudaGetLastError());
}

}  // namespace tandem::worker::cuda_ops
