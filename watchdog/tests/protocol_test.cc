#include <gtest/gtest.h>

#include "protocol.h"

using watchdog::FrameDecoder;

TEST(Protocol, RoundTripInPieces) {
  std::string wire = watchdog::encode_frame("hello") + watchdog::encode_frame("") + watchdog::encode_frame("xy");
  ASSERT_EQ(wire.substr(0, 4), std::string("\0\0\0\5", 4));
  FrameDecoder d;
  std::vector<std::string> got;
  for (char c : wire) {  // one byte at a time
    auto r = d.feed(&c, 1);
    EXPECT_TRUE(r.errors.empty());
    for (auto& f : r.frames) got.push_back(f);
  }
  ASSERT_EQ(got.size(), 3u);
  EXPECT_EQ(got[0], "hello");
  EXPECT_EQ(got[1], "");
  EXPECT_EQ(got[2], "xy");
  EXPECT_EQ(d.buffered(), 0u);
}

TEST(Protocol, OversizedFrameIsSkippedAndStreamStaysInSync) {
  FrameDecoder d;
  const uint32_t len = watchdog::kMaxFrame + 10;
  std::string header{static_cast<char>(len >> 24), static_cast<char>(len >> 16),
                     static_cast<char>(len >> 8), static_cast<char>(len)};
  auto r = d.feed(header.data(), header.size());
  ASSERT_EQ(r.errors.size(), 1u);
  EXPECT_TRUE(r.frames.empty());
  std::string junk(len, 'x');
  std::string after = watchdog::encode_frame("ok");
  std::string rest = junk + after;
  size_t total = 0;
  std::vector<std::string> frames;
  while (total < rest.size()) {  // feed in 1 MiB chunks: nothing of the junk is buffered
    size_t n = std::min<size_t>(1 << 20, rest.size() - total);
    auto rr = d.feed(rest.data() + total, n);
    EXPECT_LE(d.buffered(), 16u);
    for (auto& f : rr.frames) frames.push_back(f);
    total += n;
  }
  ASSERT_EQ(frames.size(), 1u);
  EXPECT_EQ(frames[0], "ok");
}

TEST(Protocol, MaxSizeFrameIsAccepted) {
  FrameDecoder d;
  std::string payload(watchdog::kMaxFrame, 'a');
  std::string wire = watchdog::encode_frame(payload);
  auto r = d.feed(wire.data(), wire.size());
  EXPECT_TRUE(r.errors.empty());
  ASSERT_EQ(r.frames.size(), 1u);
  EXPECT_EQ(r.frames[0].size(), watchdog::kMaxFrame);
}
