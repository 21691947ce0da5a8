#include "worker/model/builtin_models.h"

#include <cmath>
#include <functional>
#include <numbers>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"

namespace tandem::worker {
namespace {

// Standard deviations of the generated weights:
// - embeddings N(0, 1): the residual stream starts with RMS 1;
// - linear weights N(0, 1/in_features): each projection of an RMS-normalized
//   input has unit variance, so q, k, v, gate and up are O(1) and the residual
//   stream grows only to RMS ~2-3 over 8 layers;
// - norm weights 1 + N(0, 0.05^2): near identity, but not exactly 1 so that a
//   forward pass that skips them is caught;
// - biases N(0, 0.1^2) (presets have none; tests configure them);
// - lm_head N(0, kLogitStd^2 / hidden): the final norm makes its input RMS ~1,
//   so logits have a standard deviation of ~kLogitStd. With 384 ids, 3 puts the
//   top logit ~9 above the mean: peaked, yet not one-hot.
constexpr double kNormNoise = 0.05;
constexpr double kBiasStd = 0.1;
constexpr double kLogitStd = 3.0;

constexpr uint64_t kGoldenGamma = 0x9E3779B97F4A7C15ull;

uint64_t Mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Output `counter` of a SplitMix64 generator whose state starts at `stream`.
uint64_t SplitMix64(uint64_t stream, uint64_t counter) { return Mix64(stream + (counter + 1) * kGoldenGamma); }

uint64_t Fnv1a64(std::string_view text) {
  uint64_t hash = 0xCBF29CE484222325ull;
  for (unsigned char c : text) {
    hash ^= c;
    hash *= 0x100000001B3ull;
  }
  return hash;
}

// Uniform in (0, 1] from the top 53 bits.
double UnitInterval(uint64_t bits) { return (static_cast<double>(bits >> 11) + 1.0) * 0x1.0p-53; }

// out[k] = mean + stddev * z_k, z_k standard normal: Box-Muller on the pair of
// uniforms (2p, 2p+1) gives z_{2p} (cosine) and z_{2p+1} (sine).
void FillNormal(uint64_t stream, double mean, double stddev, std::vector<float>* out) {
  const size_t n = out->size();
  for (size_t k = 0; k < n; k += 2) {
    const double u1 = UnitInterval(SplitMix64(stream, k));
    const double u2 = UnitInterval(SplitMix64(stream, k + 1));
    const double radius = std::sqrt(-2.0 * std::log(u1));
    const double angle = 2.0 * std::numbers::pi * u2;
    (*out)[k] = static_cast<float>(mean + stddev * radius * std::cos(angle));
    if (k + 1 < n) (*out)[k + 1] = static_cast<float>(mean + stddev * radius * std::sin(angle));
  }
}

bool EndsWith(std::string_view text, std::string_view suffix) {
  return text.size() >= suffix.size() && text.substr(text.size() - suffix.size()) == suffix;
}

ModelConfig BaseConfig() {
  ModelConfig c;
  c.architecture = "LlamaForCausalLM";
  c.vocab_size = kBuiltinVocabSize;
  c.rms_norm_eps = 1e-5f;
  c.tie_word_embeddings = false;
  c.rope.theta = 500000.0;
  c.rope.type = RopeType::kLlama3;
  c.rope.factor = 8.0;
  c.rope.low_freq_factor = 1.0;
  c.rope.high_freq_factor = 4.0;
  c.bos_token_id = kBuiltinBeginOfTextId;
  c.eos_token_ids = {kBuiltinEndOfTextId, kBuiltinEotId};
  c.torch_dtype = "float32";
  return c;
}

uint64_t PresetSeed(std::string_view name) { return Fnv1a64(absl::StrCat("tandem-builtin-", std::string(name))); }

const std::map<std::string, int, std::less<>>& SpecialTokenIds() {
  static const auto* const kIds = [] {
    auto* ids = new std::map<std::string, int, std::less<>>;
    for (int id = kBuiltinBeginOfTextId; id < kBuiltinVocabSize; ++id) {
      ids->emplace(BuiltinTokenText(id), id);
    }
    return ids;
  }();
  return *kIds;
}

}  // namespace

const std::vector<std::string>& BuiltinModelNames() {
  static const auto* const kNames = new std::vector<std::string>{"tiny", "small"};
  return *kNames;
}

absl::StatusOr<ModelConfig> BuiltinModelConfig(std::string_view name) {
  ModelConfig c = BaseConfig();
  if (name == "tiny") {
    c.hidden_size = 64;
    c.intermediate_size = 176;
    c.num_layers = 3;
    c.num_heads = 4;
    c.num_kv_heads = 2;
    c.head_dim = 16;
    c.max_position_embeddings = 2048;
    // Short enough that llama3 scaling changes frequencies at test lengths.
    c.rope.original_max_position_embeddings = 256;
  } else if (name == "small") {
    c.hidden_size = 512;
    c.intermediate_size = 1536;
    c.num_layers = 8;
    c.num_heads = 8;
    c.num_kv_heads = 4;
    c.head_dim = 64;
    c.max_position_embeddings = 8192;
    c.rope.original_max_position_embeddings = 8192;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("unknown built-in model \"", std::string(name),
                                                   "\" (built-in models: ", absl::StrJoin(BuiltinModelNames(), ", "),
                                                   ")"));
  }
  return c;
}

SeededTensorSource::SeededTensorSource(ModelConfig config, uint64_t seed, std::string description)
    : config_(std::move(config)),
      seed_(seed),
      description_(std::move(description)),
      shapes_(ExpectedTensorShapes(config_)) {}

absl::StatusOr<Tensor> SeededTensorSource::Get(const std::string& name) const {
  auto it = shapes_.find(name);
  if (it == shapes_.end()) {
    return absl::NotFoundError(absl::StrCat("tensor '", name, "' is not part of ", description_));
  }
  Tensor tensor;
  tensor.shape = it->second;
  size_t numel = 1;
  for (int64_t d : tensor.shape) numel *= static_cast<size_t>(d);
  tensor.data.resize(numel);

  double mean = 0.0;
  double stddev;
  if (name == "model.embed_tokens.weight") {
    stddev = 1.0;
  } else if (name == "lm_head.weight") {
    stddev = kLogitStd / std::sqrt(static_cast<double>(config_.hidden_size));
  } else if (EndsWith(name, "norm.weight")) {
    mean = 1.0;
    stddev = kNormNoise;
  } else if (EndsWith(name, ".bias")) {
    stddev = kBiasStd;
  } else {  // a linear layer's [out, in] weight
    CHECK(tensor.shape.size() == 2) << name;
    stddev = 1.0 / std::sqrt(static_cast<double>(tensor.shape[1]));
  }
  FillNormal(Mix64(seed_ ^ Fnv1a64(name)), mean, stddev, &tensor.data);
  return tensor;
}

absl::StatusOr<std::vector<int64_t>> SeededTensorSource::StoredShape(const std::string& name) const {
  auto it = shapes_.find(name);
  if (it == shapes_.end()) {
    return absl::NotFoundError(absl::StrCat("tensor '", name, "' is not part of ", description_));
  }
  return it->second;
}

bool SeededTensorSource::Has(const std::string& name) const { return shapes_.count(name) > 0; }

std::string SeededTensorSource::Describe() const { return description_; }

std::vector<std::string> SeededTensorSource::TensorNames() const {
  std::vector<std::string> names;
  names.reserve(shapes_.size());
  for (const auto& [name, shape] : shapes_) names.push_back(name);
  return names;
}

absl::StatusOr<std::unique_ptr<SeededTensorSource>> MakeBuiltinTensorSource(std::string_view name) {
  absl::StatusOr<ModelConfig> config = BuiltinModelConfig(name);
  if (!config.ok()) return config.status();
  return std::make_unique<SeededTensorSource>(*std::move(config), PresetSeed(name),
                                              absl::StrCat("builtin:", std::string(name)));
}

std::string BuiltinTokenText(int id) {
  CHECK(id >= 0 && id < kBuiltinVocabSize) << "token id " << id;
  switch (id) {
    case kBuiltinBeginOfTextId:
      return "<|begin_of_text|>";
    case kBuiltinEndOfTextId:
      return "<|end_of_text|>";
    case kBuiltinStartHeaderId:
      return "<|start_header_id|>";
    case kBuiltinEndHeaderId:
      return "<|end_header_id|>";
    case kBuiltinEotId:
      return "<|eot_id|>";
    default:
      break;
  }
  if (id < 256) return std::string(1, static_cast<char>(id));
  return absl::StrCat("<|reserved_special_token_", id - (kBuiltinEotId + 1), "|>");
}

std::vector<int> EncodeBuiltinText(std::string_view text) {
  const auto& specials = SpecialTokenIds();
  std::vector<int> ids;
  ids.reserve(text.size());
  size_t i = 0;
  while (i < text.size()) {
    if (text.compare(i, 2, "<|") == 0) {
      // No special token contains "|>" before its end, so the first "|>"
      // closes the only candidate.
      const size_t close = text.find("|>", i + 2);
      if (close != std::string_view::npos) {
        auto it = specials.find(text.substr(i, close + 2 - i));
        if (it != specials.end()) {
          ids.push_back(it->second);
          i = close + 2;
          continue;
        }
      }
    }
    ids.push_back(static_cast<unsigned char>(text[i]));
    ++i;
  }
  return ids;
}

std::string DecodeBuiltinTokens(std::span<const int> ids) {
  std::string text;
  text.reserve(ids.size());
  for (int id : ids) {
    if (id >= 0 && id < 256) text.push_back(static_cast<char>(id));
  }
  return text;
}

std::string_view BuiltinChatTemplate() {
  // No trailing newline: not every Jinja implementation drops it.
  static constexpr std::string_view kTemplate =
      R"jinja({{- bos_token }}
{%- for message in messages %}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %})jinja";
  return kTemplate;
}

}  // namespace tandem::worker
