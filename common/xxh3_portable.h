// XXH3-64 (seed 0) written out as plain integer arithmetic that compiles for
// the host and for CUDA devices, so that a GPU kernel can compute the KV
// block checksums the disaggregation protocol carries (common/block_hash.h's
// HashBytes is the xxHash library's XXH3_64bits: the two agree on every
// input; xxh3_portable_test.cc checks it). The 192-byte secret is the
// library's default one, which the caller passes in (DefaultHashSecret in
// block_hash.h reads it from the library).
//
// The long-input pieces (more than 240 bytes) are separate so that a kernel
// can spread a stripe's eight lanes, and a block's sixteen stripes, over a
// warp: within a 1 KiB block the accumulators only add (mod 2^64), so the
// stripes' contributions may be summed in any order before the block's
// scramble.
//
// Thread safety: pure functions.
#ifndef TANDEM_COMMON_XXH3_PORTABLE_H_
#define TANDEM_COMMON_XXH3_PORTABLE_H_

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define TANDEM_XXH_HD __host__ __device__ inline
#else
#define TANDEM_XXH_HD inline
#endif

namespace tandem::xxh3 {

inline constexpr int kSecretSize = 192;
inline constexpr int kStripeLen = 64;
inline constexpr int kStripesPerBlock = (kSecretSize - kStripeLen) / 8;  // 16
inline constexpr int kBlockLen = kStripeLen * kStripesPerBlock;          // 1024
inline constexpr int kLastStripeSecret = kSecretSize - kStripeLen - 7;   // 121
inline constexpr int kScrambleSecret = kSecretSize - kStripeLen;         // 128
inline constexpr int kMergeSecret = 11;
inline constexpr size_t kMidSizeMax = 240;

inline constexpr uint64_t kPrime32_1 = 0x9E3779B1u;
inline constexpr uint64_t kPrime32_2 = 0x85EBCA77u;
inline constexpr uint64_t kPrime32_3 = 0xC2B2AE3Du;
inline constexpr uint64_t kPrime64_1 = 0x9E3779B185EBCA87ull;
inline constexpr uint64_t kPrime64_2 = 0xC2B2AE3D27D4EB4Full;
inline constexpr uint64_t kPrime64_3 = 0x165667B19E3779F9ull;
inline constexpr uint64_t kPrime64_4 = 0x85EBCA77C2B2AE63ull;
inline constexpr uint64_t kPrime64_5 = 0x27D4EB2F165667C5ull;
inline constexpr uint64_t kPrimeMx1 = 0x165667919E3779F9ull;
inline constexpr uint64_t kPrimeMx2 = 0x9FB21C651E98DF25ull;

// Little-endian loads (the host and the GPU are both little-endian).
TANDEM_XXH_HD uint64_t Read64(const unsigned char* p) {
  uint64_t v;
  memcpy(&v, p, sizeof(v));
  return v;
}
TANDEM_XXH_HD uint32_t Read32(const unsigned char* p) {
  uint32_t v;
  memcpy(&v, p, sizeof(v));
  return v;
}

TANDEM_XXH_HD uint64_t Rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
TANDEM_XXH_HD uint64_t Swap64(uint64_t x) {
  x = ((x & 0x00FF00FF00FF00FFull) << 8) | ((x >> 8) & 0x00FF00FF00FF00FFull);
  x = ((x & 0x0000FFFF0000FFFFull) << 16) | ((x >> 16) & 0x0000FFFF0000FFFFull);
  return (x << 32) | (x >> 32);
}

// The 128-bit product of a and b, its halves xor-ed.
TANDEM_XXH_HD uint64_t MulFold64(uint64_t a, uint64_t b) {
#if defined(__CUDA_ARCH__)
  return (a * b) ^ __umul64hi(a, b);
#else
  const unsigned __int128 p = static_cast<unsigned __int128>(a) * b;
  return static_cast<uint64_t>(p) ^ static_cast<uint64_t>(p >> 64);
#endif
}

TANDEM_XXH_HD uint64_t Avalanche(uint64_t h) {
  h ^= h >> 37;
  h *= kPrimeMx1;
  return h ^ (h >> 32);
}
TANDEM_XXH_HD uint64_t Avalanche64(uint64_t h) {
  h ^= h >> 33;
  h *= kPrime64_2;
  h ^= h >> 29;
  h *= kPrime64_3;
  return h ^ (h >> 32);
}
TANDEM_XXH_HD uint64_t Rrmxmx(uint64_t h, uint64_t len) {
  h ^= Rotl64(h, 49) ^ Rotl64(h, 24);
  h *= kPrimeMx2;
  h ^= (h >> 35) + len;
  h *= kPrimeMx2;
  return h ^ (h >> 28);
}
TANDEM_XXH_HD uint64_t Mix16(const unsigned char* p, const unsigned char* secret) {
  return MulFold64(Read64(p) ^ Read64(secret), Read64(p + 8) ^ Read64(secret + 8));
}

// The long path's accumulators, their start values.
TANDEM_XXH_HD uint64_t InitialAcc(int lane) {
  const uint64_t init[8] = {kPrime32_3, kPrime64_1, kPrime64_2, kPrime64_3,
                            kPrime64_4, kPrime32_2, kPrime64_5, kPrime32_1};
  return init[lane];
}
// One lane of one stripe: the stripe's 8-byte word `lane` against the
// secret at `secret`: it adds Product to accumulator `lane` and the word
// itself to accumulator `lane ^ 1`.
TANDEM_XXH_HD uint64_t StripeProduct(uint64_t word, const unsigned char* secret, int lane) {
  const uint64_t key = word ^ Read64(secret + 8 * lane);
  return (key & 0xFFFFFFFFull) * (key >> 32);
}
// The end of each full 1 KiB block.
TANDEM_XXH_HD uint64_t Scramble(uint64_t acc, const unsigned char* secret, int lane) {
  acc ^= acc >> 47;
  acc ^= Read64(secret + kScrambleSecret + 8 * lane);
  return acc * kPrime32_1;
}
TANDEM_XXH_HD uint64_t MergeAccs(const uint64_t (&acc)[8], const unsigned char* secret, uint64_t len) {
  uint64_t result = len * kPrime64_1;
  for (int i = 0; i < 4; ++i) {
    result += MulFold64(acc[2 * i] ^ Read64(secret + kMergeSecret + 16 * i),
                        acc[2 * i + 1] ^ Read64(secret + kMergeSecret + 16 * i + 8));
  }
  return Avalanche(result);
}

// All eight lanes of one stripe into acc.
TANDEM_XXH_HD void Accumulate512(uint64_t (&acc)[8], const unsigned char* p, const unsigned char* secret) {
  for (int i = 0; i < 8; ++i) {
    const uint64_t word = Read64(p + 8 * i);
    acc[i ^ 1] += word;
    acc[i] += StripeProduct(word, secret, i);
  }
}

// XXH3-64 with seed 0 of p[0, len) under the default `secret`.
TANDEM_XXH_HD uint64_t Hash64(const unsigned char* p, size_t len, const unsigned char* secret) {
  if (len == 0) return Avalanche64(Read64(secret + 56) ^ Read64(secret + 64));
  if (len <= 3) {
    const uint32_t c1 = p[0], c2 = p[len >> 1], c3 = p[len - 1];
    const uint32_t combined = (c1 << 16) | (c2 << 24) | c3 | (static_cast<uint32_t>(len) << 8);
    const uint64_t bitflip = static_cast<uint64_t>(Read32(secret) ^ Read32(secret + 4));
    return Avalanche64(static_cast<uint64_t>(combined) ^ bitflip);
  }
  if (len <= 8) {
    const uint64_t in1 = Read32(p), in2 = Read32(p + len - 4);
    const uint64_t bitflip = Read64(secret + 8) ^ Read64(secret + 16);
    return Rrmxmx((in2 + (in1 << 32)) ^ bitflip, len);
  }
  if (len <= 16) {
    const uint64_t lo = Read64(p) ^ (Read64(secret + 24) ^ Read64(secret + 32));
    const uint64_t hi = Read64(p + len - 8) ^ (Read64(secret + 40) ^ Read64(secret + 48));
    return Avalanche(len + Swap64(lo) + hi + MulFold64(lo, hi));
  }
  if (len <= 128) {
    uint64_t acc = len * kPrime64_1;
    if (len > 32) {
      if (len > 64) {
        if (len > 96) {
          acc += Mix16(p + 48, secret + 96);
          acc += Mix16(p + len - 64, secret + 112);
        }
        acc += Mix16(p + 32, secret + 64);
        acc += Mix16(p + len - 48, secret + 80);
      }
      acc += Mix16(p + 16, secret + 32);
      acc += Mix16(p + len - 32, secret + 48);
    }
    acc += Mix16(p, secret);
    acc += Mix16(p + len - 16, secret + 16);
    return Avalanche(acc);
  }
  if (len <= kMidSizeMax) {
    uint64_t acc = len * kPrime64_1;
    const int rounds = static_cast<int>(len / 16);
    for (int i = 0; i < 8; ++i) acc += Mix16(p + 16 * i, secret + 16 * i);
    acc = Avalanche(acc);
    for (int i = 8; i < rounds; ++i) acc += Mix16(p + 16 * i, secret + 16 * (i - 8) + 3);
    acc += Mix16(p + len - 16, secret + 136 - 17);
    return Avalanche(acc);
  }
  uint64_t acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = InitialAcc(i);
  const size_t blocks = (len - 1) / kBlockLen;
  for (size_t n = 0; n < blocks; ++n) {
    for (int s = 0; s < kStripesPerBlock; ++s) Accumulate512(acc, p + n * kBlockLen + s * kStripeLen, secret + 8 * s);
    for (int i = 0; i < 8; ++i) acc[i] = Scramble(acc[i], secret, i);
  }
  const int stripes = static_cast<int>(((len - 1) - kBlockLen * blocks) / kStripeLen);
  for (int s = 0; s < stripes; ++s) Accumulate512(acc, p + blocks * kBlockLen + s * kStripeLen, secret + 8 * s);
  Accumulate512(acc, p + len - kStripeLen, secret + kLastStripeSecret);
  return MergeAccs(acc, secret, len);
}

}  // namespace tandem::xxh3

#endif  // TANDEM_COMMON_XXH3_PORTABLE_H_
