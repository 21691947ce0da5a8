#include "worker/model/weights.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "common/status_macros.h"

namespace tandem::worker {

absl::StatusOr<std::vector<int64_t>> TensorSource::StoredShape(const std::string& name) const {
  ASSIGN_OR_RETURN(StoredTensor t, GetStored(name));
  return std::move(t.shape);
}

absl::StatusOr<StoredTensor> TensorSource::GetStored(const std::string& name) const {
  ASSIGN_OR_RETURN(Tensor t, Get(name));
  auto values = std::make_shared<std::vector<float>>(std::move(t.data));
  StoredTensor out{.shape = std::move(t.shape),
                   .dtype = WeightDtype::kF32,
                   .bytes = std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(values->data()),
                                                     values->size() * sizeof(float))};
  out.owner = std::move(values);
  return out;
}

std::string LayerTensorName(int layer, const std::string& suffix) {
  return absl::StrCat("model.layers.", layer, ".", suffix);
}

namespace {

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// That tensor `name` is in `source` with `shape` (and a dtype it reads),
// without reading its data.
absl::Status CheckTensor(const TensorSource& source, const std::string& name, const std::vector<int64_t>& shape) {
  if (!source.Has(name)) {
    return absl::NotFoundError(absl::StrCat("tensor '", name, "' (expected shape ", ShapeString(shape),
                                            ") is missing from ", source.Describe()));
  }
  ASSIGN_OR_RETURN(std::vector<int64_t> stored, source.StoredShape(name));
  if (stored != shape) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' in ", source.Describe(), " has shape ",
                                                   ShapeString(stored), ", expected ", ShapeString(shape)));
  }
  return absl::OkStatus();
}

// The data of tensor `name`, which must have `shape`.
absl::StatusOr<std::vector<float>> Fetch(const TensorSource& source, const std::string& name,
                                         const std::vector<int64_t>& shape) {
  RETURN_IF_ERROR(CheckTensor(source, name, shape));
  ASSIGN_OR_RETURN(Tensor tensor, source.Get(name));
  size_t numel = 1;
  for (int64_t d : shape) numel *= static_cast<size_t>(d);
  if (tensor.data.size() != numel) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' in ", source.Describe(), " has ",
                                                   tensor.data.size(), " values for shape ", ShapeString(shape)));
  }
  return std::move(tensor.data);
}

// Appends the row-major matrix (or vector) `rows` below `fused`.
void AppendRows(std::vector<float>* fused, const std::vector<float>& rows) {
  fused->insert(fused->end(), rows.begin(), rows.end());
}

}  // namespace

std::map<std::string, std::vector<int64_t>> ExpectedTensorShapes(const ModelConfig& config) {
  const int64_t vocab = config.vocab_size;
  const int64_t hidden = config.hidden_size;
  const int64_t inter = config.intermediate_size;
  const int64_t q = config.q_size();
  const int64_t kv = config.kv_size();
  std::map<std::string, std::vector<int64_t>> shapes;
  shapes["model.embed_tokens.weight"] = {vocab, hidden};
  for (int i = 0; i < config.num_layers; ++i) {
    shapes[LayerTensorName(i, "input_layernorm.weight")] = {hidden};
    shapes[LayerTensorName(i, "self_attn.q_proj.weight")] = {q, hidden};
    shapes[LayerTensorName(i, "self_attn.k_proj.weight")] = {kv, hidden};
    shapes[LayerTensorName(i, "self_attn.v_proj.weight")] = {kv, hidden};
    shapes[LayerTensorName(i, "self_attn.o_proj.weight")] = {hidden, q};
    if (config.qkv_bias) {
      shapes[LayerTensorName(i, "self_attn.q_proj.bias")] = {q};
      shapes[LayerTensorName(i, "self_attn.k_proj.bias")] = {kv};
      shapes[LayerTensorName(i, "self_attn.v_proj.bias")] = {kv};
    }
    if (config.o_bias) shapes[LayerTensorName(i, "self_attn.o_proj.bias")] = {hidden};
    shapes[LayerTensorName(i, "post_attention_layernorm.weight")] = {hidden};
    shapes[LayerTensorName(i, "mlp.gate_proj.weight")] = {inter, hidden};
    shapes[LayerTensorName(i, "mlp.up_proj.weight")] = {inter, hidden};
    shapes[LayerTensorName(i, "mlp.down_proj.weight")] = {hidden, inter};
    if (config.mlp_bias) {
      shapes[LayerTensorName(i, "mlp.gate_proj.bias")] = {inter};
      shapes[LayerTensorName(i, "mlp.up_proj.bias")] = {inter};
      shapes[LayerTensorName(i, "mlp.down_proj.bias")] = {hidden};
    }
  }
  shapes["model.norm.weight"] = {hidden};
  if (!config.tie_word_embeddings) shapes["lm_head.weight"] = {vocab, hidden};
  return shapes;
}

absl::Status CheckTensors(const ModelConfig& config, const TensorSource& source) {
  RETURN_IF_ERROR(ValidateModelConfig(config));
  for (const auto& [name, shape] : ExpectedTensorShapes(config)) RETURN_IF_ERROR(CheckTensor(source, name, shape));
  return absl::OkStatus();
}

int64_t ParameterCount(const ModelConfig& config) {
  int64_t count = 0;
  for (const auto& [name, shape] : ExpectedTensorShapes(config)) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    count += n;
  }
  return count;
}

absl::StatusOr<ModelWeights> LoadWeights(const ModelConfig& config, const TensorSource& source) {
  RETURN_IF_ERROR(ValidateModelConfig(config));
  const std::map<std::string, std::vector<int64_t>> shapes = ExpectedTensorShapes(config);
  return AssembleWeights<std::vector<float>>(
      config, [&](const WeightParts& parts) -> absl::StatusOr<std::vector<float>> {
        std::vector<float> fused;
        for (const std::string& name : parts.names) {
          auto it = shapes.find(name);
          CHECK(it != shapes.end()) << name;
          ASSIGN_OR_RETURN(std::vector<float> part, Fetch(source, name, it->second));
          AppendRows(&fused, part);
        }
        return fused;
      });
}

}  // namespace tandem::worker
