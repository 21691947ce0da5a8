#include "worker/runner/llama_model.h"

#include <cblas.h>

#include <cmath>
#include <cstring>
#include <numbers>

#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "kernels/cpu/vector_math.h"

namespace tandem::worker {
namespace {

// Up to this many rows, a matrix product runs as one sgemv per row. OpenBLAS
// 0.3.21's sgemm packs the whole weight matrix on every call, which at decode
// sizes costs more than streaming the weights once per row through sgemv.
// Measured on builtin:small, 2 cores (tok/s, sgemm only -> sgemv up to N rows):
// decode alone 86 -> 203 (N=1..16 alike); 8 sequences 362 -> 403 (N=8);
// 32 sequences 457 -> 458 (N=8) but 341 (N=32). So N = 8.
constexpr int kGemvMaxRows = 8;

// Y[m, n] = X[m, k] . W[n, k]^T + beta * Y (row-major, W as Hugging Face stores it).
void MatMulT(const float* x, int m, int k, const float* w, int n, float beta, float* y) {
  if (m <= kGemvMaxRows) {
    for (int r = 0; r < m; ++r) {
      cblas_sgemv(CblasRowMajor, CblasNoTrans, n, k, 1.0f, w, k, x + int64_t{r} * k, 1, beta, y + int64_t{r} * n, 1);
    }
    return;
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.0f, x, k, w, k, beta, y, n);
}

void AddBias(float* y, int m, int n, const std::vector<float>& bias) {
  if (bias.empty()) return;
  for (int r = 0; r < m; ++r) {
    float* row = y + int64_t{r} * n;
    for (int j = 0; j < n; ++j) row[j] += bias[j];
  }
}

}  // namespace

// Hugging Face's RoPE frequencies: theta^(-2i/d), then the configured scaling.
std::vector<double> RopeInverseFrequencies(const ModelConfig& c) {
  const int half = c.head_dim / 2;
  std::vector<double> inv(half);
  for (int i = 0; i < half; ++i) inv[i] = std::pow(c.rope.theta, -2.0 * i / c.head_dim);
  const RopeConfig& r = c.rope;
  switch (r.type) {
    case RopeType::kDefault:
      break;
    case RopeType::kLinear:
      for (double& f : inv) f /= r.factor;
      break;
    case RopeType::kLlama3: {
      // Long wavelengths are stretched by `factor`, short ones kept, and the
      // band between interpolated (Llama 3.1's published scheme).
      const double old_ctx = r.original_max_position_embeddings;
      const double low_wavelen = old_ctx / r.low_freq_factor;
      const double high_wavelen = old_ctx / r.high_freq_factor;
      for (double& f : inv) {
        const double wavelen = 2.0 * std::numbers::pi / f;
        if (wavelen > low_wavelen) {
          f = f / r.factor;
        } else if (wavelen >= high_wavelen) {
          const double smooth = (old_ctx / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
          f = (1.0 - smooth) * f / r.factor + smooth * f;
        }
      }
      break;
    }
  }
  return inv;
}

LlamaModel::LlamaModel(ModelConfig config, ModelWeights weights)
    : config_(std::move(config)), w_(std::move(weights)), inv_freq_(RopeInverseFrequencies(config_)) {}

kernels::KvLayout LlamaModel::KvBlockLayout(int block_size) const { return HostKvLayout(config_, block_size); }

void LlamaModel::ComputeRope(const BatchInput& in) {
  // Angles in double: position * inv_freq loses precision in f32 at long contexts.
  const int half = config_.head_dim / 2;
  cos_.resize(size_t(in.num_tokens()) * half);
  sin_.resize(cos_.size());
  for (int t = 0; t < in.num_tokens(); ++t) {
    for (int i = 0; i < half; ++i) {
      const double angle = in.positions[t] * inv_freq_[i];
      cos_[size_t(t) * half + i] = static_cast<float>(std::cos(angle));
      sin_[size_t(t) * half + i] = static_cast<float>(std::sin(angle));
    }
  }
}

// Rotates pairs (i, i + d/2) of every head: Hugging Face's rotate_half layout.
void LlamaModel::ApplyRope(float* x, int num_heads, int64_t row_stride, int num_tokens) const {
  const int hd = config_.head_dim, half = hd / 2;
  for (int t = 0; t < num_tokens; ++t) {
    const float* c = &cos_[size_t(t) * half];
    const float* s = &sin_[size_t(t) * half];
    for (int h = 0; h < num_heads; ++h) {
      float* v = x + t * row_stride + h * hd;
      for (int i = 0; i < half; ++i) {
        const float a = v[i], b = v[i + half];
        v[i] = a * c[i] - b * s[i];
        v[i + half] = b * c[i] + a * s[i];
      }
    }
  }
}

absl::Status LlamaModel::Forward(const BatchInput& in, float* kv_cache, const kernels::KvLayout& layout,
                                 std::vector<float>* logits) {
  const ModelConfig& c = config_;
  const int T = in.num_tokens();
  const int H = c.hidden_size, I = c.intermediate_size, V = c.vocab_size;
  const int q_size = c.q_size(), kv_size = c.kv_size(), qkv_size = q_size + 2 * kv_size;
  if (T == 0) {
    logits->clear();
    return absl::OkStatus();
  }
  for (int t = 0; t < T; ++t) {
    if (in.tokens[t] < 0 || in.tokens[t] >= V) {
      return absl::InvalidArgumentError(absl::StrFormat("token id %d outside the vocabulary", in.tokens[t]));
    }
  }
  x_.resize(size_t(T) * H);
  h_.resize(size_t(T) * H);
  qkv_.resize(size_t(T) * qkv_size);
  attn_.resize(size_t(T) * q_size);
  gu_.resize(size_t(T) * 2 * I);
  act_.resize(size_t(T) * I);
  for (int t = 0; t < T; ++t) {
    std::memcpy(&x_[size_t(t) * H], &w_.embed[size_t(in.tokens[t]) * H], sizeof(float) * H);
  }
  ComputeRope(in);

  kernels::PagedAttentionParams attn{.q = qkv_.data(),
                                     .q_stride_bytes = int64_t{qkv_size} * int64_t{sizeof(float)},
                                     .out = attn_.data(),
                                     .kv_cache = kv_cache,
                                     .layout = layout,
                                     .layer = 0,
                                     .num_heads = c.num_heads,
                                     .scale = static_cast<float>(1.0 / std::sqrt(double(c.head_dim))),
                                     .num_seqs = in.num_seqs(),
                                     .query_start = in.query_start.data(),
                                     .context_lens = in.context_lens.data(),
                                     .block_tables = in.block_tables.data(),
                                     .max_blocks_per_seq = in.max_blocks_per_seq};
  kernels::WriteKvParams write{.k = qkv_.data() + q_size,
                               .v = qkv_.data() + q_size + kv_size,
                               .src_stride_bytes = int64_t{qkv_size} * int64_t{sizeof(float)},
                               .slot_mapping = in.slot_mapping.data(),
                               .num_tokens = T,
                               .layer = 0,
                               .layout = layout,
                               .kv_cache = kv_cache};

  for (int l = 0; l < c.num_layers; ++l) {
    const LayerWeights& lw = w_.layers[l];
    for (int t = 0; t < T; ++t) {
      kernels::cpu::RmsNorm(&x_[size_t(t) * H], lw.input_norm.data(), c.rms_norm_eps, &h_[size_t(t) * H], H);
    }
    MatMulT(h_.data(), T, H, lw.wqkv.data(), qkv_size, 0.0f, qkv_.data());
    AddBias(qkv_.data(), T, qkv_size, lw.bqkv);
    ApplyRope(qkv_.data(), c.num_heads, qkv_size, T);
    ApplyRope(qkv_.data() + q_size, c.num_kv_heads, qkv_size, T);
    write.layer = l;
    RETURN_IF_ERROR(kernels::WriteKvCache(write));
    attn.layer = l;
    RETURN_IF_ERROR(kernels::PagedAttention(attn));
    // Residual add folded into the GEMM (beta = 1).
    if (lw.bo.empty()) {
      MatMulT(attn_.data(), T, q_size, lw.wo.data(), H, 1.0f, x_.data());
    } else {
      MatMulT(attn_.data(), T, q_size, lw.wo.data(), H, 0.0f, h_.data());
      AddBias(h_.data(), T, H, lw.bo);
      for (size_t i = 0; i < x_.size(); ++i) x_[i] += h_[i];
    }

    for (int t = 0; t < T; ++t) {
      kernels::cpu::RmsNorm(&x_[size_t(t) * H], lw.post_norm.data(), c.rms_norm_eps, &h_[size_t(t) * H], H);
    }
    MatMulT(h_.data(), T, H, lw.w_gate_up.data(), 2 * I, 0.0f, gu_.data());
    AddBias(gu_.data(), T, 2 * I, lw.b_gate_up);
    for (int t = 0; t < T; ++t) {
      const float* row = &gu_[size_t(t) * 2 * I];
      kernels::cpu::SiluMul(row, row + I, &act_[size_t(t) * I], I);
    }
    if (lw.b_down.empty()) {
      MatMulT(act_.data(), T, I, lw.w_down.data(), H, 1.0f, x_.data());
    } else {
      MatMulT(act_.data(), T, I, lw.w_down.data(), H, 0.0f, h_.data());
      AddBias(h_.data(), T, H, lw.b_down);
      for (size_t i = 0; i < x_.size(); ++i) x_[i] += h_[i];
    }
  }

  const int rows = static_cast<int>(in.logits_rows.size());
  last_.resize(size_t(rows) * H);
  for (int r = 0; r < rows; ++r) {
    const int t = in.logits_rows[r];
    if (t < 0 || t >= T) return absl::InvalidArgumentError("logits row outside the batch");
    kernels::cpu::RmsNorm(&x_[size_t(t) * H], w_.final_norm.data(), c.rms_norm_eps, &last_[size_t(r) * H], H);
  }
  logits->resize(size_t(rows) * V);
  if (rows > 0) MatMulT(last_.data(), rows, H, w_.output_matrix().data(), V, 0.0f, logits->data());
  return absl::OkStatus();
}

double LlamaForwardFlops(const ModelConfig& c, int64_t num_tokens, int64_t attended_keys, int64_t logits_rows) {
  const double per_token_linear =
      2.0 * c.num_layers *
      (double(c.hidden_size) * (c.q_size() + 2 * c.kv_size()) + double(c.q_size()) * c.hidden_size +
       3.0 * double(c.hidden_size) * c.intermediate_size);
  // QK^T and PV: 2 * head_dim multiply-adds per (query head, key) pair each.
  const double attention = 2.0 * 2.0 * c.num_layers * c.num_heads * double(c.head_dim) * attended_keys;
  const double head = 2.0 * double(c.hidden_size) * c.vocab_size * logits_rows;
  return per_token_linear * num_tokens + attention + head;
}

}  // namespace tandem::worker
