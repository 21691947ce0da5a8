#include "orchestrator/bench/datasets.h"

#include <unistd.h>

#include <cstdio>
#include <map>
#include <set>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/file_util.h"
#include "common/logging.h"
#include "orchestrator/server/model_assets.h"

namespace tandem::bench {
namespace {

using ::testing::HasSubstr;

const Tokenizer& Builtin() {
  static const std::shared_ptr<const router::ModelAssets> assets = [] {
    router::ModelConfig c;
    c.tokenizer = "builtin";
    absl::StatusOr<std::shared_ptr<const router::ModelAssets>> a = router::LoadModelAssets(c);
    CHECK(a.ok()) << a.status();
    return *a;
  }();
  return *assets->tokenizer;
}

std::string TempFile(const std::string& text) {
  char path[] = "/tmp/tandem-dataset.XXXXXX";
  const int fd = mkstemp(path);
  CHECK(fd >= 0);
  close(fd);
  CHECK(WriteFile(path, text).ok());
  return path;
}

TEST(DatasetsTest, TextSafeIdsDecodeToPrintableText) {
  absl::StatusOr<std::vector<int32_t>> ids = TextSafeIds(Builtin());
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_GT(ids->size(), 50u);
  for (int32_t id : *ids) EXPECT_FALSE(Builtin().IsSpecial(id));
}

// The large built-in presets' filler tokens decode to text ("<|filler_500|>")
// that encodes as 14 byte tokens: a prompt of them sent as text would be 14
// times as long as drawn. Text-safe ids are those their text encodes back to.
TEST(DatasetsTest, TextSafeIdsEncodeBackToThemselves) {
  router::ModelConfig c;
  c.tokenizer = "builtin:llama-3.2-1b";
  absl::StatusOr<std::shared_ptr<const router::ModelAssets>> padded = router::LoadModelAssets(c);
  ASSERT_TRUE(padded.ok()) << padded.status();
  ASSERT_EQ((*padded)->tokenizer->vocab_size(), 128256);
  absl::StatusOr<std::vector<int32_t>> ids = TextSafeIds(*(*padded)->tokenizer);
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_EQ(*ids, *TextSafeIds(Builtin()));
  for (int32_t id : *ids) {
    const int32_t one[] = {id};
    EXPECT_THAT(Builtin().Encode(Builtin().Decode(one, true), false), ::testing::ElementsAre(id));
  }
}

TEST(DatasetsTest, RandomLengthsStayInTheirRangeAndFollowTheSeed) {
  DatasetOptions o{
      .name = "random", .num_prompts = 50, .seed = 3, .input_len = 100, .output_len = 20, .range_ratio = 0.5};
  absl::StatusOr<std::vector<Session>> a = BuildDataset(o, Builtin());
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_EQ(a->size(), 50u);
  std::set<size_t> lengths;
  for (const Session& s : *a) {
    ASSERT_EQ(s.turns.size(), 1u);
    EXPECT_GE(s.turns[0].tokens.size(), 50u);
    EXPECT_LE(s.turns[0].tokens.size(), 150u);
    EXPECT_GE(s.turns[0].max_tokens, 10);
    EXPECT_LE(s.turns[0].max_tokens, 30);
    EXPECT_TRUE(s.id.empty());
    lengths.insert(s.turns[0].tokens.size());
  }
  EXPECT_GT(lengths.size(), 10u);
  absl::StatusOr<std::vector<Session>> b = BuildDataset(o, Builtin());
  ASSERT_TRUE(b.ok());
  EXPECT_EQ((*b)[7].turns[0].tokens, (*a)[7].turns[0].tokens);
  o.seed = 4;
  absl::StatusOr<std::vector<Session>> c = BuildDataset(o, Builtin());
  EXPECT_NE((*c)[7].turns[0].tokens, (*a)[7].turns[0].tokens);
}

TEST(DatasetsTest, SharedPrefixGroupsShareExactlyTheirPrefix) {
  DatasetOptions o{
      .name = "shared-prefix", .num_prompts = 40, .output_len = 8, .num_groups = 4, .prefix_len = 64, .suffix_len = 16};
  absl::StatusOr<std::vector<Session>> d = BuildDataset(o, Builtin());
  ASSERT_TRUE(d.ok()) << d.status();
  std::map<std::vector<int32_t>, int> groups;
  std::set<std::vector<int32_t>> suffixes;
  for (const Session& s : *d) {
    const std::vector<int32_t>& t = s.turns[0].tokens;
    ASSERT_EQ(t.size(), 80u);
    ++groups[std::vector<int32_t>(t.begin(), t.begin() + 64)];
    suffixes.insert(std::vector<int32_t>(t.begin() + 64, t.end()));
    EXPECT_EQ(s.turns[0].max_tokens, 8);
  }
  ASSERT_EQ(groups.size(), 4u);
  for (const auto& [prefix, n] : groups) EXPECT_EQ(n, 10);
  EXPECT_EQ(suffixes.size(), 40u);
}

TEST(DatasetsTest, MultiTurnSessionsHaveIdsSystemPromptsAndTurns) {
  DatasetOptions o{
      .name = "multi-turn", .num_prompts = 10, .output_len = 4, .turns = 3, .system_len = 32, .user_len = 8};
  absl::StatusOr<std::vector<Session>> d = BuildDataset(o, Builtin());
  ASSERT_TRUE(d.ok()) << d.status();
  ASSERT_EQ(d->size(), 4u);  // ceil(10 / 3) whole sessions
  std::set<std::string> ids;
  for (const Session& s : *d) {
    ids.insert(s.id);
    EXPECT_EQ(s.system.size(), 32u);
    ASSERT_EQ(s.turns.size(), 3u);
    for (const Turn& t : s.turns) EXPECT_EQ(t.tokens.size(), 8u);
  }
  EXPECT_EQ(ids.size(), 4u);
}

TEST(DatasetsTest, MultiTurnCommonPrefixStartsEverySystemPrompt) {
  DatasetOptions o{.name = "multi-turn",
                   .num_prompts = 8,
                   .output_len = 4,
                   .turns = 2,
                   .system_len = 16,
                   .user_len = 8,
                   .common_prefix_len = 48};
  absl::StatusOr<std::vector<Session>> d = BuildDataset(o, Builtin());
  ASSERT_TRUE(d.ok()) << d.status();
  ASSERT_EQ(d->size(), 4u);
  std::set<std::vector<int32_t>> common, own;
  for (const Session& s : *d) {
    ASSERT_EQ(s.system.size(), 64u);
    common.emplace(s.system.begin(), s.system.begin() + 48);
    own.emplace(s.system.begin() + 48, s.system.end());
  }
  EXPECT_EQ(common.size(), 1u) << "one prefix shared by every session";
  EXPECT_EQ(own.size(), 4u) << "then each session's own";

  o.common_prefix_len = -1;
  EXPECT_EQ(BuildDataset(o, Builtin()).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(DatasetsTest, TraceSharesBlocksByHashIdAndKeepsTimestamps) {
  const std::string path =
      TempFile(R"({"timestamp": 1000, "input_length": 20, "output_length": 3, "hash_ids": [7, 8]})"
               "\n"
               R"({"timestamp": 1500, "input_length": 25, "output_length": 5, "hash_ids": [7, 9, 10]})"
               "\n"
               "\n"
               R"({"timestamp": 3000, "input_length": 4, "output_length": 1, "hash_ids": [11]})"
               "\n");
  DatasetOptions o{.name = "trace", .path = path, .trace_block_tokens = 10, .trace_speedup = 2.0};
  absl::StatusOr<std::vector<Session>> d = BuildDataset(o, Builtin());
  ASSERT_TRUE(d.ok()) << d.status();
  ASSERT_EQ(d->size(), 3u);
  const auto& a = (*d)[0].turns[0].tokens;
  const auto& b = (*d)[1].turns[0].tokens;
  ASSERT_EQ(a.size(), 20u);
  ASSERT_EQ(b.size(), 25u);
  EXPECT_TRUE(std::equal(a.begin(), a.begin() + 10, b.begin())) << "hash 7 is the same block";
  EXPECT_FALSE(std::equal(a.begin() + 10, a.end(), b.begin() + 10)) << "8 and 9 differ";
  EXPECT_EQ((*d)[1].turns[0].max_tokens, 5);
  EXPECT_DOUBLE_EQ((*d)[0].arrival_s, 0.0);
  EXPECT_DOUBLE_EQ((*d)[1].arrival_s, 0.25);  // 500 ms at 2x
  EXPECT_DOUBLE_EQ((*d)[2].arrival_s, 1.0);
  std::remove(path.c_str());

  for (const char* line : {R"({"timestamp": 1, "input_length": "many", "output_length": 1})",
                           R"({"timestamp": 1, "input_length": 1e30, "output_length": 1})",
                           R"({"timestamp": 1, "input_length": 2.5, "output_length": 1})",
                           R"({"timestamp": 1, "input_length": 0, "output_length": 1})",
                           R"({"timestamp": 1, "input_length": 2000000, "output_length": 1})"}) {
    const std::string bad = TempFile(line);
    absl::StatusOr<std::vector<Session>> e = BuildDataset(DatasetOptions{.name = "trace", .path = bad}, Builtin());
    ASSERT_FALSE(e.ok()) << line;
    EXPECT_THAT(std::string(e.status().message()), HasSubstr(":1: input_length must be an integer from 1 to 1048576"))
        << line;
    std::remove(bad.c_str());
  }
  const std::string bad = TempFile(R"({"timestamp": 1, "input_length": 3, "output_length": -2})");
  EXPECT_THAT(std::string(BuildDataset(DatasetOptions{.name = "trace", .path = bad}, Builtin()).status().message()),
              HasSubstr(":1: output_length must be an integer from 1 to 1048576"));
  std::remove(bad.c_str());
}

TEST(DatasetsTest, ShareGptTakesTheFirstExchangeAndSkipsShortOnes) {
  const std::string path = TempFile(R"([
    {"conversations": [{"from": "human", "value": "Tell me about the sea and its tides."},
                       {"from": "gpt", "value": "The sea rises and falls twice a day."}]},
    {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello there, friend."}]},
    {"conversations": [{"from": "human", "value": "Only one turn here."}]},
    {"not": "a conversation"}
  ])");
  DatasetOptions o{.name = "sharegpt", .path = path, .num_prompts = 10};
  absl::StatusOr<std::vector<Session>> d = BuildDataset(o, Builtin());
  ASSERT_TRUE(d.ok()) << d.status();
  ASSERT_EQ(d->size(), 1u);
  EXPECT_EQ(Builtin().Decode((*d)[0].turns[0].tokens, true), "Tell me about the sea and its tides.");
  EXPECT_EQ((*d)[0].turns[0].max_tokens,
            static_cast<int>(Builtin().Encode("The sea rises and falls twice a day.", false).size()));
  std::remove(path.c_str());
}

TEST(DatasetsTest, BadOptionsAreErrors) {
  EXPECT_THAT(std::string(BuildDataset({.name = "zipf"}, Builtin()).status().message()),
              HasSubstr("--dataset must be"));
  EXPECT_THAT(std::string(BuildDataset({.name = "random", .num_prompts = 0}, Builtin()).status().message()),
              HasSubstr("--num-prompts"));
  EXPECT_THAT(std::string(BuildDataset({.name = "sharegpt"}, Builtin()).status().message()),
              HasSubstr("--dataset-path"));
  EXPECT_EQ(BuildDataset({.name = "trace", .path = "/nonexistent.jsonl"}, Builtin()).status().code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace tandem::bench
