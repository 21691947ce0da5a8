// KvStorage: the memory of a paged KV pool on the host, laid out as
// kernels::KvLayout describes (one block = one contiguous run). By default
// mapped anonymously (page-aligned, so a transport can register it); a KV
// transport may provide the memory instead (UCX allocates shareable memory,
// which a peer on the same host then copies from directly). Not copyable.
// Access is synchronized by the engine thread.
#ifndef TANDEM_WORKER_KV_CACHE_KV_STORAGE_H_
#define TANDEM_WORKER_KV_CACHE_KV_STORAGE_H_

#include <cstdint>
#include <functional>
#include <memory>

#include "absl/status/statusor.h"
#include "kernels/paged_attention.h"

namespace tandem::worker {

class KvStorage {
 public:
  // The number of blocks of `block_layout` (num_blocks ignored) that fit in
  // `budget_bytes`.
  static int64_t BlocksForBudget(const kernels::KvLayout& block_layout, int64_t budget_bytes);
  static int64_t BytesPerBlock(const kernels::KvLayout& layout) { return layout.block_bytes(); }

  // Memory for a pool of `bytes`, owned by whoever provides it and valid
  // until the storage is gone.
  using Allocator = std::function<absl::StatusOr<void*>(int64_t bytes)>;

  // ResourceExhausted if the memory cannot be mapped (or `allocator` fails).
  static absl::StatusOr<std::unique_ptr<KvStorage>> Create(const kernels::KvLayout& layout,
                                                           const Allocator& allocator = nullptr);
  ~KvStorage();
  KvStorage(const KvStorage&) = delete;
  KvStorage& operator=(const KvStorage&) = delete;

  const kernels::KvLayout& layout() const { return layout_; }
  float* data() { return data_; }
  const float* data() const { return data_; }
  int64_t bytes() const { return bytes_; }

 private:
  KvStorage(const kernels::KvLayout& layout, float* data, int64_t bytes, bool owned)
      : layout_(layout), data_(data), bytes_(bytes), owned_(owned) {}
  kernels::KvLayout layout_;
  float* data_;
  int64_t bytes_;
  bool owned_;  // mapped here (else the allocator's)
};

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_KV_CACHE_KV_STORAGE_H_
