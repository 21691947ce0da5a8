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

// The weights as the forward pass groups them, in any storage `Buffer` (f32
// host vectors for the CPU runner, device buffers for a GPU runner). Matrices
// are row-major [out_features, in_features]; fused ones stack their parts'
// rows in the order given. An absent optional weight (a bias the config does
// not have, lm_head when tied) is a default-constructed (empty) Buffer.
template <typename Buffer>
struct LayerWeightsOf {
  Buffer input_norm;  // [hidden]
  Buffer wqkv;        // [q_size + 2*kv_size, hidden]
  Buffer bqkv;        // [q_size + 2*kv_size] or empty
  Buffer wo;          // [hidden, q_size]
  Buffer bo;          // [hidden] or empty
  Buffer post_norm;   // [hidden]
  Buffer w_gate_up;   // [2*intermediate, hidden]: gate rows, then up rows
  Buffer b_gate_up;   // [2*intermediate] or empty
  Buffer w_down;      // [hidden, intermediate]
  Buffer b_down;      // [hidden] or empty
};

template <typename Buffer>
struct ModelWeightsOf {
  Buffer embed;  // [vocab, hidden]
  std::vector<LayerWeightsOf<Buffer>> layers;
  Buffer final_norm;  // [hidden]
  Buffer lm_head;     // [vocab, hidden]; empty when tied to embed
  const Buffer& output_matrix() const { return lm_head.empty() ? embed : lm_head; }
};

using LayerWeights = LayerWeightsOf<std::vector<float>>;
using ModelWeights = ModelWeightsOf<std::vector<float>>;

// The tensors of each weight, as AssembleWeights asks for them.
struct WeightParts {
  std::vector<std::string> names;  // Hugging Face names, stacked in this order
};

// Builds every weight of `config` through `read(const WeightParts&) ->
// absl::StatusOr<Buffer>` (one call per weight, fused weights naming their
// parts in order). The one place that knows which tensors make which
// weight; LoadWeights and the GPU runner read through it.
template <typename Buffer, typename Read>
absl::StatusOr<ModelWeightsOf<Buffer>> AssembleWeights(const ModelConfig& config, const Read& read);

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

// --- AssembleWeights ---------------------------------------------------------

std::string LayerTensorName(int layer, const std::string& suffix);  // "model.layers.N.suffix"

template <typename Buffer, typename Read>
absl::StatusOr<ModelWeightsOf<Buffer>> AssembleWeights(const ModelConfig& config, const Read& read) {
  ModelWeightsOf<Buffer> w;
  // Reads one weight into `out`; the first failure stops the rest.
  absl::Status error;
  auto get = [&](std::vector<std::string> names, Buffer* out) {
    if (!error.ok()) return;
    absl::StatusOr<Buffer> b = read(WeightParts{.names = std::move(names)});
    if (b.ok()) {
      *out = *std::move(b);
    } else {
      error = b.status();
    }
  };
  auto layer_parts = [](int layer, std::initializer_list<const char*> suffixes) {
    std::vector<std::string> names;
    for (const char* s : suffixes) names.push_back(LayerTensorName(layer, s));
    return names;
  };
  get({"model.embed_tokens.weight"}, &w.embed);
  w.layers.resize(config.num_layers);
  for (int i = 0; i < config.num_layers && error.ok(); ++i) {
    LayerWeightsOf<Buffer>& l = w.layers[i];
    get(layer_parts(i, {"input_layernorm.weight"}), &l.input_norm);
    get(layer_parts(i, {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"}), &l.wqkv);
    if (config.qkv_bias) {
      get(layer_parts(i, {"self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"}), &l.bqkv);
    }
    get(layer_parts(i, {"self_attn.o_proj.weight"}), &l.wo);
    if (config.o_bias) get(layer_parts(i, {"self_attn.o_proj.bias"}), &l.bo);
    get(layer_parts(i, {"post_attention_layernorm.weight"}), &l.post_norm);
    get(layer_parts(i, {"mlp.gate_proj.weight", "mlp.up_proj.weight"}), &l.w_gate_up);
    get(layer_parts(i, {"mlp.down_proj.weight"}), &l.w_down);
    if (config.mlp_bias) {
      get(layer_parts(i, {"mlp.gate_proj.bias", "mlp.up_proj.bias"}), &l.b_gate_up);
      get(layer_parts(i, {"mlp.down_proj.bias"}), &l.b_down);
    }
  }
  get({"model.norm.weight"}, &w.final_norm);
  // With tied embeddings lm_head.weight is ignored even when present.
  if (!config.tie_word_embeddings) get({"lm_head.weight"}, &w.lm_head);
  if (!error.ok()) return error;
  return w;
}

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_MODEL_WEIGHTS_H_
