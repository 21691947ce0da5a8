#include "worker/kv_cache/kv_storage.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_format.h"
#include "common/block_hash.h"
#include "common/status_macros.h"

namespace tandem::worker {

const char* MemoryLocationName(MemoryLocation location) {
  return location == MemoryLocation::kDevice ? "device" : "host";
}

int64_t KvStorage::BlocksForBudget(const kernels::KvLayout& block_layout, int64_t budget_bytes) {
  int64_t per_block = BytesPerBlock(block_layout);
  return per_block > 0 ? budget_bytes / per_block : 0;
}

absl::StatusOr<std::unique_ptr<KvStorage>> KvStorage::Create(const kernels::KvLayout& layout,
                                                             const Allocator& allocator) {
  int64_t bytes = layout.total_bytes();
  if (bytes <= 0) {
    return absl::InvalidArgumentError("KV cache: the memory budget holds no block");
  }
  if (allocator) {
    absl::StatusOr<KvMemory> m = allocator(bytes);
    if (!m.ok()) {
      return absl::ResourceExhaustedError(
          absl::StrFormat("KV cache: the allocator cannot give %d bytes for %d blocks: %s", bytes, layout.num_blocks,
                          m.status().message()));
    }
    return std::unique_ptr<KvStorage>(new KvStorage(layout, *m, bytes, false));
  }
  void* p = mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(absl::StrFormat("KV cache: cannot map %d bytes for %d blocks: %s", bytes,
                                                        layout.num_blocks, std::strerror(errno)));
  }
  return std::unique_ptr<KvStorage>(new KvStorage(layout, KvMemory{.data = p}, bytes, true));
}

absl::StatusOr<std::vector<uint64_t>> KvStorage::BlockChecksums(std::span<const int32_t> blocks) const {
  for (int32_t block : blocks) {
    if (block < 0 || block >= layout_.num_blocks) {
      return absl::OutOfRangeError(
          absl::StrFormat("KV block %d is outside the pool's %d blocks", block, layout_.num_blocks));
    }
  }
  const int64_t bytes = BytesPerBlock(layout_);
  if (blocks.empty()) return std::vector<uint64_t>();
  if (location_ != MemoryLocation::kHost) {
    if (!checksums_) return absl::UnimplementedError("this device pool's allocator gave no way to checksum its blocks");
    return checksums_(data_, bytes, blocks);
  }
  std::vector<uint64_t> sums;
  sums.reserve(blocks.size());
  for (int32_t block : blocks) {
    sums.push_back(HashBytes(static_cast<const unsigned char*>(data_) + block * bytes, static_cast<size_t>(bytes)));
  }
  return sums;
}

absl::StatusOr<uint64_t> KvStorage::BlockChecksum(int32_t block) const {
  ASSIGN_OR_RETURN(std::vector<uint64_t> sums, BlockChecksums(std::span<const int32_t>(&block, 1)));
  return sums.at(0);
}

KvStorage::~KvStorage() {
  if (owned_) munmap(data_, static_cast<size_t>(bytes_));
}

}  // namespace tandem::worker
