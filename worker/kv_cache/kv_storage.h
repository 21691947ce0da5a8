// KvStorage: the memory of a paged KV pool, laid out as kernels::KvLayout
// describes (one block = one contiguous run, elements of the layout's dtype),
// and where it lives: host memory, by default mapped anonymously
// (page-aligned, so a transport can register it), or what an allocator gives:
// a KV transport's shareable host memory (UCX: a peer on the same host then
// copies from it directly) or a GPU runner's device memory. Not copyable.
// Access is synchronized by the engine thread.
#ifndef TANDEM_WORKER_KV_CACHE_KV_STORAGE_H_
#define TANDEM_WORKER_KV_CACHE_KV_STORAGE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/paged_attention.h"

namespace tandem::worker {

// Where a pool's memory lives.
enum class MemoryLocation : uint8_t { kHost, kDevice };
const char* MemoryLocationName(MemoryLocation location);  // "host", "device"

// The checksums (HashBytes's values) of the blocks `blocks` of a pool at
// `pool`, `block_bytes` each: what a device pool's allocator provides (a GPU
// kernel); the ids are checked by the caller. Any thread.
using KvChecksumFn = std::function<absl::StatusOr<std::vector<uint64_t>>(const void* pool, int64_t block_bytes,
                                                                         std::span<const int32_t> blocks)>;

// Memory an allocator hands a pool.
struct KvMemory {
  void* data = nullptr;
  MemoryLocation location = MemoryLocation::kHost;
  KvChecksumFn checksums;  // device memory: how to checksum its blocks
};

class KvStorage {
 public:
  // The number of blocks of `block_layout` (num_blocks ignored) that fit in
  // `budget_bytes`.
  static int64_t BlocksForBudget(const kernels::KvLayout& block_layout, int64_t budget_bytes);
  static int64_t BytesPerBlock(const kernels::KvLayout& layout) { return layout.block_bytes(); }

  // Memory for a pool of `bytes`, owned by whoever provides it and valid
  // until the storage is gone.
  using Allocator = std::function<absl::StatusOr<KvMemory>(int64_t bytes)>;

  // ResourceExhausted if the memory cannot be mapped (or `allocator` fails).
  static absl::StatusOr<std::unique_ptr<KvStorage>> Create(const kernels::KvLayout& layout,
                                                           const Allocator& allocator = nullptr);
  ~KvStorage();
  KvStorage(const KvStorage&) = delete;
  KvStorage& operator=(const KvStorage&) = delete;

  const kernels::KvLayout& layout() const { return layout_; }
  kernels::DType dtype() const { return layout_.dtype; }
  MemoryLocation location() const { return location_; }
  void* data() { return data_; }
  const void* data() const { return data_; }
  int64_t bytes() const { return bytes_; }
  // Checksums of blocks' bytes (the hand-off's integrity check,
  // common/block_hash.h's HashBytes), one per id. A device pool's come from
  // its allocator's KvChecksumFn (Unimplemented without one); OutOfRange for
  // an id outside the pool.
  absl::StatusOr<std::vector<uint64_t>> BlockChecksums(std::span<const int32_t> blocks) const;
  absl::StatusOr<uint64_t> BlockChecksum(int32_t block) const;
  // The pool as float32 elements on the host (the CPU runner's); null for
  // any other dtype or location.
  float* host_f32() {
    return location_ == MemoryLocation::kHost && layout_.dtype == kernels::DType::kF32 ? static_cast<float*>(data_)
                                                                                       : nullptr;
  }

 private:
  KvStorage(const kernels::KvLayout& layout, KvMemory memory, int64_t bytes, bool owned)
      : layout_(layout),
        data_(memory.data),
        location_(memory.location),
        checksums_(std::move(memory.checksums)),
        bytes_(bytes),
        owned_(owned) {}
  kernels::KvLayout layout_;
  void* data_;
  MemoryLocation location_;
  KvChecksumFn checksums_;
  int64_t bytes_;
  bool owned_;  // mapped here (else the allocator's)
};

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_KV_CACHE_KV_STORAGE_H_
