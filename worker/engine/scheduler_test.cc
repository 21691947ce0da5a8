#include "worker/engine/scheduler.h"

#include <numeric>

#include "gtest/gtest.h"

namespace tandem::worker {
namespace {

std::unique_ptr<Sequence> MakeSeq(uint64_t id, int prompt_len, int first_token = 0) {
  auto s = std::make_unique<Sequence>();
  s->id = id;
  s->tokens.resize(prompt_len);
  std::iota(s->tokens.begin(), s->tokens.end(), first_token);
  s->prompt_len = prompt_len;
  return s;
}

// Runs `work` as the engine would: advance, then append a token to every
// sequence that reached the end of its tokens.
void RunStep(Scheduler& sched, const std::vector<ScheduledWork>& work) {
  for (const ScheduledWork& w : work) {
    sched.Advance(w);
    if (w.seq->pending() == 0) w.seq->tokens.push_back(7);
  }
}

void ExpectAccounting(const BlockManager& b) {
  EXPECT_EQ(b.num_free() + b.num_cached() + b.num_used(), b.total_blocks());
}

TEST(SchedulerTest, ChunkedPrefillRespectsTheTokenBudget) {
  BlockManager blocks(64, 4, true, nullptr);
  Scheduler sched({.max_batched_tokens = 10, .max_running = 8, .watermark = 0.0}, &blocks);
  sched.Add(MakeSeq(1, 25));
  sched.Add(MakeSeq(2, 3));
  auto w = sched.Schedule();
  ASSERT_EQ(w.size(), 1u);  // seq 1 takes the whole budget
  EXPECT_EQ(w[0].num_tokens, 10);
  EXPECT_EQ(w[0].seq->blocks.size(), 7u);  // the whole prompt is reserved at admission
  RunStep(sched, w);
  w = sched.Schedule();
  ASSERT_EQ(w.size(), 1u);
  EXPECT_EQ(w[0].num_tokens, 10);
  RunStep(sched, w);
  w = sched.Schedule();  // 5 left for seq 1, then seq 2 is admitted with 3 of the 5 remaining
  ASSERT_EQ(w.size(), 2u);
  EXPECT_EQ(w[0].num_tokens, 5);
  EXPECT_EQ(w[1].seq->id, 2u);
  EXPECT_EQ(w[1].num_tokens, 3);
  RunStep(sched, w);
  w = sched.Schedule();  // both decode one token
  ASSERT_EQ(w.size(), 2u);
  EXPECT_EQ(w[0].num_tokens, 1);
  EXPECT_EQ(w[1].num_tokens, 1);
  ExpectAccounting(blocks);
}

TEST(SchedulerTest, PrefixHitSkipsCachedBlocksButRecomputesTheLastToken) {
  BlockManager blocks(64, 4, true, nullptr);
  Scheduler sched({.max_batched_tokens = 100, .max_running = 8, .watermark = 0.0}, &blocks);
  sched.Add(MakeSeq(1, 12));
  auto w = sched.Schedule();
  RunStep(sched, w);  // 3 full blocks committed
  sched.Remove(1);
  EXPECT_EQ(blocks.num_cached(), 3);

  sched.Add(MakeSeq(2, 12));  // same tokens: all 3 blocks cached, but the last token must run
  w = sched.Schedule();
  ASSERT_EQ(w.size(), 1u);
  EXPECT_EQ(w[0].seq->num_computed, 8);
  EXPECT_EQ(w[0].num_tokens, 4);
  EXPECT_EQ(w[0].seq->cached_prompt_tokens, 8);
  sched.Add(MakeSeq(3, 9));  // shares 2 blocks
  w = sched.Schedule();
  ASSERT_EQ(w.size(), 2u);
  EXPECT_EQ(w[1].seq->num_computed, 8);
  EXPECT_EQ(sched.stats().prefix_query_tokens, 12 + 12 + 9);
  EXPECT_EQ(sched.stats().prefix_hit_tokens, 0 + 8 + 8);
}

TEST(SchedulerTest, WatermarkHoldsBackAdmissionWhileOthersRun) {
  BlockManager blocks(10, 4, true, nullptr);
  Scheduler sched({.max_batched_tokens = 100, .max_running = 8, .watermark = 0.3}, &blocks);
  sched.Add(MakeSeq(1, 16));  // 4 blocks; nothing runs, so the watermark is waived
  auto w = sched.Schedule();
  ASSERT_EQ(w.size(), 1u);
  RunStep(sched, w);
  sched.Add(MakeSeq(2, 16, 100));  // would leave 2 < ceil(0.3 * 10) = 3 free
  w = sched.Schedule();
  ASSERT_EQ(w.size(), 1u);
  EXPECT_EQ(sched.waiting().size(), 1u);
}

TEST(SchedulerTest, PreemptsTheNewestSequenceAndRequeuesItFirst) {
  BlockManager blocks(6, 2, true, nullptr);
  Scheduler sched({.max_batched_tokens = 100, .max_running = 8, .watermark = 0.0}, &blocks);
  sched.Add(MakeSeq(1, 6, 0));    // 3 blocks
  sched.Add(MakeSeq(2, 6, 100));  // 3 blocks: the pool is full
  auto w = sched.Schedule();
  ASSERT_EQ(w.size(), 2u);
  RunStep(sched, w);  // both have 7 tokens now: decode needs a 4th block each
  w = sched.Schedule();
  ASSERT_EQ(w.size(), 1u);
  EXPECT_EQ(w[0].seq->id, 1u);
  EXPECT_EQ(sched.stats().preemptions, 1);
  ASSERT_EQ(sched.waiting().size(), 1u);
  const Sequence& victim = *sched.waiting().front();
  EXPECT_EQ(victim.id, 2u);
  EXPECT_EQ(victim.num_computed, 0);
  EXPECT_TRUE(victim.blocks.empty());
  EXPECT_EQ(victim.tokens.size(), 7u);  // keeps its output for the recompute
  ExpectAccounting(blocks);
  // Seq 1's new block evicted seq 2's tail block (released last-to-first, so
  // it was least recently used). Seq 1 finishes; seq 2 comes back, reuses its
  // two cached prefix blocks and recomputes the rest.
  RunStep(sched, w);
  sched.Remove(1);
  w = sched.Schedule();
  ASSERT_EQ(w.size(), 1u);
  EXPECT_EQ(w[0].seq->id, 2u);
  EXPECT_EQ(w[0].seq->num_computed, 4);
  EXPECT_EQ(w[0].num_tokens, 3);
}

TEST(SchedulerTest, LoneSequenceThatOutgrowsThePoolPreemptsItself) {
  BlockManager blocks(2, 2, true, nullptr);
  Scheduler sched({.max_batched_tokens = 100, .max_running = 8, .watermark = 0.0}, &blocks);
  sched.Add(MakeSeq(1, 4));
  auto w = sched.Schedule();
  RunStep(sched, w);
  w = sched.Schedule();  // needs a 3rd block that does not exist
  EXPECT_TRUE(w.empty());
  EXPECT_EQ(sched.waiting().size(), 1u);
  EXPECT_EQ(blocks.num_used(), 0);
}

TEST(SchedulerTest, RemoveReleasesEverything) {
  BlockManager blocks(16, 4, true, nullptr);
  Scheduler sched({.max_batched_tokens = 8, .max_running = 8, .watermark = 0.0}, &blocks);
  sched.Add(MakeSeq(1, 20));
  sched.Add(MakeSeq(2, 5));
  auto w = sched.Schedule();
  RunStep(sched, w);
  EXPECT_NE(sched.Remove(1), nullptr);
  EXPECT_NE(sched.Remove(2), nullptr);
  EXPECT_EQ(sched.Remove(3), nullptr);
  EXPECT_TRUE(sched.empty());
  EXPECT_EQ(blocks.num_used(), 0);
  ExpectAccounting(blocks);
}

TEST(SchedulerTest, MaxRunningLimitsTheBatch) {
  BlockManager blocks(64, 4, true, nullptr);
  Scheduler sched({.max_batched_tokens = 100, .max_running = 2, .watermark = 0.0}, &blocks);
  for (int i = 1; i <= 4; ++i) sched.Add(MakeSeq(i, 3, 10 * i));
  auto w = sched.Schedule();
  EXPECT_EQ(w.size(), 2u);
  EXPECT_EQ(sched.waiting().size(), 2u);
}

// Places held for reservations count against max_running: admission leaves
// them free, so running + reserved never passes the cap.
TEST(SchedulerTest, ReservedSlotsCountAgainstMaxRunning) {
  BlockManager blocks(64, 4, true, nullptr);
  Scheduler sched({.max_batched_tokens = 100, .max_running = 3, .watermark = 0.0}, &blocks);
  for (int i = 1; i <= 3; ++i) sched.Add(MakeSeq(i, 3, 10 * i));
  EXPECT_EQ(sched.Schedule(/*reserved_slots=*/2).size(), 1u);
  EXPECT_EQ(sched.Schedule(/*reserved_slots=*/3).size(), 1u);  // the running one only
  EXPECT_EQ(sched.waiting().size(), 2u);
  EXPECT_EQ(sched.Schedule(/*reserved_slots=*/0).size(), 3u);
  ExpectAccounting(blocks);
}

}  // namespace
}  // namespace tandem::worker
