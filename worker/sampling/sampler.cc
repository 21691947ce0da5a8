#include "worker/sampling/sampler.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <iterator>
#include <limits>
#include <optional>

#include "absl/container/flat_hash_map.h"
#include "common/logging.h"
#include "worker/sampling/philox.h"
#include "worker/sampling/portable_exp.h"
#include "worker/sampling/sampling_math.h"

namespace tandem::worker {
namespace {

constexpr float kMaxFloat = std::numeric_limits<float>::max();
constexpr float kMinusInfinity = -std::numeric_limits<float>::infinity();

bool InVocab(int token, std::span<const float> logits) {
  return token >= 0 && static_cast<size_t>(token) < logits.size();
}

// NaN would break every comparison below and +inf every subtraction.
// Written without branches so that it vectorizes.
void ReplaceNonFinite(std::span<float> logits) {
  for (float& logit : logits) {
    const float clamped = std::min(logit, kMaxFloat);  // NaN stays NaN
    logit = std::isnan(logit) ? kMinusInfinity : clamped;
  }
}

// Reductions over a vocabulary keep kLanes interleaved partial results
// (element i goes to lane i % kLanes) and combine them in lane order at the
// end. That breaks the dependency of each add or max on the previous one
// (about 4 cycles each) and lets the loop vectorize, while a sum still adds
// in one fixed order, so its bits do not depend on the machine.
constexpr size_t kLanes = 8;

// REQUIRES: no NaN.
float MaxLogit(std::span<const float> logits) {
  std::array<float, kLanes> lanes;
  lanes.fill(kMinusInfinity);
  size_t i = 0;
  for (; i + kLanes <= logits.size(); i += kLanes) {
    for (size_t lane = 0; lane < kLanes; ++lane) {
      lanes[lane] = std::max(lanes[lane], logits[i + lane]);
    }
  }
  float max_logit = kMinusInfinity;
  for (float lane : lanes) max_logit = std::max(max_logit, lane);
  for (; i < logits.size(); ++i) max_logit = std::max(max_logit, logits[i]);
  return max_logit;
}

double LaneSum(std::span<const double> values) {
  std::array<double, kLanes> lanes{};
  size_t i = 0;
  for (; i + kLanes <= values.size(); i += kLanes) {
    for (size_t lane = 0; lane < kLanes; ++lane) lanes[lane] += values[i + lane];
  }
  double sum = 0.0;
  for (double lane : lanes) sum += lane;
  for (; i < values.size(); ++i) sum += values[i];
  return sum;
}

// The sum over the vocabulary of e^((logit - max_logit) / temperature): the
// softmax's denominator, in LaneSum order.
double SoftmaxTotal(std::span<const float> logits, float max_logit, double temperature) {
  std::vector<double> numerators(logits.size());
  for (size_t i = 0; i < logits.size(); ++i) {
    numerators[i] = (static_cast<double>(logits[i]) - max_logit) / temperature;
  }
  PortableExp(numerators, numerators);
  return LaneSum(numerators);
}

// The first index of the largest logit. REQUIRES: no NaN.
int Argmax(std::span<const float> logits) {
  const float max_logit = MaxLogit(logits);
  return static_cast<int>(std::distance(logits.begin(), std::find(logits.begin(), logits.end(), max_logit)));
}

// The model's raw distribution, recorded before the logits are processed.
class RawLogprobs {
 public:
  RawLogprobs(std::span<const float> logits, int num_top)
      : logits_(logits.begin(), logits.end()), top_ids_(MostLikely(logits, num_top)) {
    const float max_logit = MaxLogit(logits);
    // With every logit -inf no token is possible; every logprob is -inf.
    log_normalizer_ = max_logit == kMinusInfinity ? std::numeric_limits<double>::infinity()
                                                  : max_logit + std::log(SoftmaxTotal(logits, max_logit, 1.0));
  }

  float Logprob(int token) const { return static_cast<float>(static_cast<double>(logits_[token]) - log_normalizer_); }

  std::vector<TokenLogprob> Top() const {
    std::vector<TokenLogprob> top;
    top.reserve(top_ids_.size());
    for (int token : top_ids_) top.push_back({token, Logprob(token)});
    return top;
  }

 private:
  // The `n` largest logits' ids, largest first, ties by lower id. One pass
  // with a small sorted list (n <= kMaxLogprobs): ids arrive in increasing
  // order and only a strictly larger logit moves ahead of an equal one.
  static std::vector<int> MostLikely(std::span<const float> logits, int n) {
    std::vector<int> top;
    if (n <= 0) return top;
    top.reserve(static_cast<size_t>(n) + 1);
    for (size_t id = 0; id < logits.size(); ++id) {
      const float logit = logits[id];
      if (top.size() == static_cast<size_t>(n) && !(logit > logits[top.back()])) continue;
      auto position = std::find_if(top.begin(), top.end(), [&](int other) { return logits[other] < logit; });
      top.insert(position, static_cast<int>(id));
      if (top.size() > static_cast<size_t>(n)) top.pop_back();
    }
    return top;
  }

  std::vector<float> logits_;
  std::vector<int> top_ids_;
  double log_normalizer_ = 0.0;
};

struct Candidate {
  float logit;  // processed
  int token_id;
};

// The sampling order: larger logit (so more probable) first, ties by lower
// id. A strict total order, so a sorted prefix is the same however it was
// reached.
constexpr auto kComesFirst = [](const Candidate& a, const Candidate& b) {
  return a.logit > b.logit || (a.logit == b.logit && a.token_id < b.token_id);
};

// The vocabulary in sampling order, sorted only as far as it is read, with
// each read candidate's softmax numerator e^((logit - max) / temperature).
class SamplingOrder {
 public:
  SamplingOrder(std::span<const float> logits, float max_logit, double temperature)
      : logits_(logits), size_(logits.size()), max_logit_(max_logit), temperature_(temperature) {}

  size_t size() const { return size_; }

  // The token and weight of the i-th candidate. REQUIRES: i < size().
  int TokenAt(size_t i) {
    SortThrough(i);
    return candidates_[i].token_id;
  }
  double WeightAt(size_t i) {
    SortThrough(i);
    return weights_[i];
  }

  // Drops all but the first n. REQUIRES: n <= size().
  bool KeepFirst(int64_t n) {
    SortPrefix(static_cast<size_t>(n));
    candidates_.resize(static_cast<size_t>(n));
    size_ = static_cast<size_t>(n);
    all_listed_ = true;
    return true;
  }
  // PickInOrder's interface: every candidate can be read (sorted on demand).
  bool Has(int64_t /*i*/) const { return true; }
  double WeightAt(int64_t i) { return WeightAt(static_cast<size_t>(i)); }

 private:
  // The first read sorts 64 candidates: a typical top_k (20-50) or the
  // top_p nucleus of a confident model fits. Each further read sorts 4x as
  // many. Up to 1024 are chosen by one pass over the logits with a heap of
  // that many (after the first few thousand tokens nearly every token is
  // turned away by one comparison); beyond, every token is listed and
  // nth_element picks the next ones, so a walk to the end of a 128k
  // vocabulary costs a few O(V) passes plus one sort, while a shallow walk
  // stays O(V) with no copy of the vocabulary.
  static constexpr size_t kFirstPrefix = 64;
  static constexpr size_t kGrowth = 4;
  static constexpr size_t kMaxHeapSelection = 1024;

  void SortThrough(size_t i) {
    if (i >= sorted_) SortPrefix(std::max({i + 1, kGrowth * sorted_, kFirstPrefix}));
  }

  // Sorts the first n (capped at size()) candidates and weighs them.
  void SortPrefix(size_t n) {
    n = std::min(n, size_);
    if (n <= sorted_) return;
    if (!all_listed_ && n <= kMaxHeapSelection) {
      SelectByHeap(n);
    } else {
      size_t first = sorted_;
      if (!all_listed_) {
        candidates_.clear();
        candidates_.reserve(logits_.size());
        for (size_t id = 0; id < logits_.size(); ++id) {
          candidates_.push_back({logits_[id], static_cast<int>(id)});
        }
        all_listed_ = true;
        first = 0;
      }
      const auto begin = candidates_.begin() + static_cast<std::ptrdiff_t>(first);
      const auto middle = candidates_.begin() + static_cast<std::ptrdiff_t>(n);
      if (middle != candidates_.end()) {
        std::nth_element(begin, middle, candidates_.end(), kComesFirst);
      }
      std::sort(begin, middle, kComesFirst);
    }
    // The order is total, so the first sorted_ candidates did not move.
    for (size_t i = sorted_; i < n; ++i) {
      weights_.push_back(PortableExp((static_cast<double>(candidates_[i].logit) - max_logit_) / temperature_));
    }
    sorted_ = n;
  }

  // candidates_ = the first n of the order, sorted: one pass over the
  // logits with a heap of the best n so far, whose top is the one that
  // comes last.
  void SelectByHeap(size_t n) {
    candidates_.clear();
    candidates_.reserve(n);
    for (size_t id = 0; id < logits_.size(); ++id) {
      const Candidate candidate{logits_[id], static_cast<int>(id)};
      if (candidates_.size() < n) {
        candidates_.push_back(candidate);
        std::push_heap(candidates_.begin(), candidates_.end(), kComesFirst);
      } else if (kComesFirst(candidate, candidates_.front())) {
        std::pop_heap(candidates_.begin(), candidates_.end(), kComesFirst);
        candidates_.back() = candidate;
        std::push_heap(candidates_.begin(), candidates_.end(), kComesFirst);
      }
    }
    std::sort_heap(candidates_.begin(), candidates_.end(), kComesFirst);
  }

  std::span<const float> logits_;
  size_t size_;  // candidates in the order: the vocabulary, or what KeepFirst kept
  float max_logit_;
  double temperature_;
  // candidates_[0, sorted_) are the first in order, with weights_; the rest
  // of candidates_ holds every other candidate once all_listed_.
  std::vector<Candidate> candidates_;
  std::vector<double> weights_;
  size_t sorted_ = 0;
  bool all_listed_ = false;
};

// Step 4 of SampleToken for temperature > 0, on processed logits.
int SampleFromProcessed(std::span<const float> logits, const SamplingParams& params, double uniform) {
  const float max_logit = MaxLogit(logits);
  if (max_logit == kMinusInfinity) return 0;  // every token masked: as Argmax
  SamplingOrder order(logits, max_logit, params.temperature);
  const int64_t picked =
      sampling_math::PickInOrder(order, static_cast<int64_t>(order.size()), params.top_k, params.top_p, params.min_p,
                                 uniform, [&] { return SoftmaxTotal(logits, max_logit, params.temperature); });
  return order.TokenAt(static_cast<size_t>(picked));  // never -1: the order reads every candidate
}

}  // namespace

void ProcessLogits(std::span<float> logits, const SamplingParams& params, std::span<const int> prompt,
                   std::span<const int> output, std::span<const int> eos_token_ids) {
  if (params.repetition_penalty != 1.0f) {
    const float penalty = params.repetition_penalty;
    std::vector<bool> penalized(logits.size());
    auto penalize = [&](int token) {
      if (!InVocab(token, logits) || penalized[token]) return;
      penalized[token] = true;
      float& logit = logits[token];
      // A penalty below 1 could push a large logit past the float range.
      logit = logit > 0.0f ? std::min(logit / penalty, kMaxFloat) : logit * penalty;
    };
    for (int token : prompt) penalize(token);
    for (int token : output) penalize(token);
  }

  if (params.frequency_penalty != 0.0f || params.presence_penalty != 0.0f) {
    absl::flat_hash_map<int, int> counts;
    counts.reserve(output.size());
    for (int token : output) {
      if (InVocab(token, logits)) ++counts[token];
    }
    for (const auto& [token, count] : counts) {
      float& logit = logits[token];
      logit -= params.frequency_penalty * static_cast<float>(count);
      logit -= params.presence_penalty;
    }
  }

  if (std::ssize(output) < params.min_tokens) {
    for (int token : params.stop_token_ids) {
      if (InVocab(token, logits)) logits[token] = kMinusInfinity;
    }
    if (!params.ignore_eos) {
      for (int token : eos_token_ids) {
        if (InVocab(token, logits)) logits[token] = kMinusInfinity;
      }
    }
  }
}

SampledToken SampleToken(std::span<float> logits, const SamplingParams& params, std::span<const int> prompt,
                         std::span<const int> output, std::span<const int> eos_token_ids, uint64_t seed) {
  CHECK(!logits.empty()) << "SampleToken needs at least one logit";
  ReplaceNonFinite(logits);
  std::optional<RawLogprobs> raw;
  if (params.logprobs >= 0) raw.emplace(logits, params.logprobs);

  ProcessLogits(logits, params, prompt, output, eos_token_ids);

  SampledToken sampled;
  if (params.temperature == 0.0f) {
    sampled.token_id = Argmax(logits);
  } else {
    const uint64_t position = prompt.size() + output.size();
    sampled.token_id = SampleFromProcessed(logits, params, UniformDouble(seed, position));
  }
  if (raw.has_value()) {
    sampled.logprob = raw->Logprob(sampled.token_id);
    sampled.top_logprobs = raw->Top();
  }
  return sampled;
}

bool IsStopToken(int token, const SamplingParams& params, std::span<const int> eos_token_ids) {
  auto contains = [token](std::span<const int> ids) { return std::find(ids.begin(), ids.end(), token) != ids.end(); };
  return contains(params.stop_token_ids) || (!params.ignore_eos && contains(eos_token_ids));
}

}  // namespace tandem::worker
