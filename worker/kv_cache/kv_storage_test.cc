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
  // An allocator that fails is a ResourceExhausted naming the size.
  absl::StatusOr<std::unique_ptr<KvStorage>> none = KvStorage::Create(
      layout, [](int64_t) -> absl::StatusOr<KvMemory> { return absl::ResourceExhaustedError("out of memory"); });
  EXPECT_EQ(none.status().code(), absl::StatusCode::kResourceExhausted);
}

}  // namespace
}  // namespace tandem::worker
