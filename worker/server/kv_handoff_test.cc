// KvReady's checks as pure functions: the prompt a KvReady describes, its
// first token, and the pull it plans (which blocks, how many checksums).
#include "worker/server/kv_handoff.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace tandem::worker {
namespace {

using ::testing::HasSubstr;

constexpr int kBlock = 16;

// A 40-token prompt in 3 reserved blocks (10, 11, 12), 16 tokens cached here.
KvReadyExpectation Expect() {
  return {.prompt_len = 40, .prompt_hash = 0xabcdef, .cached_tokens = 16, .blocks = {10, 11, 12}};
}

tandem::v1::KvReadyRequest Ready() {
  tandem::v1::KvReadyRequest r;
  r.set_reservation_id(7);
  r.set_prompt_tokens(40);
  r.set_prompt_hash(0xabcdef);
  r.mutable_first_token()->set_token_id(5);
  for (int b : {100, 101, 102}) r.add_block_ids(b);
  return r;
}

TEST(CheckKvReadyPromptTest, TheReservationsPromptAndAFirstTokenInTheVocabularyPass) {
  EXPECT_TRUE(CheckKvReadyPrompt(Ready(), Expect(), 260).ok());
  tandem::v1::KvReadyRequest other = Ready();
  other.set_prompt_hash(0x1234);
  EXPECT_THAT(CheckKvReadyPrompt(other, Expect(), 260).message(),
              HasSubstr("another prompt (40 tokens, hash 0000000000001234) than reservation 7 (40 "
                        "tokens, hash 0000000000abcdef)"));
  other = Ready();
  other.set_prompt_tokens(41);
  EXPECT_EQ(CheckKvReadyPrompt(other, Expect(), 260).code(), absl::StatusCode::kInvalidArgument);
  for (int bad : {-1, 260}) {
    other = Ready();
    other.mutable_first_token()->set_token_id(bad);
    EXPECT_THAT(CheckKvReadyPrompt(other, Expect(), 260).message(), HasSubstr("is outside the vocabulary")) << bad;
  }
}

TEST(PlanKvReadyPullTest, PullsTheBlocksPastTheCachedPrefix) {
  absl::StatusOr<std::vector<kvtransfer::BlockPair>> pairs = PlanKvReadyPull(Ready(), Expect(), kBlock);
  ASSERT_TRUE(pairs.ok()) << pairs.status();
  ASSERT_EQ(pairs->size(), 2u);
  EXPECT_EQ((*pairs)[0].src, 101);
  EXPECT_EQ((*pairs)[0].dst, 11);
  EXPECT_EQ((*pairs)[1].src, 102);
  EXPECT_EQ((*pairs)[1].dst, 12);
  // With a checksum per pulled block, or none.
  tandem::v1::KvReadyRequest r = Ready();
  r.add_block_checksums(1);
  r.add_block_checksums(2);
  EXPECT_TRUE(PlanKvReadyPull(r, Expect(), kBlock).ok());
  // Nothing cached: every block is pulled.
  KvReadyExpectation cold = Expect();
  cold.cached_tokens = 0;
  EXPECT_EQ(PlanKvReadyPull(Ready(), cold, kBlock)->size(), 3u);
}

TEST(PlanKvReadyPullTest, CountsThatDoNotAddUpAreRefused) {
  tandem::v1::KvReadyRequest r = Ready();
  r.add_block_ids(103);
  EXPECT_THAT(PlanKvReadyPull(r, Expect(), kBlock).status().message(),
              HasSubstr("KvReady names 4 blocks; a 40-token prompt takes 3"));
  r = Ready();
  r.add_block_checksums(1);
  EXPECT_THAT(PlanKvReadyPull(r, Expect(), kBlock).status().message(),
              HasSubstr("KvReady has 1 block checksums; 2 blocks are pulled (the first 1 are cached here)"));
}

}  // namespace
}  // namespace tandem::worker
