#include "orchestrator/tokenizer/tokenizer.h"

#include <atomic>
#include <chrono>
#include <iostream>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "orchestrator/tokenizer/utf8.h"

namespace tandem::router {
namespace {

using nlohmann::json;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string TestData(const std::string& name) { return std::string(TANDEM_TOKENIZER_TESTDATA) + "/" + name; }

// Reference ids from make_reference.mjs (transformers.js), and the loaded
// tokenizers, shared by all tests: loading Qwen3's 11 MB file takes a while.
class ReferenceTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const std::string path = TestData("reference_ids.json");
    if (!std::filesystem::exists(path)) return;
    reference_ = new json(json::parse(ReadFile(path)));
    tokenizers_ = new std::map<std::string, std::unique_ptr<Tokenizer>>();
    for (const json& entry : *reference_) {
      const std::string file = TestData(entry["file"].get<std::string>());
      if (!std::filesystem::exists(file)) continue;
      absl::StatusOr<std::unique_ptr<Tokenizer>> tok;
      if (entry.contains("post_processor")) {
        json j = json::parse(ReadFile(file));
        j["post_processor"] = entry["post_processor"];
        tok = Tokenizer::FromJson(j.dump());
      } else {
        tok = Tokenizer::FromFile(file);
      }
      ASSERT_TRUE(tok.ok()) << tok.status();
      (*tokenizers_)[entry["name"].get<std::string>()] = *std::move(tok);
    }
  }
  static void TearDownTestSuite() {
    delete reference_;
    delete tokenizers_;
    reference_ = nullptr;
    tokenizers_ = nullptr;
  }
  const Tokenizer* Get(const std::string& name) {
    if (tokenizers_ == nullptr) return nullptr;
    auto it = tokenizers_->find(name);
    return it == tokenizers_->end() ? nullptr : it->second.get();
  }

  static json* reference_;
  static std::map<std::string, std::unique_ptr<Tokenizer>>* tokenizers_;
};
json* ReferenceTest::reference_ = nullptr;
std::map<std::string, std::unique_ptr<Tokenizer>>* ReferenceTest::tokenizers_ = nullptr;

TEST_F(ReferenceTest, EncodeMatchesHuggingFaceAndDecodeRoundTrips) {
  if (reference_ == nullptr) GTEST_SKIP() << "testdata/reference_ids.json absent";
  for (const json& entry : *reference_) {
    const std::string name = entry["name"].get<std::string>();
    const Tokenizer* tok = Get(name);
    if (tok == nullptr) {
      ADD_FAILURE() << name << ": testdata/" << entry["file"].get<std::string>()
                    << " absent; see make_reference.mjs";
      continue;
    }
    for (const json& c : entry["cases"]) {
      const std::string text = c["text"].get<std::string>();
      SCOPED_TRACE(name + ": \"" + text + "\"");
      const auto ids = tok->Encode(text, /*add_special_tokens=*/false);
      EXPECT_EQ(ids, c["ids"].get<std::vector<int32_t>>());
      EXPECT_EQ(tok->Encode(text, /*add_special_tokens=*/true), c["ids_with_special"].get<std::vector<int32_t>>());
      // Qwen3 normalizes to NFC, so only the NFC form round-trips there.
      if (name != "qwen3" || text.find("e\xCC\x81") == std::string::npos) {
        EXPECT_EQ(tok->Decode(ids, /*skip_special_tokens=*/false), text);
      }
    }
  }
}

TEST_F(ReferenceTest, SpecialTokensAndLookups) {
  const Tokenizer* llama = Get("llama3_bos");
  if (llama == nullptr) GTEST_SKIP() << "Llama 3 testdata absent";
  EXPECT_EQ(llama->vocab_size(), 128256);
  EXPECT_EQ(llama->TokenToId("<|begin_of_text|>"), 128000);
  EXPECT_EQ(llama->TokenToId("Hello"), 9906);
  EXPECT_EQ(llama->TokenToId("no such token"), std::nullopt);
  EXPECT_EQ(llama->IdToToken(9906), "Hello");
  EXPECT_TRUE(llama->IsSpecial(128000));
  EXPECT_FALSE(llama->IsSpecial(9906));
  const auto ids = llama->Encode("Hi<|eot_id|>", /*add_special_tokens=*/true);
  ASSERT_GE(ids.size(), 2u);
  EXPECT_EQ(ids.front(), 128000);
  EXPECT_EQ(llama->Decode(ids, /*skip_special_tokens=*/true), "Hi");
  EXPECT_EQ(llama->Decode(ids, /*skip_special_tokens=*/false), "<|begin_of_text|>Hi<|eot_id|>");
  // Unknown ids are skipped; a lone continuation byte becomes U+FFFD.
  EXPECT_EQ(llama->Decode(std::vector<int32_t>{9906, -1, 999999}, false), "Hello");
}

TEST_F(ReferenceTest, IncrementalDetokenizerNeverSplitsCharacters) {
  for (const char* name : {"llama3", "qwen3"}) {
    const Tokenizer* tok = Get(name);
    if (tok == nullptr) GTEST_SKIP() << name << " testdata absent";
    const std::string text = "emoji 😀🎉👍🏽 and 日本語 mixed ñ € 𝄞 <|im_end|>.";
    const auto ids = tok->Encode(text, false);
    IncrementalDetokenizer detok(*tok, /*skip_special_tokens=*/false);
    std::string out;
    int split_chars = 0;
    for (int32_t id : ids) {
      std::string piece;
      tok->AppendTokenBytes(id, false, &piece);
      if (!IsValidUtf8(piece)) ++split_chars;  // this token holds part of a character
      const std::string delta = detok.Add(id);
      EXPECT_TRUE(IsValidUtf8(delta)) << name;
      out += delta;
    }
    out += detok.Flush();
    EXPECT_EQ(out, text) << name;
    EXPECT_GT(split_chars, 0) << name << ": the text should exercise characters split across tokens";
  }
}

TEST_F(ReferenceTest, IncrementalDetokenizerFlushesIncompleteCharacter) {
  const Tokenizer* tok = Get("llama3");
  if (tok == nullptr) GTEST_SKIP() << "Llama 3 testdata absent";
  // The first token of an emoji that spans several tokens.
  const auto ids = tok->Encode("😀", false);
  std::string first;
  tok->AppendTokenBytes(ids[0], false, &first);
  ASSERT_FALSE(IsValidUtf8(first));
  IncrementalDetokenizer detok(*tok, false);
  EXPECT_EQ(detok.Add(ids[0]), "");
  EXPECT_EQ(detok.Flush(), "\xEF\xBF\xBD");
}

TEST_F(ReferenceTest, ConcurrentEncodeIsConsistent) {
  const Tokenizer* tok = Get("qwen3");
  if (tok == nullptr) GTEST_SKIP() << "Qwen3 testdata absent";
  const std::string text = "Concurrent encoding of the same words 12345 über 中文 should agree.";
  const auto expected = tok->Encode(text, false);
  std::vector<std::thread> threads;
  std::atomic<int> mismatches{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 200; ++i) {
        if (tok->Encode(text + std::to_string(i % 7), false).size() < expected.size()) ++mismatches;
        if (tok->Encode(text, false) != expected) ++mismatches;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(mismatches.load(), 0);
}

TEST_F(ReferenceTest, EncodeSpeed) {
  for (const char* name : {"llama3", "qwen3"}) {
    const Tokenizer* tok = Get(name);
    if (tok == nullptr) continue;
    std::string text;
    for (const json& c : (*reference_)[0]["cases"]) {
      const std::string t = c["text"].get<std::string>();
      if (t.find("e\xCC\x81") == std::string::npos) text += t + "\n";  // NFC changes it in Qwen3
    }
    while (text.size() < (1 << 20)) text += text;
    auto start = std::chrono::steady_clock::now();
    const auto ids = tok->Encode(text, false);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::cout << name << ": " << text.size() / 1e6 / s << " MB/s, " << ids.size() / s / 1e6
              << " M tokens/s (" << text.size() << " bytes, warm cache)\n";
    EXPECT_TRUE(tok->Decode(ids, false) == text) << name << ": 1 MB round trip differs";
  }
}

// Small synthetic tokenizers for the error and format cases.
json TinyByteLevelBpe() {
  json vocab = json::object();
  int id = 0;
  for (const char* t : {"a", "b", "c", "Ġ", "ab", "abc", "Ġa"}) vocab[t] = id++;
  return json{
      {"version", "1.0"},
      {"added_tokens", json::array({{{"id", 7}, {"content", "<s>"}, {"special", true}}})},
      {"normalizer", nullptr},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
      {"post_processor",
       {{"type", "TemplateProcessing"},
        {"single", json::array({{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
                                {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})},
        {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {7}}, {"tokens", {"<s>"}}}}}}}},
      {"decoder", {{"type", "ByteLevel"}}},
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", json::array({"a b", "ab c", "Ġ a"})}}},
  };
}

TEST(TokenizerTest, MergesInStringAndPairForm) {
  json j = TinyByteLevelBpe();
  auto tok = Tokenizer::FromJson(j.dump());
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_THAT((*tok)->Encode("abc a", true), ElementsAre(7, 5, 6));
  j["model"]["merges"] = json::array({json::array({"a", "b"}), json::array({"ab", "c"})});
  tok = Tokenizer::FromJson(j.dump());
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_THAT((*tok)->Encode("abc a", false), ElementsAre(5, 3, 0));
  EXPECT_EQ((*tok)->Decode(std::vector<int32_t>{5, 3, 0}, false), "abc a");
}

TEST(TokenizerTest, IgnoreMergesTakesWholeWordsFromTheVocab) {
  json j = TinyByteLevelBpe();
  j["model"]["vocab"]["bc"] = 8;  // reachable only without merges
  j["model"]["merges"] = json::array();
  auto tok = Tokenizer::FromJson(j.dump());
  ASSERT_TRUE(tok.ok());
  EXPECT_THAT((*tok)->Encode("bc", false), ElementsAre(1, 2));
  j["model"]["ignore_merges"] = true;
  tok = Tokenizer::FromJson(j.dump());
  ASSERT_TRUE(tok.ok());
  EXPECT_THAT((*tok)->Encode("bc", false), ElementsAre(8));
}

TEST(TokenizerTest, InvalidUtf8InputIsRepairedNotFatal) {
  auto tok = Tokenizer::FromJson(TinyByteLevelBpe().dump());
  ASSERT_TRUE(tok.ok());
  // U+FFFD's bytes are not in the tiny vocab, so they are dropped.
  EXPECT_THAT((*tok)->Encode("a\xFF" "b", false), ElementsAre(0, 1));
}

TEST(TokenizerTest, ErrorsNameTheJsonPath) {
  EXPECT_EQ(Tokenizer::FromJson("{not json").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Tokenizer::FromFile("/nonexistent/tokenizer.json").status().code(), absl::StatusCode::kNotFound);

  auto expect_error = [](json j, const std::string& path) {
    auto tok = Tokenizer::FromJson(j.dump());
    ASSERT_FALSE(tok.ok()) << path;
    EXPECT_EQ(tok.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(tok.status().message()), HasSubstr(path));
  };
  json j = TinyByteLevelBpe();
  j["model"]["type"] = "WordPiece";
  expect_error(j, "model.type");
  j = TinyByteLevelBpe();
  j["model"]["byte_fallback"] = true;
  expect_error(j, "model.byte_fallback");
  j = TinyByteLevelBpe();
  j["model"]["merges"] = json::array({"a b c"});
  expect_error(j, "model.merges[0]");
  j = TinyByteLevelBpe();
  j["model"]["merges"] = json::array({"a z"});
  expect_error(j, "model.merges[0]");
  j = TinyByteLevelBpe();
  j["normalizer"] = {{"type", "Lowercase"}};
  expect_error(j, "normalizer.type");
  j = TinyByteLevelBpe();
  j["pre_tokenizer"] = {{"type", "Sequence"},
                        {"pretokenizers", json::array({{{"type", "Split"},
                                                        {"pattern", {{"Regex", "(unclosed"}}},
                                                        {"behavior", "Isolated"}}})}};
  expect_error(j, "pre_tokenizer.pretokenizers[0].pattern");
  j = TinyByteLevelBpe();
  j["pre_tokenizer"] = {{"type", "Metaspace"}};
  expect_error(j, "pre_tokenizer.type");
  j = TinyByteLevelBpe();
  j["decoder"] = {{"type", "WordPiece"}};
  expect_error(j, "decoder.type");
  j = TinyByteLevelBpe();
  j["post_processor"] = {{"type", "BertProcessing"}};
  expect_error(j, "post_processor.type");
  j = TinyByteLevelBpe();
  j["added_tokens"][0]["lstrip"] = true;
  expect_error(j, "added_tokens[0].lstrip");
  j = TinyByteLevelBpe();
  j["model"]["vocab"] = "oops";
  expect_error(j, "model.vocab");
}

}  // namespace
}  // namespace tandem::router
