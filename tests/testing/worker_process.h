// Test helpers that run `tandem` as real child processes: a worker serving
// its gRPC API (WorkerProcess) and any other subcommand (ChildProcess), for
// cross-process integration tests. The binary is $TANDEM_BIN, which the
// tandem_cc_test CMake helper sets.
//
// WorkerProcess::Start spawns
//   tandem worker --port 0 --ready-file <temp dir>/ready --threads 1 <flags>
// (without the `--port 0` when `flags` give a port; with `--insecure` unless
// `flags` give --insecure or TLS files, then LaunchOptions::client_tls is
// the helper's own identity) and waits, bounded,
// until the worker has written its address to the ready file and accepts
// connections. Destruction stops it: SIGTERM, then SIGKILL
// if it has not exited within the grace period. The helper's own connection
// is closed first: gRPC's server shutdown (as of 1.51) waits out its whole
// deadline while any client connection stays open, idle or not. Children
// inherit the test's stdout and stderr, so a failing test shows the worker's
// log.
//
// Thread safety: the objects are not thread-safe, except that stub() may be
// used from any thread until Stop (gRPC stubs are thread-safe).
#ifndef TANDEM_TESTS_TESTING_WORKER_PROCESS_H_
#define TANDEM_TESTS_TESTING_WORKER_PROCESS_H_

#include <grpcpp/grpcpp.h>
#include <sys/types.h>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/tls.h"
#include "nlohmann/json.hpp"
#include "tandem/v1/worker.grpc.pb.h"

namespace tandem::testing {

// $TANDEM_BIN, or an error saying it is unset.
absl::StatusOr<std::string> TandemBinary();

// Runs `command_line` with /bin/sh (popen) and returns its exit status as
// pclose reports it (-1 if it could not start); its standard output and
// error go to `output` when given. For set-up commands such as `ip netns`.
int RunCommand(const std::string& command_line, std::string* output = nullptr);

// Runs `commands` in order with RunCommand, stopping at the first that fails;
// false then, with `*why` naming it and its output.
bool RunCommands(const std::vector<std::string>& commands, std::string* why);

// Polls `done` every `poll` until it returns true (true) or `timeout` passes
// (false).
bool WaitUntil(const std::function<bool()>& done, std::chrono::milliseconds timeout,
               std::chrono::milliseconds poll = std::chrono::milliseconds(20));

// The state letter and parent pid of a process (or, with `tid`, one of its
// threads) from /proc; nullopt if it is gone.
struct ProcStat {
  char state = 0;  // R, S, D, T (stopped), t, Z, ...
  int ppid = 0;
};
std::optional<ProcStat> ReadProcStat(pid_t pid, pid_t tid = 0);

// A process started with posix_spawn. If it is still running when the object
// is destroyed it is killed with SIGKILL and reaped.
class ChildProcess {
 public:
  // Runs argv[0] (a path) with argv. `stdout_path`, when set, receives the
  // child's standard output (e.g. "/dev/null").
  static absl::StatusOr<ChildProcess> Spawn(const std::vector<std::string>& argv,
                                            std::optional<std::string> stdout_path = std::nullopt);

  ChildProcess(ChildProcess&& other) noexcept;
  ChildProcess& operator=(ChildProcess&& other) noexcept;
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;
  ~ChildProcess();

  pid_t pid() const { return pid_; }
  // True until the process has exited (reaps it when it has).
  bool Running();
  // Sends `signal` if the process is still running.
  void Signal(int signal);
  // Waits up to `timeout` for the process to exit. Returns its wait status
  // (as waitpid reports it), or DeadlineExceeded.
  absl::StatusOr<int> Wait(std::chrono::milliseconds timeout);
  // SIGTERM, then SIGKILL after `grace`; returns the wait status.
  int Stop(std::chrono::milliseconds grace);

 private:
  explicit ChildProcess(pid_t pid) : pid_(pid) {}
  pid_t pid_ = -1;
  std::optional<int> wait_status_;
};

// How a worker is launched beyond its flags: inside another environment
// (e.g. {"ip", "netns", "exec", "ns1", "env", "UCX_NET_DEVICES=veth0"}, each
// of which execs the next, so the pid stays the worker's) and reached at
// another host than the one it listens on (it may listen on 0.0.0.0).
struct LaunchOptions {
  std::vector<std::string> wrapper;
  std::string connect_host;  // empty: the host from the ready file
  // A worker started with --tls-*: the identity of the helper's own channel
  // (stub()), usually a router certificate of the worker's CA.
  std::optional<tls::TlsFiles> client_tls;
};

// Waits until `child` has written `path` (processes write it under another
// name and rename it, so once it exists it is complete); its first line.
// An error naming `what` if the child ends first or `timeout` passes.
absl::StatusOr<std::string> WaitForReadyFile(ChildProcess& child, const std::string& path,
                                             std::chrono::milliseconds timeout, const std::string& what);

// Spawns `$TANDEM_BIN <args>` (args include the --ready-file `ready_file`)
// into `*child` and waits for the ready file's first line (WaitForReadyFile).
// `*child` holds the process as soon as it runs, so a failed wait still ends
// it with the caller's fixture.
absl::StatusOr<std::string> StartTandem(const std::vector<std::string>& args, const std::string& ready_file,
                                        std::chrono::milliseconds timeout, const std::string& what,
                                        std::unique_ptr<ChildProcess>* child);

// Runs `$TANDEM_BIN bench --url URL <flags> --json JSON_PATH` to the end; its
// JSON report (discarded if it wrote none), its output in `*output`. A
// non-zero exit is a test failure.
nlohmann::json RunBench(const std::string& url, const std::string& flags, const std::string& json_path,
                        std::string* output);

class WorkerProcess {
 public:
  // `flags` follow the fixed ones, e.g. {"--kv-cache-memory", "1MiB"}; a
  // "--port" among them replaces the fixed `--port 0`.
  static absl::StatusOr<std::unique_ptr<WorkerProcess>> Start(
      const std::vector<std::string>& flags, std::chrono::milliseconds ready_timeout = std::chrono::seconds(30),
      const LaunchOptions& launch = {});
  ~WorkerProcess();  // Stop(10 s) unless stopped already

  // "host:port": the ready file's, or LaunchOptions::connect_host's.
  const std::string& address() const { return address_; }
  int port() const;
  tandem::v1::Worker::Stub& stub() { return *stub_; }
  pid_t pid() const { return process_.pid(); }
  // Waits up to `timeout` for the worker to exit on its own (e.g. after a
  // signal the test sent); its wait status, or DeadlineExceeded.
  absl::StatusOr<int> Wait(std::chrono::milliseconds timeout) { return process_.Wait(timeout); }
  // Closes stub()'s connection, then SIGTERM, then SIGKILL after `grace`;
  // returns the wait status. stub() is unusable afterwards.
  int Stop(std::chrono::milliseconds grace = std::chrono::seconds(10));

 private:
  WorkerProcess(ChildProcess process, std::string dir, std::string address, std::shared_ptr<grpc::Channel> channel);

  ChildProcess process_;
  bool stopped_ = false;
  const std::string dir_;  // temp dir holding the ready file; removed at the end
  const std::string address_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<tandem::v1::Worker::Stub> stub_;
};

// `tandem router --config <temp dir>/router.yaml` with the given YAML, up
// once it has written its ready file (its HTTP listener is bound). `launch`
// as for a worker: a wrapper before the binary, and the host url() names
// instead of the ready file's.
class RouterProcess {
 public:
  static absl::StatusOr<std::unique_ptr<RouterProcess>> Start(
      const std::string& yaml, std::chrono::milliseconds ready_timeout = std::chrono::seconds(30),
      const LaunchOptions& launch = {});
  ~RouterProcess();  // Stop() unless stopped already

  // "http://host:port".
  const std::string& url() const { return url_; }
  pid_t pid() const { return process_.pid(); }
  // Replaces the config file's contents (atomically); SIGHUP makes the
  // router read it.
  void Rewrite(const std::string& yaml);
  void Signal(int signal) { process_.Signal(signal); }
  int Stop(std::chrono::milliseconds grace = std::chrono::seconds(15));

 private:
  RouterProcess(ChildProcess process, std::string dir, std::string config, std::string url);
  ChildProcess process_;
  std::string dir_;
  std::string config_;
  std::string url_;
  bool stopped_ = false;
};

}  // namespace tandem::testing

#endif  // TANDEM_TESTS_TESTING_WORKER_PROCESS_H_
