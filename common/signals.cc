#include "common/signals.h"

#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>

namespace tandem {
namespace {

int g_pipe[2] = {-1, -1};
std::atomic<bool> g_terminating{false};

void OnSignal(int sig) {
  if (sig == SIGINT || sig == SIGTERM) {
    if (g_terminating.exchange(true)) _exit(128 + sig);  // second one: no more waiting
  }
  const unsigned char byte = static_cast<unsigned char>(sig);
  [[maybe_unused]] ssize_t n = write(g_pipe[1], &byte, 1);
}

}  // namespace

absl::Status InstallSignalHandlers(std::initializer_list<int> signals) {
  if (g_pipe[0] < 0 && pipe(g_pipe) != 0) {
    return absl::InternalError("cannot create the signal pipe");
  }
  struct sigaction sa = {};
  sa.sa_handler = OnSignal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  for (int sig : signals) sigaction(sig, &sa, nullptr);
  return absl::OkStatus();
}

int WaitForSignal() {
  unsigned char byte = 0;
  while (read(g_pipe[0], &byte, 1) != 1) {
    if (errno != EINTR) return SIGTERM;
  }
  return byte;
}

int WaitForSignalFor(int timeout_ms) {
  pollfd p = {.fd = g_pipe[0], .events = POLLIN, .revents = 0};
  if (poll(&p, 1, timeout_ms) <= 0) return 0;
  return WaitForSignal();
}

}  // namespace tandem
