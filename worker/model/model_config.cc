#include "worker/model/model_config.h"

#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string_view>
#include <utility>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "worker/model/io_util.h"

namespace tandem::worker {
namespace {

using nlohmann::json;

constexpr char kLlama[] = "LlamaForCausalLM";
constexpr char kMistral[] = "MistralForCausalLM";
constexpr char kQwen2[] = "Qwen2ForCausalLM";

std::optional<int> AsInt(const json& value) {
  if (value.is_number_unsigned()) {
    const uint64_t u = value.get<uint64_t>();
    if (u > static_cast<uint64_t>(INT_MAX)) return std::nullopt;
    return static_cast<int>(u);
  }
  if (value.is_number_integer()) {
    const int64_t i = value.get<int64_t>();
    if (i < INT_MIN || i > INT_MAX) return std::nullopt;
    return static_cast<int>(i);
  }
  if (value.is_number_float()) {  // e.g. 4096.0
    const double d = value.get<double>();
    if (std::isfinite(d) && d == std::floor(d) && d >= INT_MIN && d <= INT_MAX) {
      return static_cast<int>(d);
    }
  }
  return std::nullopt;
}

// Typed, checked access to the keys of one JSON object. A key set to null
// reads as absent: Hugging Face writes null for "not set".
class Fields {
 public:
  // `where` starts every error message: the file, and the sub-object if any.
  Fields(const json& object, std::string where) : object_(object), where_(std::move(where)) {}

  const std::string& where() const { return where_; }

  // Present, even if null.
  bool Contains(const std::string& key) const { return object_.contains(key); }

  // Present and not null; nullptr otherwise.
  const json* Find(const std::string& key) const {
    auto it = object_.find(key);
    if (it == object_.end() || it->is_null()) return nullptr;
    return &*it;
  }
  bool Has(const std::string& key) const { return Find(key) != nullptr; }

  // A 32-bit integer; required when `fallback` is nullopt.
  absl::StatusOr<int> Int(const std::string& key, std::optional<int> fallback = std::nullopt) const {
    const json* value = Find(key);
    if (value == nullptr) {
      if (fallback.has_value()) return *fallback;
      return Missing(key);
    }
    std::optional<int> result = AsInt(*value);
    if (!result.has_value()) return Error(key, "must be a 32-bit integer", *value);
    return *result;
  }

  // A finite number; required when `fallback` is nullopt.
  absl::StatusOr<double> Number(const std::string& key, std::optional<double> fallback = std::nullopt) const {
    const json* value = Find(key);
    if (value == nullptr) {
      if (fallback.has_value()) return *fallback;
      return Missing(key);
    }
    if (!value->is_number() || !std::isfinite(value->get<double>())) {
      return Error(key, "must be a number", *value);
    }
    return value->get<double>();
  }

  absl::StatusOr<bool> Bool(const std::string& key, bool fallback) const {
    const json* value = Find(key);
    if (value == nullptr) return fallback;
    if (!value->is_boolean()) return Error(key, "must be true or false", *value);
    return value->get<bool>();
  }

  absl::StatusOr<std::string> String(const std::string& key, std::string fallback) const {
    const json* value = Find(key);
    if (value == nullptr) return fallback;
    if (!value->is_string()) return Error(key, "must be a string", *value);
    return value->get<std::string>();
  }

  absl::Status Error(const std::string& key, const std::string& message, const json& got) const {
    return absl::InvalidArgumentError(
        absl::StrCat(where_, ": \"", key, "\" ", message, ", got ", model_internal::DumpJson(got, -1)));
  }

 private:
  absl::Status Missing(const std::string& key) const {
    return absl::InvalidArgumentError(absl::StrCat(where_, ": missing required key \"", key, "\""));
  }

  const json& object_;
  std::string where_;
};

bool IsSupported(std::string_view architecture) {
  for (const std::string& a : SupportedArchitectures()) {
    if (a == architecture) return true;
  }
  return false;
}

absl::Status UnsupportedArchitecture(const std::string& where, const std::string& architecture) {
  return absl::InvalidArgumentError(
      absl::StrCat(where, ": architecture \"", architecture,
                   "\" is not supported (supported: ", absl::StrJoin(SupportedArchitectures(), ", "), ")"));
}

// From "architectures" (its first entry), or else from "model_type".
absl::StatusOr<std::string> ReadArchitecture(const Fields& f) {
  std::string architecture;
  if (const json* list = f.Find("architectures"); list != nullptr) {
    if (!list->is_array() || list->empty() || !(*list)[0].is_string()) {
      return f.Error("architectures", "must be a non-empty list of strings", *list);
    }
    architecture = (*list)[0].get<std::string>();
  } else {
    ASSIGN_OR_RETURN(std::string model_type, f.String("model_type", ""));
    if (model_type == "llama") {
      architecture = kLlama;
    } else if (model_type == "mistral") {
      architecture = kMistral;
    } else if (model_type == "qwen2") {
      architecture = kQwen2;
    } else if (model_type.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(f.where(), ": has neither \"architectures\" nor \"model_type\""));
    } else {
      architecture = absl::StrCat("model_type ", model_type);
    }
  }
  if (!IsSupported(architecture)) return UnsupportedArchitecture(f.where(), architecture);
  return architecture;
}

// RoPE from rope_parameters (transformers 5) when present, else from
// rope_theta + rope_scaling.
absl::StatusOr<RopeConfig> ReadRope(const Fields& top) {
  RopeConfig rope;
  ASSIGN_OR_RETURN(rope.theta, top.Number("rope_theta", 10000.0));
  std::string section = "rope_parameters";
  const json* params = top.Find(section);
  if (params == nullptr) {
    section = "rope_scaling";
    params = top.Find(section);
  }
  if (params == nullptr) return rope;
  if (!params->is_object()) return top.Error(section, "must be an object or null", *params);

  Fields p(*params, absl::StrCat(top.where(), ": ", section));
  ASSIGN_OR_RETURN(rope.theta, p.Number("rope_theta", rope.theta));
  std::string type;
  if (p.Has("rope_type")) {
    ASSIGN_OR_RETURN(type, p.String("rope_type", ""));
  } else if (p.Has("type")) {  // the key before transformers 4.43
    ASSIGN_OR_RETURN(type, p.String("type", ""));
  } else if (section == "rope_parameters") {
    type = "default";
  } else {
    return absl::InvalidArgumentError(absl::StrCat(p.where(), ": has neither \"rope_type\" nor \"type\""));
  }

  if (type == "default") {
    rope.type = RopeType::kDefault;
  } else if (type == "linear") {
    rope.type = RopeType::kLinear;
    ASSIGN_OR_RETURN(rope.factor, p.Number("factor"));
  } else if (type == "llama3") {
    rope.type = RopeType::kLlama3;
    ASSIGN_OR_RETURN(rope.factor, p.Number("factor"));
    ASSIGN_OR_RETURN(rope.low_freq_factor, p.Number("low_freq_factor"));
    ASSIGN_OR_RETURN(rope.high_freq_factor, p.Number("high_freq_factor"));
    ASSIGN_OR_RETURN(rope.original_max_position_embeddings, p.Int("original_max_position_embeddings"));
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat(p.where(), ": rope type \"", type, "\" is not supported (supported: default, linear, llama3)"));
  }
  return rope;
}

// The sliding-window size the checkpoint's attention uses, if any.
absl::StatusOr<std::optional<int>> ReadSlidingWindow(const Fields& f, const ModelConfig& c) {
  if (c.architecture == kMistral) {
    // MistralConfig defaults sliding_window to 4096 when the key is absent;
    // null means full attention (Mistral v0.2 and later).
    if (!f.Contains("sliding_window")) return std::optional<int>(4096);
    if (!f.Has("sliding_window")) return std::optional<int>();
    ASSIGN_OR_RETURN(int window, f.Int("sliding_window"));
    return std::optional<int>(window);
  }
  if (c.architecture == kQwen2) {
    // Qwen2 windows only the layers marked so: layer_types (transformers 5),
    // or, before it, the layers from max_window_layers on when
    // use_sliding_window is set.
    bool windowed = false;
    if (const json* types = f.Find("layer_types"); types != nullptr) {
      if (!types->is_array()) return f.Error("layer_types", "must be a list", *types);
      for (const json& t : *types) windowed = windowed || t == "sliding_attention";
    } else {
      ASSIGN_OR_RETURN(bool use, f.Bool("use_sliding_window", false));
      ASSIGN_OR_RETURN(int max_window_layers, f.Int("max_window_layers", 28));
      windowed = use && max_window_layers < c.num_layers;
    }
    if (!windowed || !f.Has("sliding_window")) return std::optional<int>();
    ASSIGN_OR_RETURN(int window, f.Int("sliding_window"));
    return std::optional<int>(window);
  }
  return std::optional<int>();
}

absl::StatusOr<std::vector<int>> ReadEosIds(const Fields& f) {
  std::vector<int> ids;
  const json* value = f.Find("eos_token_id");
  if (value == nullptr) return ids;
  if (value->is_array()) {
    for (const json& item : *value) {
      std::optional<int> id = AsInt(item);
      if (!id.has_value()) {
        return f.Error("eos_token_id", "must be an integer, a list of integers or null", *value);
      }
      ids.push_back(*id);
    }
    return ids;
  }
  std::optional<int> id = AsInt(*value);
  if (!id.has_value()) {
    return f.Error("eos_token_id", "must be an integer, a list of integers or null", *value);
  }
  ids.push_back(*id);
  return ids;
}

absl::Status Validate(const ModelConfig& c, const std::string& where) {
  auto bad = [&where](auto&&... parts) { return absl::InvalidArgumentError(absl::StrCat(where, ": ", parts...)); };
  if (!IsSupported(c.architecture)) return UnsupportedArchitecture(where, c.architecture);
  const std::pair<const char*, int> sizes[] = {
      {"vocab_size", c.vocab_size},
      {"hidden_size", c.hidden_size},
      {"intermediate_size", c.intermediate_size},
      {"num_hidden_layers", c.num_layers},
      {"num_attention_heads", c.num_heads},
      {"num_key_value_heads", c.num_kv_heads},
      {"head_dim", c.head_dim},
      {"max_position_embeddings", c.max_position_embeddings},
  };
  for (const auto& [key, value] : sizes) {
    if (value <= 0) return bad("\"", key, "\" must be positive, got ", value);
  }
  if (c.num_heads % c.num_kv_heads != 0) {
    return bad("num_attention_heads (", c.num_heads, ") must be a multiple of num_key_value_heads (", c.num_kv_heads,
               ")");
  }
  if (c.head_dim % 2 != 0) return bad("head_dim (", c.head_dim, ") must be even for rotary embeddings");
  const int64_t qkv_rows = (int64_t{c.num_heads} + 2 * int64_t{c.num_kv_heads}) * c.head_dim;
  if (qkv_rows > INT_MAX) {
    return bad("(num_attention_heads + 2 * num_key_value_heads) * head_dim = ", qkv_rows, " is too large");
  }
  if (!(c.rms_norm_eps > 0) || !std::isfinite(c.rms_norm_eps)) {
    return bad("rms_norm_eps must be positive, got ", c.rms_norm_eps);
  }
  const RopeConfig& r = c.rope;
  if (!(r.theta > 0) || !std::isfinite(r.theta)) return bad("rope_theta must be positive, got ", r.theta);
  if (r.type != RopeType::kDefault && !(r.factor > 0)) {
    return bad("rope scaling factor must be positive, got ", r.factor);
  }
  if (r.type == RopeType::kLlama3) {
    if (!(r.low_freq_factor > 0) || !(r.high_freq_factor > r.low_freq_factor)) {
      return bad("llama3 rope scaling needs 0 < low_freq_factor < high_freq_factor, got ", r.low_freq_factor, " and ",
                 r.high_freq_factor);
    }
    if (r.original_max_position_embeddings <= 0) {
      return bad("llama3 rope scaling needs a positive original_max_position_embeddings, got ",
                 r.original_max_position_embeddings);
    }
  }
  if (c.bos_token_id < -1 || c.bos_token_id >= c.vocab_size) {
    return bad("bos_token_id ", c.bos_token_id, " is outside the vocabulary (vocab_size ", c.vocab_size, ")");
  }
  for (int id : c.eos_token_ids) {
    if (id < 0 || id >= c.vocab_size) {
      return bad("eos_token_id ", id, " is outside the vocabulary (vocab_size ", c.vocab_size, ")");
    }
  }
  if (c.architecture == kLlama && c.qkv_bias != c.o_bias) {
    return bad(
        "LlamaForCausalLM's attention_bias biases q, k, v and o_proj together, so qkv_bias "
        "and o_bias must match");
  }
  if (c.architecture == kMistral && (c.qkv_bias || c.o_bias || c.mlp_bias)) {
    return bad("MistralForCausalLM has no biases");
  }
  if (c.architecture == kQwen2 && (!c.qkv_bias || c.o_bias || c.mlp_bias)) {
    return bad("Qwen2ForCausalLM has biases on q, k and v only");
  }
  return absl::OkStatus();
}

// The double with the fewest decimal digits that reads back as `value`, so
// 1e-5f is written as 1e-05 rather than 9.999999747378752e-06.
double ShortestDecimal(float value) {
  char buf[32];
  for (int digits = 1; digits <= 9; ++digits) {
    std::snprintf(buf, sizeof(buf), "%.*g", digits, static_cast<double>(value));
    const double candidate = std::strtod(buf, nullptr);
    if (static_cast<float>(candidate) == value) return candidate;
  }
  return value;
}

std::string ModelType(const std::string& architecture) {
  if (architecture == kMistral) return "mistral";
  if (architecture == kQwen2) return "qwen2";
  return "llama";
}

}  // namespace

const std::vector<std::string>& SupportedArchitectures() {
  static const auto* const kArchitectures = new std::vector<std::string>{kLlama, kMistral, kQwen2};
  return *kArchitectures;
}

absl::Status ValidateModelConfig(const ModelConfig& config) { return Validate(config, "model config"); }

absl::StatusOr<ModelConfig> ParseModelConfig(const std::string& json_text, const std::string& source) {
  ASSIGN_OR_RETURN(json root, model_internal::ParseJson(json_text, source));
  if (!root.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": expected a JSON object"));
  }
  Fields f(root, source);
  ModelConfig c;
  ASSIGN_OR_RETURN(c.architecture, ReadArchitecture(f));
  ASSIGN_OR_RETURN(c.vocab_size, f.Int("vocab_size"));
  ASSIGN_OR_RETURN(c.hidden_size, f.Int("hidden_size"));
  ASSIGN_OR_RETURN(c.intermediate_size, f.Int("intermediate_size"));
  ASSIGN_OR_RETURN(c.num_layers, f.Int("num_hidden_layers"));
  ASSIGN_OR_RETURN(c.num_heads, f.Int("num_attention_heads"));
  ASSIGN_OR_RETURN(c.num_kv_heads, f.Int("num_key_value_heads", c.num_heads));
  if (f.Has("head_dim")) {
    ASSIGN_OR_RETURN(c.head_dim, f.Int("head_dim"));
  } else if (c.num_heads > 0) {
    if (c.hidden_size % c.num_heads != 0) {
      return absl::InvalidArgumentError(absl::StrCat(source, ": hidden_size (", c.hidden_size,
                                                     ") is not a multiple of num_attention_heads (", c.num_heads,
                                                     ") and head_dim is not given"));
    }
    c.head_dim = c.hidden_size / c.num_heads;
  }
  // Defaults as in transformers' LlamaConfig, MistralConfig and Qwen2Config.
  const int default_max_positions = c.architecture == kMistral ? 4096 * 32 : c.architecture == kQwen2 ? 32768 : 2048;
  ASSIGN_OR_RETURN(c.max_position_embeddings, f.Int("max_position_embeddings", default_max_positions));
  ASSIGN_OR_RETURN(double eps, f.Number("rms_norm_eps", 1e-6));
  c.rms_norm_eps = static_cast<float>(eps);
  ASSIGN_OR_RETURN(c.tie_word_embeddings, f.Bool("tie_word_embeddings", false));
  ASSIGN_OR_RETURN(std::string act, f.String("hidden_act", "silu"));
  if (act != "silu") {
    return f.Error("hidden_act", "must be \"silu\" (the only activation supported)", act);
  }

  if (c.architecture == kLlama) {
    ASSIGN_OR_RETURN(bool attention_bias, f.Bool("attention_bias", false));
    c.qkv_bias = attention_bias;
    c.o_bias = attention_bias;
    ASSIGN_OR_RETURN(c.mlp_bias, f.Bool("mlp_bias", false));
  } else if (c.architecture == kQwen2) {
    c.qkv_bias = true;
  }

  if (f.Has("bos_token_id")) {
    ASSIGN_OR_RETURN(c.bos_token_id, f.Int("bos_token_id"));
  }
  ASSIGN_OR_RETURN(c.eos_token_ids, ReadEosIds(f));

  // transformers 5 writes "dtype"; earlier versions "torch_dtype".
  const std::string dtype_key = f.Has("dtype") ? "dtype" : "torch_dtype";
  ASSIGN_OR_RETURN(c.torch_dtype, f.String(dtype_key, "float32"));
  if (c.torch_dtype.rfind("torch.", 0) == 0) c.torch_dtype.erase(0, 6);

  ASSIGN_OR_RETURN(c.rope, ReadRope(f));

  ASSIGN_OR_RETURN(std::optional<int> window, ReadSlidingWindow(f, c));
  if (window.has_value()) {
    if (*window <= 0) return f.Error("sliding_window", "must be positive", *window);
    if (*window < c.max_position_embeddings) {
      LOG(WARNING) << source << ": sliding_window " << *window << " < max_position_embeddings "
                   << c.max_position_embeddings << "; capping the context to " << *window
                   << " tokens, where full attention is exact (the attention kernels have no "
                      "sliding window)";
      c.max_position_embeddings = *window;
    }
  }

  RETURN_IF_ERROR(Validate(c, source));
  return c;
}

absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& dir) {
  const std::string path = model_internal::JoinPath(dir, "config.json");
  ASSIGN_OR_RETURN(std::string text, model_internal::ReadFile(path));
  return ParseModelConfig(text, path);
}

std::string ModelConfigToJson(const ModelConfig& c) {
  json j = json::object();
  j["architectures"] = json::array({c.architecture});
  j["model_type"] = ModelType(c.architecture);
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.intermediate_size;
  j["num_hidden_layers"] = c.num_layers;
  j["num_attention_heads"] = c.num_heads;
  j["num_key_value_heads"] = c.num_kv_heads;
  j["head_dim"] = c.head_dim;
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["rms_norm_eps"] = ShortestDecimal(c.rms_norm_eps);
  j["hidden_act"] = "silu";
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  j["rope_theta"] = c.rope.theta;
  switch (c.rope.type) {
    case RopeType::kDefault:
      j["rope_scaling"] = nullptr;
      break;
    case RopeType::kLinear:
      j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", c.rope.factor}};
      break;
    case RopeType::kLlama3:
      j["rope_scaling"] = {
          {"rope_type", "llama3"},
          {"factor", c.rope.factor},
          {"low_freq_factor", c.rope.low_freq_factor},
          {"high_freq_factor", c.rope.high_freq_factor},
          {"original_max_position_embeddings", c.rope.original_max_position_embeddings},
      };
      break;
  }
  j["bos_token_id"] = c.bos_token_id >= 0 ? json(c.bos_token_id) : json(nullptr);
  if (c.eos_token_ids.empty()) {
    j["eos_token_id"] = nullptr;
  } else if (c.eos_token_ids.size() == 1) {
    j["eos_token_id"] = c.eos_token_ids[0];
  } else {
    j["eos_token_id"] = c.eos_token_ids;
  }
  j["torch_dtype"] = c.torch_dtype;
  j["attention_dropout"] = 0.0;
  j["initializer_range"] = 0.02;
  j["use_cache"] = true;
  j["transformers_version"] = "4.46.0";
  if (c.architecture == kLlama) {
    j["attention_bias"] = c.qkv_bias;
    j["mlp_bias"] = c.mlp_bias;
    j["pretraining_tp"] = 1;
  } else if (c.architecture == kMistral) {
    j["sliding_window"] = nullptr;
  } else if (c.architecture == kQwen2) {
    j["use_sliding_window"] = false;
    j["sliding_window"] = nullptr;
    j["max_window_layers"] = c.num_layers;
  }
  return model_internal::DumpJson(j, 2) + "\n";
}

}  // namespace tandem::worker
