#include "worker/model/builtin_models.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <functional>
#include <numbers>
#include <system_error>
#include <thread>
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
//   Tied embeddings (llama-3.2-1b) are drawn at lm_head's scale instead, so
//   the residual stream starts small (RMS 3/sqrt(hidden)); the norms rescale
//   it and the layers' outputs soon dominate. (Without scale_tied_embeddings,
//   as tests built them, they stay N(0, 1).)
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

// Elements per unit of parallel work: about 4 ms of Box-Muller on one core
// (~16 ns an element), long enough to dwarf the scheduling and short enough
// that a 14336 x 4096 matrix (224 chunks) balances over many cores. Even, so
// that no Box-Muller pair straddles two chunks.
constexpr size_t kFillChunk = size_t{1} << 18;
static_assert(kFillChunk % 2 == 0);

// Values [begin, end) of `out`: Box-Muller on the pair of uniforms (2p, 2p+1)
// gives z_{2p} (cosine) and z_{2p+1} (sine). REQUIRES: begin is even.
void FillNormalRange(uint64_t stream, double mean, double stddev, size_t begin, size_t end, std::span<float> out) {
  for (size_t k = begin; k < end; k += 2) {
    const double u1 = UnitInterval(SplitMix64(stream, k));
    const double u2 = UnitInterval(SplitMix64(stream, k + 1));
    const double radius = std::sqrt(-2.0 * std::log(u1));
    const double angle = 2.0 * std::numbers::pi * u2;
    out[k] = static_cast<float>(mean + stddev * radius * std::cos(angle));
    if (k + 1 < end) out[k + 1] = static_cast<float>(mean + stddev * radius * std::sin(angle));
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

// The shape of Meta's Llama 3.1 / 3.2 models: 128256 ids, 131072 positions
// by llama3 RoPE scaling of an original 8192-token context. Bos and eos stay
// the byte-level vocabulary's (see the header).
ModelConfig Llama3Config(int hidden, int intermediate, int layers, int heads, int kv_heads, int head_dim,
                         double rope_factor, bool tie_word_embeddings) {
  ModelConfig c = BaseConfig();
  c.vocab_size = 128256;
  c.hidden_size = hidden;
  c.intermediate_size = intermediate;
  c.num_layers = layers;
  c.num_heads = heads;
  c.num_kv_heads = kv_heads;
  c.head_dim = head_dim;
  c.max_position_embeddings = 131072;
  c.tie_word_embeddings = tie_word_embeddings;
  c.rope.factor = rope_factor;
  c.rope.low_freq_factor = 1.0;
  c.rope.high_freq_factor = 4.0;
  c.rope.original_max_position_embeddings = 8192;
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
  static const auto* const kNames = new std::vector<std::string>{"tiny", "small", "llama-3.2-1b", "llama-3.1-8b"};
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
  } else if (name == "llama-3.2-1b") {  // meta-llama/Llama-3.2-1B(-Instruct)'s config.json
    c = Llama3Config(/*hidden=*/2048, /*intermediate=*/8192, /*layers=*/16, /*heads=*/32, /*kv_heads=*/8,
                     /*head_dim=*/64, /*rope_factor=*/32.0, /*tie_word_embeddings=*/true);
  } else if (name == "llama-3.1-8b") {  // meta-llama/Llama-3.1-8B(-Instruct)'s config.json
    c = Llama3Config(/*hidden=*/4096, /*intermediate=*/14336, /*layers=*/32, /*heads=*/32, /*kv_heads=*/8,
                     /*head_dim=*/128, /*rope_factor=*/8.0, /*tie_word_embeddings=*/false);
  } else {
    return absl::InvalidArgumentError(absl::StrCat("unknown built-in model \"", std::string(name),
                                                   "\" (built-in models: ", absl::StrJoin(BuiltinModelNames(), ", "),
                                                   ")"));
  }
  return c;
}

SeededTensorSource::SeededTensorSource(ModelConfig config, uint64_t seed, std::string description,
                                       bool scale_tied_embeddings)
    : config_(std::move(config)),
      seed_(seed),
      description_(std::move(description)),
      scale_tied_embeddings_(scale_tied_embeddings),
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
  const double output_stddev = kLogitStd / std::sqrt(static_cast<double>(config_.hidden_size));
  if (name == "model.embed_tokens.weight") {
    stddev = config_.tie_word_embeddings && scale_tied_embeddings_ ? output_stddev : 1.0;
  } else if (name == "lm_head.weight") {
    stddev = output_stddev;
  } else if (EndsWith(name, "norm.weight")) {
    mean = 1.0;
    stddev = kNormNoise;
  } else if (EndsWith(name, ".bias")) {
    stddev = kBiasStd;
  } else {  // a linear layer's [out, in] weight
    CHECK(tensor.shape.size() == 2) << name;
    stddev = 1.0 / std::sqrt(static_cast<double>(tensor.shape[1]));
  }
  builtin_models_internal::FillNormal(Mix64(seed_ ^ Fnv1a64(name)), mean, stddev, tensor.data);
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
                                              absl::StrCat("builtin:", std::string(name)),
                                              /*scale_tied_embeddings=*/true);
}

std::string BuiltinTokenText(int id) {
  CHECK(id >= 0) << "token id " << id;
  if (id >= kBuiltinVocabSize) return absl::StrCat("<|filler_", id, "|>");
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

namespace builtin_models_internal {

void FillNormal(uint64_t stream, double mean, double stddev, std::span<float> out, int max_threads) {
  const size_t chunks = (out.size() + kFillChunk - 1) / kFillChunk;
  std::atomic<size_t> next_chunk{0};
  // The one place that generates: each chunk's values depend only on its
  // indices, never on which thread or in which order it runs.
  auto work = [&] {
    for (size_t c = next_chunk++; c < chunks; c = next_chunk++) {
      FillNormalRange(stream, mean, stddev, c * kFillChunk, std::min(out.size(), (c + 1) * kFillChunk), out);
    }
  };
  const size_t cores = std::max(1u, std::thread::hardware_concurrency());
  const size_t threads = std::min(chunks, max_threads > 0 ? static_cast<size_t>(max_threads) : cores);
  std::vector<std::thread> helpers;
  for (size_t i = 1; i < threads; ++i) {
    try {
      helpers.emplace_back(work);
    } catch (const std::system_error&) {  // out of threads: the ones started and this one do it all
      break;
    }
  }
  work();
  for (std::thread& t : helpers) t.join();
}

}  // namespace builtin_models_internal

}  // namespace tandem::worker
