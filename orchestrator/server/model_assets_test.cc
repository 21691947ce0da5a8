#include "orchestrator/server/model_assets.h"

#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "worker/model/builtin_models.h"
#include "worker/model/model_loader.h"

namespace tandem::router {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

std::shared_ptr<const ModelAssets> Load(const std::string& tokenizer) {
  ModelConfig c;
  c.tokenizer = tokenizer;
  absl::StatusOr<std::shared_ptr<const ModelAssets>> assets = LoadModelAssets(c);
  EXPECT_TRUE(assets.ok()) << tokenizer << ": " << assets.status();
  return assets.ok() ? *assets : nullptr;
}

// "builtin:NAME" is the tokenizer the worker serving builtin:NAME reports
// (else the router would refuse the worker), and its vocabulary covers every
// id the model can emit.
TEST(ModelAssetsTest, BuiltinPresetTokenizerMatchesTheWorkers) {
  for (const std::string& name : worker::BuiltinModelNames()) {
    std::shared_ptr<const ModelAssets> assets = Load("builtin:" + name);
    ASSERT_NE(assets, nullptr);
    absl::StatusOr<worker::LoadedModel> model = worker::LoadModel("builtin:" + name);
    ASSERT_TRUE(model.ok()) << model.status();
    EXPECT_EQ(assets->tokenizer_sha256, model->tokenizer_sha256) << name;
    EXPECT_EQ(assets->tokenizer->vocab_size(), model->config.vocab_size) << name;
    EXPECT_EQ(assets->source, "builtin:" + name);
    EXPECT_EQ(assets->bos_token, "<|begin_of_text|>");
    EXPECT_EQ(assets->eos_token, "<|eot_id|>");
    EXPECT_NE(assets->chat_template, nullptr);
  }
  EXPECT_EQ(Load("builtin:tiny")->tokenizer_sha256, Load("builtin")->tokenizer_sha256);
}

TEST(ModelAssetsTest, PaddedTokenizerDecodesEveryIdAndEncodesAsTheSmallOne) {
  std::shared_ptr<const ModelAssets> padded = Load("builtin:llama-3.1-8b");
  std::shared_ptr<const ModelAssets> small = Load("builtin");
  ASSERT_NE(padded, nullptr);
  ASSERT_NE(small, nullptr);
  const Tokenizer& t = *padded->tokenizer;
  ASSERT_EQ(t.vocab_size(), 128256);
  for (int32_t id = 0; id < t.vocab_size(); ++id) {
    const int32_t one[] = {id};
    if (id < worker::kBuiltinVocabSize) {
      ASSERT_EQ(t.Decode(one, false), small->tokenizer->Decode(one, false)) << id;
      ASSERT_EQ(t.IsSpecial(id), small->tokenizer->IsSpecial(id)) << id;
    } else {
      ASSERT_EQ(t.Decode(one, true), worker::BuiltinTokenText(id)) << id;  // not special: never skipped
    }
  }
  const std::vector<std::string> texts = {
      "Hello, world!",
      "  spaces\tand\nnewlines\r\n",
      "naïve café, 日本語, emoji \xF0\x9F\x98\x80",
      "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>",
      "<|reserved_special_token_122|> and <|filler_384|> and <|filler_128255|>",  // fillers stay text
      std::string("nul \0 byte", 10),
  };
  for (const std::string& text : texts) {
    const std::vector<int32_t> ids = t.Encode(text, /*add_special_tokens=*/false);
    EXPECT_EQ(ids, small->tokenizer->Encode(text, false)) << text;
    const std::vector<int> builtin = worker::EncodeBuiltinText(text);
    EXPECT_EQ(ids, std::vector<int32_t>(builtin.begin(), builtin.end())) << text;
  }
}

TEST(ModelAssetsTest, UnknownBuiltinModelIsNamed) {
  ModelConfig c;
  c.tokenizer = "builtin:nosuch";
  absl::StatusOr<std::shared_ptr<const ModelAssets>> assets = LoadModelAssets(c);
  EXPECT_EQ(assets.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(assets.status().message(),
              AllOf(HasSubstr("model.tokenizer"), HasSubstr("\"nosuch\""), HasSubstr("llama-3.1-8b")));
}

}  // namespace
}  // namespace tandem::router
