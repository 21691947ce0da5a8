#include "worker/sampling/parallel_sampler.h"

#include <algorithm>

#include "common/thread_util.h"

namespace tandem::worker {

ParallelSampler::ParallelSampler(int threads) {
  if (threads <= 0) {
    const int cores = static_cast<int>(std::thread::hardware_concurrency());
    threads = std::clamp(cores - 1, 0, 15);
  }
  workers_.reserve(threads);
  for (int i = 0; i < threads; ++i) workers_.emplace_back([this] { Work(); });
}

ParallelSampler::~ParallelSampler() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void ParallelSampler::Drain(Batch& b) {
  for (size_t i = b.next.fetch_add(1); i < b.rows.size(); i = b.next.fetch_add(1)) {
    const Row& r = b.rows[i];
    *r.out = SampleToken(r.logits, *r.params, r.prompt, r.output, b.eos, r.seed);
  }
}

void ParallelSampler::Work() {
  SetThreadName("sampler");
  uint64_t last = 0;  // the last batch this worker joined
  for (;;) {
    std::shared_ptr<Batch> b;
    {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait(lock, [&] { return stop_ || (current_ != nullptr && current_->seq != last); });
      if (stop_) return;
      b = current_;
      last = b->seq;
      ++b->busy;
    }
    Drain(*b);
    {
      std::lock_guard<std::mutex> lock(mu_);
      --b->busy;
    }
    idle_.notify_all();
  }
}

void ParallelSampler::Sample(std::span<const Row> rows, std::span<const int> eos_token_ids) {
  if (rows.empty()) return;
  auto b = std::make_shared<Batch>();
  b->rows = rows;
  b->eos = eos_token_ids;
  const bool share = rows.size() > 1 && !workers_.empty();
  if (share) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      b->seq = ++seq_;
      current_ = b;
    }
    wake_.notify_all();
  }
  Drain(*b);
  if (!share) return;
  // Every row is taken: no worker joins any more, and those inside finish
  // their last row before the rows' memory goes back to the caller.
  std::unique_lock<std::mutex> lock(mu_);
  current_ = nullptr;
  idle_.wait(lock, [&] { return b->busy == 0; });
}

}  // namespace tandem::worker
