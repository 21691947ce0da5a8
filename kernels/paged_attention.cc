// The backend-neutral entry points: dispatch on the params' backend.
#include "kernels/paged_attention.h"

#include <cmath>

#include "absl/strings/str_format.h"

namespace tandem::kernels {

const char* DTypeName(DType t) {
  switch (t) {
    case DType::kF32:
      return "float32";
    case DType::kBF16:
      return "bfloat16";
    case DType::kF16:
      return "float16";
  }
  return "unknown";
}

absl::Status WriteKvCache(const WriteKvParams& params) {
  return params.backend == Backend::kCuda ? cuda::WriteKvCache(params) : cpu::WriteKvCache(params);
}

absl::Status PagedAttention(const PagedAttentionParams& params) {
  // Both backends: the CUDA kernels take row maxima on unscaled scores (the
  // prefill) or scale before masking (split-KV), which agree only for a
  // finite, positive scale.
  if (!std::isfinite(params.scale) || params.scale <= 0.0f) {
    return absl::InvalidArgumentError(
        absl::StrFormat("paged attention: scale %g must be finite and positive", static_cast<double>(params.scale)));
  }
  return params.backend == Backend::kCuda ? cuda::PagedAttention(params) : cpu::PagedAttention(params);
}

}  // namespace tandem::kernels
