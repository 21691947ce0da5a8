// ModelWeights: every parameter of a Llama-family decoder in f32, laid out for
// the CPU forward pass. Matrices are row-major [out_features, in_features], as
// Hugging Face stores them; q/k/v are fused into one [q+2kv, hidden] matrix and
// gate/up into one [2*intermediate, hidden] matrix so each is one GEMM.
//
// A TensorSource yields named tensors (Hugging Face names such as
// "model.layers.0.self_attn.q_proj.weight"); both a safetensors checkpoint and
// a built-in preset are TensorSources, so weights are assembled by one path.
//
// Thread safety: TensorSource implementations are immutable once built; their
// const methods may be called concurrently. ModelWeights is plain data.
#ifndef TANDEM_WORKER_MODEL_WEIGHTS_H_
#define TANDEM_WORKER_MODEL_WEIGHTS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/model/model_config.h"

namespace tandem::worker {

struct Tensor {
  std::vector<int64_t> shape;
  std::vector<float> data;  // row-major, converted to f32
};

// The element types weights are stored in.
enum class WeightDtype { kF32, kF16, kBF16 };

// A tensor as its source stores it, not converted: its element type and its
// row-major little-endian bytes (a checkpoint's are a view of the mapped
// file, so a GPU runner copies bf16 weights to the device as they are).
// `owner`, when set, keeps the bytes alive; otherwise they live as long as
// the source.
struct StoredTensor {
  std::vector<int64_t> shape;
  WeightDtype dtype = WeightDtype::kF32;
  std::span<const uint8_t> bytes;
  std::shared_ptr<const void> owner;
};

class TensorSource {
 public:
  virtual ~TensorSource() = default;
  // The tensor `name` converted to f32. NotFound names the tensor and where it
  // was looked for; a truncated or malformed file is DataLoss/InvalidArgument
  // naming the file and the tensor.
  virtual absl::StatusOr<Tensor> Get(const std::string& name) const = 0;
  // The tensor `name` in its stored dtype, with Get's errors. By default
  // Get's f32 values (a source that makes its tensors, like the built-in
  // presets, stores f32).
  virtual absl::StatusOr<StoredTensor> GetStored(const std::string& name) const;
  // The shape of tensor `name` (and, for a checkpoint, that its dtype is
  // one we read), without converting it. By default GetStored's.
  virtual absl::StatusOr<std::vector<int64_t>> StoredShape(const std::string& name) const;
  virtual bool Has(const std::string& name) const = 0;
  // Human-readable origin, for error messages ("checkpoint /x/y", "builtin:tiny").
  virtual std::string Describe() const = 0;
};

struct LayerWeights {
  std::vector<float> input_norm;  // [hidden]
  std::vector<float> wqkv;        // [q_size + 2*kv_size, hidden]
  std::vector<float> bqkv;        // [q_size + 2*kv_size] or empty
  std::vector<float> wo;          // [hidden, q_size]
  std::vector<float> bo;          // [hidden] or empty
  std::vector<float> post_norm;   // [hidden]
  std::vector<float> w_gate_up;   // [2*intermediate, hidden]: gate rows, then up rows
  std::vector<float> b_gate_up;   // [2*intermediate] or empty
  std::vector<float> w_down;      // [hidden, intermediate]
  std::vector<float> b_down;      // [hidden] or empty
};

struct ModelWeights {
  std::vector<float> embed;  // [vocab, hidden]
  std::vector<LayerWeights> layers;
  std::vector<float> final_norm;  // [hidden]
  std::vector<float> lm_head;     // [vocab, hidden]; empty when tied to embed
  const std::vector<float>& output_matrix() const { return lm_head.empty() ? embed : lm_head; }
};

// The Hugging Face tensors LoadWeights reads for `config`: name -> shape, with
// matrices as [out_features, in_features]. Biases appear where the config has
// them; lm_head.weight is absent when tie_word_embeddings is set.
std::map<std::string, std::vector<int64_t>> ExpectedTensorShapes(const ModelConfig& config);

// Assembles weights from `source`, checking every tensor's presence and shape
// against `config`. Errors name the tensor, the expected and the found shape.
absl::StatusOr<ModelWeights> LoadWeights(const ModelConfig& config, const TensorSource& source);

// LoadWeights' checks (presence, shape, a readable dtype) without reading the
// data: a model is checked when it is loaded, and each runner reads the
// weights its own way (the CPU runner as f32, a GPU runner as stored).
absl::Status CheckTensors(const ModelConfig& config, const TensorSource& source);

// The parameters `config` has (the elements of ExpectedTensorShapes).
int64_t ParameterCount(const ModelConfig& config);

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_MODEL_WEIGHTS_H_
