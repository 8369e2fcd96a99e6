// Timing windows' choices (windows.cc): whom a window freezes, and which OpenWindow it refuses.
// Freezing itself needs cgroups and root: tests/watchdog/test_windows.py runs the binary.
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>

#include "watchdog.h"

namespace watchdog {
namespace {

void add(std::map<std::string, Worker>& workers, const std::string& id, int device, pid_t pid) {
  Worker& w = workers[id];
  w.id = id;
  w.device = device;
  w.pid = pid;
}

// Device 0: holder, partner, two others, one not yet spawned, one SIGKILLed, one in its SIGTERM
// grace; device 1: one; the build pseudo-device: one.
std::map<std::string, Worker> fleet() {
  std::map<std::string, Worker> workers;
  add(workers, "d0-w1", 0, 101);
  add(workers, "d0-w2", 0, 102);
  add(workers, "d0-w3", 0, 103);
  add(workers, "d0-w4", 0, 104);
  add(workers, "d0-w5", 0, 0);
  add(workers, "d0-w6", 0, 106);
  workers["d0-w6"].exit_reason = "killed:timeout";  // SIGKILLed: dying, it must run
  add(workers, "d0-w7", 0, 107);
  workers["d0-w7"].exit_reason = "stopped";
  workers["d0-w7"].kill_at_ms = 5000;  // SIGTERMed, its grace running: it may start GPU work
  add(workers, "d1-w8", 1, 108);
  add(workers, "build-w9", kBuildDevice, 109);
  return workers;
}

Window window(const std::string& holder, std::set<std::string> partners, bool freeze = true) {
  Window win;
  win.holder = holder;
  win.partners = std::move(partners);
  win.freeze_others = freeze;
  return win;
}

pb::OpenWindow asked(int device, const std::string& holder,
                    std::initializer_list<std::string> partners) {
  pb::OpenWindow o;
  o.set_device_index(device);
  o.set_holder_worker_id(holder);
  o.set_freeze_others(true);
  for (const auto& p : partners) o.add_partner_worker_ids(p);
  return o;
}

using Ids = std::set<std::string>;

TEST(Windows, FreezeEveryOtherJobProcessOfTheDeviceButTheHolderAndPartners) {
  const auto workers = fleet();
  EXPECT_EQ(window_wants_frozen(window("d0-w1", {"d0-w2"}), 0, workers),
            (Ids{"d0-w3", "d0-w4", "d0-w7"}));
  EXPECT_EQ(window_wants_frozen(window("d0-w1", {"d0-w2", "d0-w3"}), 0, workers),
            (Ids{"d0-w4", "d0-w7"}));
  // Without partners, as before them: all but the holder.
  EXPECT_EQ(window_wants_frozen(window("d0-w1", {}), 0, workers),
            (Ids{"d0-w2", "d0-w3", "d0-w4", "d0-w7"}));
  EXPECT_EQ(window_wants_frozen(window("d1-w8", {}), 1, workers), Ids{});
}

TEST(Windows, WarmingJobProcessesRunWhereTheWindowLetsThem) {
  auto workers = fleet();
  for (auto& [id, w] : workers) w.warm = id != "d0-w3";  // d0-w3 has not said warm yet
  Window win = window("d0-w1", {"d0-w2"});
  EXPECT_EQ(window_wants_frozen(win, 0, workers), (Ids{"d0-w3", "d0-w4", "d0-w7"}));
  win.warming_runs = true;  // Configure.warming_runs_in_windows
  EXPECT_EQ(window_wants_frozen(win, 0, workers), (Ids{"d0-w4", "d0-w7"}));
  EXPECT_TRUE(win.leaves(workers.at("d0-w3")));
  workers["d0-w3"].warm = true;  // JobProcessWarm: frozen from then on
  EXPECT_EQ(window_wants_frozen(win, 0, workers), (Ids{"d0-w3", "d0-w4", "d0-w7"}));
  EXPECT_FALSE(win.leaves(workers.at("d0-w3")));
}

TEST(Windows, NextWindowFreezesTheLastOnesPartnersAndRunsItsOwn) {
  const auto workers = fleet();
  // The last window's holder and partner are frozen by the next; its frozen ones it names run.
  EXPECT_EQ(window_wants_frozen(window("d0-w3", {"d0-w4"}), 0, workers),
            (Ids{"d0-w1", "d0-w2", "d0-w7"}));
}

TEST(Windows, FreezeNothingWhenNotAskedTo) {
  const auto workers = fleet();
  EXPECT_EQ(window_wants_frozen(window("d0-w1", {"d0-w2"}, false), 0, workers), Ids{});
}

TEST(Windows, RunsItsHolderAndPartnersOnly) {
  const Window win = window("d0-w1", {"d0-w2", "d0-w3"});
  EXPECT_TRUE(win.runs("d0-w1"));
  EXPECT_TRUE(win.runs("d0-w2"));
  EXPECT_TRUE(win.runs("d0-w3"));
  EXPECT_FALSE(win.runs("d0-w4"));
  EXPECT_FALSE(win.runs(""));
}

TEST(Windows, OpenWithJobProcessesOfTheDevice) {
  const auto workers = fleet();
  EXPECT_EQ(window_refusal(asked(0, "d0-w1", {}), 0, workers), "");
  EXPECT_EQ(window_refusal(asked(0, "d0-w1", {"d0-w2"}), 0, workers), "");
  EXPECT_EQ(window_refusal(asked(0, "d0-w1", {"d0-w2", "d0-w5", "d0-w1"}), 0, workers), "");
}

TEST(Windows, RefuseAHolderOrPartnerThatIsNoJobProcessOfTheDevice) {
  const auto workers = fleet();
  EXPECT_EQ(window_refusal(asked(0, "d0-w99", {"d0-w2"}), 0, workers),
            "no job process 'd0-w99' on device 0; the window is unchanged");
  EXPECT_EQ(window_refusal(asked(0, "d1-w8", {}), 0, workers),
            "no job process 'd1-w8' on device 0; the window is unchanged");
  EXPECT_EQ(window_refusal(asked(0, "d0-w1", {"d0-w2", "d0-w99"}), 0, workers),
            "no job process 'd0-w99' (a partner) on device 0; the window is unchanged");
  EXPECT_EQ(window_refusal(asked(0, "d0-w1", {"d1-w8"}), 0, workers),
            "no job process 'd1-w8' (a partner) on device 0; the window is unchanged");
  EXPECT_EQ(window_refusal(asked(0, "d0-w1", {"build-w9"}), 0, workers),
            "no job process 'build-w9' (a partner) on device 0; the window is unchanged");
  EXPECT_EQ(window_refusal(asked(0, "d0-w1", {""}), 0, workers),
            "no job process '' (a partner) on device 0; the window is unchanged");
}

}  // namespace
}  // namespace watchdog
