// What /proc says about processes of this host: whether a process still
// runs, told apart from a later process that reuses its pid (the start
// time), and which pid namespace this process sees.
#ifndef TANDEM_COMMON_PROCESS_INFO_H_
#define TANDEM_COMMON_PROCESS_INFO_H_

#include <cstdint>
#include <optional>
#include <string>

namespace tandem {

// Process `pid`'s start time in clock ticks after boot (field 22 of
// /proc/PID/stat); 0 where it has exited (no such pid, or a zombie not yet
// reaped); nullopt where /proc does not say (out of file descriptors, a
// /proc that hides other users' processes, a malformed line): unknown,
// never to be taken for an exit.
std::optional<uint64_t> ProcessStartTime(int64_t pid);

// This process's start time, 0 where unknown (a /proc mounted from another
// pid namespace, whose /proc/self is not this process).
uint64_t OwnStartTime();

// This process's pid namespace ("pid:[4026531836]"); empty where unknown.
const std::string& PidNamespace();

// This host's boot id (/proc/sys/kernel/random/boot_id: the same for every
// process and container of one boot); empty where /proc does not say.
std::string HostBootId();

}  // namespace tandem

#endif  // TANDEM_COMMON_PROCESS_INFO_H_
