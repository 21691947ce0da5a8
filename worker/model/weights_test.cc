#include "worker/model/weights.h"

#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/model/builtin_models.h"

namespace tandem::worker {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

// Wraps a source, hiding some tensors and reshaping others.
class EditedSource : public TensorSource {
 public:
  explicit EditedSource(const TensorSource& base) : base_(base) {}
  void Hide(const std::string& name) { hidden_.insert(name); }
  void Reshape(const std::string& name, std::vector<int64_t> shape) { shapes_[name] = shape; }

  absl::StatusOr<Tensor> Get(const std::string& name) const override {
    if (hidden_.count(name) > 0) return absl::NotFoundError(name);
    absl::StatusOr<Tensor> t = base_.Get(name);
    if (t.ok() && shapes_.count(name) > 0) t->shape = shapes_.at(name);
    return t;
  }
  bool Has(const std::string& name) const override { return hidden_.count(name) == 0 && base_.Has(name); }
  std::string Describe() const override { return "edited " + base_.Describe(); }

 private:
  const TensorSource& base_;
  std::set<std::string> hidden_;
  std::map<std::string, std::vector<int64_t>> shapes_;
};

ModelConfig Tiny() { return *BuiltinModelConfig("tiny"); }

std::vector<float> Data(const TensorSource& source, const std::string& name) { return source.Get(name)->data; }

std::vector<float> Concat(std::initializer_list<std::vector<float>> parts) {
  std::vector<float> all;
  for (const auto& p : parts) all.insert(all.end(), p.begin(), p.end());
  return all;
}

TEST(WeightsTest, ExpectedShapesOfTiny) {
  const auto shapes = ExpectedTensorShapes(Tiny());
  EXPECT_EQ(shapes.at("model.embed_tokens.weight"), (std::vector<int64_t>{384, 64}));
  EXPECT_EQ(shapes.at("model.layers.2.self_attn.q_proj.weight"), (std::vector<int64_t>{64, 64}));
  EXPECT_EQ(shapes.at("model.layers.2.self_attn.k_proj.weight"), (std::vector<int64_t>{32, 64}));
  EXPECT_EQ(shapes.at("model.layers.0.self_attn.o_proj.weight"), (std::vector<int64_t>{64, 64}));
  EXPECT_EQ(shapes.at("model.layers.0.mlp.down_proj.weight"), (std::vector<int64_t>{64, 176}));
  EXPECT_EQ(shapes.at("lm_head.weight"), (std::vector<int64_t>{384, 64}));
  EXPECT_EQ(shapes.size(), 1 + 3 * 9 + 1 + 1u);
  EXPECT_EQ(shapes.count("model.layers.0.self_attn.q_proj.bias"), 0u);
}

TEST(WeightsTest, LoadsAndFusesTiny) {
  const ModelConfig config = Tiny();
  SeededTensorSource source(config, 7, "test source");
  absl::StatusOr<ModelWeights> w = LoadWeights(config, source);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->embed, Data(source, "model.embed_tokens.weight"));
  ASSERT_EQ(w->layers.size(), 3u);
  const LayerWeights& l1 = w->layers[1];
  EXPECT_EQ(l1.wqkv, Concat({Data(source, "model.layers.1.self_attn.q_proj.weight"),
                             Data(source, "model.layers.1.self_attn.k_proj.weight"),
                             Data(source, "model.layers.1.self_attn.v_proj.weight")}));
  EXPECT_EQ(l1.wqkv.size(), size_t{(64 + 2 * 32) * 64});
  EXPECT_EQ(l1.w_gate_up, Concat({Data(source, "model.layers.1.mlp.gate_proj.weight"),
                                  Data(source, "model.layers.1.mlp.up_proj.weight")}));
  EXPECT_EQ(l1.wo, Data(source, "model.layers.1.self_attn.o_proj.weight"));
  EXPECT_EQ(l1.w_down, Data(source, "model.layers.1.mlp.down_proj.weight"));
  EXPECT_EQ(l1.input_norm, Data(source, "model.layers.1.input_layernorm.weight"));
  EXPECT_EQ(l1.post_norm, Data(source, "model.layers.1.post_attention_layernorm.weight"));
  EXPECT_THAT(l1.bqkv, IsEmpty());
  EXPECT_THAT(l1.bo, IsEmpty());
  EXPECT_THAT(l1.b_gate_up, IsEmpty());
  EXPECT_THAT(l1.b_down, IsEmpty());
  EXPECT_EQ(w->final_norm, Data(source, "model.norm.weight"));
  EXPECT_EQ(w->lm_head, Data(source, "lm_head.weight"));
  EXPECT_EQ(&w->output_matrix(), &w->lm_head);
}

TEST(WeightsTest, Qwen2BiasFusionOrder) {
  ModelConfig config = Tiny();
  config.architecture = "Qwen2ForCausalLM";
  config.qkv_bias = true;
  SeededTensorSource source(config, 11, "qwen2 test source");
  absl::StatusOr<ModelWeights> w = LoadWeights(config, source);
  ASSERT_TRUE(w.ok()) << w.status();
  const LayerWeights& l = w->layers[2];
  EXPECT_EQ(l.bqkv, Concat({Data(source, "model.layers.2.self_attn.q_proj.bias"),
                            Data(source, "model.layers.2.self_attn.k_proj.bias"),
                            Data(source, "model.layers.2.self_attn.v_proj.bias")}));
  EXPECT_EQ(l.bqkv.size(), 128u);
  EXPECT_THAT(l.bo, IsEmpty());
  EXPECT_THAT(l.b_gate_up, IsEmpty());
}

TEST(WeightsTest, LlamaAttentionAndMlpBiases) {
  ModelConfig config = Tiny();
  config.qkv_bias = config.o_bias = config.mlp_bias = true;
  SeededTensorSource source(config, 13, "biased test source");
  absl::StatusOr<ModelWeights> w = LoadWeights(config, source);
  ASSERT_TRUE(w.ok()) << w.status();
  const LayerWeights& l = w->layers[0];
  EXPECT_EQ(l.bo, Data(source, "model.layers.0.self_attn.o_proj.bias"));
  EXPECT_EQ(l.b_gate_up, Concat({Data(source, "model.layers.0.mlp.gate_proj.bias"),
                                 Data(source, "model.layers.0.mlp.up_proj.bias")}));
  EXPECT_EQ(l.b_gate_up.size(), 2 * 176u);
  EXPECT_EQ(l.b_down, Data(source, "model.layers.0.mlp.down_proj.bias"));
}

TEST(WeightsTest, TiedEmbeddingsIgnoreLmHead) {
  ModelConfig config = Tiny();
  SeededTensorSource untied(config, 7, "untied");  // has an lm_head.weight
  config.tie_word_embeddings = true;
  absl::StatusOr<ModelWeights> w = LoadWeights(config, untied);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_THAT(w->lm_head, IsEmpty());
  EXPECT_EQ(&w->output_matrix(), &w->embed);

  SeededTensorSource tied(config, 7, "tied");  // has none
  EXPECT_FALSE(tied.Has("lm_head.weight"));
  EXPECT_TRUE(LoadWeights(config, tied).ok());
}

TEST(WeightsTest, MissingTensorIsNamed) {
  const ModelConfig config = Tiny();
  SeededTensorSource base(config, 7, "builtin:test");
  for (const char* name : {"model.layers.1.self_attn.k_proj.weight", "lm_head.weight", "model.norm.weight",
                           "model.layers.2.mlp.up_proj.weight"}) {
    EditedSource source(base);
    source.Hide(name);
    absl::StatusOr<ModelWeights> w = LoadWeights(config, source);
    ASSERT_FALSE(w.ok()) << name;
    EXPECT_EQ(w.status().code(), absl::StatusCode::kNotFound);
    EXPECT_THAT(w.status().message(), AllOf(HasSubstr(absl::StrCat("'", name, "'")), HasSubstr("edited builtin:test"),
                                            HasSubstr("expected shape [")));
  }
  ModelConfig biased = config;
  biased.architecture = "Qwen2ForCausalLM";
  biased.qkv_bias = true;
  EXPECT_THAT(LoadWeights(biased, base).status().message(),
              AllOf(HasSubstr("'model.layers.0.self_attn.q_proj.bias'"), HasSubstr("[64]")));
}

TEST(WeightsTest, WrongShapeIsNamed) {
  const ModelConfig config = Tiny();
  SeededTensorSource base(config, 7, "builtin:test");
  EditedSource source(base);
  source.Reshape("model.layers.0.self_attn.v_proj.weight", {64, 32});  // transposed
  absl::StatusOr<ModelWeights> w = LoadWeights(config, source);
  EXPECT_EQ(w.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(w.status().message(),
              AllOf(HasSubstr("'model.layers.0.self_attn.v_proj.weight'"), HasSubstr("edited builtin:test"),
                    HasSubstr("has shape [64, 32]"), HasSubstr("expected [32, 64]")));

  // A config whose vocabulary disagrees with the checkpoint.
  ModelConfig bigger = config;
  bigger.vocab_size = 400;
  EXPECT_THAT(LoadWeights(bigger, base).status().message(),
              AllOf(HasSubstr("'model.embed_tokens.weight'"), HasSubstr("[384, 64]"), HasSubstr("expected [400, 64]")));
}

TEST(WeightsTest, InvalidConfigIsRejected) {
  ModelConfig config = Tiny();
  SeededTensorSource base(config, 7, "builtin:test");
  config.num_kv_heads = 3;
  EXPECT_THAT(LoadWeights(config, base).status().message(), HasSubstr("multiple of num_key_value_heads"));
}

}  // namespace
}  // namespace tandem::worker
