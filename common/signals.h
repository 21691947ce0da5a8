// Signal waiting for long-running commands (`tandem worker`, `tandem router`,
// `tandem up`): handlers write the signal number to a self-pipe and the main
// thread waits for it. A second SIGINT/SIGTERM while the first is being
// handled exits at once (128 + signal), so a stuck shutdown can always be
// cut short; SIGHUP (reload) may come any number of times.
//
// Thread safety: InstallSignalHandlers once, from the main thread, before
// other threads start; WaitForSignal from one thread.
#ifndef TANDEM_COMMON_SIGNALS_H_
#define TANDEM_COMMON_SIGNALS_H_

#include <initializer_list>

#include "absl/status/status.h"

namespace tandem {

// Installs the handler for `signals` (e.g. {SIGINT, SIGTERM, SIGHUP}).
absl::Status InstallSignalHandlers(std::initializer_list<int> signals);

// Blocks until one of the installed signals arrives; returns its number.
int WaitForSignal();

// Polls for a signal for up to `timeout_ms`; returns its number, or 0.
int WaitForSignalFor(int timeout_ms);

}  // namespace tandem

#endif  // TANDEM_COMMON_SIGNALS_H_
