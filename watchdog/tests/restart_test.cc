#include <gtest/gtest.h>

#include "restart.h"

using watchdog::RestartIntensity;

TEST(RestartIntensity, TripsAfterMoreThanMaxInWindow) {
  RestartIntensity r(3, 10000, 100, 5000);
  EXPECT_FALSE(r.record_failure(0));
  EXPECT_FALSE(r.record_failure(1000));
  EXPECT_FALSE(r.record_failure(2000));
  EXPECT_TRUE(r.record_failure(3000));  // the 4th in 10 s
}

TEST(RestartIntensity, OldFailuresExpire) {
  RestartIntensity r(2, 10000, 100, 5000);
  EXPECT_FALSE(r.record_failure(0));
  EXPECT_FALSE(r.record_failure(1000));
  EXPECT_FALSE(r.record_failure(10500));  // the one at 0 left the window
  EXPECT_EQ(r.failures(10500), 2);
  EXPECT_EQ(r.failures(30000), 0);
}

TEST(RestartIntensity, BackoffDoublesAndCaps) {
  RestartIntensity r(100, 60000, 100, 1000);
  EXPECT_EQ(r.backoff_ms(0), 0);
  r.record_failure(0);
  EXPECT_EQ(r.backoff_ms(0), 100);
  r.record_failure(1);
  EXPECT_EQ(r.backoff_ms(1), 200);
  r.record_failure(2);
  EXPECT_EQ(r.backoff_ms(2), 400);
  for (int i = 0; i < 10; ++i) r.record_failure(3 + i);
  EXPECT_EQ(r.backoff_ms(20), 1000);
  r.clear();
  EXPECT_EQ(r.backoff_ms(20), 0);
}
