#include "worker/kv_cache/kv_storage.h"

#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "common/block_hash.h"

namespace tandem::worker {
namespace {

kernels::KvLayout Layout(int64_t blocks) {
  return kernels::KvLayout{.num_layers = 2, .num_kv_heads = 2, .head_dim = 8, .block_size = 4, .num_blocks = blocks};
}

TEST(KvStorageTest, AHostPoolChecksumsEachBlocksBytes) {
  absl::StatusOr<std::unique_ptr<KvStorage>> kv = KvStorage::Create(Layout(3));
  ASSERT_TRUE(kv.ok()) << kv.status();
  EXPECT_EQ((*kv)->location(), MemoryLocation::kHost);
  ASSERT_NE((*kv)->host_f32(), nullptr);
  const int64_t block_bytes = KvStorage::BytesPerBlock((*kv)->layout());
  auto* bytes = static_cast<unsigned char*>((*kv)->data());
  for (int64_t i = 0; i < 3 * block_bytes; ++i) bytes[i] = static_cast<unsigned char>(i * 7);
  absl::StatusOr<uint64_t> one = (*kv)->BlockChecksum(1);
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(*one, HashBytes(bytes + block_bytes, static_cast<size_t>(block_bytes)));
  // One byte of block 1 changes its checksum and no other block's.
  const uint64_t zero = *(*kv)->BlockChecksum(0), two = *(*kv)->BlockChecksum(2);
  bytes[block_bytes + 5] ^= 1;
  EXPECT_NE(*(*kv)->BlockChecksum(1), *one);
  EXPECT_EQ(*(*kv)->BlockChecksum(0), zero);
  EXPECT_EQ(*(*kv)->BlockChecksum(2), two);
  EXPECT_EQ((*kv)->BlockChecksum(3).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ((*kv)->BlockChecksum(-1).status().code(), absl::StatusCode::kOutOfRange);
}

TEST(KvStorageTest, ADevicePoolSaysWhereItLives) {
  const kernels::KvLayout layout = Layout(1);
  std::vector<char> backing(static_cast<size_t>(layout.total_bytes()));
  absl::StatusOr<std::unique_ptr<KvStorage>> kv =
      KvStorage::Create(layout, [&](int64_t bytes) -> absl::StatusOr<KvMemory> {
        EXPECT_EQ(bytes, layout.total_bytes());
        return KvMemory{.data = backing.data(), .location = MemoryLocation::kDevice};
      });
  ASSERT_TRUE(kv.ok()) << kv.status();
  EXPECT_EQ((*kv)->location(), MemoryLocation::kDevice);
  EXPECT_STREQ(MemoryLocationName((*kv)->location()), "device");
  EXPECT_EQ((*kv)->host_f32(), nullptr);
  EXPECT_EQ((*kv)->BlockChecksum(0).status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_TRUE((*kv)->BlockChecksums({}).ok());  // nothing asked: nothing to refuse
  // An allocator that fails is a ResourceExhausted naming the size.
  absl::StatusOr<std::unique_ptr<KvStorage>> none = KvStorage::Create(
      layout, [](int64_t) -> absl::StatusOr<KvMemory> { return absl::ResourceExhaustedError("out of memory"); });
  EXPECT_EQ(none.status().code(), absl::StatusCode::kResourceExhausted);
}

// A device pool's checksums come from its allocator's function, with the
// pool, the block size and the ids (checked first) as given.
TEST(KvStorageTest, ADevicePoolsChecksumsComeFromItsAllocator) {
  const kernels::KvLayout layout = Layout(3);
  std::vector<char> backing(static_cast<size_t>(layout.total_bytes()));
  int calls = 0;
  absl::StatusOr<std::unique_ptr<KvStorage>> kv = KvStorage::Create(layout, [&](int64_t) -> absl::StatusOr<KvMemory> {
    return KvMemory{.data = backing.data(),
                    .location = MemoryLocation::kDevice,
                    .checksums = [&](const void* pool, int64_t block_bytes,
                                     std::span<const int32_t> blocks) -> absl::StatusOr<std::vector<uint64_t>> {
                      ++calls;
                      EXPECT_EQ(pool, backing.data());
                      EXPECT_EQ(block_bytes, layout.block_bytes());
                      std::vector<uint64_t> sums;
                      for (int32_t b : blocks) sums.push_back(1000 + b);
                      return sums;
                    }};
  });
  ASSERT_TRUE(kv.ok()) << kv.status();
  const int32_t ids[] = {2, 0, 2};
  absl::StatusOr<std::vector<uint64_t>> sums = (*kv)->BlockChecksums(ids);
  ASSERT_TRUE(sums.ok()) << sums.status();
  EXPECT_EQ(*sums, (std::vector<uint64_t>{1002, 1000, 1002}));
  EXPECT_EQ(*(*kv)->BlockChecksum(1), 1001u);
  const int32_t bad[] = {1, 3};
  EXPECT_EQ((*kv)->BlockChecksums(bad).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(calls, 2);  // the bad ids never reached it
}

}  // namespace
}  // namespace tandem::worker
