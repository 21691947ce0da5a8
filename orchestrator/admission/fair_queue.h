// FairQueue: the router's admission queue, shared fairly between API keys
// (weighted fair queueing). Each item has a key, a cost (the sequences it
// will run: its n) and its key's weight (the key's priority). An item is
// stamped with a virtual finish time,
//   finish = max(V, the key's previous finish) + cost / weight,
// where V is the finish time of the item served last, and items are served
// in order of finish time (ties: arrival order). A key that floods the queue
// pushes only its own later items back: another key's first item is stamped
// just after V and is served next but one, whatever the flood's length. With
// one key (a router without keys) finish times grow with arrival: FIFO.
// Weights share the service: a key of weight 2 is served twice as often as
// one of weight 1 while both have items waiting.
//
// T is the item's handle (a shared_ptr), ordered and copyable; Remove finds
// an item by it.
//
// Thread safety: none; the router holds its lock around every call.
#ifndef TANDEM_ORCHESTRATOR_ADMISSION_FAIR_QUEUE_H_
#define TANDEM_ORCHESTRATOR_ADMISSION_FAIR_QUEUE_H_

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <utility>

namespace tandem::router {

template <typename T>
class FairQueue {
 public:
  // REQUIRES: cost >= 1, weight >= 1, `item` not queued already.
  void Push(const std::string& key, int weight, int64_t cost, T item) {
    const double start = std::max(virtual_time_, last_finish_[key]);
    const double finish = start + static_cast<double>(cost) / static_cast<double>(std::max(1, weight));
    last_finish_[key] = finish;
    const Tag tag{finish, next_seq_++};
    positions_.emplace(item, tag);
    items_.emplace(tag, Entry{key, cost, std::move(item)});
  }

  // Takes `item` out of the queue; false if it is not queued.
  bool Remove(const T& item) {
    auto it = positions_.find(item);
    if (it == positions_.end()) return false;
    items_.erase(it->second);
    positions_.erase(it);
    return true;
  }

  bool empty() const { return items_.empty(); }
  size_t size() const { return items_.size(); }

  // The next item to serve and its cost. REQUIRES: !empty().
  const T& Front() const { return items_.begin()->second.item; }
  int64_t FrontCost() const { return items_.begin()->second.cost; }
  const std::string& FrontKey() const { return items_.begin()->second.key; }

  // Takes the next item out. REQUIRES: !empty().
  T Pop() {
    auto it = items_.begin();
    virtual_time_ = std::max(virtual_time_, it->first.finish);
    Entry e = std::move(it->second);
    items_.erase(it);
    positions_.erase(e.item);
    // A key whose last finish V has passed needs no entry: max(V, ...) is V.
    if (auto k = last_finish_.find(e.key); k != last_finish_.end() && k->second <= virtual_time_) {
      last_finish_.erase(k);
    }
    return std::move(e.item);
  }

 private:
  struct Tag {
    double finish;
    uint64_t seq;
    bool operator<(const Tag& o) const { return finish != o.finish ? finish < o.finish : seq < o.seq; }
  };
  struct Entry {
    std::string key;
    int64_t cost;
    T item;
  };

  double virtual_time_ = 0;
  uint64_t next_seq_ = 0;
  std::map<std::string, double> last_finish_;
  std::map<Tag, Entry> items_;
  std::map<T, Tag> positions_;
};

}  // namespace tandem::router

#endif  // TANDEM_ORCHESTRATOR_ADMISSION_FAIR_QUEUE_H_
