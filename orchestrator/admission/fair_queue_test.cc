#include "orchestrator/admission/fair_queue.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

namespace tandem::router {
namespace {

using Item = std::shared_ptr<std::string>;

Item Make(const std::string& s) { return std::make_shared<std::string>(s); }

std::vector<std::string> Drain(FairQueue<Item>& q) {
  std::vector<std::string> out;
  while (!q.empty()) out.push_back(*q.Pop());
  return out;
}

TEST(FairQueueTest, OneKeyIsFifo) {
  FairQueue<Item> q;
  for (int i = 0; i < 5; ++i) q.Push("", 1, 1 + i % 3, Make(std::to_string(i)));
  EXPECT_EQ(q.size(), 5u);
  EXPECT_EQ(q.FrontCost(), 1);
  EXPECT_EQ(Drain(q), (std::vector<std::string>{"0", "1", "2", "3", "4"}));
}

TEST(FairQueueTest, AFloodDoesNotDelayAnotherKey) {
  FairQueue<Item> q;
  for (int i = 0; i < 100; ++i) q.Push("flood", 1, 1, Make(std::string("f").append(std::to_string(i))));
  // Two served, then another key arrives.
  EXPECT_EQ(*q.Pop(), "f0");
  EXPECT_EQ(*q.Pop(), "f1");
  q.Push("other", 1, 1, Make("o0"));
  std::vector<std::string> next;
  for (int i = 0; i < 2; ++i) next.push_back(*q.Pop());
  EXPECT_EQ(next, (std::vector<std::string>{"f2", "o0"}));
}

TEST(FairQueueTest, KeysAlternateAndWeightsShare) {
  FairQueue<Item> q;
  for (int i = 0; i < 4; ++i) q.Push("a", 1, 1, Make("a"));
  for (int i = 0; i < 4; ++i) q.Push("b", 1, 1, Make("b"));
  EXPECT_EQ(Drain(q), (std::vector<std::string>{"a", "b", "a", "b", "a", "b", "a", "b"}));
  // Weight 3 against 1: three of "h" per "l".
  for (int i = 0; i < 6; ++i) q.Push("h", 3, 1, Make("h"));
  for (int i = 0; i < 2; ++i) q.Push("l", 1, 1, Make("l"));
  std::vector<std::string> order = Drain(q);
  EXPECT_EQ(order, (std::vector<std::string>{"h", "h", "h", "l", "h", "h", "h", "l"}));
}

TEST(FairQueueTest, CostCountsAgainstTheKey) {
  FairQueue<Item> q;
  // A request of 4 sequences weighs as much as four of one.
  q.Push("big", 1, 4, Make("B"));
  q.Push("big", 1, 4, Make("B"));
  for (int i = 0; i < 5; ++i) q.Push("small", 1, 1, Make("s"));
  EXPECT_EQ(Drain(q), (std::vector<std::string>{"s", "s", "s", "B", "s", "s", "B"}));
}

TEST(FairQueueTest, RemoveTakesAnItemOut) {
  FairQueue<Item> q;
  Item a = Make("a"), b = Make("b"), c = Make("c");
  q.Push("k", 1, 1, a);
  q.Push("k", 1, 1, b);
  q.Push("k", 1, 1, c);
  EXPECT_TRUE(q.Remove(b));
  EXPECT_FALSE(q.Remove(b));
  EXPECT_EQ(q.size(), 2u);
  EXPECT_EQ(Drain(q), (std::vector<std::string>{"a", "c"}));
  EXPECT_FALSE(q.Remove(a));
}

}  // namespace
}  // namespace tandem::router
