#include "tests/testing/worker_process.h"

#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <thread>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

extern char** environ;

namespace tandem::testing {
namespace {

using Clock = std::chrono::steady_clock;

constexpr std::chrono::milliseconds kPollInterval(10);

std::string DescribeWaitStatus(int status) {
  if (WIFEXITED(status)) return absl::StrCat("exited with status ", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return absl::StrCat("killed by signal ", WTERMSIG(status));
  return absl::StrCat("wait status ", status);
}

absl::StatusOr<std::string> MakeTempDir() {
  const char* base = std::getenv("TMPDIR");
  std::string tmpl = absl::StrCat(base != nullptr && *base != '\0' ? base : "/tmp", "/tandem_worker_XXXXXX");
  if (mkdtemp(tmpl.data()) == nullptr) {
    return absl::InternalError(absl::StrCat("mkdtemp(", tmpl, "): ", std::strerror(errno)));
  }
  return tmpl;
}

}  // namespace

absl::StatusOr<std::string> TandemBinary() {
  const char* bin = std::getenv("TANDEM_BIN");
  if (bin == nullptr || *bin == '\0') {
    return absl::FailedPreconditionError("TANDEM_BIN is not set (ctest sets it; by hand: TANDEM_BIN=build/tandem)");
  }
  return std::string(bin);
}

int RunCommand(const std::string& command_line, std::string* output) {
  FILE* p = popen((command_line + " 2>&1").c_str(), "r");
  if (p == nullptr) return -1;
  std::string text;
  char buf[512];
  while (fgets(buf, sizeof(buf), p) != nullptr) text += buf;
  const int rc = pclose(p);
  if (output != nullptr) *output = text;
  return rc;
}

bool RunCommands(const std::vector<std::string>& commands, std::string* why) {
  for (const std::string& c : commands) {
    std::string out;
    if (RunCommand(c, &out) != 0) {
      *why = absl::StrCat("`", c, "` failed: ", out);
      return false;
    }
  }
  return true;
}

// ---------------------------------------------------------------------------
// ChildProcess

absl::StatusOr<ChildProcess> ChildProcess::Spawn(const std::vector<std::string>& argv,
                                                 std::optional<std::string> stdout_path) {
  if (argv.empty()) return absl::InvalidArgumentError("empty argv");
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  if (stdout_path.has_value()) {
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, stdout_path->c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  }
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, args[0], &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) {
    return absl::InternalError(absl::StrCat("posix_spawn(", absl::StrJoin(argv, " "), "): ", std::strerror(rc)));
  }
  return ChildProcess(pid);
}

ChildProcess::ChildProcess(ChildProcess&& other) noexcept
    : pid_(std::exchange(other.pid_, -1)), wait_status_(other.wait_status_) {}

ChildProcess& ChildProcess::operator=(ChildProcess&& other) noexcept {
  if (this != &other) {
    if (pid_ > 0 && Running()) Stop(std::chrono::milliseconds(0));
    pid_ = std::exchange(other.pid_, -1);
    wait_status_ = other.wait_status_;
  }
  return *this;
}

ChildProcess::~ChildProcess() {
  if (pid_ > 0 && Running()) {
    kill(pid_, SIGKILL);
    int status = 0;
    waitpid(pid_, &status, 0);
  }
}

bool ChildProcess::Running() {
  if (pid_ <= 0 || wait_status_.has_value()) return false;
  int status = 0;
  const pid_t r = waitpid(pid_, &status, WNOHANG);
  if (r == pid_) {
    wait_status_ = status;
    return false;
  }
  return r == 0;
}

void ChildProcess::Signal(int signal) {
  if (Running()) kill(pid_, signal);
}

absl::StatusOr<int> ChildProcess::Wait(std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (Running()) {
    if (Clock::now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("process ", pid_, " still running after ", timeout.count(), " ms"));
    }
    std::this_thread::sleep_for(kPollInterval);
  }
  if (!wait_status_.has_value()) return absl::InternalError("process was never started");
  return *wait_status_;
}

int ChildProcess::Stop(std::chrono::milliseconds grace) {
  Signal(SIGTERM);
  absl::StatusOr<int> status = Wait(grace);
  if (status.ok()) return *status;
  Signal(SIGKILL);
  status = Wait(std::chrono::seconds(30));
  return status.ok() ? *status : -1;
}

// ---------------------------------------------------------------------------
// WorkerProcess

absl::StatusOr<std::unique_ptr<WorkerProcess>> WorkerProcess::Start(const std::vector<std::string>& flags,
                                                                    std::chrono::milliseconds ready_timeout,
                                                                    const LaunchOptions& launch) {
  absl::StatusOr<std::string> bin = TandemBinary();
  if (!bin.ok()) return bin.status();
  absl::StatusOr<std::string> dir = MakeTempDir();
  if (!dir.ok()) return dir.status();
  const std::string ready_file = *dir + "/ready";

  std::vector<std::string> argv = launch.wrapper;
  argv.insert(argv.end(), {*bin, "worker"});
  if (std::find(flags.begin(), flags.end(), "--port") == flags.end()) {
    argv.insert(argv.end(), {"--port", "0"});
  }
  argv.insert(argv.end(), {"--ready-file", ready_file, "--threads", "1"});
  // A worker serves mutual TLS or --insecure, never by default: tests that
  // are not about trust ask for insecure.
  const bool trust_given = std::any_of(flags.begin(), flags.end(), [](const std::string& f) {
    return f == "--insecure" || f == "--tls-ca" || f == "--tls-cert" || f == "--tls-key";
  });
  if (!trust_given) argv.push_back("--insecure");
  argv.insert(argv.end(), flags.begin(), flags.end());
  // TANDEM_TEST_WORKER_DEVICE=cuda (on the GPU machine): the worker tests'
  // real-engine workers run on the GPU runner, so the same gRPC tests drive
  // it, with TANDEM_TEST_WORKER_ARGS (space-separated flags, e.g.
  // --batch-invariant) added. Simulated workers and workers of
  // --kv-transport ucx (host memory only) stay on the CPU.
  // TANDEM_TEST_WORKER_DEVICE=cuda:by-role: decode workers on GPU 1, the
  // others on GPU 0 (a split over NCCL joins two GPUs).
  if (const char* env = std::getenv("TANDEM_TEST_WORKER_DEVICE"); env != nullptr && *env != '\0') {
    auto has = [&](const std::string& flag, const std::string& value) {
      for (size_t i = 0; i < flags.size(); ++i) {
        if (flags[i] == flag + "=" + value || (flags[i] == flag && i + 1 < flags.size() && flags[i + 1] == value)) {
          return true;
        }
      }
      return false;
    };
    const bool named = std::any_of(flags.begin(), flags.end(), [](const std::string& f) {
      return f == "--device" || f.rfind("--device=", 0) == 0;
    });
    std::string device = env;
    if (device == "cuda:by-role") device = has("--role", "decode") ? "cuda:1" : "cuda:0";
    if (!named && !has("--engine", "sim") && !has("--kv-transport", "ucx")) {
      argv.insert(argv.end(), {"--device", device});
      if (const char* extra = std::getenv("TANDEM_TEST_WORKER_ARGS"); extra != nullptr) {
        for (absl::string_view a : absl::StrSplit(extra, ' ', absl::SkipEmpty())) argv.emplace_back(a);
      }
      // Several test workers share the GPU: each keeps the host's default
      // KV size unless the test gives one (a GPU worker's own default is
      // 0.9 of the GPU, which leaves no room for a second).
      const bool sized = std::any_of(flags.begin(), flags.end(), [](const std::string& f) {
        return f.rfind("--kv-cache-memory", 0) == 0 || f.rfind("--gpu-memory-utilization", 0) == 0;
      });
      if (!sized) argv.insert(argv.end(), {"--kv-cache-memory", "256MiB"});
    }
  }
  std::shared_ptr<const tls::ChannelFactory> channels = tls::ChannelFactory::Insecure();
  if (launch.client_tls.has_value()) {
    absl::StatusOr<tls::TlsMaterial> m =
        tls::LoadTlsMaterial(*launch.client_tls, {.ca = "client ca", .cert = "client cert", .key = "client key"});
    if (!m.ok()) {
      std::filesystem::remove_all(*dir);
      return m.status();
    }
    channels = tls::ChannelFactory::Mutual(*m);
  }
  absl::StatusOr<ChildProcess> child = ChildProcess::Spawn(argv);
  if (!child.ok()) {
    std::filesystem::remove_all(*dir);
    return child.status();
  }
  auto fail = [&](absl::Status status) {
    child->Stop(std::chrono::seconds(5));
    std::filesystem::remove_all(*dir);
    return status;
  };

  absl::StatusOr<std::string> ready =
      WaitForReadyFile(*child, ready_file, ready_timeout, absl::StrCat("tandem worker ", absl::StrJoin(flags, " ")));
  if (!ready.ok()) return fail(ready.status());
  std::string address = *ready;
  if (!launch.connect_host.empty()) {
    address = absl::StrCat(launch.connect_host, address.substr(address.rfind(':')));
  }

  auto worker =
      std::unique_ptr<WorkerProcess>(new WorkerProcess(std::move(*child), *dir, address, channels->Create(address)));
  const auto connect_deadline =
      std::chrono::system_clock::now() + std::max(ready_timeout, std::chrono::milliseconds(1000));
  if (!worker->channel_->WaitForConnected(connect_deadline)) {
    return absl::UnavailableError(absl::StrCat("cannot connect to the worker at ", address));
  }
  return worker;
}

WorkerProcess::WorkerProcess(ChildProcess process, std::string dir, std::string address,
                             std::shared_ptr<grpc::Channel> channel)
    : process_(std::move(process)),
      dir_(std::move(dir)),
      address_(std::move(address)),
      channel_(std::move(channel)),
      stub_(tandem::v1::Worker::NewStub(channel_)) {}

int WorkerProcess::port() const { return std::stoi(address_.substr(address_.rfind(':') + 1)); }

WorkerProcess::~WorkerProcess() {
  if (!stopped_) Stop();
  std::error_code ignored;
  std::filesystem::remove_all(dir_, ignored);
}

int WorkerProcess::Stop(std::chrono::milliseconds grace) {
  stopped_ = true;
  // Close our connection first: the worker's server shutdown waits for open
  // connections until its own deadline.
  stub_.reset();
  channel_.reset();
  return process_.Stop(grace);
}

// ---------------------------------------------------------------------------
// RouterProcess

absl::StatusOr<std::unique_ptr<RouterProcess>> RouterProcess::Start(const std::string& yaml,
                                                                    std::chrono::milliseconds ready_timeout,
                                                                    const LaunchOptions& launch) {
  absl::StatusOr<std::string> bin = TandemBinary();
  if (!bin.ok()) return bin.status();
  absl::StatusOr<std::string> dir = MakeTempDir();
  if (!dir.ok()) return dir.status();
  const std::string config = *dir + "/router.yaml";
  const std::string ready_file = *dir + "/ready";
  {
    std::ofstream out(config);
    out << yaml;
  }
  std::vector<std::string> argv = launch.wrapper;
  argv.insert(argv.end(), {*bin, "router", "--config", config, "--ready-file", ready_file});
  absl::StatusOr<ChildProcess> child = ChildProcess::Spawn(argv);
  if (!child.ok()) return child.status();
  absl::StatusOr<std::string> address = WaitForReadyFile(*child, ready_file, ready_timeout, "tandem router");
  if (!address.ok()) {
    child->Stop(std::chrono::seconds(5));
    return address.status();
  }
  if (!launch.connect_host.empty()) {
    *address = absl::StrCat(launch.connect_host, address->substr(address->rfind(':')));
  }
  return std::unique_ptr<RouterProcess>(new RouterProcess(std::move(*child), *dir, config, "http://" + *address));
}

RouterProcess::RouterProcess(ChildProcess process, std::string dir, std::string config, std::string url)
    : process_(std::move(process)), dir_(std::move(dir)), config_(std::move(config)), url_(std::move(url)) {}

RouterProcess::~RouterProcess() {
  if (!stopped_) Stop();
  std::error_code ignored;
  std::filesystem::remove_all(dir_, ignored);
}

void RouterProcess::Rewrite(const std::string& yaml) {
  const std::string tmp = config_ + ".tmp";
  {
    std::ofstream out(tmp);
    out << yaml;
  }
  std::filesystem::rename(tmp, config_);
}

int RouterProcess::Stop(std::chrono::milliseconds grace) {
  stopped_ = true;
  return process_.Stop(grace);
}

absl::StatusOr<std::string> WaitForReadyFile(ChildProcess& child, const std::string& path,
                                             std::chrono::milliseconds timeout, const std::string& what) {
  const auto deadline = Clock::now() + timeout;
  while (true) {
    std::ifstream in(path);
    std::string line;
    if (in && std::getline(in, line) && !absl::StripAsciiWhitespace(line).empty()) {
      return std::string(absl::StripAsciiWhitespace(line));
    }
    if (!child.Running()) {
      absl::StatusOr<int> status = child.Wait(std::chrono::milliseconds(0));
      return absl::InternalError(
          absl::StrCat(what, " ", status.ok() ? DescribeWaitStatus(*status) : "ended", " before serving"));
    }
    if (Clock::now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(what, " wrote no ready file within ", timeout.count(), " ms"));
    }
    std::this_thread::sleep_for(kPollInterval);
  }
}

absl::StatusOr<std::string> StartTandem(const std::vector<std::string>& args, const std::string& ready_file,
                                        std::chrono::milliseconds timeout, const std::string& what,
                                        std::unique_ptr<ChildProcess>* child) {
  absl::StatusOr<std::string> bin = TandemBinary();
  if (!bin.ok()) return bin.status();
  std::vector<std::string> argv = {*bin};
  argv.insert(argv.end(), args.begin(), args.end());
  absl::StatusOr<ChildProcess> spawned = ChildProcess::Spawn(argv);
  if (!spawned.ok()) return spawned.status();
  *child = std::make_unique<ChildProcess>(*std::move(spawned));
  return WaitForReadyFile(**child, ready_file, timeout, what);
}

nlohmann::json RunBench(const std::string& url, const std::string& flags, const std::string& json_path,
                        std::string* output) {
  absl::StatusOr<std::string> bin = TandemBinary();
  if (!bin.ok()) {
    ADD_FAILURE() << bin.status();
    return nullptr;
  }
  std::filesystem::remove(json_path);
  const int rc = RunCommand(absl::StrCat(*bin, " bench --url ", url, " ", flags, " --json ", json_path), output);
  EXPECT_EQ(rc, 0) << *output;
  std::ifstream in(json_path);
  std::string text((std::istreambuf_iterator<char>(in)), {});
  return nlohmann::json::parse(text, nullptr, false);
}

bool WaitUntil(const std::function<bool()>& done, std::chrono::milliseconds timeout, std::chrono::milliseconds poll) {
  const auto deadline = Clock::now() + timeout;
  while (!done()) {
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(poll);
  }
  return true;
}

std::optional<ProcStat> ReadProcStat(pid_t pid, pid_t tid) {
  std::ifstream in(tid > 0 ? absl::StrCat("/proc/", pid, "/task/", tid, "/stat")
                           : absl::StrCat("/proc/", pid, "/stat"));
  std::string line;
  if (!std::getline(in, line)) return std::nullopt;
  // "pid (comm) S ppid ...": the comm may hold spaces and parentheses.
  const size_t paren = line.rfind(')');
  ProcStat st;
  if (paren == std::string::npos || std::sscanf(line.c_str() + paren + 1, " %c %d", &st.state, &st.ppid) != 2) {
    return std::nullopt;
  }
  return st;
}

}  // namespace tandem::testing
