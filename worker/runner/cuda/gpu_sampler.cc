#include "worker/runner/cuda/gpu_sampler.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "worker/sampling/philox.h"

namespace tandem::worker {
void GpuSampler::NewList(int vocab) {
  if (stamp_.size() != static_cast<size_t>(vocab)) {
    stamp_.assign(static_cast<size_t>(vocab), 0);
    counts_.assign(static_cast<size_t>(vocab), 0);
    generation_ = 0;
  }
  if (++generation_ == 0) {  // wrapped: every stamp is stale again
    std::fill(stamp_.begin(), stamp_.end(), 0);
    generation_ = 1;
  }
}

bool GpuSampler::FirstTime(int token) {
  if (stamp_[static_cast<size_t>(token)] == generation_) return false;
  stamp_[static_cast<size_t>(token)] = generation_;
  return true;
}

absl::Status GpuSampler::Enqueue(float* logits, int vocab, std::span<const RowSampling> rows,
                                 std::span<const int> which, std::span<const int> eos_token_ids, cudaStream_t stream) {
  args_.clear();
  ids_.clear();
  slots_.clear();
  if (which.empty()) return absl::OkStatus();
  auto in_vocab = [vocab](int t) { return t >= 0 && t < vocab; };
  for (int i : which) {
    const RowSampling& r = rows[static_cast<size_t>(i)];
    const SamplingParams& p = *r.params;
    cuda_ops::SampleRowArgs a;
    a.logits_row = i;
    a.temperature = p.temperature;
    a.top_k = p.top_k;
    a.top_p = p.top_p;
    a.min_p = p.min_p;
    a.repetition_penalty = p.repetition_penalty;
    a.presence_penalty = p.presence_penalty;
    a.frequency_penalty = p.frequency_penalty;
    a.logprobs = p.logprobs;
    a.uniform = UniformDouble(r.seed, r.prompt.size() + r.output.size());
    if (p.repetition_penalty != 1.0f) {
      NewList(vocab);
      a.rep_begin = static_cast<int>(ids_.size());
      for (std::span<const int> part : {r.prompt, r.output}) {
        for (int t : part) {
          if (in_vocab(t) && FirstTime(t)) ids_.push_back(t);
        }
      }
      a.rep_count = static_cast<int>(ids_.size()) - a.rep_begin;
    }
    if (p.frequency_penalty != 0.0f || p.presence_penalty != 0.0f) {
      NewList(vocab);
      std::vector<int32_t> order;
      for (int t : r.output) {
        if (!in_vocab(t)) continue;
        if (FirstTime(t)) {
          counts_[static_cast<size_t>(t)] = 0;
          order.push_back(t);
        }
        ++counts_[static_cast<size_t>(t)];
      }
      a.freq_begin = static_cast<int>(ids_.size());
      a.freq_count = static_cast<int>(order.size());
      for (int t : order) {
        ids_.push_back(t);
        ids_.push_back(counts_[static_cast<size_t>(t)]);
      }
    }
    if (static_cast<int64_t>(r.output.size()) < p.min_tokens) {
      a.mask_begin = static_cast<int>(ids_.size());
      for (int t : p.stop_token_ids) {
        if (in_vocab(t)) ids_.push_back(t);
      }
      if (!p.ignore_eos) {
        for (int t : eos_token_ids) {
          if (in_vocab(t)) ids_.push_back(t);
        }
      }
      a.mask_count = static_cast<int>(ids_.size()) - a.mask_begin;
    }
    args_.push_back(a);
  }
  const size_t n = args_.size();
  args_bytes_ = cuda_util::Align16(n * sizeof(cuda_ops::SampleRowArgs));
  RETURN_IF_ERROR(ReserveRows(n, ids_.size(), stream));
  const size_t args_bytes = args_bytes_;
  const size_t out_bytes = n * sizeof(cuda_ops::SampleRowResult);
  // Only now, with every buffer in hand, are the rows this sampler's to finish.
  for (size_t j = 0; j < n; ++j) slots_.push_back(static_cast<int>(j));
  auto* up = static_cast<unsigned char*>(up_.get());
  std::memcpy(up, args_.data(), n * sizeof(cuda_ops::SampleRowArgs));
  if (!ids_.empty()) std::memcpy(up + args_bytes, ids_.data(), ids_.size() * sizeof(int32_t));
  auto* d_up = static_cast<unsigned char*>(d_up_.get());
  RETURN_IF_ERROR(cuda_util::Cuda(
      cudaMemcpyAsync(d_up, up, args_bytes + ids_.size() * sizeof(int32_t), cudaMemcpyHostToDevice, stream),
      "upload sampling arguments"));
  RETURN_IF_ERROR(cuda_util::Launch(
      cuda_ops::LaunchSample(logits, vocab, reinterpret_cast<const cuda_ops::SampleRowArgs*>(d_up), int(n),
                             reinterpret_cast<const int32_t*>(d_up + args_bytes), static_cast<float*>(d_saved_.get()),
                             static_cast<cuda_ops::SampleRowResult*>(d_out_.get()), nullptr, stream),
      "sample"));
  return cuda_util::Cuda(cudaMemcpyAsync(down_.get(), d_out_.get(), out_bytes, cudaMemcpyDeviceToHost, stream),
                         "download sampling results");
}

bool GpuSampler::Finish(std::span<const RowSampling> rows, std::vector<SampledToken>* sampled) {
  const auto* results = static_cast<const cuda_ops::SampleRowResult*>(down_.get());
  std::vector<int> rest;
  for (size_t j = 0; j < slots_.size(); ++j) {
    const int slot = slots_[j];
    const int i = args_[static_cast<size_t>(slot)].logits_row;
    const cuda_ops::SampleRowResult& res = results[j];
    if (res.fallback != 0) {
      rest.push_back(slot);
      continue;
    }
    SampledToken& out = (*sampled)[static_cast<size_t>(i)];
    out.token_id = res.token;
    out.logprob = 0.0f;
    out.top_logprobs.clear();
    if (rows[static_cast<size_t>(i)].params->logprobs >= 0) {
      out.logprob = res.logprob;
      for (int k = 0; k < res.num_top; ++k) out.top_logprobs.push_back({res.top_ids[k], res.top_logprobs[k]});
    }
  }
  slots_ = std::move(rest);
  return !slots_.empty();
}

absl::Status GpuSampler::ReserveRows(size_t rows, size_t ids, cudaStream_t stream) {
  const size_t args_bytes = cuda_util::Align16(rows * sizeof(cuda_ops::SampleRowArgs));
  const size_t ids_bytes = cuda_util::Align16(std::max<size_t>(ids, 1) * sizeof(int32_t));
  const size_t out_bytes = rows * sizeof(cuda_ops::SampleRowResult);
  RETURN_IF_ERROR(cuda_util::Reserve(&up_, int64_t(args_bytes + ids_bytes), "sampling arguments (pinned)"));
  RETURN_IF_ERROR(cuda_util::Reserve(&down_, int64_t(out_bytes), "sampling results (pinned)"));
  RETURN_IF_ERROR(cuda_util::Reserve(&d_up_, int64_t(args_bytes + ids_bytes), "sampling arguments", stream));
  RETURN_IF_ERROR(cuda_util::Reserve(&d_saved_, int64_t(ids_bytes), "sampling saved logits", stream));
  return cuda_util::Reserve(&d_out_, int64_t(out_bytes), "sampling results", stream);
}

absl::Status GpuSampler::Reserve(int rows, int ids, int vocab, cudaStream_t stream) {
  RETURN_IF_ERROR(ReserveRows(static_cast<size_t>(rows), static_cast<size_t>(ids), stream));
  return cuda_util::Reserve(&d_full_,
                            cuda_ops::SampleFullScratchBytes(vocab, std::min(rows, cuda_ops::kSampleFullRows)),
                            "sampling full-order scratch", stream);
}

std::vector<int> GpuSampler::PendingRows() const {
  std::vector<int> rows;
  for (int slot : slots_) rows.push_back(args_[static_cast<size_t>(slot)].logits_row);
  return rows;
}

absl::Status GpuSampler::EnqueueRest(float* logits, int vocab, cudaStream_t stream) {
  // The arguments of the rows left, over the first ones of the last upload
  // (the token lists stay where they are).
  rest_.clear();
  for (int slot : slots_) rest_.push_back(args_[static_cast<size_t>(slot)]);
  const int n = static_cast<int>(rest_.size());
  std::memcpy(up_.get(), rest_.data(), rest_.size() * sizeof(cuda_ops::SampleRowArgs));
  auto* d_up = static_cast<unsigned char*>(d_up_.get());
  RETURN_IF_ERROR(cuda_util::Cuda(
      cudaMemcpyAsync(d_up, up_.get(), rest_.size() * sizeof(cuda_ops::SampleRowArgs), cudaMemcpyHostToDevice, stream),
      "upload sampling arguments"));
  const int per_launch = std::min(n, cuda_ops::kSampleFullRows);
  RETURN_IF_ERROR(cuda_util::Reserve(&d_full_, cuda_ops::SampleFullScratchBytes(vocab, per_launch),
                                     "sampling full-order scratch", stream));
  const auto* d_args = reinterpret_cast<const cuda_ops::SampleRowArgs*>(d_up);
  auto* d_out = static_cast<cuda_ops::SampleRowResult*>(d_out_.get());
  // Launches in turn on one stream: each reuses the scratch after the last.
  for (int first = 0; first < n; first += per_launch) {
    RETURN_IF_ERROR(
        cuda_util::Launch(cuda_ops::LaunchSample(logits, vocab, d_args + first, std::min(per_launch, n - first),
                                                 reinterpret_cast<const int32_t*>(d_up + args_bytes_),
                                                 static_cast<float*>(d_saved_.get()), d_out + first,
                                                 static_cast<unsigned long long*>(d_full_.get()), stream),
                          "sample (full order)"));
  }
  return cuda_util::Cuda(
      cudaMemcpyAsync(down_.get(), d_out, n * sizeof(cuda_ops::SampleRowResult), cudaMemcpyDeviceToHost, stream),
      "download sampling results");
}

}  // namespace tandem::worker
