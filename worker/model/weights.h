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
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/model/model_config.h"

namespace tandem::worker {

struct Tensor {
  std::vector<int64_t> shape;
  std::vector<float> data;  // row-major, converted to f32
};

class TensorSource {
 public:
  virtual ~TensorSource() = default;
  // The tensor `name` converted to f32. NotFound names the tensor and where it
  // was looked for; a truncated or malformed file is DataLoss/InvalidArgument
  // naming the file and the tensor.
  virtual absl::StatusOr<Tensor> Get(const std::string& name) const = 0;
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

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_MODEL_WEIGHTS_H_
