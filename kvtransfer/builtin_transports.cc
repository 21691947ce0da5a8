// TransportRegistry::Builtin(): the transports a worker can use across
// processes. The one place that knows which backends this binary was built
// with.
#include "absl/status/status.h"
#include "kvtransfer/transport.h"
#ifdef TANDEM_HAVE_UCX
#include "kvtransfer/ucx/ucx_transport.h"
#endif
#ifdef TANDEM_HAVE_CUDA_IPC
#include "kvtransfer/cuda_ipc/cuda_ipc_transport.h"
#endif

namespace tandem::kvtransfer {

const TransportRegistry& TransportRegistry::Builtin() {
  static const TransportRegistry* registry = [] {
    auto* r = new TransportRegistry;
#ifdef TANDEM_HAVE_UCX
    r->Register("ucx", UcxTransport::Capabilities(),
                [](const TransportOptions& o) -> absl::StatusOr<std::unique_ptr<Transport>> {
                  UcxOptions ucx;
                  ucx.transports = o.transports;
                  ucx.net_devices = o.net_devices;
                  absl::StatusOr<std::unique_ptr<UcxTransport>> t = UcxTransport::Create(ucx);
                  if (!t.ok()) return t.status();
                  return std::unique_ptr<Transport>(*std::move(t));
                });
#else
    r->Register("ucx", TransportCapabilities{.push = true, .pull = true, .memory = {MemoryType::kHost}},
                [](const TransportOptions&) -> absl::StatusOr<std::unique_ptr<Transport>> {
                  return absl::UnimplementedError(
                      "--kv-transport ucx: this tandem was built without UCX "
                      "(TANDEM_WITH_UCX=OFF)");
                });
#endif
    // GPU pools of workers on one host, device to device.
    const TransportCapabilities cuda_ipc{.push = true, .pull = true, .memory = {MemoryType::kCuda}};
#ifdef TANDEM_HAVE_CUDA_IPC
    r->Register("cuda_ipc", cuda_ipc, [](const TransportOptions& o) -> absl::StatusOr<std::unique_ptr<Transport>> {
      absl::StatusOr<std::unique_ptr<CudaIpcTransport>> t = CudaIpcTransport::Create(o.device);
      if (!t.ok()) return t.status();
      return std::unique_ptr<Transport>(*std::move(t));
    });
#else
    r->Register("cuda_ipc", cuda_ipc, [](const TransportOptions&) -> absl::StatusOr<std::unique_ptr<Transport>> {
      return absl::UnimplementedError("--kv-transport cuda_ipc: this tandem was built without CUDA (no nvcc)");
    });
#endif
    return r;
  }();
  return *registry;
}

}  // namespace tandem::kvtransfer
