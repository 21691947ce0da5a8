// Tensor-core prefill over the paged cache. Until it lands, every call takes
// the split-KV kernel (split_kv.cu), which serves any shape correctly.
#include "kernels/cuda/common.cuh"

namespace tandem::kernels::cuda::internal {

bool PrefillSupports(const AttnArgs&) { return false; }

int LaunchPrefill(const AttnArgs&, void*) { return static_cast<int>(cudaErrorNotSupported); }

}  // namespace tandem::kernels::cuda::internal
