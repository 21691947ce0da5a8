// ModelConfig: the shape of a Llama-family decoder as read from a Hugging Face
// config.json (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM) or
// given by a built-in preset. Plain data; validated once by ParseModelConfig
// (or ValidateModelConfig for a config built in code).
//
// Thread safety: all functions are pure; ModelConfig is a value type.
#ifndef TANDEM_WORKER_MODEL_MODEL_CONFIG_H_
#define TANDEM_WORKER_MODEL_MODEL_CONFIG_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tandem::worker {

enum class RopeType {
  kDefault,  // inv_freq = theta^(-2i/d)
  kLinear,   // positions divided by factor
  kLlama3,   // Llama 3.1 frequency-dependent scaling
};

struct RopeConfig {
  double theta = 10000.0;
  RopeType type = RopeType::kDefault;
  double factor = 1.0;                          // kLinear, kLlama3
  double low_freq_factor = 1.0;                 // kLlama3
  double high_freq_factor = 4.0;                // kLlama3
  int original_max_position_embeddings = 8192;  // kLlama3

  friend bool operator==(const RopeConfig&, const RopeConfig&) = default;
};

struct ModelConfig {
  std::string architecture = "LlamaForCausalLM";
  int vocab_size = 0;
  int hidden_size = 0;
  int intermediate_size = 0;
  int num_layers = 0;
  int num_heads = 0;
  int num_kv_heads = 0;  // GQA when < num_heads; defaults to num_heads
  int head_dim = 0;      // given, or hidden_size / num_heads
  int max_position_embeddings = 0;
  float rms_norm_eps = 1e-5f;
  bool qkv_bias = false;  // Qwen2: always; Llama: attention_bias
  bool o_bias = false;    // Llama attention_bias also biases o_proj
  bool mlp_bias = false;  // Llama mlp_bias
  bool tie_word_embeddings = false;
  RopeConfig rope;
  int bos_token_id = -1;           // -1: none
  std::vector<int> eos_token_ids;  // may be empty
  std::string torch_dtype = "float32";

  int q_size() const { return num_heads * head_dim; }
  int kv_size() const { return num_kv_heads * head_dim; }

  friend bool operator==(const ModelConfig&, const ModelConfig&) = default;
};

// The architectures ParseModelConfig accepts, in the order error messages list them.
const std::vector<std::string>& SupportedArchitectures();

// Checks a config built in code with the rules ParseModelConfig applies:
// positive sizes, num_heads % num_kv_heads == 0, even head_dim, token ids inside
// the vocabulary, rope parameters, and the bias pattern of the architecture
// (Llama: qkv_bias == o_bias; Mistral: none; Qwen2: qkv only).
absl::Status ValidateModelConfig(const ModelConfig& config);

// Parses the text of a config.json. `source` names the file in error messages.
// Reads RoPE settings from either rope_theta + rope_scaling (older checkpoints)
// or rope_parameters (transformers 5). Unknown architectures, unsupported
// rope types and inconsistent shapes are InvalidArgument errors.
// A Mistral/Qwen2 sliding window smaller than max_position_embeddings caps
// max_position_embeddings to the window (logged as a WARNING): the attention
// kernels have no sliding window, and within the window full attention is exact.
absl::StatusOr<ModelConfig> ParseModelConfig(const std::string& json_text, const std::string& source);

// Reads and parses DIR/config.json.
absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& dir);

// Serializes `config` as a Hugging Face config.json (model_type, architectures,
// rope_theta/rope_scaling, ...), loadable by transformers and by ParseModelConfig,
// which reads it back equal to `config`. REQUIRES: ValidateModelConfig(config).ok().
std::string ModelConfigToJson(const ModelConfig& config);

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_MODEL_MODEL_CONFIG_H_
