// `tandem worker --engine sim`: the simulated engine keeps the worker's real
// API, scheduler, KV pool, prefix cache and transfers, replaces compute by
// its timing model, and says it is a simulator.
#include <chrono>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "common/process_info.h"
#include "tests/testing/worker_client.h"
#include "tests/testing/worker_process.h"
#include "tests/testing/worker_test.h"

namespace tandem::testing {
namespace {

using std::chrono::duration;
using std::chrono::milliseconds;

class SimEngineTest : public WorkerTest {};

TEST_F(SimEngineTest, ServesTheWorkerApiOnItsTimingModel) {
  // 20 ms per step, 100 us per prompt token.
  WorkerProcess* w = StartWorker({"--engine", "sim", "--sim-step-ms", "20", "--sim-prefill-us-per-token", "100",
                                  "--sim-decode-us-per-seq", "0", "--sim-context-ns-per-token", "0", "--max-model-len",
                                  "12000", "--kv-cache-memory", "64MiB"});
  ASSERT_NE(w, nullptr);
  const v1::ModelInfo info = GetModelInfo(w->stub());
  EXPECT_EQ(info.engine(), "sim");
  // Nothing is computed, so the context may exceed the model's positions.
  EXPECT_EQ(info.max_context_length(), 12000);

  // A request runs to max_tokens (never EOS), one token per step, and its
  // tokens follow from its seed.
  const std::vector<int32_t> prompt = MakePrompt(1, 500);
  const v1::GenerateRequest req = SampledRequest(prompt, 10, 42);
  const Output a = Generate(w->stub(), req);
  ASSERT_TRUE(a.status.ok()) << a.status.error_message();
  ExpectWellFormed(a, "sim");
  EXPECT_EQ(a.tokens.size(), 10u);
  EXPECT_EQ(a.finish, v1::FINISH_REASON_LENGTH);
  for (int32_t t : a.tokens) {
    EXPECT_GE(t, 0);
    EXPECT_LT(t, info.vocab_size());
  }
  // The model's time is at least its sleeps: the prefill step (20 ms + 50 ms)
  // and nine decode steps (20 ms each).
  EXPECT_GE(duration<double>(a.ended - a.started).count(), 0.070 + 9 * 0.020);

  // Same seed, same tokens; the prompt's blocks are now cached.
  const Output b = Generate(w->stub(), req);
  ASSERT_TRUE(b.status.ok());
  EXPECT_EQ(b.tokens, a.tokens);
  EXPECT_GE(b.usage.cached_prompt_tokens(), 496);
  const Output c = Generate(w->stub(), SampledRequest(prompt, 10, 43));
  EXPECT_NE(c.tokens, a.tokens);

  // A prompt past the real model's 2048 positions.
  const Output longer = Generate(w->stub(), GreedyRequest(MakePrompt(2, 10000), 2));
  ASSERT_TRUE(longer.status.ok()) << longer.status.error_message();
  EXPECT_EQ(longer.tokens.size(), 2u);
  ExpectIdle(w->stub(), "sim worker");
}

TEST_F(SimEngineTest, DisaggregatesLikeTheRealEngine) {
  const std::vector<std::string> common = {"--engine",       "sim", "--sim-step-ms",      "1",
                                           "--kv-transport", "ucx", "--kv-transport-tls", "shm"};
  std::vector<std::string> p = common, d = common;
  p.insert(p.end(), {"--role", "prefill"});
  d.insert(d.end(), {"--role", "decode"});
  WorkerProcess* prefill = StartWorker(p);
  WorkerProcess* decode = StartWorker(d);
  ASSERT_TRUE(prefill && decode);
  const v1::GenerateRequest req = SampledRequest(MakePrompt(3, 300), 8, 7);
  const Split split = RunDisaggregated(prefill->stub(), decode->stub(), decode->address(), req);
  EXPECT_EQ(split.prefill.kv_transfer_error, "");
  const Output joined = Combine(split.prefill, split.decode);
  EXPECT_EQ(joined.tokens.size(), 8u);
  // The decode worker pulled the KV (no local prefill) and continues the
  // same token sequence an aggregated sim worker produces.
  const v1::LoadReport l = ExpectIdle(decode->stub(), "sim decode");
  EXPECT_EQ(l.kv_pulls(), 1);
  EXPECT_EQ(l.local_prefill_fallbacks(), 0);
  WorkerProcess* both = StartWorker({"--engine", "sim", "--sim-step-ms", "1"});
  ASSERT_NE(both, nullptr);
  EXPECT_EQ(Generate(both->stub(), req).tokens, joined.tokens);
}

// ModelInfo.kv_domain: the transport's (UCX over shm reaches this host),
// --kv-domain's over a transport that reaches any host (tcp), and both
// where the transport is bound to its host: two hosts named one rack are
// never paired over shared memory.
TEST_F(SimEngineTest, KvDomainNarrowsToTheTransportsHost) {
  const std::string boot = HostBootId();
  ASSERT_FALSE(boot.empty());
  const std::vector<std::string> sim = {"--engine", "sim", "--role", "prefill", "--kv-transport", "ucx"};
  auto domain_of = [&](std::vector<std::string> extra) {
    std::vector<std::string> args = sim;
    args.insert(args.end(), extra.begin(), extra.end());
    WorkerProcess* w = StartWorker(args);
    return w == nullptr ? std::string("(no worker)") : GetModelInfo(w->stub()).kv_domain();
  };
  EXPECT_EQ(domain_of({"--kv-transport-tls", "shm"}), "host:" + boot);
  EXPECT_EQ(domain_of({"--kv-transport-tls", "tcp"}), "");
  EXPECT_EQ(domain_of({"--kv-transport-tls", "tcp", "--kv-domain", "rack-a"}), "rack-a");
  EXPECT_EQ(domain_of({"--kv-transport-tls", "shm", "--kv-domain", "rack-a"}), "rack-a/host:" + boot);
}

TEST_F(SimEngineTest, RejectsBadFlags) {
  absl::StatusOr<std::string> bin = TandemBinary();
  ASSERT_TRUE(bin.ok()) << bin.status();
  std::string out;
  EXPECT_NE(RunCommand(*bin + " worker --port 0 --engine fast", &out), 0);
  EXPECT_NE(out.find("--engine must be real or sim"), std::string::npos) << out;
  EXPECT_NE(RunCommand(*bin + " worker --port 0 --engine sim --sim-step-ms -1", &out), 0);
  EXPECT_NE(out.find("sim step_ms must be in [0, 1e6)"), std::string::npos) << out;
  EXPECT_NE(RunCommand(*bin + " worker --port 0 --insecure --device tpu", &out), 0);
  EXPECT_NE(out.find("--device must be cpu, cuda or cuda:N, got 'tpu'"), std::string::npos) << out;
  EXPECT_NE(RunCommand(*bin + " worker --port 0 --insecure --engine sim --device cuda", &out), 0);
  EXPECT_NE(out.find("--device cuda: the simulator (--engine sim) computes nothing"), std::string::npos) << out;
  EXPECT_NE(RunCommand(*bin + " worker --port 0 --insecure --device cuda --role decode --kv-transport ucx", &out), 0);
  EXPECT_NE(out.find("--device cuda keeps the KV cache in GPU memory, which --kv-transport ucx cannot move"),
            std::string::npos)
      << out;
  EXPECT_NE(RunCommand(*bin + " worker --port 0 --insecure --role prefill --kv-transport cuda_ipc", &out), 0);
  EXPECT_NE(out.find("--kv-transport cuda_ipc moves GPU memory, and --device cpu keeps the KV cache in host memory"),
            std::string::npos)
      << out;
  EXPECT_NE(RunCommand(*bin + " worker --port 0 --insecure --kv-domain 'rack 1'", &out), 0);
  EXPECT_NE(out.find("--kv-domain must be at most 128 letters, digits and . _ : -, got 'rack 1'"), std::string::npos)
      << out;
  EXPECT_NE(RunCommand(*bin + " worker --port 0 --insecure --kv-transport gloo", &out), 0);
  EXPECT_NE(out.find("--kv-transport must be none or one of cuda_ipc, nccl, ucx, ucx_staged, got 'gloo'"),
            std::string::npos)
      << out;
  EXPECT_NE(RunCommand(*bin + " worker --port 0 --insecure --kv-transport nccl", &out), 0);
  EXPECT_NE(out.find("--kv-transport nccl sends and receives in pairs: it needs --kv-delivery push (got pull)"),
            std::string::npos)
      << out;
  EXPECT_NE(RunCommand(*bin + " worker --port 0 --insecure --kv-transport nccl --kv-delivery push", &out), 0);
  EXPECT_NE(out.find("--kv-transport nccl moves GPU memory, and --device cpu keeps the KV cache in host memory"),
            std::string::npos)
      << out;
  // The GPU runner's switches on a CPU (or simulated) worker: refused, not ignored.
  for (const std::string flag : {"--host-sampling", "--enforce-eager", "--batch-invariant"}) {
    EXPECT_NE(RunCommand(*bin + " worker --port 0 --insecure " + flag, &out), 0);
    EXPECT_NE(out.find(flag + " applies to --device cuda only (this worker runs on --device cpu)"), std::string::npos)
        << out;
  }
  EXPECT_NE(RunCommand(*bin + " worker --port 0 --insecure --engine sim --host-sampling", &out), 0);
  EXPECT_NE(out.find("--host-sampling applies to --device cuda only"), std::string::npos) << out;
  // --logits-dtype: bfloat16 logits are the GPU runner's; other values are refused by name, in the worker and
  // in `tandem logits`.
  const std::pair<std::string, std::string> logits_dtype_refusals[] = {
      {"worker --port 0 --insecure --logits-dtype bfloat16",
       "--logits-dtype bfloat16 applies to --device cuda only (--device cpu computes float32 logits)"},
      {"worker --port 0 --insecure --engine sim --logits-dtype bfloat16",
       "--logits-dtype bfloat16 applies to --device cuda only (the simulator computes no logits)"},
      {"worker --port 0 --insecure --logits-dtype float16",
       "--logits-dtype must be float32 or bfloat16, got 'float16'"},
      {"logits --model builtin:tiny --tokens 1,2 --logits-dtype bfloat16",
       "--logits-dtype bfloat16 applies to --device cuda only (--device cpu computes float32 logits)"},
  };
  for (const auto& [args, message] : logits_dtype_refusals) {
    EXPECT_NE(RunCommand(*bin + " " + args, &out), 0) << args;
    EXPECT_NE(out.find(message), std::string::npos) << args << ": " << out;
  }
  EXPECT_EQ(RunCommand(*bin + " logits --model builtin:tiny --tokens 1,2 --logits-dtype float32", &out), 0) << out;
  EXPECT_NE(out.find("\"vocab_size\""), std::string::npos) << out;
  EXPECT_NE(RunCommand(*bin + " worker --port 0 --insecure --gpu-memory-utilization 1.5", &out), 0);
  EXPECT_NE(out.find("--gpu-memory-utilization must be in (0, 1], got 1.5"), std::string::npos) << out;
  EXPECT_NE(RunCommand(*bin + " worker --port 0 --insecure --model builtin:tiny --gpu-memory-utilization 0.5", &out),
            0);
  EXPECT_NE(out.find("--gpu-memory-utilization sizes a GPU's KV cache; the cpu runner keeps it in host memory"),
            std::string::npos)
      << out;
  EXPECT_NE(RunCommand(*bin + " worker --port 0 --insecure --kv-delivery push", &out), 0);
  EXPECT_NE(out.find("--kv-delivery push needs a --kv-transport that writes into a peer's pool (got --kv-transport "
                     "none)"),
            std::string::npos)
      << out;
  // A send/receive transport takes part on the receiving side only in the push handshake.
  EXPECT_NE(RunCommand(*bin + " worker --port 0 --insecure --role decode --kv-transport ucx_staged", &out), 0);
  EXPECT_NE(out.find("--kv-transport ucx_staged sends and receives in pairs: it needs --kv-delivery push (got pull)"),
            std::string::npos)
      << out;
  EXPECT_NE(RunCommand(*bin + " worker --port 0 --insecure --kv-transport ucx --kv-staging-slots 4", &out), 0);
  EXPECT_NE(out.find("--kv-staging-slots and --kv-staging-slot-size apply to --kv-transport ucx_staged only"),
            std::string::npos)
      << out;
  EXPECT_NE(RunCommand(*bin + " worker --port 0 --insecure --kv-transport ucx_staged --kv-delivery push "
                              "--kv-staging-slots 1",
                       &out),
            0);
  EXPECT_NE(out.find("--kv-staging-slots must be in [2, 1024]"), std::string::npos) << out;
  EXPECT_NE(RunCommand(*bin + " worker --port 0 --insecure --kv-transport ucx_staged --kv-delivery push "
                              "--kv-staging-slot-size lots",
                       &out),
            0);
  EXPECT_NE(out.find("--kv-staging-slot-size: "), std::string::npos) << out;
  EXPECT_NE(RunCommand(*bin + " worker --port 0 --insecure --kv-delivery shove", &out), 0);
  EXPECT_NE(out.find("--kv-delivery"), std::string::npos) << out;
}

}  // namespace
}  // namespace tandem::testing
