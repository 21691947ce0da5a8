#include "worker/engine/engine.h"

#include <cblas.h>

#include <unistd.h>

#include <algorithm>
#include <limits>
#include <random>
#include <span>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "common/thread_util.h"

namespace tandem::worker {
namespace {

uint64_t RandomSeed() {
  static std::mutex mu;
  static std::mt19937_64 rng{std::random_device{}()};
  std::lock_guard<std::mutex> lock(mu);
  return rng();
}

}  // namespace

absl::Status EngineConfig::Validate() const {
  if (block_size < 1 || block_size > 1024) {
    return absl::InvalidArgumentError(absl::StrFormat("block_size must be in [1, 1024], got %d", block_size));
  }
  if (kv_cache_bytes <= 0) return absl::InvalidArgumentError("kv_cache_bytes must be positive");
  if (!(gpu_memory_utilization >= 0.0 && gpu_memory_utilization <= 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--gpu-memory-utilization must be in (0, 1], got %g", gpu_memory_utilization));
  }
  if (max_batched_tokens < 1) return absl::InvalidArgumentError("max_batched_tokens must be >= 1");
  if (max_running < 1) return absl::InvalidArgumentError("max_running must be >= 1");
  if (max_waiting < 1) return absl::InvalidArgumentError("max_waiting must be >= 1");
  if (!(watermark >= 0.0 && watermark < 1.0)) {
    return absl::InvalidArgumentError("watermark must be in [0, 1)");
  }
  if (max_model_len < 0) return absl::InvalidArgumentError("max_model_len must be >= 0");
  if (threads < 0) return absl::InvalidArgumentError("threads must be >= 0");
  RETURN_IF_ERROR(runner_options.sim.Validate());
  return ModelRunnerRegistry::Builtin().Check(runner);
}

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(const EngineConfig& config, LoadedModel model,
                                                       const KvStorage::Allocator& pool_allocator) {
  RETURN_IF_ERROR(config.Validate());
  ASSIGN_OR_RETURN(
      std::unique_ptr<ModelRunner> runner,
      ModelRunnerRegistry::Builtin().Create(config.runner, model.config, model.tensors, config.runner_options));
  kernels::KvLayout layout = runner->KvBlockLayout(config.block_size);
  int64_t kv_bytes = config.kv_cache_bytes;
  if (config.gpu_memory_utilization > 0) {
    ASSIGN_OR_RETURN(kv_bytes,
                     runner->KvBudget(config.gpu_memory_utilization, config.max_batched_tokens, config.max_running));
  }
  layout.num_blocks = KvStorage::BlocksForBudget(layout, kv_bytes);
  if (layout.num_blocks < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("kv cache budget of %d bytes holds no block (one block of %d tokens takes %d bytes)", kv_bytes,
                        config.block_size, KvStorage::BytesPerBlock(layout)));
  }
  RETURN_IF_ERROR(runner->CheckKvLayout(layout));
  KvStorage::Allocator allocator = runner->KvAllocator();
  const bool runner_pool = static_cast<bool>(allocator);
  if (!runner_pool) {
    allocator = pool_allocator;
  } else if (pool_allocator) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "the %s runner keeps its KV cache in device memory, which a KV transport of host memory (UCX) cannot send: "
        "use --kv-transport cuda_ipc or none",
        runner->name()));
  }
  // A host pool is mapped lazily (pages arrive as blocks are first written),
  // so an oversized budget would start fine and be OOM-killed under load.
  const int64_t phys = int64_t{sysconf(_SC_PHYS_PAGES)} * sysconf(_SC_PAGESIZE);
  if (!runner_pool && phys > 0 && kv_bytes > phys) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "kv cache budget of %d bytes exceeds this machine's %d bytes of memory", config.kv_cache_bytes, phys));
  }
  if (layout.num_blocks > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("kv cache budget gives %d blocks; block ids are 32-bit: use larger blocks", layout.num_blocks));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<KvStorage> storage, KvStorage::Create(layout, allocator));
  int max_len = model.config.max_position_embeddings;
  if (config.max_model_len > 0) {
    max_len = runner->simulated() ? config.max_model_len : std::min(max_len, config.max_model_len);
  }
  const int64_t cache_tokens = layout.num_blocks * config.block_size;
  const int max_len_before_cache = max_len;
  if (cache_tokens < max_len) {
    LOG(WARNING) << "the KV cache holds " << cache_tokens << " tokens (" << layout.num_blocks
                 << " blocks), less than the context of " << max_len << ": requests are limited to the cache";
    max_len = static_cast<int>(cache_tokens);
  }
  const int max_blocks_per_seq = (max_len + config.block_size - 1) / config.block_size;
  RETURN_IF_ERROR(runner->ReserveSteps(config.max_batched_tokens, config.max_running, max_blocks_per_seq));
  RETURN_IF_ERROR(
      runner->WarmUp(*storage, std::min(config.max_running, config.max_batched_tokens), max_blocks_per_seq));
  auto engine = std::unique_ptr<Engine>(new Engine(config, model, std::move(runner), std::move(storage), max_len));
  engine->cache_limited_ = cache_tokens < max_len_before_cache;
  return engine;
}

Engine::Engine(const EngineConfig& config, const LoadedModel& model, std::unique_ptr<ModelRunner> runner,
               std::unique_ptr<KvStorage> storage, int max_model_len)
    : config_(config),
      model_name_(model.name),
      tokenizer_sha256_(model.tokenizer_sha256),
      runner_(std::move(runner)),
      storage_(std::move(storage)),
      max_model_len_(max_model_len),
      total_blocks_(storage_->layout().num_blocks),
      events_(config.kv_event_capacity),
      blocks_(total_blocks_, config.block_size, config.enable_prefix_caching, &events_),
      scheduler_(SchedulerConfig{.max_batched_tokens = config.max_batched_tokens,
                                 .max_running = config.max_running,
                                 .watermark = config.watermark,
                                 .block_hash_seed = config.block_hash_seed},
                 &blocks_) {
  batch_.Clear();
  PublishLoad();
}

Engine::~Engine() { Stop(); }

kvtransfer::PoolLayout Engine::pool_layout() const {
  const kernels::KvLayout& l = storage_->layout();
  const bool device = storage_->location() == MemoryLocation::kDevice;
  return kvtransfer::PoolLayout{.model = model_name_,
                                .dtype = kernels::DTypeName(l.dtype),
                                .num_layers = l.num_layers,
                                .num_kv_heads = l.num_kv_heads,
                                .head_dim = l.head_dim,
                                .block_size = l.block_size,
                                .num_blocks = l.num_blocks,
                                .block_bytes = KvStorage::BytesPerBlock(l),
                                .memory_type = device ? kvtransfer::MemoryType::kCuda : kvtransfer::MemoryType::kHost,
                                .device_id = device ? config_.runner_options.device : -1};
}

void Engine::Start() {
  if (config_.threads > 0) openblas_set_num_threads(config_.threads);
  running_ = true;
  thread_ = std::thread([this] {
    SetThreadName("engine");
    Loop();
  });
}

void Engine::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) return;
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  running_ = false;
}

absl::StatusOr<std::unique_ptr<Sequence>> Engine::MakeSequence(GenerateSpec spec, std::shared_ptr<OutputSink> sink) {
  const ModelConfig& mc = runner_->config();
  const int len = static_cast<int>(spec.prompt.size());
  if (len == 0) return absl::InvalidArgumentError("prompt_token_ids is empty");
  for (int i = 0; i < len; ++i) {
    if (spec.prompt[i] < 0 || spec.prompt[i] >= mc.vocab_size) {
      return absl::InvalidArgumentError(absl::StrFormat("prompt_token_ids[%d] = %d is outside the vocabulary [0, %d)",
                                                        i, spec.prompt[i], mc.vocab_size));
    }
  }
  RETURN_IF_ERROR(ValidateSamplingParams(spec.params, mc.vocab_size));
  // A resumed generation: its last `resumed` prompt tokens are output it
  // produced elsewhere; limits count from the true prompt, as they did there.
  const int resumed = spec.resume_output_tokens;
  if (resumed < 0 || resumed >= len) {
    return absl::InvalidArgumentError(
        absl::StrFormat("resume_output_tokens = %d must be in [0, %d) (the prompt has %d tokens, at least one of "
                        "them prompt)",
                        resumed, len, len));
  }
  if (spec.params.max_tokens >= 0 && resumed >= spec.params.max_tokens) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "resume_output_tokens = %d leaves nothing to generate: max_tokens is %d", resumed, spec.params.max_tokens));
  }
  const int prompt_len = len - resumed;
  const std::string limit =
      cache_limited_ ? absl::StrFormat("the whole KV cache (%d blocks of %d tokens)", total_blocks_, config_.block_size)
                     : std::string("the context");
  if (len >= max_model_len_) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "the prompt has %d tokens but %s holds %d, leaving no room to generate", len, limit, max_model_len_));
  }
  int max_tokens = max_model_len_ - prompt_len;
  if (spec.params.max_tokens >= 0) {
    if (prompt_len + int64_t{spec.params.max_tokens} > max_model_len_) {
      return absl::InvalidArgumentError(
          absl::StrFormat("max_tokens = %d is too large: the prompt has %d tokens and %s holds %d",
                          spec.params.max_tokens, prompt_len, limit, max_model_len_));
    }
    max_tokens = spec.params.max_tokens;
  }
  auto seq = std::make_unique<Sequence>();
  seq->id = next_id_.fetch_add(1);
  seq->request_id = std::move(spec.request_id);
  seq->prompt_len = prompt_len;
  seq->resumed_output = resumed;
  seq->tokens = std::move(spec.prompt);
  seq->seed = spec.params.seed.has_value() ? *spec.params.seed : RandomSeed();
  seq->params = std::move(spec.params);
  seq->max_tokens = max_tokens;
  seq->sink = std::move(sink);
  seq->last_hash = config_.block_hash_seed;
  seq->on_prefilled = std::move(spec.on_prefilled);
  seq->hold_timeout = spec.hold_timeout;
  return seq;
}

absl::StatusOr<uint64_t> Engine::Submit(GenerateSpec spec, std::shared_ptr<OutputSink> sink) {
  if (!running_.load()) return absl::UnavailableError("the engine is not running");
  ASSIGN_OR_RETURN(std::unique_ptr<Sequence> seq, MakeSequence(std::move(spec), std::move(sink)));
  const uint64_t id = seq->id;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) return absl::UnavailableError("the engine is stopping");
    if (static_cast<int>(submitted_.size()) + waiting_.load() >= config_.max_waiting) {
      return absl::ResourceExhaustedError(
          absl::StrFormat("worker overloaded: %d requests are already waiting", config_.max_waiting));
    }
    // The published report counts the request from now on: a client that
    // saw its response never reads a report from before it (the engine
    // republishes only at the end of the step that answered it).
    std::lock_guard<std::mutex> load_lock(load_mu_);
    ++load_.waiting;
    load_.tokens_in_flight += static_cast<int64_t>(seq->tokens.size());
    submitted_.push_back(std::move(seq));
  }
  cv_.notify_one();
  return id;
}

void Engine::Reserve(GenerateSpec spec, std::shared_ptr<OutputSink> sink, Deadline deadline,
                     std::function<void(absl::StatusOr<Reservation>)> done) {
  absl::StatusOr<std::unique_ptr<Sequence>> seq = MakeSequence(std::move(spec), std::move(sink));
  if (!seq.ok()) {
    done(seq.status());
    return;
  }
  if (!EnqueueIfRunning([&] {
        std::lock_guard<std::mutex> load_lock(load_mu_);  // counted at once, as in Submit
        ++load_.reserved;
        reserves_.push_back({std::move(*seq), deadline, std::move(done)});
      })) {
    done(absl::UnavailableError("the engine is not running"));
  }
}

void Engine::Commit(uint64_t id, SampledToken first, std::function<void(absl::Status)> done) {
  if (!EnqueueIfRunning([&] { commits_.push_back({id, std::move(first), std::move(done)}); })) {
    done(absl::UnavailableError("the engine is not running"));
  }
}

void Engine::PinReservation(uint64_t id, Deadline until, std::function<void(absl::Status)> done) {
  if (!EnqueueIfRunning([&] { pins_.push_back({id, until, std::move(done)}); })) {
    done(absl::UnavailableError("the engine is not running"));
  }
}

void Engine::Fallback(uint64_t id, std::optional<SampledToken> first, std::string why) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    fallbacks_.push_back({id, std::move(first), std::move(why)});
  }
  cv_.notify_one();
}

// A reservation whose KV will not come: compute its prompt here, from the
// cached prefix on (its blocks are already reserved), or end it with an error.
void Engine::FallBackLocally(std::unique_ptr<Sequence> seq, std::optional<SampledToken> first, const std::string& why) {
  DropReservationBlocks(*seq);
  if (!config_.local_prefill_fallback) {
    Finish(std::move(seq),
           FinishInfo{.reason = FinishReason::kError, .error = absl::StrCat("disaggregated prefill failed: ", why)});
    return;
  }
  ++local_prefill_fallbacks_;
  LOG(WARNING) << "reservation " << seq->id << " (" << seq->request_id << "): " << why << "; prefilling locally";
  if (seq->sink) seq->sink->OnLocalPrefill(first.has_value());
  seq->forced_first = std::move(first);
  // Queued like a new request: admission finds its cached prefix again and
  // gives it fresh blocks for the rest.
  scheduler_.Add(std::move(seq));
}

void Engine::DropReservationBlocks(Sequence& seq) {
  // Blocks [0, num_hashed) came from the prefix cache and were never a
  // transfer's destination; the rest were.
  // Quarantined for transfer_quarantine_s after the later of now and the
  // end of a pin: a write may be ending at the pin's end, and its late
  // bytes land within the quarantine after it.
  const size_t shared = static_cast<size_t>(seq.num_hashed);
  const auto quarantine = std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::duration<double>(config_.transfer_quarantine_s));
  Quarantined q{.blocks = std::vector<int32_t>(seq.blocks.begin() + shared, seq.blocks.end()),
                .until = std::max(seq.pinned_until, std::chrono::steady_clock::now()) + quarantine};
  seq.blocks.resize(shared);
  scheduler_.ReleaseBlocks(seq);
  if (!q.blocks.empty()) quarantine_.push_back(std::move(q));
}

void Engine::ReleasePrefilled(uint64_t id) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    releases_.push_back(id);
  }
  cv_.notify_one();
}

void Engine::Cancel(uint64_t id) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    cancelled_.push_back(id);
  }
  cv_.notify_one();
}

void Engine::ClearPrefixCache(std::function<void(absl::StatusOr<int64_t>)> done) {
  if (!EnqueueIfRunning([&] { clears_.push_back(std::move(done)); })) {
    done(absl::UnavailableError("the engine is not running"));
  }
}

// `enqueue` runs under mu_ (so it may touch the command queues) only while
// the engine accepts commands; the engine thread is then woken. When it
// returns false nothing was queued and whatever `enqueue` would have moved
// is still the caller's.
bool Engine::EnqueueIfRunning(const std::function<void()>& enqueue) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_ || !running_.load()) return false;
    enqueue();
  }
  cv_.notify_one();
  return true;
}

LoadSnapshot Engine::GetLoad() const {
  std::lock_guard<std::mutex> lock(load_mu_);
  return load_;
}

void Engine::Finish(std::unique_ptr<Sequence> seq, FinishInfo info) {
  info.prompt_tokens = seq->prompt_len;
  info.completion_tokens = seq->output_len() - seq->resumed_output;
  info.cached_prompt_tokens = seq->cached_prompt_tokens;
  ++finished_;
  if (seq->sink) seq->sink->OnFinish(info);
}

void Engine::DrainCommands() {
  std::deque<std::unique_ptr<Sequence>> submitted;
  std::vector<uint64_t> cancelled;
  std::vector<std::function<void(absl::StatusOr<int64_t>)>> clears;
  std::vector<ReserveCommand> reserves;
  std::vector<CommitCommand> commits;
  std::vector<uint64_t> releases;
  std::vector<FallbackCommand> fallbacks;
  std::vector<PinCommand> pins;
  {
    std::lock_guard<std::mutex> lock(mu_);
    fallbacks.swap(fallbacks_);
    pins.swap(pins_);
    reserves.swap(reserves_);
    commits.swap(commits_);
    releases.swap(releases_);
    submitted.swap(submitted_);
    // Moved requests stay counted against max_waiting until PublishLoad
    // recounts the scheduler's queue.
    waiting_.fetch_add(static_cast<int>(submitted.size()));
    cancelled.swap(cancelled_);
    clears.swap(clears_);
  }
  for (auto& seq : submitted) scheduler_.Add(std::move(seq));
  // Pins before cancels: a pin and a cancel of one step keep the blocks out
  // of use until the pin ends.
  for (PinCommand& p : pins) {
    auto r = reserved_.find(p.id);
    if (r == reserved_.end()) {
      p.done(absl::NotFoundError(absl::StrFormat("reservation %d is not waiting (unknown, committed or ended)", p.id)));
      continue;
    }
    r->second.seq->pinned_until = std::max(r->second.seq->pinned_until, p.until);
    p.done(absl::OkStatus());
  }
  for (uint64_t id : cancelled) {
    std::unique_ptr<Sequence> seq = scheduler_.Remove(id);
    if (seq == nullptr) {
      auto r = reserved_.find(id);
      if (r == reserved_.end()) continue;
      seq = std::move(r->second.seq);
      reserved_.erase(r);
      DropReservationBlocks(*seq);
    }
    Finish(std::move(seq), FinishInfo{.reason = FinishReason::kAbort});
  }
  for (uint64_t id : releases) {
    auto p = prefilled_.find(id);
    if (p == prefilled_.end()) continue;
    scheduler_.ReleaseBlocks(*p->second.seq);
    prefilled_.erase(p);
  }
  for (FallbackCommand& f : fallbacks) {
    auto r = reserved_.find(f.id);
    if (r == reserved_.end()) continue;
    std::unique_ptr<Sequence> seq = std::move(r->second.seq);
    reserved_.erase(r);
    FallBackLocally(std::move(seq), std::move(f.first), f.why);
  }
  for (ReserveCommand& r : reserves) {
    // A reservation holds a place in the batch (it runs on commit): running
    // plus reserved stays within max_running, so a burst of hand-offs (n=128
    // choices) is refused here and placed elsewhere by the caller, never
    // committed past the cap.
    const int running = static_cast<int>(scheduler_.running().size());
    const int held = static_cast<int>(reserved_.size());
    if (running + held >= config_.max_running) {
      ++reservations_refused_;
      r.done(absl::ResourceExhaustedError(
          absl::StrFormat("the worker runs its maximum of %d sequences (--max-running): %d running and %d "
                          "reserved",
                          config_.max_running, running, held)));
      continue;
    }
    if (!scheduler_.Reserve(*r.seq)) {
      ++reservations_refused_;
      r.done(
          absl::ResourceExhaustedError(absl::StrFormat("no room in the KV cache for %d prompt tokens (%d blocks free)",
                                                       r.seq->prompt_len, blocks_.num_allocatable())));
      continue;
    }
    Reservation res{.id = r.seq->id, .cached_tokens = r.seq->num_computed, .blocks = r.seq->blocks};
    reserved_[res.id] = Parked{std::move(r.seq), r.deadline};
    r.done(std::move(res));
  }
  for (CommitCommand& c : commits) {
    auto r = reserved_.find(c.id);
    if (r == reserved_.end()) {
      c.done(absl::NotFoundError(absl::StrFormat("no reservation %d (expired or cancelled)", c.id)));
      continue;
    }
    std::unique_ptr<Sequence> seq = std::move(r->second.seq);
    reserved_.erase(r);
    // The prompt's KV arrived: register its blocks (KV events for what was
    // received), then continue from the prefill worker's first token.
    seq->num_computed = seq->prompt_len;
    scheduler_.CommitFullBlocks(*seq);
    seq->tokens.push_back(c.first.token_id);
    c.done(absl::OkStatus());
    if (std::optional<FinishInfo> end = FinishAfterLastToken(*seq)) {
      scheduler_.ReleaseBlocks(*seq);
      Finish(std::move(seq), *end);
    } else {
      scheduler_.AddRunning(std::move(seq));
    }
  }
  for (auto& done : clears) {
    const int64_t freed = blocks_.Clear();
    // The caller sees the cleared cache in the events and the load report.
    events_.Publish();
    PublishLoad();
    done(freed);
  }
}

// Whatever a command queue holds wakes the engine thread; every queue that
// DrainCommands empties must be listed here.
bool Engine::HasWorkLocked() const {
  return stop_ || !submitted_.empty() || !cancelled_.empty() || !clears_.empty() || !reserves_.empty() ||
         !commits_.empty() || !pins_.empty() || !releases_.empty() || !fallbacks_.empty() || !scheduler_.empty();
}

void Engine::Loop() {
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      auto ready = [&] { return HasWorkLocked(); };
      if (reserved_.empty() && prefilled_.empty() && quarantine_.empty()) {
        cv_.wait(lock, ready);
      } else {
        cv_.wait_until(lock, NextDeadline(), ready);
      }
      if (stop_) break;
    }
    DrainCommands();
    ExpireParked();
    if (!scheduler_.empty()) Step();
    events_.Publish();
    PublishLoad();
    MaybeLogStats();
  }
  // Shutdown: every request still here ends with kAbort, marked as the
  // worker's doing so that clients retry elsewhere.
  std::vector<std::function<void(absl::StatusOr<int64_t>)>> clears;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& seq : submitted_) scheduler_.Add(std::move(seq));
    submitted_.clear();
    clears.swap(clears_);
  }
  std::vector<uint64_t> ids;
  for (const auto& s : scheduler_.running()) ids.push_back(s->id);
  for (const auto& s : scheduler_.waiting()) ids.push_back(s->id);
  for (uint64_t id : ids) {
    Finish(scheduler_.Remove(id), FinishInfo{.reason = FinishReason::kAbort, .worker_stopping = true});
  }
  for (auto& [id, parked] : reserved_) {
    DropReservationBlocks(*parked.seq);
    Finish(std::move(parked.seq), FinishInfo{.reason = FinishReason::kAbort, .worker_stopping = true});
  }
  reserved_.clear();
  for (auto& [id, parked] : prefilled_) scheduler_.ReleaseBlocks(*parked.seq);
  prefilled_.clear();
  std::vector<ReserveCommand> reserves;
  std::vector<CommitCommand> commits;
  std::vector<PinCommand> pins;
  {
    std::lock_guard<std::mutex> lock(mu_);
    reserves.swap(reserves_);
    commits.swap(commits_);
    pins.swap(pins_);
  }
  for (auto& r : reserves) r.done(absl::UnavailableError("the engine stopped"));
  for (auto& c : commits) c.done(absl::UnavailableError("the engine stopped"));
  for (auto& p : pins) p.done(absl::UnavailableError("the engine stopped"));
  for (auto& done : clears) done(absl::UnavailableError("the engine stopped"));
  events_.Publish();
  PublishLoad();
}

void Engine::Step() {
  const auto step_started = std::chrono::steady_clock::now();
  std::vector<ScheduledWork> work = scheduler_.Schedule(static_cast<int>(reserved_.size()));
  if (work.empty()) return;

  const int bs = config_.block_size;
  int max_blocks = 0;
  for (const ScheduledWork& w : work) {
    max_blocks = std::max(max_blocks, static_cast<int>(w.seq->blocks.size()));
  }
  batch_.Clear();
  batch_.started = step_started;
  batch_.max_blocks_per_seq = max_blocks;
  batch_.block_tables.assign(work.size() * max_blocks, 0);
  rows_.clear();
  for (size_t s = 0; s < work.size(); ++s) {
    const Sequence& seq = *work[s].seq;
    const bool prefilling = seq.num_computed < seq.prompt_len;
    if (prefilling) {
      batch_.prefill_tokens += work[s].num_tokens;
    } else {
      ++batch_.decode_seqs;
    }
    batch_.prefilling.push_back(prefilling ? 1 : 0);
    for (int i = 0; i < work[s].num_tokens; ++i) {
      const int pos = seq.num_computed + i;
      batch_.tokens.push_back(seq.tokens[pos]);
      batch_.positions.push_back(pos);
      batch_.slot_mapping.push_back(int64_t{seq.blocks[pos / bs]} * bs + pos % bs);
    }
    batch_.query_start.push_back(batch_.num_tokens());
    batch_.context_lens.push_back(seq.num_computed + work[s].num_tokens);
    std::copy(seq.blocks.begin(), seq.blocks.end(), batch_.block_tables.begin() + s * max_blocks);
    if (seq.num_computed + work[s].num_tokens == static_cast<int>(seq.tokens.size())) {
      batch_.logits_rows.push_back(batch_.num_tokens() - 1);
      rows_.push_back(RowSampling{.params = &seq.params,
                                  .prompt = seq.prompt(),
                                  .output = seq.output(),
                                  .seed = seq.seed,
                                  .position = static_cast<int>(seq.tokens.size())});
    }
  }

  absl::Status st = runner_->Step(batch_, rows_, *storage_, &sampled_);
  if (!st.ok()) {
    LOG(ERROR) << "forward pass failed: " << st;
    std::vector<uint64_t> ids;
    for (const ScheduledWork& w : work) ids.push_back(w.seq->id);
    for (uint64_t id : ids) {
      Finish(scheduler_.Remove(id), FinishInfo{.reason = FinishReason::kError, .error = std::string(st.message())});
    }
    return;
  }

  for (const ScheduledWork& w : work) {
    if (w.seq->num_computed < w.seq->prompt_len) {
      prompt_tokens_computed_ += std::min(w.num_tokens, w.seq->prompt_len - w.seq->num_computed);
    }
  }
  tokens_generated_ += static_cast<int64_t>(batch_.logits_rows.size());
  std::vector<uint64_t> finished_ids;
  std::vector<FinishInfo> finish_infos;
  std::vector<uint64_t> handoffs;
  int row = 0;
  for (const ScheduledWork& w : work) {
    scheduler_.Advance(w);
    Sequence& seq = *w.seq;
    if (seq.num_computed != static_cast<int>(seq.tokens.size())) continue;  // mid-prompt chunk
    const size_t logits_row = size_t(row++);
    if (seq.forced_first.has_value() && seq.output_len() == 0) {
      // A local prefill after a failed transfer: the caller already has the
      // prefill worker's first token; continue from it.
      seq.tokens.push_back(seq.forced_first->token_id);
      seq.forced_first.reset();
    } else {
      SampledToken tok = std::move(sampled_[logits_row]);
      seq.tokens.push_back(tok.token_id);
      if (seq.sink) seq.sink->OnToken(tok);
      if (seq.on_prefilled) {
        handoffs.push_back(seq.id);
        // Completed: every runner's Step returns after its KV writes landed
        // (the CUDA runner synchronizes its stream). A runner that returns
        // earlier hands its own fence here (issue 21's cuda_ipc work).
        seq.on_prefilled(Prefilled{.id = seq.id,
                                   .first = tok,
                                   .blocks = seq.blocks,
                                   .prompt_len = seq.prompt_len,
                                   .written = kvtransfer::CompletedFence()});
        continue;
      }
    }
    if (std::optional<FinishInfo> end = FinishAfterLastToken(seq)) {
      finished_ids.push_back(seq.id);
      finish_infos.push_back(*end);
    }
  }
  for (size_t i = 0; i < finished_ids.size(); ++i) {
    Finish(scheduler_.Remove(finished_ids[i]), finish_infos[i]);
  }
  for (uint64_t id : handoffs) HandOff(id);
}

// A prefill-only sequence produced its first token: it leaves the batch with
// its blocks still referenced, until ReleasePrefilled or its hold deadline.
void Engine::HandOff(uint64_t id) {
  std::unique_ptr<Sequence> seq = scheduler_.Take(id);
  if (seq == nullptr) return;
  // The prefill's part ends here: STOP if the first token is a stop token,
  // LENGTH otherwise.
  FinishInfo info = FinishAfterLastToken(*seq).value_or(FinishInfo{.reason = FinishReason::kLength});
  // Only the prompt's blocks travel; the first token's KV is computed by the
  // decode worker.
  seq->num_computed = seq->prompt_len;
  info.prompt_tokens = seq->prompt_len;
  info.completion_tokens = seq->output_len() - seq->resumed_output;
  info.cached_prompt_tokens = seq->cached_prompt_tokens;
  ++finished_;
  if (seq->sink) seq->sink->OnFinish(info);
  const Deadline until = std::chrono::steady_clock::now() + seq->hold_timeout;
  prefilled_[id] = Parked{std::move(seq), until};
}

std::optional<FinishInfo> Engine::FinishAfterLastToken(const Sequence& seq) const {
  const int last = seq.tokens.back();
  if (IsStopToken(last, seq.params, runner_->config().eos_token_ids)) {
    return FinishInfo{.reason = FinishReason::kStop, .stop_token_id = last};
  }
  if (seq.output_len() >= seq.max_tokens || static_cast<int>(seq.tokens.size()) >= max_model_len_) {
    return FinishInfo{.reason = FinishReason::kLength};
  }
  return std::nullopt;
}

Deadline Engine::NextDeadline() const {
  Deadline next = Deadline::max();
  for (const auto& [id, p] : reserved_) next = std::min(next, p.deadline);
  for (const auto& [id, p] : prefilled_) next = std::min(next, p.deadline);
  for (const Quarantined& q : quarantine_) next = std::min(next, q.until);
  return next;
}

// Parked sequences past their deadline: a reservation whose prefill never
// came falls back to a local prefill (or ends with an error); blocks held for
// a transfer that never finished are freed. Both are counted and logged.
void Engine::ExpireParked() {
  const Deadline now = std::chrono::steady_clock::now();
  for (auto it = reserved_.begin(); it != reserved_.end();) {
    if (it->second.deadline > now) {
      ++it;
      continue;
    }
    std::unique_ptr<Sequence> seq = std::move(it->second.seq);
    it = reserved_.erase(it);
    ++expired_reservations_;
    FallBackLocally(std::move(seq), std::nullopt, "its KV did not arrive before the deadline");
  }
  for (auto it = quarantine_.begin(); it != quarantine_.end();) {
    if (it->until > now) {
      ++it;
      continue;
    }
    blocks_.ReleaseTable(it->blocks);
    it = quarantine_.erase(it);
  }
  for (auto it = prefilled_.begin(); it != prefilled_.end();) {
    if (it->second.deadline > now) {
      ++it;
      continue;
    }
    scheduler_.ReleaseBlocks(*it->second.seq);
    ++expired_handoffs_;
    LOG(WARNING) << "prefilled sequence " << it->first << " was never released; freed its blocks";
    it = prefilled_.erase(it);
  }
}

void Engine::PublishLoad() {
  LoadSnapshot s;
  for (const auto& seq : scheduler_.running()) {
    s.tokens_in_flight += static_cast<int64_t>(seq->tokens.size());
    s.prefill_tokens_pending += std::max(0, seq->pending() - 1);
  }
  for (const auto& seq : scheduler_.waiting()) {
    s.tokens_in_flight += static_cast<int64_t>(seq->tokens.size());
    s.prefill_tokens_pending += seq->pending();
  }
  s.running = static_cast<int>(scheduler_.running().size());
  s.waiting = static_cast<int>(scheduler_.waiting().size());
  waiting_.store(s.waiting);
  s.total_blocks = blocks_.total_blocks();
  s.free_blocks = blocks_.num_free();
  s.used_blocks = blocks_.num_used();
  s.cached_blocks = blocks_.num_cached();
  s.prefix_query_tokens = scheduler_.stats().prefix_query_tokens;
  s.prefix_hit_tokens = scheduler_.stats().prefix_hit_tokens;
  s.preemptions = scheduler_.stats().preemptions;
  s.finished = finished_;
  s.reserved = static_cast<int>(reserved_.size());
  for (const Quarantined& q : quarantine_) s.quarantined_blocks += static_cast<int64_t>(q.blocks.size());
  s.prefilled = static_cast<int>(prefilled_.size());
  s.expired_reservations = expired_reservations_;
  s.local_prefill_fallbacks = local_prefill_fallbacks_;
  s.reservations_refused = reservations_refused_;
  s.expired_handoffs = expired_handoffs_;
  // The engine thread alone changes the cache: this seq matches the blocks
  // counted above.
  s.kv_event_seq = events_.last_seq();
  // Submit and Reserve count their request into load_ under mu_: the queues
  // are read and the report replaced under both locks, so no request is
  // counted twice or dropped between the two.
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& seq : submitted_) s.tokens_in_flight += static_cast<int64_t>(seq->tokens.size());
  s.waiting += static_cast<int>(submitted_.size());
  s.reserved += static_cast<int>(reserves_.size());
  std::lock_guard<std::mutex> load_lock(load_mu_);
  load_ = s;
}

// One line like vLLM's: throughput since the last line, queue, KV usage.
void Engine::MaybeLogStats() {
  if (config_.log_stats_interval_s <= 0) return;
  const auto now = std::chrono::steady_clock::now();
  const double elapsed = std::chrono::duration<double>(now - last_stats_).count();
  if (elapsed < config_.log_stats_interval_s) return;
  if (prompt_tokens_computed_ > 0 || tokens_generated_ > 0 || !scheduler_.empty()) {
    const LoadSnapshot s = GetLoad();
    LOG(INFO) << absl::StrFormat(
        "engine: prompt %.1f tok/s, generation %.1f tok/s, %d running, %d waiting, "
        "KV %.1f%% used (%d cached blocks), prefix hit rate %.1f%%, %d preemptions",
        prompt_tokens_computed_ / elapsed, tokens_generated_ / elapsed, s.running, s.waiting,
        100.0 * s.used_blocks / std::max<int64_t>(1, s.total_blocks), s.cached_blocks, 100.0 * s.hit_rate(),
        s.preemptions);
  }
  prompt_tokens_computed_ = 0;
  tokens_generated_ = 0;
  last_stats_ = now;
}

}  // namespace tandem::worker
