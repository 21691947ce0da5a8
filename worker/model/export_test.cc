#include "worker/model/export.h"

#include <bit>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/sha256.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/model/builtin_models.h"
#include "worker/model/model_loader.h"
#include "worker/model/safetensors.h"
#include "worker/model/test_util.h"

namespace tandem::worker {
namespace {

// A loaded model's weights as the CPU runner reads them.
ModelWeights Weights(const LoadedModel& m) {
  absl::StatusOr<ModelWeights> w = LoadWeights(m.config, *m.tensors);
  EXPECT_TRUE(w.ok()) << w.status();
  return w.ok() ? *std::move(w) : ModelWeights{};
}

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

nlohmann::json ReadJson(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

// Every parameter, in a fixed order, for whole-model comparisons.
std::vector<const std::vector<float>*> Parameters(const ModelWeights& w) {
  std::vector<const std::vector<float>*> all = {&w.embed, &w.final_norm, &w.lm_head};
  for (const LayerWeights& l : w.layers) {
    for (const std::vector<float>* v : {&l.input_norm, &l.wqkv, &l.bqkv, &l.wo, &l.bo, &l.post_norm, &l.w_gate_up,
                                        &l.b_gate_up, &l.w_down, &l.b_down}) {
      all.push_back(v);
    }
  }
  return all;
}

// Expects `got` to equal `want` rounded through `dtype`, bit for bit.
void ExpectWeightsEqual(const ModelWeights& want, const ModelWeights& got,
                        SafetensorsDtype dtype = SafetensorsDtype::kF32) {
  const auto a = Parameters(want);
  const auto b = Parameters(got);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i]->size(), b[i]->size()) << "parameter " << i;
    for (size_t k = 0; k < a[i]->size(); ++k) {
      const float expected = RoundToDtype((*a[i])[k], dtype);
      ASSERT_EQ(std::bit_cast<uint32_t>(expected), std::bit_cast<uint32_t>((*b[i])[k]))
          << "parameter " << i << " element " << k;
    }
  }
}

TEST(ExportTest, Float32ExportReloadsBitIdentical) {
  ScopedTempDir tmp("tiny_f32");
  const std::string& dir = tmp.path();
  ASSERT_TRUE(ExportModel("tiny", dir).ok());
  for (const char* file :
       {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}) {
    EXPECT_TRUE(std::filesystem::exists(dir + "/" + file)) << file;
  }
  absl::StatusOr<LoadedModel> builtin = LoadModel("builtin:tiny");
  ASSERT_TRUE(builtin.ok()) << builtin.status();
  absl::StatusOr<LoadedModel> loaded = LoadModel(dir);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->name, "tiny_f32");
  EXPECT_EQ(loaded->source_dir, dir);
  EXPECT_EQ(builtin->name, "tiny");
  EXPECT_TRUE(builtin->source_dir.empty());
  EXPECT_TRUE(loaded->config == builtin->config);
  ExpectWeightsEqual(Weights(*builtin), Weights(*loaded));

  EXPECT_EQ(LoadModel(dir + "/")->name, "tiny_f32");

  const nlohmann::json generation = ReadJson(dir + "/generation_config.json");
  EXPECT_EQ(generation["bos_token_id"], 256);
  EXPECT_EQ(generation["eos_token_id"], nlohmann::json::array({257, 260}));
}

TEST(ExportTest, BFloat16AndFloat16ExportsReloadRounded) {
  absl::StatusOr<LoadedModel> builtin = LoadModel("builtin:tiny");
  ASSERT_TRUE(builtin.ok());
  for (const auto& [name, dtype] :
       {std::pair{"bfloat16", SafetensorsDtype::kBF16}, std::pair{"float16", SafetensorsDtype::kF16}}) {
    ScopedTempDir tmp(std::string("tiny_") + name);
    const std::string& dir = tmp.path();
    ASSERT_TRUE(ExportModel("tiny", dir, {.dtype = name}).ok());
    absl::StatusOr<LoadedModel> loaded = LoadModel(dir);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    EXPECT_EQ(loaded->config.torch_dtype, name);
    ExpectWeightsEqual(Weights(*builtin), Weights(*loaded), dtype);
    // The file holds 16-bit values: about half the f32 size.
    EXPECT_LT(std::filesystem::file_size(dir + "/model.safetensors"), 500000u);
  }
}

TEST(ExportTest, ShardedExportReloads) {
  ScopedTempDir tmp("tiny_sharded");
  const std::string& dir = tmp.path();
  ASSERT_TRUE(ExportModel("tiny", dir).ok());  // a single file first: must be replaced
  ASSERT_TRUE(ExportModel("tiny", dir, {.max_shard_bytes = 100000}).ok());
  EXPECT_FALSE(std::filesystem::exists(dir + "/model.safetensors"));

  const nlohmann::json index = ReadJson(dir + "/model.safetensors.index.json");
  std::set<std::string> shards;
  for (const auto& item : index["weight_map"].items()) shards.insert(item.value().get<std::string>());
  ASSERT_GE(shards.size(), 3u);
  const int n = static_cast<int>(shards.size());
  char expected_last[64];
  std::snprintf(expected_last, sizeof(expected_last), "model-%05d-of-%05d.safetensors", n, n);
  EXPECT_EQ(*shards.rbegin(), expected_last);
  EXPECT_EQ(*shards.begin(), std::string("model-00001-of-") + (expected_last + 15));

  int64_t total = 0;
  for (const auto& [name, shape] : ExpectedTensorShapes(*BuiltinModelConfig("tiny"))) {
    int64_t numel = 1;
    for (int64_t d : shape) numel *= d;
    total += numel * 4;
    EXPECT_TRUE(index["weight_map"].contains(name)) << name;
  }
  EXPECT_EQ(index["metadata"]["total_size"], total);
  for (const std::string& shard : shards) {
    // A shard holds at most max_shard_bytes of data, unless one tensor is larger.
    auto file = SafetensorsFile::Open(dir + "/" + shard);
    ASSERT_TRUE(file.ok()) << file.status();
    uint64_t bytes = 0;
    for (const auto& [name, entry] : (*file)->entries()) bytes += entry.end - entry.begin;
    EXPECT_TRUE(bytes <= 100000 || (*file)->entries().size() == 1) << shard;
  }

  absl::StatusOr<LoadedModel> loaded = LoadModel(dir);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ExpectWeightsEqual(Weights(*LoadModel("builtin:tiny")), Weights(*loaded));

  // Exporting unsharded again removes the shards.
  ASSERT_TRUE(ExportModel("tiny", dir).ok());
  EXPECT_FALSE(std::filesystem::exists(dir + "/model.safetensors.index.json"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/" + *shards.begin()));
}

TEST(ExportTest, TokenizerJsonIsByteLevel) {
  ScopedTempDir tmp("tokenizer");
  const std::string& dir = tmp.path();
  ASSERT_TRUE(ExportModel("tiny", dir).ok());
  const nlohmann::json t = ReadJson(dir + "/tokenizer.json");
  const nlohmann::json& model = t["model"];
  EXPECT_EQ(model["type"], "BPE");
  EXPECT_EQ(model["merges"], nlohmann::json::array());
  const nlohmann::json& vocab = model["vocab"];
  EXPECT_EQ(vocab["A"], 0x41);
  EXPECT_EQ(vocab["!"], 33);
  EXPECT_EQ(vocab["\xC4\xA0"], 32);    // U+0120 'Ġ' is the space
  EXPECT_EQ(vocab["\xC4\x8A"], 10);    // U+010A 'Ċ' is the newline
  EXPECT_EQ(vocab["\xC4\x80"], 0);     // U+0100 is byte 0
  EXPECT_EQ(vocab["\xC3\xBF"], 255);   // U+00FF 'ÿ' stands for itself
  EXPECT_EQ(vocab["\xC5\x83"], 0xAD);  // U+0143: the last shifted byte, soft hyphen
  std::set<int> ids;
  for (const auto& item : vocab.items()) ids.insert(item.value().get<int>());
  EXPECT_EQ(vocab.size(), 256u);
  EXPECT_EQ(ids.size(), 256u);
  EXPECT_EQ(*ids.rbegin(), 255);

  EXPECT_EQ(t["pre_tokenizer"]["type"], "ByteLevel");
  EXPECT_EQ(t["pre_tokenizer"]["add_prefix_space"], false);
  EXPECT_EQ(t["pre_tokenizer"]["use_regex"], false);
  EXPECT_EQ(t["pre_tokenizer"]["trim_offsets"], true);
  EXPECT_EQ(t["decoder"]["type"], "ByteLevel");
  const nlohmann::json& added = t["added_tokens"];
  ASSERT_EQ(added.size(), 128u);
  EXPECT_EQ(added[0]["id"], 256);
  EXPECT_EQ(added[0]["content"], "<|begin_of_text|>");
  EXPECT_EQ(added[4]["content"], "<|eot_id|>");
  EXPECT_EQ(added[127]["id"], 383);
  EXPECT_EQ(added[127]["content"], "<|reserved_special_token_122|>");
  for (const auto& token : added) EXPECT_EQ(token["special"], true);

  const nlohmann::json c = ReadJson(dir + "/tokenizer_config.json");
  EXPECT_EQ(c["bos_token"], "<|begin_of_text|>");
  EXPECT_EQ(c["eos_token"], "<|eot_id|>");
  EXPECT_EQ(c["chat_template"], std::string(BuiltinChatTemplate()));
  EXPECT_EQ(c["tokenizer_class"], "PreTrainedTokenizerFast");
  EXPECT_EQ(c["clean_up_tokenization_spaces"], false);
  EXPECT_EQ(c["model_max_length"], 2048);
  EXPECT_EQ(c["added_tokens_decoder"]["260"]["content"], "<|eot_id|>");
  EXPECT_EQ(c["added_tokens_decoder"].size(), 128u);
}

TEST(ExportTest, BadOptionsAndPresets) {
  ScopedTempDir tmp("bad");
  const std::string& dir = tmp.path();
  EXPECT_THAT(ExportModel("tiny", dir, {.dtype = "int8"}).message(), HasSubstr("int8"));
  EXPECT_THAT(ExportModel("tiny", dir, {.max_shard_bytes = -1}).message(), HasSubstr("max_shard_bytes"));
  absl::Status s = ExportModel("huge", dir);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("huge"), HasSubstr("tiny, small, llama-3.2-1b, llama-3.1-8b")));
  EXPECT_FALSE(std::filesystem::exists(dir + "/config.json"));

  // A seeded model whose vocabulary cannot hold the tokenizer's special tokens.
  ModelConfig small_vocab = *BuiltinModelConfig("tiny");
  small_vocab.vocab_size = 300;
  small_vocab.eos_token_ids = {257};
  s = ExportSeededModel(SeededTensorSource(small_vocab, 1, "test model"), dir);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("test model"), HasSubstr("vocab_size 300"), HasSubstr("384")));
}

std::string FileSha256(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return Sha256Hex(std::string(std::istreambuf_iterator<char>(in), {}));
}

// Export streams tensor by tensor; its files are byte for byte those of the
// in-memory writer it replaced (digests taken from that writer's exports:
// `tandem export-model --preset P [--dtype D] [--max-shard-bytes 100000]`).
// "small" has tensors of several generation chunks, so this also pins the
// parallel generator to the values the serial one made.
TEST(ExportTest, FilesAreThoseOfTheInMemoryWriter) {
  struct Case {
    std::string preset;
    ExportOptions options;
    std::map<std::string, std::string> sha256;  // file -> digest
  };
  const std::vector<Case> cases = {
      {"tiny",
       {},
       {{"model.safetensors", "1d5f4287587e11752d3de9f6de5f897d11c9af78e64a0df1b9fb98251edee86b"},
        {"tokenizer.json", "6d9d110a9d0c05a22b2eab170de492548eb94b2b5cf4ed2fae4760d1ae6f4bab"},
        {"config.json", "dee5d54917885347ed7b6caccb056ab0b3fee60069cc460c0c3bb2faa1870800"},
        {"tokenizer_config.json", "1b272f44e56e91ac6db93c26fb8715ca7296947a6ec4790560bb632790c9fce8"}}},
      {"tiny",
       {.dtype = "bfloat16"},
       {{"model.safetensors", "68e640d196460605eda5fa0d965902fa0020e19b4fce574a8a9f5c79aa811f10"}}},
      {"tiny",
       {.dtype = "float16", .max_shard_bytes = 100000},
       {{"model-00001-of-00004.safetensors", "6cd6d3f65911fd5e51c1463df294bca0dade1202da228ab481380e2f8a78ddfa"},
        {"model-00002-of-00004.safetensors", "bec21eda7c9abc6e365de65628d99bc0680afbf9df52fac9c7ab0b92799b1d74"},
        {"model-00003-of-00004.safetensors", "3cb828d16059c62107b9e773f261a6019cea6185ed9c44b0fc2e05a3566ac814"},
        {"model-00004-of-00004.safetensors", "52f769e9f19de90cda826ffb49a0279713d72af73ab957861afbbf43d84285de"},
        {"model.safetensors.index.json", "f51880b858d4ea85861129683995f1b37d2f52e55f2711b1b4a9717c7fc860ed"}}},
      {"small", {}, {{"model.safetensors", "e84af0711b2c85ba598f4d582c5de490e89925394735343f683d5be1a20fc8c7"}}},
  };
  for (const Case& c : cases) {
    ScopedTempDir tmp("pinned");
    ASSERT_TRUE(ExportModel(c.preset, tmp.path(), c.options).ok());
    for (const auto& [file, sha256] : c.sha256) {
      EXPECT_EQ(FileSha256(tmp.path() + "/" + file), sha256) << c.preset << " " << c.options.dtype << " " << file;
    }
  }
}

// A test model through the same streaming path as the large presets: a
// padded vocabulary (1000 ids), tied embeddings, one file and shards.
TEST(ExportTest, StreamedExportOfAPaddedModelReloads) {
  ModelConfig config = *BuiltinModelConfig("tiny");
  config.vocab_size = 1000;
  config.tie_word_embeddings = true;
  const SeededTensorSource source(config, 99, "padded test model");
  const ModelWeights want = *LoadWeights(config, source);

  ScopedTempDir tmp("padded");
  const std::string& dir = tmp.path();
  ASSERT_TRUE(ExportSeededModel(source, dir).ok());
  // The same bytes as writing every tensor at once.
  std::map<std::string, Tensor> all;
  for (const std::string& name : source.TensorNames()) all[name] = *source.Get(name);
  ASSERT_TRUE(WriteSafetensors(dir + "/in_memory.safetensors", all, SafetensorsDtype::kF32).ok());
  EXPECT_EQ(FileSha256(dir + "/model.safetensors"), FileSha256(dir + "/in_memory.safetensors"));
  std::filesystem::remove(dir + "/in_memory.safetensors");

  absl::StatusOr<LoadedModel> loaded = LoadModel(dir);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_TRUE(loaded->config == config);
  EXPECT_EQ(loaded->tokenizer_sha256, Sha256Hex(BuiltinTokenizerJson(1000)));
  ExpectWeightsEqual(want, Weights(*loaded));

  ASSERT_TRUE(ExportSeededModel(source, dir, {.dtype = "bfloat16", .max_shard_bytes = 40000}).ok());
  EXPECT_FALSE(std::filesystem::exists(dir + "/model.safetensors"));
  loaded = LoadModel(dir);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ExpectWeightsEqual(want, Weights(*loaded), SafetensorsDtype::kBF16);
}

TEST(ExportTest, TokenizerJsonIsPaddedToTheVocabulary) {
  const nlohmann::json t = nlohmann::json::parse(BuiltinTokenizerJson(1000));
  const nlohmann::json& vocab = t["model"]["vocab"];
  EXPECT_EQ(vocab.size(), 256u + 616u);
  std::set<int> ids;
  for (const auto& item : vocab.items()) ids.insert(item.value().get<int>());
  EXPECT_EQ(ids.size(), vocab.size());
  EXPECT_EQ(*ids.rbegin(), 999);
  EXPECT_EQ(ids.count(256), 0u);  // 256-383 are the added tokens, as with 384 ids
  EXPECT_EQ(vocab["<|filler_384|>"], 384);
  EXPECT_EQ(vocab["<|filler_999|>"], 999);
  EXPECT_EQ(t["model"]["merges"], nlohmann::json::array());
  EXPECT_EQ(t["added_tokens"], nlohmann::json::parse(BuiltinTokenizerJson())["added_tokens"]);
  // The unpadded tokenizer is unchanged: routers and workers of other builds agree on it.
  EXPECT_EQ(BuiltinTokenizerJson(kBuiltinVocabSize), BuiltinTokenizerJson());
  EXPECT_EQ(Sha256Hex(BuiltinTokenizerJson()), "6d9d110a9d0c05a22b2eab170de492548eb94b2b5cf4ed2fae4760d1ae6f4bab");
}

TEST(LoadModelTest, ErrorsNameWhatIsWrong) {
  absl::StatusOr<LoadedModel> m = LoadModel("builtin:huge");
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(m.status().message(), AllOf(HasSubstr("huge"), HasSubstr("tiny")));

  m = LoadModel("/nonexistent/model");
  EXPECT_EQ(m.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(m.status().message(), HasSubstr("/nonexistent/model"));

  ScopedTempDir tmp("broken");
  const std::string& dir = tmp.path();
  m = LoadModel(dir);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(m.status().message(), HasSubstr(dir + "/config.json"));

  // A truncated checkpoint names the file and the tensor cut off.
  ASSERT_TRUE(ExportModel("tiny", dir).ok());
  const std::string weights = dir + "/model.safetensors";
  std::filesystem::resize_file(weights, std::filesystem::file_size(weights) - 100);
  m = LoadModel(dir);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(m.status().message(),
              AllOf(HasSubstr(weights), HasSubstr("truncated"), HasSubstr("'model.norm.weight'")));

  // A config that disagrees with the weights names the tensor (the first in
  // name order: LoadModel checks shapes without reading the data).
  ASSERT_TRUE(ExportModel("tiny", dir).ok());
  nlohmann::json config = ReadJson(dir + "/config.json");
  config["intermediate_size"] = 128;
  std::ofstream(dir + "/config.json") << config.dump();
  m = LoadModel(dir);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(m.status().message(), AllOf(HasSubstr("'model.layers.0.mlp.down_proj.weight'"), HasSubstr("[64, 176]"),
                                          HasSubstr("expected [64, 128]"), HasSubstr("checkpoint " + dir)));
}

TEST(BuiltinModelsTest, PresetsAreDeterministic) {
  auto a = MakeBuiltinTensorSource("tiny");
  auto b = MakeBuiltinTensorSource("tiny");
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ((*a)->Describe(), "builtin:tiny");
  for (const std::string& name : (*a)->TensorNames()) {
    EXPECT_EQ((*a)->Get(name)->data, (*b)->Get(name)->data) << name;
  }
  // Pinned values: a change here changes every built-in model's outputs.
  const std::vector<float> embed = (*a)->Get("model.embed_tokens.weight")->data;
  const std::vector<float> q = (*a)->Get("model.layers.0.self_attn.q_proj.weight")->data;
  char text[128];
  std::snprintf(text, sizeof(text), "%.9g %.9g %.9g | %.9g", embed[0], embed[1], embed[12345], q[7]);
  EXPECT_STREQ(text, "-0.228333741 2.1654501 -0.65065068 | 0.0538303629");
  // Different tensors and presets get different numbers.
  EXPECT_NE(q[0], (*a)->Get("model.layers.1.self_attn.q_proj.weight")->data[0]);
  auto small = MakeBuiltinTensorSource("small");
  ASSERT_TRUE(small.ok());
  EXPECT_NE(embed[0], (*small)->Get("model.embed_tokens.weight")->data[0]);
}

double Mean(const std::vector<float>& v) {
  double sum = 0;
  for (float x : v) sum += x;
  return sum / v.size();
}

double Std(const std::vector<float>& v) {
  const double mean = Mean(v);
  double sum = 0;
  for (float x : v) sum += (x - mean) * (x - mean);
  return std::sqrt(sum / v.size());
}

TEST(BuiltinModelsTest, WeightScales) {
  auto source = MakeBuiltinTensorSource("tiny");
  ASSERT_TRUE(source.ok());
  auto get = [&](const char* name) { return (*source)->Get(name)->data; };
  EXPECT_NEAR(Mean(get("model.embed_tokens.weight")), 0.0, 0.03);
  EXPECT_NEAR(Std(get("model.embed_tokens.weight")), 1.0, 0.03);
  EXPECT_NEAR(Std(get("model.layers.0.mlp.gate_proj.weight")), 1 / 8.0, 0.005);  // 1/sqrt(64)
  EXPECT_NEAR(Std(get("model.layers.0.mlp.down_proj.weight")), 1 / std::sqrt(176.0), 0.005);
  EXPECT_NEAR(Std(get("lm_head.weight")), 3 / 8.0, 0.01);
  EXPECT_NEAR(Mean(get("model.norm.weight")), 1.0, 0.03);
  EXPECT_NEAR(Std(get("model.layers.2.input_layernorm.weight")), 0.05, 0.02);
}

TEST(BuiltinModelsTest, PresetConfigs) {
  absl::StatusOr<ModelConfig> tiny = BuiltinModelConfig("tiny");
  ASSERT_TRUE(tiny.ok());
  EXPECT_TRUE(ValidateModelConfig(*tiny).ok());
  EXPECT_EQ(tiny->vocab_size, 384);
  EXPECT_EQ(tiny->hidden_size, 64);
  EXPECT_EQ(tiny->intermediate_size, 176);
  EXPECT_EQ(tiny->num_layers, 3);
  EXPECT_EQ(tiny->num_heads, 4);
  EXPECT_EQ(tiny->num_kv_heads, 2);
  EXPECT_EQ(tiny->head_dim, 16);
  EXPECT_EQ(tiny->max_position_embeddings, 2048);
  EXPECT_EQ(tiny->rope.type, RopeType::kLlama3);
  EXPECT_EQ(tiny->rope.original_max_position_embeddings, 256);
  EXPECT_EQ(tiny->bos_token_id, 256);
  EXPECT_THAT(tiny->eos_token_ids, ElementsAre(257, 260));
  EXPECT_FALSE(tiny->tie_word_embeddings);

  absl::StatusOr<ModelConfig> small = BuiltinModelConfig("small");
  ASSERT_TRUE(small.ok());
  EXPECT_TRUE(ValidateModelConfig(*small).ok());
  EXPECT_EQ(small->hidden_size, 512);
  EXPECT_EQ(small->intermediate_size, 1536);
  EXPECT_EQ(small->num_layers, 8);
  EXPECT_EQ(small->num_heads, 8);
  EXPECT_EQ(small->num_kv_heads, 4);
  EXPECT_EQ(small->head_dim, 64);
  EXPECT_EQ(small->max_position_embeddings, 8192);
  EXPECT_EQ(small->rope.original_max_position_embeddings, 8192);
}

TEST(BuiltinModelsTest, LoadsSmall) {
  absl::StatusOr<LoadedModel> m = LoadModel("builtin:small");
  ASSERT_TRUE(m.ok()) << m.status();
  const ModelWeights w = Weights(*m);
  EXPECT_EQ(w.layers.size(), 8u);
  EXPECT_EQ(w.layers[7].wqkv.size(), size_t{(512 + 2 * 256) * 512});
  EXPECT_EQ(w.layers[7].w_gate_up.size(), size_t{2 * 1536 * 512});
}

TEST(BuiltinModelsTest, ByteTokenizer) {
  EXPECT_THAT(EncodeBuiltinText("Hi!"), ElementsAre(72, 105, 33));
  EXPECT_THAT(EncodeBuiltinText("\xFF\x00"), ElementsAre(255));  // string_view stops at NUL
  EXPECT_THAT(EncodeBuiltinText(std::string_view("a\0b", 3)), ElementsAre(97, 0, 98));
  EXPECT_THAT(EncodeBuiltinText("<|begin_of_text|>x<|eot_id|><|reserved_special_token_122|>"),
              ElementsAre(256, 120, 260, 383));
  // Text that only looks like a special token stays bytes.
  EXPECT_EQ(EncodeBuiltinText("<|nope|>").size(), 8u);
  EXPECT_EQ(EncodeBuiltinText("<|eot_id").size(), 8u);

  const std::vector<int> ids = {256, 72, 105, 260, 383, 10, -1, 999};
  EXPECT_EQ(DecodeBuiltinTokens(ids), "Hi\n");
  EXPECT_EQ(BuiltinTokenText(258), "<|start_header_id|>");
  EXPECT_EQ(BuiltinTokenText(259), "<|end_header_id|>");
  EXPECT_EQ(BuiltinTokenText(261), "<|reserved_special_token_0|>");
  EXPECT_EQ(BuiltinTokenText(65), "A");
  for (int id = 0; id < kBuiltinVocabSize; ++id) {
    EXPECT_THAT(EncodeBuiltinText(BuiltinTokenText(id)), ElementsAre(id));
  }
  EXPECT_THAT(std::string(BuiltinChatTemplate()), AllOf(HasSubstr("<|start_header_id|>"), HasSubstr("<|eot_id|>"),
                                                        HasSubstr("add_generation_prompt"), HasSubstr("bos_token")));
}

}  // namespace
}  // namespace tandem::worker
