#include "worker/model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <utility>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "worker/model/io_util.h"

namespace tandem::worker {
namespace {

static_assert(std::endian::native == std::endian::little, "safetensors data is little-endian and is copied as is");

using nlohmann::json;

constexpr char kSingleFile[] = "model.safetensors";
constexpr char kIndexFile[] = "model.safetensors.index.json";

// Bytes per element of the dtypes safetensors defines, so that byte sizes are
// checked even for tensors this reader cannot convert. 0: unknown.
int ItemSize(std::string_view dtype) {
  if (dtype == "F64" || dtype == "I64" || dtype == "U64") return 8;
  if (dtype == "F32" || dtype == "I32" || dtype == "U32") return 4;
  if (dtype == "F16" || dtype == "BF16" || dtype == "I16" || dtype == "U16") return 2;
  if (dtype == "BOOL" || dtype == "U8" || dtype == "I8" || dtype == "F8_E4M3" || dtype == "F8_E5M2") {
    return 1;
  }
  return 0;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// A JSON array of non-negative integers, or nullopt.
std::optional<std::vector<uint64_t>> UnsignedList(const json& value) {
  if (!value.is_array()) return std::nullopt;
  std::vector<uint64_t> result;
  for (const json& item : value) {
    if (!item.is_number_unsigned()) return std::nullopt;
    result.push_back(item.get<uint64_t>());
  }
  return result;
}

// Values per write: 4 MiB of f32, so that converting a large tensor to 16 bits
// needs no second copy of it.
constexpr size_t kWriteChunk = size_t{1} << 20;

// `values` as the bits of 16-bit `dtype` (F16 or BF16), into `out`.
void EncodeHalves(std::span<const float> values, SafetensorsDtype dtype, std::string* out) {
  out->resize(values.size() * 2);
  char* dst = out->data();
  const bool is_half = dtype == SafetensorsDtype::kF16;
  for (size_t i = 0; i < values.size(); ++i) {
    const uint16_t bits = is_half ? FloatToHalf(values[i]) : FloatToBFloat16(values[i]);
    std::memcpy(dst + 2 * i, &bits, 2);
  }
}

uint64_t NumElements(const std::vector<int64_t>& shape) {
  uint64_t numel = 1;
  for (int64_t d : shape) numel *= d < 0 ? 0 : static_cast<uint64_t>(d);
  return numel;
}

}  // namespace

std::string_view SafetensorsDtypeName(SafetensorsDtype dtype) {
  switch (dtype) {
    case SafetensorsDtype::kF32:
      return "F32";
    case SafetensorsDtype::kF16:
      return "F16";
    case SafetensorsDtype::kBF16:
      return "BF16";
  }
  return "?";
}

int SafetensorsDtypeSize(SafetensorsDtype dtype) { return dtype == SafetensorsDtype::kF32 ? 4 : 2; }

absl::StatusOr<SafetensorsDtype> SafetensorsDtypeFromTorchName(std::string_view name) {
  if (name == "float32") return SafetensorsDtype::kF32;
  if (name == "bfloat16") return SafetensorsDtype::kBF16;
  if (name == "float16") return SafetensorsDtype::kF16;
  return absl::InvalidArgumentError(
      absl::StrCat("dtype \"", std::string(name), "\" is not supported (supported: float32, bfloat16, float16)"));
}

uint16_t FloatToBFloat16(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  if (std::isnan(value)) return static_cast<uint16_t>((bits >> 16) | 0x0040);
  // Adding 0x7FFF, plus 1 when the kept part is odd, rounds to nearest even;
  // a carry out of the mantissa correctly bumps the exponent (up to infinity).
  const uint32_t rounding = 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

float BFloat16ToFloat(uint16_t bits) { return std::bit_cast<float>(uint32_t{bits} << 16); }

uint16_t FloatToHalf(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000);
  const uint32_t exponent = (bits >> 23) & 0xFF;
  const uint32_t mantissa = bits & 0x7FFFFF;
  if (exponent == 0xFF) {  // infinity, or NaN kept quiet
    return sign | 0x7C00 | (mantissa != 0 ? 0x0200 | (mantissa >> 13) : 0);
  }
  const int half_exponent = static_cast<int>(exponent) - 127 + 15;
  if (half_exponent >= 31) return sign | 0x7C00;  // too large: infinity
  if (half_exponent <= 0) {
    // A half subnormal m * 2^-24. |value| = full * 2^(exponent - 150), so
    // m = full >> (14 - half_exponent), rounded to nearest even. Below 2^-25
    // everything rounds to zero (f32 subnormals included).
    if (half_exponent < -10) return sign;
    const uint32_t full = mantissa | 0x800000;
    const int shift = 14 - half_exponent;  // 14..24
    uint32_t m = full >> shift;
    const uint32_t rest = full & ((1u << shift) - 1);
    const uint32_t halfway = 1u << (shift - 1);
    if (rest > halfway || (rest == halfway && (m & 1) != 0)) ++m;  // may reach the smallest normal
    return static_cast<uint16_t>(sign | m);
  }
  uint32_t h = (static_cast<uint32_t>(half_exponent) << 10) | (mantissa >> 13);
  const uint32_t rest = mantissa & 0x1FFF;
  if (rest > 0x1000 || (rest == 0x1000 && (h & 1) != 0)) ++h;  // a carry may reach infinity
  return static_cast<uint16_t>(sign | h);
}

float HalfToFloat(uint16_t bits) {
  const uint32_t sign = uint32_t{bits & 0x8000u} << 16;
  const uint32_t exponent = (bits >> 10) & 0x1F;
  const uint32_t mantissa = bits & 0x3FF;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in f32
    const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return sign != 0 ? -magnitude : magnitude;
  }
  if (exponent == 31) return std::bit_cast<float>(sign | 0x7F800000 | (mantissa << 13));
  return std::bit_cast<float>(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

float RoundToDtype(float value, SafetensorsDtype dtype) {
  switch (dtype) {
    case SafetensorsDtype::kF32:
      return value;
    case SafetensorsDtype::kF16:
      return HalfToFloat(FloatToHalf(value));
    case SafetensorsDtype::kBF16:
      return BFloat16ToFloat(FloatToBFloat16(value));
  }
  return value;
}

// ---------------------------------------------------------------------------
// SafetensorsFile

SafetensorsFile::SafetensorsFile(std::string path, const uint8_t* map, size_t map_size)
    : path_(std::move(path)), map_(map), map_size_(map_size) {}

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) munmap(const_cast<uint8_t*>(map_), map_size_);
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return absl::NotFoundError(absl::StrCat(path, " does not exist"));
    return absl::UnavailableError(absl::StrCat("cannot open ", path, ": ", std::strerror(errno)));
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(path, " is not a regular file"));
  }
  const size_t size = static_cast<size_t>(st.st_size);
  const uint8_t* map = nullptr;
  if (size > 0) {
    void* addr = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (addr == MAP_FAILED) {
      const int error = errno;
      ::close(fd);
      return absl::UnavailableError(absl::StrCat("cannot map ", path, ": ", std::strerror(error)));
    }
    map = static_cast<const uint8_t*>(addr);
  }
  ::close(fd);  // the mapping stays valid
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile(path, map, size));
  RETURN_IF_ERROR(file->ParseHeader());
  return file;
}

absl::Status SafetensorsFile::ParseHeader() {
  if (map_size_ < 8) {
    return absl::DataLossError(
        absl::StrCat(path_, ": the file is ", map_size_, " bytes, too short for the 8-byte header length"));
  }
  uint64_t header_size;
  std::memcpy(&header_size, map_, 8);
  if (header_size > map_size_ - 8) {
    return absl::DataLossError(absl::StrCat(path_, ": header length ", header_size, " runs past the end of the file (",
                                            map_size_, " bytes); the file is truncated or not safetensors"));
  }
  const std::string_view text(reinterpret_cast<const char*>(map_ + 8), header_size);
  ASSIGN_OR_RETURN(json header, model_internal::ParseJson(text, absl::StrCat(path_, " header")));
  if (!header.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(path_, ": header is not a JSON object"));
  }
  const uint64_t data_start = 8 + header_size;
  data_ = map_ + data_start;
  data_size_ = map_size_ - data_start;

  for (const auto& item : header.items()) {
    const std::string& name = item.key();
    const json& value = item.value();
    if (name == "__metadata__") {
      if (!value.is_object()) {
        return absl::InvalidArgumentError(absl::StrCat(path_, ": __metadata__ is not an object"));
      }
      for (const auto& meta : value.items()) {
        if (!meta.value().is_string()) {
          return absl::InvalidArgumentError(
              absl::StrCat(path_, ": __metadata__ value \"", meta.key(), "\" is not a string"));
        }
        metadata_[meta.key()] = meta.value().get<std::string>();
      }
      continue;
    }
    const std::string where = absl::StrCat(path_, ": tensor '", name, "'");
    auto bad = [&where](const std::string& message) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": ", message));
    };
    if (!value.is_object()) return bad("header entry is not an object");
    SafetensorsEntry entry;
    auto dtype = value.find("dtype");
    if (dtype == value.end() || !dtype->is_string()) return bad("\"dtype\" is missing or not a string");
    entry.dtype = dtype->get<std::string>();

    auto shape = value.find("shape");
    std::optional<std::vector<uint64_t>> dims;
    if (shape != value.end()) dims = UnsignedList(*shape);
    if (!dims.has_value()) return bad("\"shape\" is missing or not a list of non-negative integers");
    uint64_t numel = 1;
    bool overflow = false;
    for (uint64_t d : *dims) {
      if (d > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) overflow = true;
      if (d != 0 && numel > std::numeric_limits<uint64_t>::max() / d) overflow = true;
      numel *= d;
      entry.shape.push_back(static_cast<int64_t>(d));
    }
    if (overflow) return bad("shape is too large");

    auto offsets = value.find("data_offsets");
    std::optional<std::vector<uint64_t>> range;
    if (offsets != value.end()) range = UnsignedList(*offsets);
    if (!range.has_value() || range->size() != 2) {
      return bad("\"data_offsets\" is missing or not two non-negative integers");
    }
    entry.begin = (*range)[0];
    entry.end = (*range)[1];
    if (entry.begin > entry.end) {
      return bad(absl::StrCat("data_offsets [", entry.begin, ", ", entry.end, "] end before they begin"));
    }
    if (entry.end > data_size_) {
      return absl::DataLossError(absl::StrCat(path_, ": the file is truncated: tensor '", name, "' needs data bytes [",
                                              entry.begin, ", ", entry.end, "), which are file bytes [",
                                              data_start + entry.begin, ", ", data_start + entry.end,
                                              "), but the file has only ", map_size_, " bytes"));
    }
    const int item_size = ItemSize(entry.dtype);
    const uint64_t span = entry.end - entry.begin;
    if (item_size > 0 && (numel > span || numel * item_size != span)) {
      return bad(absl::StrCat("shape ", ShapeString(entry.shape), " of ", entry.dtype, " needs ", numel, " x ",
                              item_size, " bytes, but data_offsets [", entry.begin, ", ", entry.end, "] span ", span,
                              " bytes"));
    }
    entries_.emplace(name, std::move(entry));
  }
  return absl::OkStatus();
}

absl::StatusOr<StoredTensor> SafetensorsFile::View(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) {
    return absl::NotFoundError(absl::StrCat(path_, ": no tensor '", name, "'"));
  }
  const SafetensorsEntry& entry = it->second;
  StoredTensor view{.shape = entry.shape,
                    .bytes = std::span<const uint8_t>(data_ + entry.begin, entry.end - entry.begin)};
  if (entry.dtype == "F32") {
    view.dtype = WeightDtype::kF32;
  } else if (entry.dtype == "F16") {
    view.dtype = WeightDtype::kF16;
  } else if (entry.dtype == "BF16") {
    view.dtype = WeightDtype::kBF16;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(path_, ": tensor '", name, "' has dtype ", entry.dtype,
                                                   ", which is not supported (supported: F32, F16, BF16)"));
  }
  return view;
}

absl::StatusOr<Tensor> SafetensorsFile::Read(const std::string& name) const {
  ASSIGN_OR_RETURN(StoredTensor view, View(name));
  Tensor tensor;
  tensor.shape = std::move(view.shape);
  const uint8_t* src = view.bytes.data();
  if (view.dtype == WeightDtype::kF32) {
    tensor.data.resize(view.bytes.size() / 4);
    if (!tensor.data.empty()) std::memcpy(tensor.data.data(), src, tensor.data.size() * 4);
    return tensor;
  }
  const bool is_half = view.dtype == WeightDtype::kF16;
  tensor.data.resize(view.bytes.size() / 2);
  for (size_t i = 0; i < tensor.data.size(); ++i) {
    uint16_t bits;
    std::memcpy(&bits, src + 2 * i, 2);
    tensor.data[i] = is_half ? HalfToFloat(bits) : BFloat16ToFloat(bits);
  }
  return tensor;
}

absl::Status WriteSafetensors(const std::string& path, const std::map<std::string, Tensor>& tensors,
                              SafetensorsDtype dtype) {
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& [name, tensor] : tensors) {
    const uint64_t numel = NumElements(tensor.shape);
    if (numel != tensor.data.size()) {  // before the file is created
      return absl::InvalidArgumentError(absl::StrCat(path, ": tensor '", name, "' has shape ",
                                                     ShapeString(tensor.shape), " (", numel, " elements) but ",
                                                     tensor.data.size(), " values"));
    }
    shapes.emplace(name, tensor.shape);
  }
  return WriteSafetensorsStreaming(path, shapes, dtype,
                                   [&tensors](const std::string& name) -> absl::StatusOr<std::span<const float>> {
                                     return std::span<const float>(tensors.at(name).data);
                                   });
}

absl::Status WriteSafetensorsStreaming(const std::string& path,
                                       const std::map<std::string, std::vector<int64_t>>& shapes,
                                       SafetensorsDtype dtype, const TensorValues& values) {
  json header = json::object();
  header["__metadata__"] = {{"format", "pt"}};
  uint64_t offset = 0;
  for (const auto& [name, shape] : shapes) {
    if (name == "__metadata__") {
      return absl::InvalidArgumentError(absl::StrCat(path, ": \"__metadata__\" is reserved"));
    }
    const uint64_t end = offset + NumElements(shape) * SafetensorsDtypeSize(dtype);
    header[name] = {{"dtype", std::string(SafetensorsDtypeName(dtype))},
                    {"shape", shape},
                    {"data_offsets", json::array({offset, end})}};
    offset = end;
  }
  std::string text = model_internal::DumpJson(header, -1);
  text.append((8 - text.size() % 8) % 8, ' ');  // data then starts 8-byte aligned

  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) {
    return absl::UnavailableError(absl::StrCat("cannot create ", path, ": ", std::strerror(errno)));
  }
  auto fail = [&](absl::Status status) {
    out.close();
    std::error_code ec;
    std::filesystem::remove(path, ec);
    return status;
  };
  const uint64_t header_size = text.size();
  out.write(reinterpret_cast<const char*>(&header_size), 8);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  std::string buffer;
  for (const auto& [name, shape] : shapes) {
    absl::StatusOr<std::span<const float>> data = values(name);
    if (!data.ok()) return fail(data.status());
    if (const uint64_t numel = NumElements(shape); numel != data->size()) {
      return fail(absl::InvalidArgumentError(absl::StrCat(path, ": tensor '", name, "' has shape ", ShapeString(shape),
                                                          " (", numel, " elements) but ", data->size(), " values")));
    }
    for (size_t begin = 0; begin < data->size() && out; begin += kWriteChunk) {
      const std::span<const float> chunk = data->subspan(begin, std::min(kWriteChunk, data->size() - begin));
      if (dtype == SafetensorsDtype::kF32) {  // already the file's bytes
        out.write(reinterpret_cast<const char*>(chunk.data()), static_cast<std::streamsize>(chunk.size_bytes()));
        continue;
      }
      EncodeHalves(chunk, dtype, &buffer);
      out.write(buffer.data(), static_cast<std::streamsize>(buffer.size()));
    }
    if (!out) return fail(absl::DataLossError(absl::StrCat("error writing ", path)));
  }
  out.close();
  if (!out) return fail(absl::DataLossError(absl::StrCat("error writing ", path)));
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// CheckpointTensorSource

absl::StatusOr<std::unique_ptr<CheckpointTensorSource>> CheckpointTensorSource::Open(const std::string& dir) {
  namespace fs = std::filesystem;
  using model_internal::JoinPath;
  std::error_code ec;
  const fs::file_status status = fs::status(dir, ec);
  if (!fs::exists(status)) {
    return absl::NotFoundError(absl::StrCat("checkpoint directory ", dir, " does not exist"));
  }
  if (!fs::is_directory(status)) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint ", dir, " is not a directory"));
  }
  std::unique_ptr<CheckpointTensorSource> source(new CheckpointTensorSource(dir));

  const std::string single = JoinPath(dir, kSingleFile);
  if (fs::exists(single, ec)) {
    ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> file, SafetensorsFile::Open(single));
    for (const auto& [name, entry] : file->entries()) source->file_of_tensor_[name] = file.get();
    source->files_.push_back(std::move(file));
    return source;
  }

  const std::string index = JoinPath(dir, kIndexFile);
  if (!fs::exists(index, ec)) {
    const bool has_bin = fs::exists(JoinPath(dir, "pytorch_model.bin"), ec) ||
                         fs::exists(JoinPath(dir, "pytorch_model.bin.index.json"), ec);
    return absl::NotFoundError(
        absl::StrCat("checkpoint directory ", dir, " has neither ", kSingleFile, " nor ", kIndexFile,
                     has_bin ? " (PyTorch .bin checkpoints are not supported: convert them to safetensors)" : ""));
  }
  ASSIGN_OR_RETURN(std::string text, model_internal::ReadFile(index));
  ASSIGN_OR_RETURN(json root, model_internal::ParseJson(text, index));
  const json* weight_map = nullptr;
  if (root.is_object() && root.contains("weight_map")) weight_map = &root["weight_map"];
  if (weight_map == nullptr || !weight_map->is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(index, ": no \"weight_map\" object"));
  }
  std::map<std::string, const SafetensorsFile*> shards;  // by file name
  for (const auto& item : weight_map->items()) {
    const std::string& name = item.key();
    if (!item.value().is_string()) {
      return absl::InvalidArgumentError(absl::StrCat(index, ": weight_map entry for '", name, "' is not a file name"));
    }
    const std::string shard = item.value().get<std::string>();
    auto it = shards.find(shard);
    if (it == shards.end()) {
      const std::string path = JoinPath(dir, shard);
      if (!fs::exists(path, ec)) {
        return absl::NotFoundError(
            absl::StrCat(index, ": shard ", shard, " (holding tensor '", name, "') is missing from ", dir));
      }
      ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> file, SafetensorsFile::Open(path));
      it = shards.emplace(shard, file.get()).first;
      source->files_.push_back(std::move(file));
    }
    if (!it->second->Has(name)) {
      return absl::InvalidArgumentError(
          absl::StrCat(index, " puts tensor '", name, "' in ", shard, ", which has no such tensor"));
    }
    source->file_of_tensor_[name] = it->second;
  }
  return source;
}

absl::StatusOr<Tensor> CheckpointTensorSource::Get(const std::string& name) const {
  auto it = file_of_tensor_.find(name);
  if (it == file_of_tensor_.end()) {
    return absl::NotFoundError(absl::StrCat("tensor '", name, "' not found in ", Describe()));
  }
  return it->second->Read(name);
}

absl::StatusOr<StoredTensor> CheckpointTensorSource::GetStored(const std::string& name) const {
  auto it = file_of_tensor_.find(name);
  if (it == file_of_tensor_.end()) {
    return absl::NotFoundError(absl::StrCat("tensor '", name, "' not found in ", Describe()));
  }
  return it->second->View(name);
}

bool CheckpointTensorSource::Has(const std::string& name) const { return file_of_tensor_.count(name) > 0; }

std::string CheckpointTensorSource::Describe() const { return absl::StrCat("checkpoint ", dir_); }

std::vector<std::string> CheckpointTensorSource::TensorNames() const {
  std::vector<std::string> names;
  names.reserve(file_of_tensor_.size());
  for (const auto& [name, file] : file_of_tensor_) names.push_back(name);
  return names;
}

}  // namespace tandem::worker
