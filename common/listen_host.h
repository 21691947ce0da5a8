#pragma once

namespace tandem {

// The environment variable that sets the address servers listen on where
// neither a flag nor a config file does: the container images set it to
// 0.0.0.0 (every interface, as a pod needs); outside them the default stays
// 127.0.0.1. Read by the router's listener.host and the worker's --host.
inline constexpr char kListenHostEnv[] = "TANDEM_HOST";

}  // namespace tandem
