#include "orchestrator/cluster/compatibility.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace tandem::router {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

tandem::v1::ModelInfo Info() {
  tandem::v1::ModelInfo i;
  i.set_model("tiny");
  i.set_architecture("LlamaForCausalLM");
  i.set_vocab_size(260);
  i.set_num_layers(2);
  i.set_num_kv_heads(2);
  i.set_head_dim(16);
  i.set_kv_dtype("float32");
  i.set_block_size(16);
  i.set_block_hash_seed(0);
  i.set_engine("real");
  i.set_tokenizer_sha256("aaaabbbbccccdddd");
  return i;
}

const RouterTokenizer kRouter{.sha256 = "aaaabbbbccccdddd", .vocab_size = 260, .source = "builtin"};

TEST(CompatibilityTest, TheSameModelAndTokenizerFit) {
  const tandem::v1::ModelInfo ref = Info();
  EXPECT_THAT(Incompatibility(Info(), nullptr, kRouter), IsEmpty());
  EXPECT_THAT(Incompatibility(Info(), &ref, kRouter), IsEmpty());
  // Instance-specific fields do not matter.
  tandem::v1::ModelInfo other = Info();
  other.set_instance_id("another");
  other.set_total_blocks(12345);
  other.set_role("prefill");
  other.set_max_batched_tokens(64);
  EXPECT_THAT(Incompatibility(other, &ref, kRouter), IsEmpty());
}

TEST(CompatibilityTest, AnotherTokenizerIsRefusedWithTheFix) {
  tandem::v1::ModelInfo w = Info();
  w.set_tokenizer_sha256("0123456789abcdef");
  EXPECT_THAT(Incompatibility(w, nullptr, kRouter),
              AllOf(HasSubstr("tokenizer.json (sha256 0123456789ab) is not the router's (builtin, "
                              "sha256 aaaabbbbcccc)"),
                    HasSubstr("model.tokenizer")));
  // A worker that reports no tokenizer is checked by vocabulary size only.
  w.set_tokenizer_sha256("");
  EXPECT_THAT(Incompatibility(w, nullptr, kRouter), IsEmpty());
  w.set_vocab_size(100);
  EXPECT_THAT(Incompatibility(w, nullptr, kRouter),
              HasSubstr("the router's tokenizer (builtin) has 260 ids, the model's vocabulary only 100"));
  // A router that does not know its tokenizer's digest checks nothing but the size.
  w.set_vocab_size(260);
  w.set_tokenizer_sha256("0123456789abcdef");
  EXPECT_THAT(Incompatibility(w, nullptr, {.vocab_size = 260, .source = "x"}), IsEmpty());
}

TEST(CompatibilityTest, EveryFieldRoutingAndHandOffsNeedIsCompared) {
  const tandem::v1::ModelInfo ref = Info();
  struct Case {
    void (*change)(tandem::v1::ModelInfo&);
    const char* says;
  };
  const Case cases[] = {
      {[](tandem::v1::ModelInfo& i) { i.set_model("small"); }, "model small, the cluster's tiny"},
      {[](tandem::v1::ModelInfo& i) { i.set_architecture("Qwen2ForCausalLM"); }, "architecture Qwen2"},
      {[](tandem::v1::ModelInfo& i) { i.set_vocab_size(300); }, "vocab_size 300, the cluster's 260"},
      {[](tandem::v1::ModelInfo& i) { i.set_num_layers(4); }, "num_layers 4, the cluster's 2"},
      {[](tandem::v1::ModelInfo& i) { i.set_num_kv_heads(4); }, "num_kv_heads 4"},
      {[](tandem::v1::ModelInfo& i) { i.set_head_dim(64); }, "head_dim 64"},
      {[](tandem::v1::ModelInfo& i) { i.set_kv_dtype("bfloat16"); }, "kv_dtype bfloat16"},
      {[](tandem::v1::ModelInfo& i) { i.set_block_size(32); }, "block_size 32, the cluster's 16"},
      {[](tandem::v1::ModelInfo& i) { i.set_block_hash_seed(7); }, "block_hash_seed 7, the cluster's 0"},
      {[](tandem::v1::ModelInfo& i) { i.set_engine("sim"); }, "engine sim, the cluster's real"},
  };
  for (const Case& c : cases) {
    tandem::v1::ModelInfo w = Info();
    c.change(w);
    EXPECT_THAT(Incompatibility(w, &ref, kRouter), HasSubstr(c.says)) << c.says;
  }
  // Several at once are all named.
  tandem::v1::ModelInfo w = Info();
  w.set_block_size(32);
  w.set_block_hash_seed(9);
  EXPECT_EQ(Incompatibility(w, &ref, kRouter), "block_size 32, the cluster's 16; block_hash_seed 9, the cluster's 0");
}

}  // namespace
}  // namespace tandem::router
