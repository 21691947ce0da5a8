// Hugging Face safetensors: a read-only memory-mapped reader, a writer, and
// CheckpointTensorSource, the TensorSource over a checkpoint directory.
//
// File layout: an 8-byte little-endian header length N; N bytes of JSON
//   {"<name>": {"dtype": "BF16", "shape": [rows, cols], "data_offsets": [begin, end]},
//    ..., "__metadata__": {"format": "pt"}}   (the metadata is optional)
// padded with spaces; then the data section, which data_offsets index
// (begin inclusive, end exclusive). Data is little-endian and row-major.
//
// The reader checks the whole header when a file is opened: every malformation
// (header length beyond the file, bad JSON, offsets past the end of the data
// section, a byte size that disagrees with shape and dtype) is a Status naming
// the file and the tensor. F32, F16 and BF16 tensors convert to f32 on Read;
// other dtypes are an error when read (they may sit unread in a checkpoint).
//
// Thread safety: SafetensorsFile and CheckpointTensorSource are immutable after
// Open; their const methods may be called from any number of threads.
#ifndef TANDEM_WORKER_MODEL_SAFETENSORS_H_
#define TANDEM_WORKER_MODEL_SAFETENSORS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/model/weights.h"

namespace tandem::worker {

// The element types this layer reads and writes (the weights' types).
using SafetensorsDtype = WeightDtype;

// "F32", "F16", "BF16": the spelling in a safetensors header.
std::string_view SafetensorsDtypeName(SafetensorsDtype dtype);

// Bytes per element: 4 or 2.
int SafetensorsDtypeSize(SafetensorsDtype dtype);

// From a torch dtype name as config.json spells it: "float32", "bfloat16",
// "float16". InvalidArgument for anything else.
absl::StatusOr<SafetensorsDtype> SafetensorsDtypeFromTorchName(std::string_view name);

// Bit-exact conversions. f32 -> 16 bits rounds to nearest, ties to even;
// values past the 16-bit range become infinity; NaN stays a (quiet) NaN.
uint16_t FloatToBFloat16(float value);
float BFloat16ToFloat(uint16_t bits);
uint16_t FloatToHalf(float value);
float HalfToFloat(uint16_t bits);

// `value` after a round trip through `dtype` (unchanged for kF32).
float RoundToDtype(float value, SafetensorsDtype dtype);

// One header entry. Offsets are relative to the start of the data section.
struct SafetensorsEntry {
  std::string dtype;  // as written, e.g. "BF16", "I64"
  std::vector<int64_t> shape;
  uint64_t begin = 0;
  uint64_t end = 0;
};

class SafetensorsFile {
 public:
  // Maps `path` and checks its header. NotFound when the file does not exist,
  // DataLoss when it is truncated, InvalidArgument when it is malformed.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);

  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  // Header entries by tensor name.
  const std::map<std::string, SafetensorsEntry>& entries() const { return entries_; }
  // The optional "__metadata__" string map.
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  bool Has(const std::string& name) const { return entries_.count(name) > 0; }

  // The tensor `name` converted to f32. NotFound when absent; InvalidArgument
  // naming the tensor and dtype when the dtype is not F32, F16 or BF16.
  absl::StatusOr<Tensor> Read(const std::string& name) const;
  // The tensor `name` as stored: a view of the mapped file, valid while this
  // file is open. Read's errors.
  absl::StatusOr<StoredTensor> View(const std::string& name) const;

 private:
  SafetensorsFile(std::string path, const uint8_t* map, size_t map_size);
  absl::Status ParseHeader();

  std::string path_;
  const uint8_t* map_;  // the whole file, read-only
  size_t map_size_;
  const uint8_t* data_ = nullptr;  // start of the data section
  uint64_t data_size_ = 0;
  std::map<std::string, SafetensorsEntry> entries_;
  std::map<std::string, std::string> metadata_;
};

// Writes `tensors` to `path` in `dtype`, laid out in name order (the map's
// order) with an 8-byte aligned header and __metadata__ {"format": "pt"}, as
// Hugging Face's safetensors writes them. InvalidArgument naming the tensor
// when a tensor's data size disagrees with its shape.
absl::Status WriteSafetensors(const std::string& path, const std::map<std::string, Tensor>& tensors,
                              SafetensorsDtype dtype);

// The values of one tensor for WriteSafetensorsStreaming, which calls it once
// per tensor, in name order: as many f32 values as the tensor's shape has
// elements, valid until the next call.
using TensorValues = std::function<absl::StatusOr<std::span<const float>>(const std::string& name)>;

// WriteSafetensors for tensors made one at a time, so that only one need be in
// memory (an 8B-parameter model is 32 GB in f32): the header, which shapes
// and dtype alone determine, goes first; then each tensor's data as `values`
// yields it. The same bytes as WriteSafetensors over the same tensors. When
// `values` fails, or yields a count its shape disagrees with (InvalidArgument
// naming the tensor), the partial file is removed and that error returned.
absl::Status WriteSafetensorsStreaming(const std::string& path,
                                       const std::map<std::string, std::vector<int64_t>>& shapes,
                                       SafetensorsDtype dtype, const TensorValues& values);

// The tensors of a checkpoint directory: DIR/model.safetensors, or the shards
// that DIR/model.safetensors.index.json lists in its "weight_map"
// (tensor name -> shard file name).
class CheckpointTensorSource : public TensorSource {
 public:
  // Opens every file and checks every header, and that each tensor the index
  // lists is in its shard. NotFound names the directory when it or both files
  // are missing, and the shard when one is missing.
  static absl::StatusOr<std::unique_ptr<CheckpointTensorSource>> Open(const std::string& dir);

  absl::StatusOr<Tensor> Get(const std::string& name) const override;
  absl::StatusOr<StoredTensor> GetStored(const std::string& name) const override;  // a view of the mapped file
  bool Has(const std::string& name) const override;
  std::string Describe() const override;  // "checkpoint DIR"

  // Every tensor name in the checkpoint, sorted.
  std::vector<std::string> TensorNames() const;

 private:
  explicit CheckpointTensorSource(std::string dir) : dir_(std::move(dir)) {}

  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const SafetensorsFile*> file_of_tensor_;
};

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_MODEL_SAFETENSORS_H_
