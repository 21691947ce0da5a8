#include "worker/model/safetensors.h"

#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/model/builtin_models.h"
#include "worker/model/test_util.h"

namespace tandem::worker {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// A hand-made safetensors file: length prefix, `header` verbatim, `data`.
void WriteRaw(const std::string& path, const std::string& header, const std::string& data) {
  const uint64_t n = header.size();
  std::string bytes(reinterpret_cast<const char*>(&n), 8);
  WriteBytes(path, bytes + header + data);
}

float Bits(uint32_t bits) { return std::bit_cast<float>(bits); }

TEST(DtypeConversionTest, BFloat16RoundsToNearestEven) {
  EXPECT_EQ(FloatToBFloat16(1.0f), 0x3F80);
  EXPECT_EQ(FloatToBFloat16(-2.0f), 0xC000);
  EXPECT_EQ(FloatToBFloat16(1.0f + 0x1p-8f), 0x3F80);                     // tie, kept part even: down
  EXPECT_EQ(FloatToBFloat16(1.0f + 3 * 0x1p-8f), 0x3F82);                 // tie, kept part odd: up
  EXPECT_EQ(FloatToBFloat16(1.0f + 0x1p-8f + 0x1p-20f), 0x3F81);          // above the tie: up
  EXPECT_EQ(FloatToBFloat16(std::numeric_limits<float>::max()), 0x7F80);  // rounds to inf
  EXPECT_EQ(FloatToBFloat16(-std::numeric_limits<float>::infinity()), 0xFF80);
  EXPECT_TRUE(std::isnan(BFloat16ToFloat(FloatToBFloat16(std::nanf("")))));
  EXPECT_EQ(BFloat16ToFloat(0x3F82), 1.015625f);
  EXPECT_EQ(BFloat16ToFloat(0x0001), Bits(0x00010000));
}

TEST(DtypeConversionTest, HalfRoundsToNearestEven) {
  EXPECT_EQ(FloatToHalf(1.0f), 0x3C00);
  EXPECT_EQ(FloatToHalf(-2.0f), 0xC000);
  EXPECT_EQ(FloatToHalf(65504.0f), 0x7BFF);  // largest finite
  EXPECT_EQ(FloatToHalf(65519.0f), 0x7BFF);  // below the tie
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7C00);  // tie rounds to even: inf
  EXPECT_EQ(FloatToHalf(1e6f), 0x7C00);
  EXPECT_EQ(FloatToHalf(1.0f + 0x1p-11f), 0x3C00);      // tie, even: down
  EXPECT_EQ(FloatToHalf(1.0f + 3 * 0x1p-11f), 0x3C02);  // tie, odd: up
  EXPECT_EQ(FloatToHalf(0x1p-14f), 0x0400);             // smallest normal
  EXPECT_EQ(FloatToHalf(0x1p-24f), 0x0001);             // smallest subnormal
  EXPECT_EQ(FloatToHalf(0x1p-25f), 0x0000);             // tie with zero: even
  EXPECT_EQ(FloatToHalf(0x1.8p-25f), 0x0001);           // above the tie
  EXPECT_EQ(FloatToHalf(3 * 0x1p-25f), 0x0002);         // 1.5 ulp: tie, odd: up
  EXPECT_EQ(FloatToHalf(0x1.ffcp-15f), 0x0400);         // rounds up into the normals
  EXPECT_EQ(FloatToHalf(-0x1p-30f), 0x8000);
  EXPECT_EQ(FloatToHalf(1e-45f), 0x0000);  // f32 subnormal
  EXPECT_EQ(FloatToHalf(std::numeric_limits<float>::infinity()), 0x7C00);
  EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(std::nanf("")))));
  EXPECT_EQ(HalfToFloat(0x0001), 0x1p-24f);
  EXPECT_EQ(HalfToFloat(0x83FF), -1023 * 0x1p-24f);
  EXPECT_EQ(HalfToFloat(0x7BFF), 65504.0f);
  EXPECT_EQ(HalfToFloat(0xFC00), -std::numeric_limits<float>::infinity());
  EXPECT_EQ(HalfToFloat(0x3555), 0.333251953125f);
}

TEST(DtypeConversionTest, HalfRoundTripsEveryFiniteValue) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    if ((h & 0x7C00) == 0x7C00) continue;  // inf and NaN
    ASSERT_EQ(FloatToHalf(HalfToFloat(static_cast<uint16_t>(h))), h) << std::hex << h;
  }
}

TEST(DtypeConversionTest, TorchNames) {
  EXPECT_EQ(*SafetensorsDtypeFromTorchName("bfloat16"), SafetensorsDtype::kBF16);
  EXPECT_EQ(*SafetensorsDtypeFromTorchName("float16"), SafetensorsDtype::kF16);
  EXPECT_EQ(*SafetensorsDtypeFromTorchName("float32"), SafetensorsDtype::kF32);
  EXPECT_THAT(SafetensorsDtypeFromTorchName("int8").status().message(), HasSubstr("int8"));
}

std::map<std::string, Tensor> SampleTensors() {
  std::map<std::string, Tensor> tensors;
  tensors["b.weight"] = {{2, 3}, {1.0f, -2.5f, 1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, 65520.0f, 0x1p-25f}};
  tensors["a.bias"] = {{3}, {0.1f, -0.0f, 1e-8f}};
  tensors["scalar"] = {{}, {42.0f}};
  tensors["empty"] = {{0, 4}, {}};
  return tensors;
}

TEST(SafetensorsTest, RoundTripF32IsExact) {
  ScopedTempDir tmp("f32");
  const std::string path = tmp.path() + "/t.safetensors";
  const auto tensors = SampleTensors();
  ASSERT_TRUE(WriteSafetensors(path, tensors, SafetensorsDtype::kF32).ok());
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->metadata().at("format"), "pt");
  EXPECT_EQ((*file)->entries().size(), 4u);
  for (const auto& [name, tensor] : tensors) {
    absl::StatusOr<Tensor> read = (*file)->Read(name);
    ASSERT_TRUE(read.ok()) << read.status();
    EXPECT_EQ(read->shape, tensor.shape) << name;
    ASSERT_EQ(read->data.size(), tensor.data.size());
    for (size_t i = 0; i < tensor.data.size(); ++i) {
      EXPECT_EQ(std::bit_cast<uint32_t>(read->data[i]), std::bit_cast<uint32_t>(tensor.data[i]));
    }
  }
}

TEST(SafetensorsTest, RoundTripBFloat16) {
  ScopedTempDir tmp("bf16");
  const std::string path = tmp.path() + "/t.safetensors";
  ASSERT_TRUE(WriteSafetensors(path, SampleTensors(), SafetensorsDtype::kBF16).ok());
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->entries().at("b.weight").dtype, "BF16");
  absl::StatusOr<Tensor> b = (*file)->Read("b.weight");
  ASSERT_TRUE(b.ok());
  EXPECT_THAT(b->data, ElementsAre(1.0f, -2.5f, 1.0f, 1.0f + 0x1p-6f, 65536.0f, 0x1p-25f));
  absl::StatusOr<Tensor> a = (*file)->Read("a.bias");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->data[0], Bits(0x3DCD0000));  // 0.1f = 0x3DCCCCCD rounds up
  EXPECT_TRUE(std::signbit(a->data[1]));
}

// Stored tensors come as the file has them: a checkpoint written in bf16 or
// f16 hands back its 16-bit words unconverted (what a GPU runner uploads),
// and the same words Read converts.
TEST(SafetensorsTest, StoredTensorsKeepTheirDtype) {
  for (SafetensorsDtype dtype : {SafetensorsDtype::kBF16, SafetensorsDtype::kF16, SafetensorsDtype::kF32}) {
    ScopedTempDir tmp("stored");
    const std::string path = tmp.path() + "/model.safetensors";
    const auto tensors = SampleTensors();
    ASSERT_TRUE(WriteSafetensors(path, tensors, dtype).ok());
    absl::StatusOr<std::unique_ptr<CheckpointTensorSource>> source = CheckpointTensorSource::Open(tmp.path());
    ASSERT_TRUE(source.ok()) << source.status();
    for (const auto& [name, tensor] : tensors) {
      absl::StatusOr<StoredTensor> stored = (*source)->GetStored(name);
      ASSERT_TRUE(stored.ok()) << stored.status();
      EXPECT_EQ(stored->dtype, dtype) << name;
      EXPECT_EQ(stored->shape, tensor.shape) << name;
      const size_t size = static_cast<size_t>(SafetensorsDtypeSize(dtype));
      ASSERT_EQ(stored->bytes.size(), tensor.data.size() * size) << name;
      absl::StatusOr<Tensor> read = (*source)->Get(name);
      ASSERT_TRUE(read.ok());
      for (size_t i = 0; i < tensor.data.size(); ++i) {
        if (dtype == SafetensorsDtype::kF32) {
          float v;
          std::memcpy(&v, stored->bytes.data() + 4 * i, 4);
          EXPECT_EQ(std::bit_cast<uint32_t>(v), std::bit_cast<uint32_t>(tensor.data[i]));
          continue;
        }
        uint16_t bits;
        std::memcpy(&bits, stored->bytes.data() + 2 * i, 2);
        const bool bf16 = dtype == SafetensorsDtype::kBF16;
        EXPECT_EQ(bits, bf16 ? FloatToBFloat16(tensor.data[i]) : FloatToHalf(tensor.data[i])) << name << " " << i;
        EXPECT_EQ(std::bit_cast<uint32_t>(read->data[i]),
                  std::bit_cast<uint32_t>(bf16 ? BFloat16ToFloat(bits) : HalfToFloat(bits)));
      }
    }
    EXPECT_EQ((*source)->GetStored("nope").status().code(), absl::StatusCode::kNotFound);
  }
}

// A source that makes its tensors stores them in f32 (TensorSource's default).
TEST(SafetensorsTest, BuiltinPresetsStoreF32) {
  absl::StatusOr<std::unique_ptr<SeededTensorSource>> source = MakeBuiltinTensorSource("tiny");
  ASSERT_TRUE(source.ok()) << source.status();
  absl::StatusOr<Tensor> t = (*source)->Get("model.norm.weight");
  absl::StatusOr<StoredTensor> stored = (*source)->GetStored("model.norm.weight");
  ASSERT_TRUE(t.ok() && stored.ok());
  EXPECT_EQ(stored->dtype, WeightDtype::kF32);
  ASSERT_EQ(stored->bytes.size(), t->data.size() * 4);
  EXPECT_EQ(std::memcmp(stored->bytes.data(), t->data.data(), stored->bytes.size()), 0);
}

TEST(SafetensorsTest, RoundTripHalf) {
  ScopedTempDir tmp("f16");
  const std::string path = tmp.path() + "/t.safetensors";
  ASSERT_TRUE(WriteSafetensors(path, SampleTensors(), SafetensorsDtype::kF16).ok());
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  absl::StatusOr<Tensor> b = (*file)->Read("b.weight");
  ASSERT_TRUE(b.ok());
  // 1 + 2^-8 and 1 + 3 * 2^-8 are exact in f16; 65520 ties to infinity; 2^-25 ties to zero.
  EXPECT_THAT(b->data, ElementsAre(1.0f, -2.5f, 1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f,
                                   std::numeric_limits<float>::infinity(), 0.0f));
  absl::StatusOr<Tensor> a = (*file)->Read("a.bias");
  ASSERT_TRUE(a.ok());
  EXPECT_THAT(a->data, ElementsAre(HalfToFloat(0x2E66), -0.0f, 0.0f));  // 0.1 -> 0.0999755859375
  EXPECT_EQ(HalfToFloat(0x2E66), 0.0999755859375f);
}

TEST(SafetensorsTest, LayoutMatchesHuggingFace) {
  ScopedTempDir tmp("layout");
  const std::string path = tmp.path() + "/t.safetensors";
  ASSERT_TRUE(WriteSafetensors(path, SampleTensors(), SafetensorsDtype::kF32).ok());
  const std::string bytes = ReadBytes(path);
  uint64_t n;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_EQ((8 + n) % 8, 0u);
  const nlohmann::json header = nlohmann::json::parse(bytes.substr(8, n));
  // Data laid out in name order, back to back.
  EXPECT_EQ(header["a.bias"]["data_offsets"], nlohmann::json::array({0, 12}));
  EXPECT_EQ(header["b.weight"]["data_offsets"], nlohmann::json::array({12, 36}));
  EXPECT_EQ(header["empty"]["data_offsets"], nlohmann::json::array({36, 36}));
  EXPECT_EQ(header["scalar"]["data_offsets"], nlohmann::json::array({36, 40}));
  EXPECT_EQ(header["scalar"]["shape"], nlohmann::json::array());
  EXPECT_EQ(header["b.weight"]["dtype"], "F32");
  EXPECT_EQ(bytes.size(), 8 + n + 40);
}

TEST(SafetensorsTest, WriterRejectsShapeMismatch) {
  std::map<std::string, Tensor> tensors;
  tensors["w"] = {{2, 2}, {1, 2, 3}};
  ScopedTempDir tmp("mismatch");
  absl::Status s = WriteSafetensors(tmp.path() + "/t.safetensors", tensors, SafetensorsDtype::kF32);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("'w'"), HasSubstr("[2, 2]")));
}

// The streaming writer asks for each tensor once, in name order, and writes
// the in-memory writer's bytes, tensors longer than its 2^20-value write
// chunks included.
TEST(SafetensorsTest, StreamingWriterMatchesInMemoryWriter) {
  std::map<std::string, Tensor> tensors = SampleTensors();
  Tensor& big = tensors["c.big"];
  big.shape = {(1 << 20) + 5};
  big.data.resize((1 << 20) + 5);
  for (size_t i = 0; i < big.data.size(); ++i) big.data[i] = static_cast<float>(i) * 0.001f;
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& [name, tensor] : tensors) shapes[name] = tensor.shape;
  ScopedTempDir tmp("streaming");
  for (SafetensorsDtype dtype : {SafetensorsDtype::kF32, SafetensorsDtype::kBF16, SafetensorsDtype::kF16}) {
    const std::string whole = tmp.path() + "/whole.safetensors";
    const std::string streamed = tmp.path() + "/streamed.safetensors";
    ASSERT_TRUE(WriteSafetensors(whole, tensors, dtype).ok());
    std::vector<std::string> asked;
    std::vector<float> current;
    absl::Status s = WriteSafetensorsStreaming(streamed, shapes, dtype,
                                               [&](const std::string& name) -> absl::StatusOr<std::span<const float>> {
                                                 asked.push_back(name);
                                                 current = tensors.at(name).data;
                                                 return std::span<const float>(current);
                                               });
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_THAT(asked, ElementsAre("a.bias", "b.weight", "c.big", "empty", "scalar"));
    EXPECT_EQ(ReadBytes(streamed), ReadBytes(whole)) << SafetensorsDtypeName(dtype);
    absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(streamed);
    ASSERT_TRUE(file.ok()) << file.status();
    absl::StatusOr<Tensor> read = (*file)->Read("c.big");
    ASSERT_TRUE(read.ok());
    for (size_t i = 0; i < big.data.size(); i += 4099) {
      ASSERT_EQ(read->data[i], RoundToDtype(big.data[i], dtype)) << i;
    }
    EXPECT_EQ(read->data.back(), RoundToDtype(big.data.back(), dtype));
  }
}

// A tensor that cannot be made, or of the wrong size, fails the write and
// leaves no partial file (whose header would promise the missing data).
TEST(SafetensorsTest, StreamingWriterRemovesThePartialFileOnError) {
  ScopedTempDir tmp("streaming_error");
  const std::string path = tmp.path() + "/t.safetensors";
  const std::map<std::string, std::vector<int64_t>> shapes = {{"a", {2}}, {"b", {3}}};
  const std::vector<float> two = {1, 2};
  absl::Status s = WriteSafetensorsStreaming(path, shapes, SafetensorsDtype::kBF16,
                                             [&](const std::string& name) -> absl::StatusOr<std::span<const float>> {
                                               if (name == "b")
                                                 return absl::ResourceExhaustedError("out of memory making 'b'");
                                               return std::span<const float>(two);
                                             });
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_FALSE(std::filesystem::exists(path));

  s = WriteSafetensorsStreaming(path, shapes, SafetensorsDtype::kF32,
                                [&](const std::string&) -> absl::StatusOr<std::span<const float>> {
                                  return std::span<const float>(two);  // "b" needs 3
                                });
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), AllOf(HasSubstr(path), HasSubstr("'b'"), HasSubstr("[3]"), HasSubstr("2 values")));
  EXPECT_FALSE(std::filesystem::exists(path));
}

TEST(SafetensorsTest, TruncatedFileNamesTensorAndBytes) {
  ScopedTempDir tmp("truncated");
  const std::string path = tmp.path() + "/t.safetensors";
  ASSERT_TRUE(WriteSafetensors(path, SampleTensors(), SafetensorsDtype::kF32).ok());
  std::string bytes = ReadBytes(path);
  const size_t full = bytes.size();
  WriteBytes(path, bytes.substr(0, full - 3));  // cuts into "scalar", the last tensor
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
  ASSERT_FALSE(file.ok());
  EXPECT_EQ(file.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(file.status().message(),
              AllOf(HasSubstr(path), HasSubstr("truncated"), HasSubstr("'scalar'"), HasSubstr("[36, 40)"),
                    HasSubstr(std::to_string(full)), HasSubstr(absl::StrCat("only ", full - 3, " bytes"))));
}

TEST(SafetensorsTest, HeaderLengthBeyondFile) {
  ScopedTempDir tmp("overflow");
  const std::string path = tmp.path() + "/t.safetensors";
  const uint64_t n = 1ull << 40;
  WriteBytes(path, std::string(reinterpret_cast<const char*>(&n), 8) + "{}");
  auto file = SafetensorsFile::Open(path);
  EXPECT_EQ(file.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(file.status().message(), AllOf(HasSubstr(path), HasSubstr("header length 1099511627776")));

  WriteBytes(path, "abc");
  EXPECT_THAT(SafetensorsFile::Open(path).status().message(), HasSubstr("too short"));
  WriteBytes(path, "");
  EXPECT_THAT(SafetensorsFile::Open(path).status().message(), HasSubstr("too short"));
}

TEST(SafetensorsTest, MalformedHeaders) {
  ScopedTempDir tmp("malformed");
  const std::string path = tmp.path() + "/t.safetensors";
  struct Case {
    const char* header;
    const char* expected;
  };
  const Case cases[] = {
      {"{\"w\": {\"dtype\": \"F32\"", "invalid JSON"},
      {"[1]", "not a JSON object"},
      {R"({"w": 3})", "'w': header entry is not an object"},
      {R"({"w": {"shape": [1], "data_offsets": [0, 4]}})", "'w': \"dtype\""},
      {R"({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}})", "'w': \"shape\""},
      {R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0]}})", "'w': \"data_offsets\""},
      {R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}})", "end before"},
      {R"({"__metadata__": {"format": 1}})", "__metadata__"},
  };
  for (const Case& c : cases) {
    WriteRaw(path, c.header, std::string(16, '\0'));
    auto file = SafetensorsFile::Open(path);
    ASSERT_FALSE(file.ok()) << c.header;
    EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument) << c.header;
    EXPECT_THAT(file.status().message(), AllOf(HasSubstr(path), HasSubstr(c.expected)));
  }
}

TEST(SafetensorsTest, WrongByteSize) {
  ScopedTempDir tmp("bytesize");
  const std::string path = tmp.path() + "/t.safetensors";
  WriteRaw(path, R"({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]}})", std::string(16, '\0'));
  auto file = SafetensorsFile::Open(path);
  EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(file.status().message(), AllOf(HasSubstr("'w'"), HasSubstr("[2, 2]"), HasSubstr("span 12 bytes")));
  // Known but unconvertible dtypes are size-checked too.
  WriteRaw(path, R"({"ids": {"dtype": "I64", "shape": [3], "data_offsets": [0, 16]}})", std::string(16, '\0'));
  EXPECT_THAT(SafetensorsFile::Open(path).status().message(), AllOf(HasSubstr("'ids'"), HasSubstr("I64")));
}

TEST(SafetensorsTest, UnsupportedDtypeFailsOnRead) {
  ScopedTempDir tmp("dtype");
  const std::string path = tmp.path() + "/t.safetensors";
  WriteRaw(path,
           R"({"ids": {"dtype": "I64", "shape": [2], "data_offsets": [0, 16]},)"
           R"( "w": {"dtype": "F32", "shape": [1], "data_offsets": [16, 20]}})",
           std::string(20, '\0'));
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_TRUE((*file)->Read("w").ok());
  absl::StatusOr<Tensor> ids = (*file)->Read("ids");
  EXPECT_EQ(ids.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ids.status().message(), AllOf(HasSubstr(path), HasSubstr("'ids'"), HasSubstr("I64")));
  EXPECT_EQ((*file)->Read("nope").status().code(), absl::StatusCode::kNotFound);
}

TEST(SafetensorsTest, OpenMissingFile) {
  auto file = SafetensorsFile::Open("/nonexistent/x.safetensors");
  EXPECT_EQ(file.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(file.status().message(), HasSubstr("/nonexistent/x.safetensors"));
}

// Two shards and an index, as transformers writes them.
void MakeShardedCheckpoint(const std::string& dir) {
  std::map<std::string, Tensor> first, second;
  first["x"] = {{2}, {1, 2}};
  first["y"] = {{1}, {3}};
  second["z"] = {{2, 1}, {4, 5}};
  EXPECT_TRUE(WriteSafetensors(dir + "/model-00001-of-00002.safetensors", first, SafetensorsDtype::kBF16).ok());
  EXPECT_TRUE(WriteSafetensors(dir + "/model-00002-of-00002.safetensors", second, SafetensorsDtype::kF16).ok());
  const nlohmann::json index = {{"metadata", {{"total_size", 10}}},
                                {"weight_map",
                                 {{"x", "model-00001-of-00002.safetensors"},
                                  {"y", "model-00001-of-00002.safetensors"},
                                  {"z", "model-00002-of-00002.safetensors"}}}};
  WriteBytes(dir + "/model.safetensors.index.json", index.dump());
}

TEST(CheckpointTensorSourceTest, ReadsShardedCheckpoint) {
  ScopedTempDir tmp("sharded");
  const std::string& dir = tmp.path();
  MakeShardedCheckpoint(dir);
  auto source = CheckpointTensorSource::Open(dir);
  ASSERT_TRUE(source.ok()) << source.status();
  EXPECT_THAT((*source)->TensorNames(), ElementsAre("x", "y", "z"));
  EXPECT_TRUE((*source)->Has("z"));
  EXPECT_FALSE((*source)->Has("w"));
  absl::StatusOr<Tensor> z = (*source)->Get("z");
  ASSERT_TRUE(z.ok()) << z.status();
  EXPECT_THAT(z->shape, ElementsAre(2, 1));
  EXPECT_THAT(z->data, ElementsAre(4.0f, 5.0f));
  EXPECT_THAT((*source)->Get("x")->data, ElementsAre(1.0f, 2.0f));
  EXPECT_EQ((*source)->Describe(), "checkpoint " + dir);
  absl::StatusOr<Tensor> w = (*source)->Get("w");
  EXPECT_EQ(w.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(w.status().message(), AllOf(HasSubstr("'w'"), HasSubstr(dir)));
}

TEST(CheckpointTensorSourceTest, MissingShardIsNamed) {
  ScopedTempDir tmp("missing_shard");
  const std::string& dir = tmp.path();
  MakeShardedCheckpoint(dir);
  std::filesystem::remove(dir + "/model-00002-of-00002.safetensors");
  auto source = CheckpointTensorSource::Open(dir);
  EXPECT_EQ(source.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(source.status().message(), AllOf(HasSubstr("model-00002-of-00002.safetensors"), HasSubstr("'z'"),
                                               HasSubstr("model.safetensors.index.json")));
}

TEST(CheckpointTensorSourceTest, IndexNamingATensorItsShardLacks) {
  ScopedTempDir tmp("wrong_shard");
  const std::string& dir = tmp.path();
  MakeShardedCheckpoint(dir);
  const nlohmann::json index = {{"weight_map", {{"x", "model-00002-of-00002.safetensors"}}}};
  WriteBytes(dir + "/model.safetensors.index.json", index.dump());
  EXPECT_THAT(CheckpointTensorSource::Open(dir).status().message(),
              AllOf(HasSubstr("'x'"), HasSubstr("model-00002-of-00002.safetensors"), HasSubstr("no such tensor")));
  WriteBytes(dir + "/model.safetensors.index.json", R"({"metadata": {}})");
  EXPECT_THAT(CheckpointTensorSource::Open(dir).status().message(), HasSubstr("weight_map"));
}

TEST(CheckpointTensorSourceTest, SingleFileAndMissingFiles) {
  ScopedTempDir tmp("single");
  const std::string& dir = tmp.path();
  auto empty = CheckpointTensorSource::Open(dir);
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(empty.status().message(), AllOf(HasSubstr(dir), HasSubstr("model.safetensors.index.json")));

  WriteBytes(dir + "/pytorch_model.bin", "x");
  EXPECT_THAT(CheckpointTensorSource::Open(dir).status().message(), HasSubstr("PyTorch"));

  ASSERT_TRUE(WriteSafetensors(dir + "/model.safetensors", SampleTensors(), SafetensorsDtype::kF32).ok());
  auto source = CheckpointTensorSource::Open(dir);
  ASSERT_TRUE(source.ok()) << source.status();
  EXPECT_EQ((*source)->TensorNames().size(), 4u);
  EXPECT_THAT((*source)->Get("scalar")->data, ElementsAre(42.0f));

  auto missing = CheckpointTensorSource::Open("/nonexistent/ckpt");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr("/nonexistent/ckpt"));
}

}  // namespace
}  // namespace tandem::worker
