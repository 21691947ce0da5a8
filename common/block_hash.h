// The chained KV block hash: the one contract the workers' prefix caches and
// the router's KV index must compute identically.
//
//   hash(block) = XXH3_64bits_withSeed(token_ids as little-endian int32 bytes,
//                                      seed = hash(parent block))
//
// The first block of a sequence takes `seed` (ModelInfo.block_hash_seed) as
// its parent. Only full blocks (block_size tokens) are hashed. Thread-safe.
#ifndef TANDEM_COMMON_BLOCK_HASH_H_
#define TANDEM_COMMON_BLOCK_HASH_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace tandem {

uint64_t HashBlock(uint64_t parent_hash, std::span<const int32_t> tokens);

// XXH3-64 (no seed) of arbitrary bytes: prompt fingerprints and KV block
// checksums in the disaggregation protocol.
uint64_t HashBytes(const void* data, size_t size);
inline uint64_t HashTokens(std::span<const int32_t> tokens) { return HashBytes(tokens.data(), tokens.size_bytes()); }

// The 192-byte default secret of XXH3 (HashBytes's), from the library: what
// xxh3_portable.h's Hash64 needs to give HashBytes's values (on a GPU).
void DefaultHashSecret(unsigned char (&secret)[192]);

// Hashes of the first floor(tokens.size() / block_size) full blocks.
std::vector<uint64_t> HashBlocks(uint64_t seed, std::span<const int32_t> tokens, int block_size);

}  // namespace tandem

#endif  // TANDEM_COMMON_BLOCK_HASH_H_
