#include "kvtransfer/staging/staging_copier.h"

#include <cstring>

namespace tandem::kvtransfer {
namespace {

class HostStagingCopier final : public StagingCopier {
 public:
  MemoryType memory() const override { return MemoryType::kHost; }
  bool Ready(const WriteFence& fence) const override {
    return fence.memory() == MemoryType::kHost && fence.Completed();
  }
  absl::StatusOr<uint64_t> Start(Direction direction, uint8_t* pool, uint8_t* staging,
                                 std::span<const CopyRun> runs) override {
    const bool to = direction == Direction::kToStaging;
    for (const CopyRun& r : runs) {
      std::memcpy((to ? staging : pool) + r.dst_offset, (to ? pool : staging) + r.src_offset,
                  static_cast<size_t>(r.bytes));
    }
    return ++next_ticket_;
  }
  absl::StatusOr<bool> Poll(uint64_t ticket) override {
    (void)ticket;
    return true;
  }

 private:
  uint64_t next_ticket_ = 0;
};

}  // namespace

std::vector<CopyRun> StagingRuns(std::span<const BlockPair> pairs, int64_t block_bytes,
                                 StagingCopier::Direction direction) {
  const bool to = direction == StagingCopier::Direction::kToStaging;
  std::vector<CopyRun> runs;
  for (size_t i = 0; i < pairs.size(); ++i) {
    const int64_t slot = static_cast<int64_t>(i) * block_bytes;
    const int64_t pool = static_cast<int64_t>(to ? pairs[i].src : pairs[i].dst) * block_bytes;
    AppendRun(runs, {.src_offset = to ? pool : slot, .dst_offset = to ? slot : pool, .bytes = block_bytes});
  }
  return runs;
}

std::unique_ptr<StagingCopier> NewHostStagingCopier() { return std::make_unique<HostStagingCopier>(); }

}  // namespace tandem::kvtransfer
