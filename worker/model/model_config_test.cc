#include "worker/model/model_config.h"

#include <string>

#include <nlohmann/json.hpp>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/model/builtin_models.h"

namespace tandem::worker {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

// Meta-Llama-3.1-8B's config.json (abridged: keys tandem ignores removed).
constexpr char kLlama31[] = R"({
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "bos_token_id": 128000,
  "eos_token_id": [128001, 128008, 128009],
  "hidden_act": "silu",
  "hidden_size": 4096,
  "intermediate_size": 14336,
  "max_position_embeddings": 131072,
  "mlp_bias": false,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "rms_norm_eps": 1e-05,
  "rope_scaling": {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3"
  },
  "rope_theta": 500000.0,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "vocab_size": 128256
})";

nlohmann::json Llama31() { return nlohmann::json::parse(kLlama31); }

absl::StatusOr<ModelConfig> Parse(const nlohmann::json& j) { return ParseModelConfig(j.dump(), "/ckpt/config.json"); }

TEST(ModelConfigTest, ParsesLlama31WithRopeScaling) {
  absl::StatusOr<ModelConfig> c = ParseModelConfig(kLlama31, "/ckpt/config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->architecture, "LlamaForCausalLM");
  EXPECT_EQ(c->vocab_size, 128256);
  EXPECT_EQ(c->hidden_size, 4096);
  EXPECT_EQ(c->intermediate_size, 14336);
  EXPECT_EQ(c->num_layers, 32);
  EXPECT_EQ(c->num_heads, 32);
  EXPECT_EQ(c->num_kv_heads, 8);
  EXPECT_EQ(c->head_dim, 128);  // derived: 4096 / 32
  EXPECT_EQ(c->max_position_embeddings, 131072);
  EXPECT_EQ(c->rms_norm_eps, 1e-5f);
  EXPECT_FALSE(c->qkv_bias);
  EXPECT_FALSE(c->o_bias);
  EXPECT_FALSE(c->mlp_bias);
  EXPECT_FALSE(c->tie_word_embeddings);
  EXPECT_EQ(c->rope.theta, 500000.0);
  EXPECT_EQ(c->rope.type, RopeType::kLlama3);
  EXPECT_EQ(c->rope.factor, 8.0);
  EXPECT_EQ(c->rope.low_freq_factor, 1.0);
  EXPECT_EQ(c->rope.high_freq_factor, 4.0);
  EXPECT_EQ(c->rope.original_max_position_embeddings, 8192);
  EXPECT_EQ(c->bos_token_id, 128000);
  EXPECT_THAT(c->eos_token_ids, ElementsAre(128001, 128008, 128009));
  EXPECT_EQ(c->torch_dtype, "bfloat16");
  EXPECT_EQ(c->q_size(), 4096);
  EXPECT_EQ(c->kv_size(), 1024);
}

TEST(ModelConfigTest, ParsesTransformers5RopeParametersAndDtype) {
  nlohmann::json j = Llama31();
  j.erase("rope_scaling");
  j.erase("rope_theta");
  j.erase("torch_dtype");
  j["dtype"] = "float16";
  j["rope_parameters"] = {{"rope_type", "llama3"},   {"rope_theta", 250000.0},
                          {"factor", 32.0},          {"low_freq_factor", 2.0},
                          {"high_freq_factor", 8.0}, {"original_max_position_embeddings", 4096}};
  absl::StatusOr<ModelConfig> c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope.theta, 250000.0);
  EXPECT_EQ(c->rope.type, RopeType::kLlama3);
  EXPECT_EQ(c->rope.factor, 32.0);
  EXPECT_EQ(c->rope.low_freq_factor, 2.0);
  EXPECT_EQ(c->rope.high_freq_factor, 8.0);
  EXPECT_EQ(c->rope.original_max_position_embeddings, 4096);
  EXPECT_EQ(c->torch_dtype, "float16");
}

TEST(ModelConfigTest, RopeParametersDefaultTypeAndTopLevelTheta) {
  nlohmann::json j = Llama31();
  j.erase("rope_scaling");
  j["rope_theta"] = 1000.0;
  j["rope_parameters"] = nlohmann::json::object();  // no type: default; theta from the top
  absl::StatusOr<ModelConfig> c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope.type, RopeType::kDefault);
  EXPECT_EQ(c->rope.theta, 1000.0);

  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 10000.0}};
  c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope.type, RopeType::kDefault);
  EXPECT_EQ(c->rope.theta, 10000.0);
}

TEST(ModelConfigTest, Llama2DefaultsNullRopeScalingAndIntEos) {
  nlohmann::json j = {{"architectures", {"LlamaForCausalLM"}},
                      {"hidden_size", 4096},
                      {"intermediate_size", 11008},
                      {"num_attention_heads", 32},
                      {"num_hidden_layers", 32},
                      {"vocab_size", 32000},
                      {"bos_token_id", 1},
                      {"eos_token_id", 2},
                      {"rope_scaling", nullptr},
                      {"head_dim", nullptr}};
  absl::StatusOr<ModelConfig> c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->num_kv_heads, 32);  // defaults to the head count
  EXPECT_EQ(c->head_dim, 128);
  EXPECT_EQ(c->max_position_embeddings, 2048);  // LlamaConfig's default
  EXPECT_EQ(c->rms_norm_eps, 1e-6f);
  EXPECT_EQ(c->rope.type, RopeType::kDefault);
  EXPECT_EQ(c->rope.theta, 10000.0);
  EXPECT_EQ(c->bos_token_id, 1);
  EXPECT_THAT(c->eos_token_ids, ElementsAre(2));
  EXPECT_EQ(c->torch_dtype, "float32");
}

TEST(ModelConfigTest, EosAndBosNull) {
  nlohmann::json j = Llama31();
  j["eos_token_id"] = nullptr;
  j["bos_token_id"] = nullptr;
  absl::StatusOr<ModelConfig> c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->bos_token_id, -1);
  EXPECT_THAT(c->eos_token_ids, IsEmpty());
}

TEST(ModelConfigTest, LegacyLinearRopeScaling) {
  nlohmann::json j = Llama31();
  j["rope_scaling"] = {{"type", "linear"}, {"factor", 4.0}};
  absl::StatusOr<ModelConfig> c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope.type, RopeType::kLinear);
  EXPECT_EQ(c->rope.factor, 4.0);
}

TEST(ModelConfigTest, HeadDimGiven) {
  nlohmann::json j = Llama31();
  j["head_dim"] = 64;  // Llama 3.2 style: not hidden / heads
  absl::StatusOr<ModelConfig> c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->head_dim, 64);
  EXPECT_EQ(c->q_size(), 2048);
}

TEST(ModelConfigTest, LlamaAttentionBiasAlsoBiasesOutput) {
  nlohmann::json j = Llama31();
  j["attention_bias"] = true;
  j["mlp_bias"] = true;
  absl::StatusOr<ModelConfig> c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->qkv_bias);
  EXPECT_TRUE(c->o_bias);
  EXPECT_TRUE(c->mlp_bias);
}

// Qwen2.5-0.5B-Instruct's config.json (abridged).
nlohmann::json Qwen25() {
  return nlohmann::json::parse(R"({
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "max_window_layers": 21,
    "model_type": "qwen2",
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": true,
    "torch_dtype": "bfloat16",
    "use_cache": true,
    "use_sliding_window": false,
    "vocab_size": 151936
  })");
}

TEST(ModelConfigTest, Qwen2HasQkvBiasOnly) {
  absl::StatusOr<ModelConfig> c = Parse(Qwen25());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->architecture, "Qwen2ForCausalLM");
  EXPECT_TRUE(c->qkv_bias);
  EXPECT_FALSE(c->o_bias);
  EXPECT_FALSE(c->mlp_bias);
  EXPECT_TRUE(c->tie_word_embeddings);
  EXPECT_EQ(c->head_dim, 64);
  EXPECT_EQ(c->max_position_embeddings, 32768);  // use_sliding_window is false
  EXPECT_EQ(c->rope.theta, 1000000.0);
}

TEST(ModelConfigTest, Qwen2SlidingWindowCapsContext) {
  nlohmann::json j = Qwen25();
  j["use_sliding_window"] = true;
  j["sliding_window"] = 4096;
  absl::StatusOr<ModelConfig> c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->max_position_embeddings, 4096);

  // Layers from max_window_layers on are windowed: none here.
  j["max_window_layers"] = 24;
  c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->max_position_embeddings, 32768);
}

TEST(ModelConfigTest, MistralSlidingWindow) {
  nlohmann::json j = {{"architectures", {"MistralForCausalLM"}},
                      {"hidden_size", 4096},
                      {"intermediate_size", 14336},
                      {"num_attention_heads", 32},
                      {"num_hidden_layers", 32},
                      {"num_key_value_heads", 8},
                      {"max_position_embeddings", 32768},
                      {"rope_theta", 10000.0},
                      {"sliding_window", 4096},
                      {"vocab_size", 32000}};
  absl::StatusOr<ModelConfig> c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->architecture, "MistralForCausalLM");
  EXPECT_EQ(c->max_position_embeddings, 4096);  // v0.1: capped to the window
  EXPECT_FALSE(c->qkv_bias || c->o_bias || c->mlp_bias);

  j["sliding_window"] = nullptr;  // v0.2 and later
  c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->max_position_embeddings, 32768);

  j.erase("sliding_window");  // MistralConfig's default is 4096
  c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->max_position_embeddings, 4096);
}

TEST(ModelConfigTest, MistralNemoHeadDim) {
  nlohmann::json j = {{"architectures", {"MistralForCausalLM"}},
                      {"hidden_size", 5120},
                      {"head_dim", 128},
                      {"intermediate_size", 14336},
                      {"num_attention_heads", 32},
                      {"num_hidden_layers", 40},
                      {"num_key_value_heads", 8},
                      {"max_position_embeddings", 1024000},
                      {"sliding_window", nullptr},
                      {"vocab_size", 131072}};
  absl::StatusOr<ModelConfig> c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->head_dim, 128);
  EXPECT_EQ(c->q_size(), 4096);
}

TEST(ModelConfigTest, UnknownArchitectureNamesFileAndSupported) {
  nlohmann::json j = Llama31();
  j["architectures"] = {"GPTNeoXForCausalLM"};
  absl::StatusOr<ModelConfig> c = Parse(j);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(),
              AllOf(HasSubstr("/ckpt/config.json"), HasSubstr("GPTNeoXForCausalLM"), HasSubstr("LlamaForCausalLM"),
                    HasSubstr("MistralForCausalLM"), HasSubstr("Qwen2ForCausalLM")));
}

TEST(ModelConfigTest, UnsupportedRopeTypes) {
  for (const char* type : {"yarn", "dynamic", "longrope"}) {
    nlohmann::json j = Llama31();
    j["rope_scaling"] = {{"rope_type", type}, {"factor", 4.0}};
    absl::StatusOr<ModelConfig> c = Parse(j);
    ASSERT_FALSE(c.ok()) << type;
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(c.status().message(), AllOf(HasSubstr("/ckpt/config.json"), HasSubstr(type), HasSubstr("llama3")));
  }
  nlohmann::json j = Llama31();
  j.erase("rope_scaling");
  j["rope_parameters"] = {{"rope_type", "yarn"}, {"rope_theta", 1e6}, {"factor", 4.0}};
  EXPECT_THAT(Parse(j).status().message(), HasSubstr("\"yarn\" is not supported"));
}

TEST(ModelConfigTest, Llama3RopeNeedsItsParameters) {
  nlohmann::json j = Llama31();
  j["rope_scaling"].erase("low_freq_factor");
  EXPECT_THAT(Parse(j).status().message(), AllOf(HasSubstr("rope_scaling"), HasSubstr("low_freq_factor")));
}

TEST(ModelConfigTest, BadValuesAreClearErrors) {
  struct Case {
    const char* key;
    nlohmann::json value;
    const char* expected;
  };
  const Case cases[] = {
      {"num_key_value_heads", 5, "multiple of num_key_value_heads"},
      {"hidden_size", -4096, "\"hidden_size\" must be positive"},
      {"vocab_size", 0, "\"vocab_size\" must be positive"},
      {"num_hidden_layers", "32", "\"num_hidden_layers\" must be a 32-bit integer"},
      {"num_hidden_layers", 1e12, "\"num_hidden_layers\" must be a 32-bit integer"},
      {"rms_norm_eps", "small", "\"rms_norm_eps\" must be a number"},
      {"rms_norm_eps", 0.0, "rms_norm_eps must be positive"},
      {"tie_word_embeddings", 1, "\"tie_word_embeddings\" must be true or false"},
      {"hidden_act", "gelu", "\"hidden_act\" must be \"silu\""},
      {"head_dim", 33, "must be even"},
      {"eos_token_id", "</s>", "\"eos_token_id\" must be an integer, a list"},
      {"eos_token_id", 200000, "eos_token_id 200000 is outside the vocabulary"},
      {"rope_theta", -1.0, "rope_theta must be positive"},
      {"architectures", nlohmann::json::array(), "\"architectures\" must be a non-empty list"},
  };
  for (const Case& c : cases) {
    nlohmann::json j = Llama31();
    j[c.key] = c.value;
    absl::StatusOr<ModelConfig> config = Parse(j);
    ASSERT_FALSE(config.ok()) << c.key << " = " << c.value;
    EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(config.status().message(), AllOf(HasSubstr("/ckpt/config.json"), HasSubstr(c.expected)));
  }
}

TEST(ModelConfigTest, MissingKeysAndBadJson) {
  nlohmann::json j = Llama31();
  j.erase("hidden_size");
  EXPECT_THAT(Parse(j).status().message(), HasSubstr("missing required key \"hidden_size\""));

  j = Llama31();
  j["hidden_size"] = 4100;  // 4100 / 32 heads is not whole, and no head_dim
  EXPECT_THAT(Parse(j).status().message(), HasSubstr("not a multiple of num_attention_heads"));

  absl::StatusOr<ModelConfig> c = ParseModelConfig("{\"vocab_size\": 3,", "/x/config.json");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), AllOf(HasSubstr("/x/config.json"), HasSubstr("invalid JSON")));

  c = ParseModelConfig("[1, 2]", "/x/config.json");
  EXPECT_THAT(c.status().message(), HasSubstr("expected a JSON object"));
}

TEST(ModelConfigTest, LoadModelConfigNamesTheMissingFile) {
  absl::StatusOr<ModelConfig> c = LoadModelConfig("/nonexistent/model");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(c.status().message(), HasSubstr("/nonexistent/model/config.json"));
}

TEST(ModelConfigTest, ToJsonIsAHuggingFaceLlamaConfig) {
  absl::StatusOr<ModelConfig> tiny = BuiltinModelConfig("tiny");
  ASSERT_TRUE(tiny.ok());
  const nlohmann::json j = nlohmann::json::parse(ModelConfigToJson(*tiny));
  EXPECT_EQ(j["architectures"], nlohmann::json::array({"LlamaForCausalLM"}));
  EXPECT_EQ(j["model_type"], "llama");
  EXPECT_EQ(j["hidden_act"], "silu");
  EXPECT_EQ(j["pretraining_tp"], 1);
  EXPECT_EQ(j["attention_bias"], false);
  EXPECT_EQ(j["mlp_bias"], false);
  EXPECT_EQ(j["head_dim"], 16);
  EXPECT_EQ(j["num_key_value_heads"], 2);
  EXPECT_EQ(j["rms_norm_eps"].get<double>(), 1e-5);  // not 9.99999974e-06
  EXPECT_EQ(j["rope_theta"], 500000.0);
  EXPECT_EQ(j["rope_scaling"]["rope_type"], "llama3");
  EXPECT_EQ(j["rope_scaling"]["original_max_position_embeddings"], 256);
  EXPECT_EQ(j["bos_token_id"], 256);
  EXPECT_EQ(j["eos_token_id"], nlohmann::json::array({257, 260}));
  EXPECT_EQ(j["torch_dtype"], "float32");
  EXPECT_EQ(j["tie_word_embeddings"], false);
  EXPECT_TRUE(j.contains("initializer_range"));
  EXPECT_TRUE(j.contains("transformers_version"));
  EXPECT_EQ(j["use_cache"], true);
}

TEST(ModelConfigTest, ToJsonRoundTrips) {
  std::vector<ModelConfig> configs;
  configs.push_back(*BuiltinModelConfig("tiny"));
  configs.push_back(*BuiltinModelConfig("small"));
  configs.push_back(*ParseModelConfig(kLlama31, "llama31"));
  configs.push_back(*Parse(Qwen25()));
  ModelConfig odd = *BuiltinModelConfig("tiny");
  odd.rope = RopeConfig{.theta = 12345.5, .type = RopeType::kLinear, .factor = 2.5};
  odd.rms_norm_eps = 3.3e-7f;
  odd.qkv_bias = odd.o_bias = odd.mlp_bias = true;
  odd.tie_word_embeddings = true;
  odd.bos_token_id = -1;
  odd.eos_token_ids = {7};
  odd.torch_dtype = "bfloat16";
  configs.push_back(odd);
  odd.architecture = "MistralForCausalLM";
  odd.qkv_bias = odd.o_bias = odd.mlp_bias = false;
  odd.eos_token_ids = {};
  configs.push_back(odd);
  for (const ModelConfig& config : configs) {
    ASSERT_TRUE(ValidateModelConfig(config).ok()) << ValidateModelConfig(config);
    absl::StatusOr<ModelConfig> back = ParseModelConfig(ModelConfigToJson(config), "round trip");
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_TRUE(*back == config) << ModelConfigToJson(config);
  }
}

TEST(ModelConfigTest, ValidateChecksArchitectureBiases) {
  ModelConfig c = *BuiltinModelConfig("tiny");
  c.qkv_bias = true;  // o_bias false: not expressible as Llama attention_bias
  EXPECT_THAT(ValidateModelConfig(c).message(), HasSubstr("attention_bias"));
  c.architecture = "Qwen2ForCausalLM";
  EXPECT_TRUE(ValidateModelConfig(c).ok());
  c.architecture = "FalconForCausalLM";
  EXPECT_THAT(ValidateModelConfig(c).message(), HasSubstr("FalconForCausalLM"));
}

}  // namespace
}  // namespace tandem::worker
