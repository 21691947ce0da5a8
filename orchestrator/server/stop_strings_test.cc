#include "orchestrator/server/stop_strings.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace tandem::router {
namespace {

// Feeds `pieces` one by one; returns everything released.
std::string Feed(StopStrings& s, const std::vector<std::string>& pieces) {
  std::string out;
  for (const std::string& p : pieces) out += s.Push(p);
  return out + s.Flush();
}

TEST(StopStringsTest, NoStopsReleasesEverythingAtOnce) {
  StopStrings s({});
  EXPECT_EQ(s.Push("hello"), "hello");
  EXPECT_EQ(s.Flush(), "");
  EXPECT_FALSE(s.stopped());
}

TEST(StopStringsTest, MatchInOnePieceCutsBeforeIt) {
  StopStrings s({"END"});
  EXPECT_EQ(s.Push("abcENDdef"), "abc");
  EXPECT_TRUE(s.stopped());
  EXPECT_EQ(s.matched(), "END");
  EXPECT_EQ(s.Push("more"), "");
  EXPECT_EQ(s.Flush(), "");
}

TEST(StopStringsTest, MatchAcrossPiecesHoldsOnlyAPossiblePrefix) {
  StopStrings s({"</answer>"});
  EXPECT_EQ(s.Push("x = 1 <"), "x = 1 ");  // "<" could start the stop string
  EXPECT_EQ(s.Push("/ans"), "");
  EXPECT_EQ(s.Push("wer> tail"), "");
  EXPECT_TRUE(s.stopped());
}

TEST(StopStringsTest, FalseStartIsReleased) {
  StopStrings s({"</answer>"});
  EXPECT_EQ(s.Push("a </an"), "a ");
  EXPECT_EQ(s.Push("other"), "</another");
  EXPECT_FALSE(s.stopped());
  EXPECT_EQ(s.Flush(), "");
}

TEST(StopStringsTest, EarliestOfSeveralWins) {
  StopStrings s({"world", "lo w"});
  EXPECT_EQ(Feed(s, {"hel", "lo world"}), "hel");
  EXPECT_EQ(s.matched(), "lo w");
}

TEST(StopStringsTest, HeldTextComesOutAtFlush) {
  StopStrings s({"STOP"});
  EXPECT_EQ(s.Push("go ST"), "go ");
  EXPECT_EQ(s.Flush(), "ST");
}

TEST(StopStringsTest, MultiByteStopStrings) {
  StopStrings s({"。\n"});
  EXPECT_EQ(Feed(s, {"你好", "。", "\n再见"}), "你好");
  EXPECT_TRUE(s.stopped());
}

TEST(StopStringsTest, EveryCutOfTheTextGivesTheSameResult) {
  const std::string text = "The answer is 42.\n\nQuestion: what";
  for (size_t a = 0; a <= text.size(); ++a) {
    for (size_t b = a; b <= text.size(); ++b) {
      StopStrings s({"\n\nQuestion:", "zzz"});
      EXPECT_EQ(Feed(s, {text.substr(0, a), text.substr(a, b - a), text.substr(b)}), "The answer is 42.")
          << a << " " << b;
      EXPECT_TRUE(s.stopped());
    }
  }
}

}  // namespace
}  // namespace tandem::router
