#include "worker/engine/scheduler.h"

#include <algorithm>
#include <cmath>

#include "common/block_hash.h"
#include "common/logging.h"

namespace tandem::worker {
namespace {
int BlocksFor(int tokens, int block_size) { return (tokens + block_size - 1) / block_size; }
}  // namespace

Scheduler::Scheduler(const SchedulerConfig& config, BlockManager* blocks) : config_(config), blocks_(blocks) {}

void Scheduler::Add(std::unique_ptr<Sequence> seq) { waiting_.push_back(std::move(seq)); }

void Scheduler::ReleaseBlocks(Sequence& seq) {
  blocks_->ReleaseTable(seq.blocks);
  seq.blocks.clear();
  seq.num_computed = 0;
  seq.num_hashed = 0;
  seq.last_hash = config_.block_hash_seed;
}

void Scheduler::Preempt(size_t running_index) {
  std::unique_ptr<Sequence> seq = std::move(running_[running_index]);
  running_.erase(running_.begin() + running_index);
  ReleaseBlocks(*seq);
  ++seq->preemptions;
  ++stats_.preemptions;
  LOG(DEBUG) << "preempted sequence " << seq->id << " (" << seq->tokens.size() << " tokens)";
  // Older than everything still waiting: back to the head of the queue.
  waiting_.push_front(std::move(seq));
}

bool Scheduler::AllocateFor(Sequence& seq, std::span<const int32_t> hashable, int len) {
  const int bs = blocks_->block_size();
  std::vector<uint64_t> hashes = HashBlocks(config_.block_hash_seed, hashable, bs);
  std::vector<int32_t> table;
  const int hits = blocks_->AcquireCachedPrefix(hashes, hashable, &table);
  const int new_blocks = BlocksFor(len, bs) - hits;
  // The watermark keeps room for running sequences to decode into; with
  // nothing running it would only stall the queue, so it is waived.
  const int64_t reserve =
      running_.empty() ? 0 : static_cast<int64_t>(std::ceil(config_.watermark * blocks_->total_blocks()));
  if (blocks_->num_allocatable() - new_blocks < reserve || !blocks_->Allocate(new_blocks, &table)) {
    blocks_->ReleaseTable(table);
    return false;
  }
  seq.blocks = std::move(table);
  seq.num_computed = hits * bs;
  seq.num_hashed = hits;
  seq.last_hash = hits > 0 ? hashes[hits - 1] : config_.block_hash_seed;
  if (!seq.admitted_before) {
    seq.admitted_before = true;
    // (A resumed sequence's hits may reach into its earlier output.)
    seq.cached_prompt_tokens = std::min(hits * bs, seq.prompt_len);
    stats_.prefix_query_tokens += seq.prompt_len;
    stats_.prefix_hit_tokens += seq.cached_prompt_tokens;
  }
  return true;
}

bool Scheduler::AdmitHead(int* budget, std::vector<ScheduledWork>* out) {
  Sequence& seq = *waiting_.front();
  const int len = static_cast<int>(seq.tokens.size());
  // Leave at least one token to compute: its logits give the next sample.
  if (!AllocateFor(seq, std::span<const int32_t>(seq.tokens.data(), size_t(len - 1)), len)) {
    return false;
  }
  const int n = std::min(seq.pending(), *budget);
  *budget -= n;
  std::unique_ptr<Sequence> owned = std::move(waiting_.front());
  waiting_.pop_front();
  out->push_back({owned.get(), n});
  InsertRunning(std::move(owned));
  return true;
}

bool Scheduler::Reserve(Sequence& seq) {
  // As in admission, the last prompt token is never taken from the cache, so
  // a reservation that falls back to a local prefill has a token to compute.
  return AllocateFor(seq, seq.prompt().first(size_t(seq.prompt_len - 1)), seq.prompt_len);
}

void Scheduler::InsertRunning(std::unique_ptr<Sequence> seq) {
  // Keep running_ in arrival order so preemption always picks the newest.
  auto pos = std::upper_bound(running_.begin(), running_.end(), seq->id,
                              [](uint64_t id, const auto& s) { return id < s->id; });
  running_.insert(pos, std::move(seq));
}

void Scheduler::AddRunning(std::unique_ptr<Sequence> seq) { InsertRunning(std::move(seq)); }

std::unique_ptr<Sequence> Scheduler::Take(uint64_t id) {
  auto r =
      std::find_if(running_.begin(), running_.end(), [id](const std::unique_ptr<Sequence>& s) { return s->id == id; });
  if (r == running_.end()) return nullptr;
  std::unique_ptr<Sequence> seq = std::move(*r);
  running_.erase(r);
  return seq;
}

std::vector<ScheduledWork> Scheduler::Schedule(int reserved_slots) {
  std::vector<ScheduledWork> work;
  int budget = config_.max_batched_tokens;
  const int bs = blocks_->block_size();

  for (size_t i = 0; i < running_.size() && budget > 0;) {
    Sequence& seq = *running_[i];
    const int n = std::min(seq.pending(), budget);
    const int need = BlocksFor(seq.num_computed + n, bs) - static_cast<int>(seq.blocks.size());
    bool ok = need <= 0 || blocks_->Allocate(need, &seq.blocks);
    while (!ok) {
      // Out of blocks: preempt the newest running sequence. Work already
      // scheduled this step belongs to older sequences, so it is never a victim.
      const size_t victim = running_.size() - 1;
      const bool self = victim == i;
      Preempt(victim);
      if (self) break;
      ok = blocks_->Allocate(need, &seq.blocks);
    }
    if (!ok) break;  // sequence i preempted itself; everything after it is gone too
    work.push_back({&seq, n});
    budget -= n;
    ++i;
  }

  while (budget > 0 && !waiting_.empty() && static_cast<int>(running_.size()) + reserved_slots < config_.max_running) {
    if (!AdmitHead(&budget, &work)) break;
  }
  return work;
}

void Scheduler::Advance(const ScheduledWork& w) {
  w.seq->num_computed += w.num_tokens;
  CommitFullBlocks(*w.seq);
}

void Scheduler::CommitFullBlocks(Sequence& seq) {
  const int bs = blocks_->block_size();
  while ((seq.num_hashed + 1) * bs <= seq.num_computed) {
    std::span<const int32_t> block_tokens(seq.tokens.data() + size_t(seq.num_hashed) * bs, size_t(bs));
    const uint64_t h = HashBlock(seq.last_hash, block_tokens);
    blocks_->Commit(seq.blocks[seq.num_hashed], h, seq.last_hash, block_tokens);
    seq.last_hash = h;
    ++seq.num_hashed;
  }
}

std::unique_ptr<Sequence> Scheduler::Remove(uint64_t id) {
  auto match = [id](const std::unique_ptr<Sequence>& s) { return s->id == id; };
  auto r = std::find_if(running_.begin(), running_.end(), match);
  std::unique_ptr<Sequence> seq;
  if (r != running_.end()) {
    seq = std::move(*r);
    running_.erase(r);
  } else {
    auto w = std::find_if(waiting_.begin(), waiting_.end(), match);
    if (w == waiting_.end()) return nullptr;
    seq = std::move(*w);
    waiting_.erase(w);
  }
  ReleaseBlocks(*seq);
  return seq;
}

}  // namespace tandem::worker
