#include "orchestrator/bench/bench_command.h"

#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/file_util.h"
#include "common/status_macros.h"
#include "common/thread_util.h"
#include "orchestrator/bench/datasets.h"
#include "orchestrator/bench/load_generator.h"
#include "orchestrator/bench/report.h"
#include "orchestrator/server/model_assets.h"
#include "worker/cli/commands.h"

namespace tandem::bench {
namespace {

struct ServingBenchOptions {
  LoadOptions load;
  DatasetOptions dataset;
  std::string request_rate = "inf";
  std::string tokenizer = "builtin";
  std::vector<std::string> goodput;  // "ttft:500", "tpot:50", "e2e:2000"
  std::string json_path;
  std::string html_path;
  bool save_detailed = false;  // --json also lists every request
  std::string metrics_url;     // empty: --url
  std::string title;
  double max_failure_rate = 0;  // of the recorded requests; above it the command fails
};

// This process's command line as a shell would take it back (/proc/self/cmdline).
std::string CommandLine() {
  absl::StatusOr<std::string> raw = ReadFile("/proc/self/cmdline");
  if (!raw.ok()) return "";
  std::vector<std::string> args;
  for (absl::string_view a : absl::StrSplit(*raw, '\0', absl::SkipEmpty())) {
    const bool plain = !a.empty() && a.find_first_not_of(
                                         "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                         "0123456789-_=./:,@%+") == absl::string_view::npos;
    args.push_back(plain ? std::string(a) : absl::StrCat("'", absl::StrReplaceAll(a, {{"'", "'\\''"}}), "'"));
  }
  return absl::StrJoin(args, " ");
}

// The dataset's own parameters, as its flags name them.
std::string DatasetParameters(const DatasetOptions& d) {
  if (d.name == "random") {
    return absl::StrFormat("input-len %d, output-len %d, range-ratio %g", d.input_len, d.output_len, d.range_ratio);
  }
  if (d.name == "shared-prefix") {
    return absl::StrFormat("num-groups %d, prefix-len %d, suffix-len %d, output-len %d", d.num_groups, d.prefix_len,
                           d.suffix_len, d.output_len);
  }
  if (d.name == "multi-turn") {
    return absl::StrFormat("turns %d, system-len %d, user-len %d, common-prefix-len %d, output-len %d", d.turns,
                           d.system_len, d.user_len, d.common_prefix_len, d.output_len);
  }
  if (d.name == "sharegpt") {
    return absl::StrFormat("path %s, sharegpt-output-len %d", d.path, d.sharegpt_output_len);
  }
  if (d.name == "trace") {
    return absl::StrFormat("path %s, trace-block-tokens %d, trace-speedup %g", d.path, d.trace_block_tokens,
                           d.trace_speedup);
  }
  return "";
}

absl::StatusOr<Slo> ParseGoodput(const std::vector<std::string>& items) {
  Slo slo;
  for (const std::string& item : items) {
    std::vector<std::string> kv = absl::StrSplit(item, ':');
    double v = 0;
    if (kv.size() != 2 || !absl::SimpleAtod(kv[1], &v) || !(v > 0)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("--goodput takes METRIC:MS items (ttft, tpot, e2e), got '%s'", item));
    }
    if (kv[0] == "ttft") {
      slo.ttft_ms = v;
    } else if (kv[0] == "tpot") {
      slo.tpot_ms = v;
    } else if (kv[0] == "e2e") {
      slo.e2e_ms = v;
    } else {
      return absl::InvalidArgumentError(absl::StrFormat("--goodput: unknown metric '%s' (ttft, tpot or e2e)", kv[0]));
    }
  }
  return slo;
}

// The router's prompt and cached-prompt token counters, when it is tandem's.
std::optional<std::pair<double, double>> PrefixCounters(const std::string& url) {
  absl::StatusOr<Endpoint> ep = ParseUrl(url);
  if (!ep.ok()) return std::nullopt;
  const SimpleResponse r = HttpGetOnce(*ep, "/metrics");
  if (r.status != 200) return std::nullopt;
  const std::map<std::string, double> c = ParseCounters(r.body);
  auto prompt = c.find("tandem_router_prompt_tokens_total");
  auto cached = c.find("tandem_router_cached_prompt_tokens_total");
  if (prompt == c.end() || cached == c.end()) return std::nullopt;
  return std::make_pair(prompt->second, cached->second);
}

// A progress bar on a terminal, a line per tenth otherwise.
std::function<void(int, int)> Progress() {
  const bool tty = isatty(STDERR_FILENO) != 0;
  auto last_tenth = std::make_shared<int>(-1);
  return [tty, last_tenth](int done, int total) {
    if (tty) {
      const int width = 40;
      const int fill = total > 0 ? done * width / total : width;
      std::fprintf(stderr, "\r[%s%s] %d/%d", std::string(fill, '=').c_str(), std::string(width - fill, ' ').c_str(),
                   done, total);
      if (done == total) std::fprintf(stderr, "\n");
    } else {
      const int tenth = total > 0 ? done * 10 / total : 10;
      if (tenth != *last_tenth) {
        *last_tenth = tenth;
        std::fprintf(stderr, "bench: %d/%d requests done\n", done, total);
      }
    }
  };
}

absl::Status RunServingBench(ServingBenchOptions opt) {
  if (opt.request_rate == "inf") {
    opt.load.request_rate = std::numeric_limits<double>::infinity();
  } else if (!absl::SimpleAtod(opt.request_rate, &opt.load.request_rate) || !(opt.load.request_rate > 0)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--request-rate must be a positive number or inf, got '%s'", opt.request_rate));
  }
  ASSIGN_OR_RETURN(const Slo slo, ParseGoodput(opt.goodput));
  if (!(opt.max_failure_rate >= 0 && opt.max_failure_rate <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--max-failure-rate must be in [0, 1], got %g", opt.max_failure_rate));
  }
  opt.dataset.seed = opt.load.seed;
  router::ModelConfig model_config;
  model_config.tokenizer = opt.tokenizer;
  ASSIGN_OR_RETURN(std::shared_ptr<const router::ModelAssets> assets, router::LoadModelAssets(model_config));
  ASSIGN_OR_RETURN(const std::vector<Session> sessions, BuildDataset(opt.dataset, *assets->tokenizer));
  if (opt.dataset.name == "multi-turn" && opt.load.endpoint != "chat") {
    std::fprintf(stderr, "bench: multi-turn over completions sends each history as one prompt\n");
  }
  ASSIGN_OR_RETURN(opt.load.model, ResolveModel(opt.load));
  const std::string date = absl::FormatTime("%Y-%m-%d %H:%M:%S UTC", absl::Now(), absl::UTCTimeZone());
  const std::string metrics_url = opt.metrics_url.empty() ? opt.load.url : opt.metrics_url;
  const std::optional<std::pair<double, double>> before = PrefixCounters(metrics_url);
  opt.load.progress = Progress();

  // The calling thread runs the client's event loop (the process's other threads
  // are libraries' idle pools, e.g. OpenBLAS's).
  const double cpu0 = ThreadCpuSeconds();
  ASSIGN_OR_RETURN(const std::vector<RequestRecord> records, RunLoad(opt.load, sessions, *assets->tokenizer));
  const double cpu = ThreadCpuSeconds() - cpu0;

  Summary summary = Summarize(records, slo);
  summary.run = {{"command", CommandLine()},
                 {"url", opt.load.url},
                 {"model", opt.load.model},
                 {"endpoint", opt.load.endpoint},
                 {"dataset", opt.dataset.name},
                 {"dataset parameters", DatasetParameters(opt.dataset)},
                 {"requests", absl::StrCat(opt.dataset.num_prompts, " (seed ", opt.load.seed, ")")},
                 {"request rate", opt.request_rate},
                 {"max concurrency",
                  opt.load.max_concurrency == 0 ? std::string("no limit") : absl::StrCat(opt.load.max_concurrency)},
                 {"date", date}};
  const int64_t sent = static_cast<int64_t>(records.size()) + opt.load.num_warmups;
  summary.client_overhead_us_per_request = sent > 0 ? cpu / static_cast<double>(sent) * 1e6 : 0;
  if (const std::optional<std::pair<double, double>> after = PrefixCounters(metrics_url);
      before.has_value() && after.has_value()) {
    const double prompt = after->first - before->first;
    if (prompt > 0) summary.router_prefix_hit_rate = (after->second - before->second) / prompt;
  }
  const std::string title = opt.title.empty()
                                ? absl::StrFormat("%s on %s (%s)", opt.dataset.name, opt.load.url, opt.load.endpoint)
                                : opt.title;
  std::printf("%s", FormatText(summary, title).c_str());
  std::fflush(stdout);
  if (!opt.json_path.empty()) {
    nlohmann::json j = ToJson(summary);
    j["title"] = title;
    j["dataset"] = opt.dataset.name;
    j["endpoint"] = opt.load.endpoint;
    j["request_rate"] = opt.request_rate;
    j["max_concurrency"] = opt.load.max_concurrency;
    if (opt.save_detailed) j["requests"] = RequestsJson(records);
    RETURN_IF_ERROR(WriteFile(opt.json_path, j.dump(2) + "\n"));
  }
  if (!opt.html_path.empty()) {
    RETURN_IF_ERROR(WriteFile(opt.html_path, RenderHtml(summary, records, title)));
  }
  const int64_t recorded = summary.completed + summary.failed;
  if (recorded > 0 && static_cast<double>(summary.failed) > opt.max_failure_rate * recorded) {
    return absl::UnavailableError(
        absl::StrFormat("%d of %d requests failed (%.1f%%), more than --max-failure-rate %g allows", summary.failed,
                        recorded, 100.0 * summary.failed / recorded, opt.max_failure_rate));
  }
  return absl::OkStatus();
}

}  // namespace

void AddServingBench(CLI::App& bench) {
  auto opt = std::make_shared<ServingBenchOptions>();
  LoadOptions& l = opt->load;
  DatasetOptions& d = opt->dataset;
  bench.add_option("--url", l.url, "Serving benchmark: the OpenAI-compatible server, http://host:port");
  bench.add_option("--endpoint", l.endpoint, "chat or completions")->capture_default_str();
  bench.add_option("--model", l.model, "Model name to send (default: the server's first)");
  bench.add_option("--dataset,--dataset-name", d.name, "random, shared-prefix, multi-turn, sharegpt or trace")
      ->capture_default_str();
  bench.add_option("--dataset-path", d.path, "sharegpt: the JSON file; trace: the Mooncake jsonl");
  bench.add_option("--num-prompts", d.num_prompts, "Requests to send")->capture_default_str();
  bench.add_option("--request-rate", opt->request_rate, "Requests (sessions) per second, or inf")
      ->capture_default_str();
  bench.add_option("--burstiness", l.burstiness, "Gamma shape of arrivals (1: Poisson)")->capture_default_str();
  bench.add_option("--max-concurrency", l.max_concurrency, "Requests in flight at most (0: no limit)")
      ->capture_default_str();
  bench.add_option("--num-warmups", l.num_warmups, "Unrecorded requests sent first")->capture_default_str();
  bench.add_option("--seed", l.seed, "Seed of the dataset and the arrivals")->capture_default_str();
  bench
      .add_option(
          "--tokenizer", opt->tokenizer,
          "builtin, builtin:NAME (a built-in model's), or a tokenizer.json / model directory (to build prompts)")
      ->capture_default_str();
  bench.add_option("--random-input-len,--input-len", d.input_len, "random: input tokens")->capture_default_str();
  bench
      .add_option("--random-output-len,--output-len", d.output_len, "random, shared-prefix, multi-turn: output tokens")
      ->capture_default_str();
  bench.add_option("--random-range-ratio", d.range_ratio, "random: lengths vary by this fraction")
      ->capture_default_str();
  bench.add_option("--num-groups", d.num_groups, "shared-prefix: groups")->capture_default_str();
  bench.add_option("--prefix-len", d.prefix_len, "shared-prefix: tokens of each group's prefix")->capture_default_str();
  bench.add_option("--suffix-len", d.suffix_len, "shared-prefix: unique tokens per request")->capture_default_str();
  bench.add_option("--turns", d.turns, "multi-turn: turns per session")->capture_default_str();
  bench.add_option("--system-len", d.system_len, "multi-turn: system prompt tokens")->capture_default_str();
  bench.add_option("--user-len", d.user_len, "multi-turn: tokens per user turn")->capture_default_str();
  bench
      .add_option("--common-prefix-len", d.common_prefix_len,
                  "multi-turn: tokens every session's system prompt starts with, before its own "
                  "--system-len (one application's prompt, shared across sessions)")
      ->capture_default_str();
  bench
      .add_option("--sharegpt-output-len", d.sharegpt_output_len, "sharegpt: output tokens (0: the reference answer's)")
      ->capture_default_str();
  bench.add_option("--trace-block-tokens", d.trace_block_tokens, "trace: tokens per hash id")->capture_default_str();
  bench.add_option("--trace-speedup", d.trace_speedup, "trace: replay this many times faster")->capture_default_str();
  bench.add_option("--session-header", l.session_header, "Header carrying a session's id")->capture_default_str();
  bench
      .add_flag("--ignore-eos,!--no-ignore-eos", l.ignore_eos,
                "Ask the server to ignore EOS so outputs have the asked length (default: on; {false} is "
                "what --no-ignore-eos sets)")
      ->capture_default_str();
  bench.add_flag("--prompt-as-text", l.prompt_as_text, "completions: send text, not token ids");
  bench
      .add_flag("--keep-alive,!--no-keep-alive", l.keep_alive,
                "Reuse connections between requests (default: on; --no-keep-alive opens one per "
                "request)")
      ->capture_default_str();
  bench.add_option("--goodput", opt->goodput, "SLOs for goodput, e.g. ttft:500 tpot:50 (ms)");
  CLI::Option* json = bench.add_option("--json", opt->json_path, "Write the results as JSON here");
  bench.add_option("--html", opt->html_path, "Write a self-contained HTML report here");
  bench
      .add_flag("--save-detailed", opt->save_detailed,
                "--json also lists every request (session and turn, send time, TTFT, ITL gaps, "
                "tokens, cached tokens, error)")
      ->needs(json);
  bench.add_option("--metrics-url", opt->metrics_url,
                   "Where tandem's /metrics is read for the prefix hit rate (default: --url)");
  bench.add_option("--title", opt->title, "Title of the report");
  bench
      .add_option("--max-failure-rate", opt->max_failure_rate,
                  "Fraction of requests that may fail before the command exits non-zero (after "
                  "writing its reports)")
      ->capture_default_str();
  bench.require_subcommand(0, 1);
  bench.callback([opt, &bench] {
    if (!bench.get_subcommands().empty()) return;
    if (opt->load.url.empty()) {
      worker::ExitWithStatus("bench", absl::InvalidArgumentError("give --url http://host:port (serving benchmark) or a "
                                                                 "subcommand (engine, transfer, mock-server)"));
    }
    worker::ExitWithStatus("bench", RunServingBench(*opt));
  });
}

}  // namespace tandem::bench
