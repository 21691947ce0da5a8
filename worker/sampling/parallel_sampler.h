// ParallelSampler: SampleToken over many logits rows at once, on a small
// pool of threads of its own (a GPU runner's host-sampled rows: a batch of
// 64 rows of a 128k vocabulary is ~100 ms on one core). Each row's token is
// SampleToken's, whatever the thread count or the order the rows are taken
// in (SampleToken is a pure function of its row).
//
// Thread-safe for one caller at a time (a runner's step).
#ifndef TANDEM_WORKER_SAMPLING_PARALLEL_SAMPLER_H_
#define TANDEM_WORKER_SAMPLING_PARALLEL_SAMPLER_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include "worker/sampling/sampler.h"

namespace tandem::worker {

class ParallelSampler {
 public:
  // One row to sample: `logits` (overwritten, as SampleToken does) and the
  // arguments SampleToken takes besides; the result goes to *out.
  struct Row {
    std::span<float> logits;
    const SamplingParams* params = nullptr;
    std::span<const int> prompt;
    std::span<const int> output;
    uint64_t seed = 0;
    SampledToken* out = nullptr;
  };

  // `threads` workers besides the caller (0: the machine's cores less one,
  // at most 15).
  explicit ParallelSampler(int threads = 0);
  ~ParallelSampler();
  ParallelSampler(const ParallelSampler&) = delete;
  ParallelSampler& operator=(const ParallelSampler&) = delete;

  // Samples every row; returns once all are done. The caller samples too.
  void Sample(std::span<const Row> rows, std::span<const int> eos_token_ids);

  int threads() const { return static_cast<int>(workers_.size()); }

 private:
  // One Sample call's rows, taken one at a time by whoever is free.
  struct Batch {
    std::span<const Row> rows;
    std::span<const int> eos;
    uint64_t seq = 0;
    std::atomic<size_t> next{0};
    int busy = 0;  // guarded by mu_: workers that joined it and have not left
  };
  void Work();
  static void Drain(Batch& b);

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable wake_, idle_;
  bool stop_ = false;
  std::shared_ptr<Batch> current_;  // guarded by mu_: the batch workers may join
  uint64_t seq_ = 0;                // guarded by mu_
};

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_SAMPLING_PARALLEL_SAMPLER_H_
