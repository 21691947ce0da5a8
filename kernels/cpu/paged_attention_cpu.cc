// CPU paged attention. Prefill-shaped work (many queries of one sequence)
// gathers the sequence's K and V for one KV head into dense scratch and runs
// two sgemms per tile of queries (QK^T, then PV) through OpenBLAS; the causal
// mask trims each tile's key range. Decode-shaped work (one query) reads the
// cache blocks in place with vector dot products, avoiding the gather.
//
// Batch invariance: a sequence's result depends only on its own queries,
// context and tile boundaries, never on the other sequences in the call.
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "absl/strings/str_format.h"
#include "kernels/cpu/vector_math.h"
#include "kernels/paged_attention.h"

namespace tandem::kernels::cpu {
namespace {

// Queries per sgemm tile. 128 keeps the score tile (heads_per_kv * 128 x
// context) within L2 for contexts of a few thousand while leaving M large
// enough for OpenBLAS to reach its peak rate.
constexpr int kQueryTile = 128;

// The call's arrays as floats, strides in floats.
struct View {
  const float* q;
  int64_t q_stride;
  float* out;
  const float* kv;
};
View ViewOf(const PagedAttentionParams& p) {
  return View{static_cast<const float*>(p.q), p.q_stride_bytes / int64_t{sizeof(float)}, static_cast<float*>(p.out),
              static_cast<const float*>(p.kv_cache)};
}

absl::Status CheckSequence(const PagedAttentionParams& p, int s) {
  int q_len = p.query_start[s + 1] - p.query_start[s];
  int ctx = p.context_lens[s];
  if (q_len < 0 || ctx < q_len) {
    return absl::InvalidArgumentError(
        absl::StrFormat("paged attention: sequence %d has %d queries but context %d", s, q_len, ctx));
  }
  int blocks = (ctx + p.layout.block_size - 1) / p.layout.block_size;
  if (blocks > p.max_blocks_per_seq) {
    return absl::InvalidArgumentError(absl::StrFormat("paged attention: sequence %d needs %d blocks, table holds %d", s,
                                                      blocks, p.max_blocks_per_seq));
  }
  const int32_t* table = p.block_tables + int64_t{s} * p.max_blocks_per_seq;
  for (int b = 0; b < blocks; ++b) {
    if (table[b] < 0 || table[b] >= p.layout.num_blocks) {
      return absl::InvalidArgumentError(absl::StrFormat("paged attention: sequence %d block %d is %d, pool has %d", s,
                                                        b, table[b], p.layout.num_blocks));
    }
  }
  return absl::OkStatus();
}

// One query row against `ctx` keys read in place from the blocks.
void DecodeOneHead(const PagedAttentionParams& p, const float* kv_cache, const int32_t* table, int ctx, int kv_head,
                   const float* q, float* out, std::vector<float>& scores) {
  const KvLayout& L = p.layout;
  const int hd = L.head_dim;
  scores.resize(ctx);
  for (int t = 0; t < ctx; ++t) {
    const float* k = kv_cache + L.OffsetElems(table[t / L.block_size], p.layer, 0, kv_head, t % L.block_size);
    scores[t] = cpu::Dot(q, k, hd) * p.scale;
  }
  float mx = cpu::MaxOf(scores.data(), ctx);
  double sum = cpu::ExpShiftSum(scores.data(), mx, ctx);
  float inv = static_cast<float>(1.0 / sum);
  std::fill(out, out + hd, 0.0f);
  for (int t = 0; t < ctx; ++t) {
    const float* v = kv_cache + L.OffsetElems(table[t / L.block_size], p.layer, 1, kv_head, t % L.block_size);
    cpu::Axpy(scores[t] * inv, v, out, hd);
  }
}

struct Scratch {
  std::vector<float> k, v, q, s, o;
};

// All queries of sequence s for one KV head and its group of query heads.
void PrefillGroup(const PagedAttentionParams& p, const View& a, int s, int kv_head, Scratch& w) {
  const KvLayout& L = p.layout;
  const int hd = L.head_dim;
  const int group = p.num_heads / L.num_kv_heads;
  const int q0 = p.query_start[s];
  const int q_len = p.query_start[s + 1] - q0;
  const int ctx = p.context_lens[s];
  const int first_pos = ctx - q_len;
  const int32_t* table = p.block_tables + int64_t{s} * p.max_blocks_per_seq;
  const int64_t out_stride = int64_t{p.num_heads} * hd;

  // Gather this head's keys and values densely: [ctx, hd].
  w.k.resize(size_t(ctx) * hd);
  w.v.resize(size_t(ctx) * hd);
  for (int t0 = 0; t0 < ctx; t0 += L.block_size) {
    int n = std::min(L.block_size, ctx - t0);
    int64_t blk = table[t0 / L.block_size];
    std::memcpy(&w.k[size_t(t0) * hd], a.kv + L.OffsetElems(blk, p.layer, 0, kv_head, 0), sizeof(float) * n * hd);
    std::memcpy(&w.v[size_t(t0) * hd], a.kv + L.OffsetElems(blk, p.layer, 1, kv_head, 0), sizeof(float) * n * hd);
  }

  for (int i0 = 0; i0 < q_len; i0 += kQueryTile) {
    const int tq = std::min(kQueryTile, q_len - i0);
    // The tile's last query sees keys [0, keys) (all of them when not causal).
    const int keys = p.causal ? first_pos + i0 + tq : ctx;
    const int rows = group * tq;  // row r: head (r / tq), query i0 + (r % tq)
    w.q.resize(size_t(rows) * hd);
    for (int g = 0; g < group; ++g) {
      const int h = kv_head * group + g;
      for (int i = 0; i < tq; ++i) {
        std::memcpy(&w.q[(size_t(g) * tq + i) * hd], a.q + (q0 + i0 + i) * a.q_stride + h * hd, sizeof(float) * hd);
      }
    }
    w.s.resize(size_t(rows) * keys);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, keys, hd, p.scale, w.q.data(), hd, w.k.data(), hd, 0.0f,
                w.s.data(), keys);
    for (int r = 0; r < rows; ++r) {
      float* row = &w.s[size_t(r) * keys];
      const int valid = p.causal ? first_pos + i0 + (r % tq) + 1 : ctx;
      float mx = cpu::MaxOf(row, valid);
      double sum = cpu::ExpShiftSum(row, mx, valid);
      cpu::Scale(row, static_cast<float>(1.0 / sum), valid);
      std::fill(row + valid, row + keys, 0.0f);
    }
    w.o.resize(size_t(rows) * hd);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, hd, keys, 1.0f, w.s.data(), keys, w.v.data(), hd, 0.0f,
                w.o.data(), hd);
    for (int g = 0; g < group; ++g) {
      const int h = kv_head * group + g;
      for (int i = 0; i < tq; ++i) {
        std::memcpy(a.out + (q0 + i0 + i) * out_stride + h * hd, &w.o[(size_t(g) * tq + i) * hd], sizeof(float) * hd);
      }
    }
  }
}

}  // namespace

absl::Status WriteKvCache(const WriteKvParams& p) {
  const KvLayout& L = p.layout;
  if (L.dtype != DType::kF32) {
    return absl::InvalidArgumentError(
        absl::StrFormat("write kv: the CPU kernels take float32, not %s", DTypeName(L.dtype)));
  }
  const int hd = L.head_dim;
  const auto* k = static_cast<const char*>(p.k);
  const auto* v = static_cast<const char*>(p.v);
  auto* cache = static_cast<float*>(p.kv_cache);
  for (int t = 0; t < p.num_tokens; ++t) {
    int64_t slot = p.slot_mapping[t];
    if (slot < 0) continue;  // a padded row
    int64_t block = slot / L.block_size;
    if (block >= L.num_blocks) {
      return absl::InvalidArgumentError(
          absl::StrFormat("write kv: token %d maps to slot %d outside the pool", t, slot));
    }
    int off = static_cast<int>(slot % L.block_size);
    const auto* kt = reinterpret_cast<const float*>(k + t * p.src_stride_bytes);
    const auto* vt = reinterpret_cast<const float*>(v + t * p.src_stride_bytes);
    for (int h = 0; h < L.num_kv_heads; ++h) {
      std::memcpy(cache + L.OffsetElems(block, p.layer, 0, h, off), kt + h * hd, sizeof(float) * hd);
      std::memcpy(cache + L.OffsetElems(block, p.layer, 1, h, off), vt + h * hd, sizeof(float) * hd);
    }
  }
  return absl::OkStatus();
}

absl::Status PagedAttention(const PagedAttentionParams& p) {
  if (p.layout.dtype != DType::kF32) {
    return absl::InvalidArgumentError(
        absl::StrFormat("paged attention: the CPU kernels take float32, not %s", DTypeName(p.layout.dtype)));
  }
  if (p.layout.num_kv_heads <= 0 || p.num_heads % p.layout.num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "paged attention: %d query heads is not a multiple of %d kv heads", p.num_heads, p.layout.num_kv_heads));
  }
  for (int s = 0; s < p.num_seqs; ++s) {
    absl::Status st = CheckSequence(p, s);
    if (!st.ok()) return st;
  }
  const int hd = p.layout.head_dim;
  const int group = p.num_heads / p.layout.num_kv_heads;
  const int64_t out_stride = int64_t{p.num_heads} * hd;
  const View a = ViewOf(p);
  Scratch scratch;
  for (int s = 0; s < p.num_seqs; ++s) {
    const int q0 = p.query_start[s];
    const int q_len = p.query_start[s + 1] - q0;
    if (q_len == 0) continue;
    if (q_len == 1) {
      const int32_t* table = p.block_tables + int64_t{s} * p.max_blocks_per_seq;
      for (int h = 0; h < p.num_heads; ++h) {
        DecodeOneHead(p, a.kv, table, p.context_lens[s], h / group, a.q + q0 * a.q_stride + h * hd,
                      a.out + q0 * out_stride + h * hd, scratch.s);
      }
      continue;
    }
    for (int kvh = 0; kvh < p.layout.num_kv_heads; ++kvh) PrefillGroup(p, a, s, kvh, scratch);
  }
  return absl::OkStatus();
}

}  // namespace tandem::kernels::cpu
