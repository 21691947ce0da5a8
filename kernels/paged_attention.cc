// The backend-neutral entry points: dispatch on the params' backend.
#include "kernels/paged_attention.h"

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
  return params.backend == Backend::kCuda ? cuda::PagedAttention(params) : cpu::PagedAttention(params);
}

}  // namespace tandem::kernels
