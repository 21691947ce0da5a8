// libFuzzer target: the router's YAML config, as `tandem router --config`
// reads it at start and on SIGHUP. A config is accepted (and then passes
// ValidateRouterConfig again, as a config built in code would) or refused
// with InvalidArgument; yaml-cpp's exceptions must not escape.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string_view>

#include "orchestrator/config/router_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view yaml(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<tandem::router::RouterConfig> config = tandem::router::ParseRouterConfig(yaml, "fuzz.yaml");
  if (!config.ok()) {
    if (config.status().code() != absl::StatusCode::kInvalidArgument) {
      std::fprintf(stderr, "a refusal that is not InvalidArgument: %s\n", config.status().ToString().c_str());
      std::abort();
    }
    return 0;
  }
  if (absl::Status again = tandem::router::ValidateRouterConfig(*config); !again.ok()) {
    std::fprintf(stderr, "a parsed config fails validation: %s\n", again.ToString().c_str());
    std::abort();
  }
  return 0;
}
