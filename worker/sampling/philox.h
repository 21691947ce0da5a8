// Philox4x32-10, the counter-based random number generator of Salmon, Moraes,
// Dror and Shaw, "Parallel Random Numbers: As Easy as 1, 2, 3" (SC 2011),
// written from that paper's definition. A counter-based generator keeps no
// state: the output is a pure function of (counter, key), so a token's random
// draw depends only on (seed, token position, draw index). A sequence can then
// be sampled partly on one worker and partly on another with the same result
// as on one worker, and no generator state needs to travel with it.
//
// Thread safety: pure functions.
#ifndef TANDEM_WORKER_SAMPLING_PHILOX_H_
#define TANDEM_WORKER_SAMPLING_PHILOX_H_

#include <array>
#include <cstdint>

namespace tandem::worker {

using PhiloxCounter = std::array<uint32_t, 4>;
using PhiloxKey = std::array<uint32_t, 2>;

// Philox4x32 with 10 rounds: the 128-bit output block for `counter` under
// `key`. Each round multiplies words 0 and 2 by the constants below, swaps
// the words and mixes in the round key; the key is bumped by the Weyl
// constants (golden ratio and sqrt(3) - 1, as 32-bit fractions) between rounds.
constexpr PhiloxCounter Philox4x32(PhiloxCounter counter, PhiloxKey key) {
  constexpr uint64_t kMultiplier0 = 0xD2511F53;
  constexpr uint64_t kMultiplier1 = 0xCD9E8D57;
  constexpr uint32_t kWeyl0 = 0x9E3779B9;
  constexpr uint32_t kWeyl1 = 0xBB67AE85;
  constexpr int kRounds = 10;
  for (int round = 0; round < kRounds; ++round) {
    if (round > 0) {
      key[0] += kWeyl0;
      key[1] += kWeyl1;
    }
    const uint64_t product0 = kMultiplier0 * counter[0];
    const uint64_t product1 = kMultiplier1 * counter[2];
    const auto hi0 = static_cast<uint32_t>(product0 >> 32);
    const auto lo0 = static_cast<uint32_t>(product0);
    const auto hi1 = static_cast<uint32_t>(product1 >> 32);
    const auto lo1 = static_cast<uint32_t>(product1);
    counter = {hi1 ^ counter[1] ^ key[0], lo1, hi0 ^ counter[3] ^ key[1], lo0};
  }
  return counter;
}

// A uniform double in [0, 1) with 53 random bits (every multiple of 2^-53 in
// the range equally likely), a function of its arguments only. The key is
// the seed (low word first); the counter is {position low, position high,
// draw, 0}. `draw` numbers independent draws for the same position; the
// sampler uses draw 0.
constexpr double UniformDouble(uint64_t seed, uint64_t position, uint32_t draw = 0) {
  const PhiloxKey key = {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)};
  const PhiloxCounter counter = {static_cast<uint32_t>(position), static_cast<uint32_t>(position >> 32), draw, 0};
  const PhiloxCounter block = Philox4x32(counter, key);
  // 32 bits of word 0 above the top 21 bits of word 1.
  const uint64_t bits = (uint64_t{block[0]} << 21) | (block[1] >> 11);
  return static_cast<double>(bits) * 0x1.0p-53;
}

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_SAMPLING_PHILOX_H_
