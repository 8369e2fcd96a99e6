#include <gtest/gtest.h>

#include "policy.h"

using watchdog::XidPolicy;

TEST(Policy, ApplicationFaultsRestartTheWorker) {
  XidPolicy p;
  for (int xid : {13, 31, 43, 45, 68, 69}) {
    EXPECT_EQ(p.lookup(xid).category, "application") << xid;
    EXPECT_EQ(p.lookup(xid).action, watchdog::kRestartWorker) << xid;
  }
}

TEST(Policy, HardwareFaultsNeedAReset) {
  XidPolicy p;
  for (int xid : {48, 62, 64, 74, 79, 92, 94, 95, 109, 119, 120}) {
    EXPECT_EQ(p.lookup(xid).action, watchdog::kResetGpu) << xid;
  }
}

TEST(Policy, UnknownXidIsIgnored) {
  XidPolicy p;
  EXPECT_EQ(p.lookup(9999).category, "unknown");
  EXPECT_EQ(p.lookup(9999).action, watchdog::kIgnore);
}

TEST(Policy, OverridesReplaceAndAdd) {
  XidPolicy p;
  EXPECT_TRUE(p.set(31, "custom", watchdog::kResetGpu));
  EXPECT_EQ(p.lookup(31).action, watchdog::kResetGpu);
  EXPECT_EQ(p.lookup(31).category, "custom");
  EXPECT_TRUE(p.set(500, "application", watchdog::kRestartWorker));
  EXPECT_EQ(p.lookup(500).action, watchdog::kRestartWorker);
  EXPECT_FALSE(p.set(13, "application", "reboot_the_planet"));
  EXPECT_EQ(p.lookup(13).action, watchdog::kRestartWorker);
}

TEST(Policy, RecoveryActions) {
  EXPECT_EQ(XidPolicy::action_for_recovery("gpu_reset"), watchdog::kResetGpu);
  EXPECT_EQ(XidPolicy::action_for_recovery("drain_and_reset"), watchdog::kResetGpu);
  EXPECT_EQ(XidPolicy::action_for_recovery("node_reboot"), watchdog::kMarkUnhealthy);
  EXPECT_EQ(XidPolicy::action_for_recovery("none"), "");
  EXPECT_EQ(XidPolicy::action_for_recovery(""), "");
}
