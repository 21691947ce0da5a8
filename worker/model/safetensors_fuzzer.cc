// libFuzzer target: a safetensors file as the worker maps it from a
// checkpoint directory. The input is the whole file (8-byte header length,
// JSON header, data), put in a memfd and opened through /proc/self/fd, so
// SafetensorsFile::Open maps it exactly as it maps a file on disk. Every
// tensor a file that opens lists is then read (converted to f32). A file
// that does not open must be refused with InvalidArgument or DataLoss.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "worker/model/safetensors.h"

namespace {

int MemFd() {
  static const int fd = memfd_create("safetensors_fuzzer", MFD_CLOEXEC);
  if (fd < 0) std::abort();
  return fd;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const int fd = MemFd();
  if (ftruncate(fd, 0) != 0 || pwrite(fd, data, size, 0) != static_cast<ssize_t>(size)) std::abort();
  const std::string path = "/proc/self/fd/" + std::to_string(fd);
  auto file = tandem::worker::SafetensorsFile::Open(path);
  if (!file.ok()) {
    const absl::StatusCode code = file.status().code();
    if (code != absl::StatusCode::kInvalidArgument && code != absl::StatusCode::kDataLoss) {
      std::fprintf(stderr, "unexpected refusal: %s\n", file.status().ToString().c_str());
      std::abort();
    }
    return 0;
  }
  for (const auto& [name, entry] : (*file)->entries()) {
    if (entry.begin > entry.end) std::abort();
    auto tensor = (*file)->Read(name);
    if (!tensor.ok() && tensor.status().code() != absl::StatusCode::kInvalidArgument) {
      std::fprintf(stderr, "unexpected read error: %s\n", tensor.status().ToString().c_str());
      std::abort();
    }
  }
  return 0;
}
