// xxh3_portable.h's Hash64 against the xxHash library (HashBytes) on every
// length up to 4 KiB and some larger ones, at unaligned starts too.
#include "common/xxh3_portable.h"

#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "common/block_hash.h"

namespace tandem {
namespace {

TEST(Xxh3PortableTest, MatchesTheLibraryOnEveryLength) {
  unsigned char secret[192];
  DefaultHashSecret(secret);
  std::mt19937 rng(5);
  std::vector<unsigned char> data(3 * 1024 * 1024 + 64);
  for (unsigned char& b : data) b = static_cast<unsigned char>(rng());
  std::vector<size_t> lengths;
  for (size_t n = 0; n <= 4096; ++n) lengths.push_back(n);
  for (size_t n : {8191, 8192, 8193, 65536, 65536 + 7, 1 << 20, 2 * 1024 * 1024 + 1000}) lengths.push_back(n);
  for (size_t n : lengths) {
    for (size_t offset : {0, 3}) {
      const unsigned char* p = data.data() + offset;
      ASSERT_EQ(xxh3::Hash64(p, n, secret), HashBytes(p, n)) << "length " << n << " at offset " << offset;
    }
  }
}

}  // namespace
}  // namespace tandem
