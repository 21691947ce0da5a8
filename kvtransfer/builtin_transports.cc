// TransportRegistry::Builtin(): the transports a worker can use across
// processes. The one place that knows which backends this binary was built
// with.
#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kvtransfer/nccl/nccl_transport.h"
#include "kvtransfer/transport.h"
#ifdef TANDEM_HAVE_UCX
#include "kvtransfer/ucx/ucx_transport.h"
#endif
#ifdef TANDEM_HAVE_CUDA_IPC
#include "kvtransfer/cuda_ipc/cuda_ipc_transport.h"
#include "kvtransfer/cuda_ipc/cuda_staging_copier.h"
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
    // Send/receive through host staging: GPU pools across hosts (and host
    // pools, the same protocol where there is no GPU).
    r->Register("ucx_staged", UcxTransport::StagedCapabilities(),
                [](const TransportOptions& o) -> absl::StatusOr<std::unique_ptr<Transport>> {
                  UcxOptions ucx;
                  ucx.transports = o.transports;
                  ucx.net_devices = o.net_devices;
                  ucx.staged = true;
                  ucx.staging_slots = o.staging_slots;
                  ucx.staging_slot_bytes = o.staging_slot_bytes;
                  ucx.make_copier = [](const PoolLayout& layout) -> absl::StatusOr<std::unique_ptr<StagingCopier>> {
                    if (layout.memory_type == MemoryType::kHost) return NewHostStagingCopier();
#ifdef TANDEM_HAVE_CUDA_IPC
                    return NewCudaStagingCopier(layout.device_id);
#else
                    return absl::UnimplementedError(
                        "--kv-transport ucx_staged: GPU pools need a tandem built with CUDA (no nvcc)");
#endif
                  };
                  absl::StatusOr<std::unique_ptr<UcxTransport>> t = UcxTransport::Create(ucx);
                  if (!t.ok()) return t.status();
                  return std::unique_ptr<Transport>(*std::move(t));
                });
#else
    for (const char* name : {"ucx", "ucx_staged"}) {
      const bool staged = std::string_view(name) == "ucx_staged";
      r->Register(name,
                  TransportCapabilities{.push = true,
                                        .pull = !staged,
                                        .needs_pairing = staged,
                                        .memory = staged ? std::vector<MemoryType>{MemoryType::kHost, MemoryType::kCuda}
                                                         : std::vector<MemoryType>{MemoryType::kHost}},
                  [name](const TransportOptions&) -> absl::StatusOr<std::unique_ptr<Transport>> {
                    return absl::UnimplementedError(absl::StrCat(
                        "--kv-transport ", name, ": this tandem was built without UCX (TANDEM_WITH_UCX=OFF)"));
                  });
    }
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
    // GPU pools on two different GPUs, by NCCL send/receive (libnccl.so.2
    // loaded at run time: an error naming TANDEM_NCCL where it is not found).
    r->Register("nccl", NcclTransport::Capabilities(),
                [](const TransportOptions& o) -> absl::StatusOr<std::unique_ptr<Transport>> {
                  absl::StatusOr<std::unique_ptr<NcclTransport>> t = NcclTransport::Create({.device = o.device});
                  if (!t.ok())
                    return absl::Status(t.status().code(), absl::StrCat("--kv-transport nccl: ", t.status().message()));
                  return std::unique_ptr<Transport>(*std::move(t));
                });
    return r;
  }();
  return *registry;
}

}  // namespace tandem::kvtransfer
