#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <map>

#include "nvml_source.h"

TEST(FakeNvml, DevicesHealthProcessesAndXids) {
  char path[] = "/tmp/fake_nvml_test_XXXXXX";
  int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  close(fd);
  {
    std::ofstream f(path);
    f << "# two GPUs\ndevice 0 name=A100 uuid=GPU-a\ndevice 1\nbogus line\n";
  }
  std::string error;
  auto nvml = watchdog::open_fake_nvml(path, &error);
  ASSERT_TRUE(nvml) << error;
  auto devs = nvml->devices();
  ASSERT_EQ(devs.size(), 2u);
  EXPECT_EQ(devs[0].name, "A100");
  EXPECT_EQ(devs[0].uuid, "GPU-a");
  EXPECT_EQ(nvml->poll_events().size(), 0u);
  {
    std::ofstream f(path, std::ios::app);
    f << "xid 1 31 pid=77\nxid 0 79\nhealth 0 temperature=71 memory_used=5 ok=0 error=boom "
         "recovery_action=gpu_reset\nprocesses 1 10 11\n";
  }
  auto events = nvml->poll_events();
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].device_index, 1);
  EXPECT_EQ(events[0].xid, 31);
  EXPECT_EQ(events[0].pid, 77);
  EXPECT_EQ(events[1].xid, 79);
  EXPECT_EQ(events[1].pid, 0);
  auto r = nvml->read(0);
  EXPECT_EQ(r.temperature_celsius, 71);
  EXPECT_EQ(r.memory_used_bytes, 5);
  EXPECT_FALSE(r.ok);
  EXPECT_EQ(r.error, "boom");
  EXPECT_EQ(r.recovery_action, "gpu_reset");
  std::vector<int> pids;
  ASSERT_TRUE(nvml->processes(1, pids));
  EXPECT_EQ(pids, (std::vector<int>{10, 11}));
  EXPECT_FALSE(nvml->read(5).ok);
  std::remove(path);
}

TEST(FakeNvml, ClocksRecordSetsTheConditions) {
  char path[] = "/tmp/fake_nvml_test_XXXXXX";
  int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  close(fd);
  {
    std::ofstream f(path);
    f << "device 0\nhealth 0 temperature=63\n";
  }
  std::string error;
  auto nvml = watchdog::open_fake_nvml(path, &error);
  ASSERT_TRUE(nvml) << error;
  // Before any clocks line: known, zeros, the health line's temperature.
  auto c = nvml->conditions(0);
  EXPECT_TRUE(c.known);
  EXPECT_EQ(c.temperature_celsius, 63);
  EXPECT_EQ(c.sm_clock_mhz, 0);
  EXPECT_EQ(c.throttle_reasons, 0u);
  {
    std::ofstream f(path, std::ios::app);
    f << "clocks 0 sm=1980 mem=2619 power_mw=301500 reasons=0x8000000000000024\n"
         "clocks 7 sm=1\n";  // an undeclared device: a bad line, ignored
  }
  c = nvml->conditions(0);
  EXPECT_TRUE(c.known);
  EXPECT_EQ(c.sm_clock_mhz, 1980);
  EXPECT_EQ(c.memory_clock_mhz, 2619);
  EXPECT_EQ(c.power_milliwatts, 301500);
  EXPECT_EQ(c.throttle_reasons, 0x8000000000000024ull);
  EXPECT_EQ(c.temperature_celsius, 63);  // no clocks line named one yet
  {
    std::ofstream f(path, std::ios::app);
    f << "clocks 0 temperature=44 reasons=8\nhealth 0 temperature=70\n";
  }
  c = nvml->conditions(0);
  EXPECT_EQ(c.temperature_celsius, 44);  // a clocks line's wins over later health lines
  EXPECT_EQ(c.throttle_reasons, 8u);
  EXPECT_EQ(c.sm_clock_mhz, 1980);  // kept: the line did not name it
  EXPECT_FALSE(nvml->conditions(7).known);
  std::remove(path);
}

TEST(FakeNvml, UtilizationSamplesNameTheGpuUsersSinceATime) {
  char path[] = "/tmp/fake_nvml_test_XXXXXX";
  int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  close(fd);
  {
    std::ofstream f(path);
    f << "device 0\ndevice 1\n";
  }
  std::string error;
  auto nvml = watchdog::open_fake_nvml(path, &error);
  ASSERT_TRUE(nvml) << error;
  std::map<int, uint64_t> users;
  ASSERT_TRUE(nvml->gpu_users(0, 0, users));  // a declared device with no samples: nobody
  EXPECT_TRUE(users.empty());
  EXPECT_FALSE(nvml->gpu_users(5, 0, users));  // an undeclared one: cannot tell
  const uint64_t before = watchdog::nvml_clock_us();
  {
    std::ofstream f(path, std::ios::app);
    f << "utilization 0 100 sm=80\n"
         "utilization 0 101 mem=3\n"
         "utilization 0 102 sm=0 mem=0\n"  // idle: not a user
         "utilization 0 103\n"             // both default to 0
         "utilization 1 200 sm=10\n"       // another GPU
         "utilization 0 oops sm=1\n"       // no pid: a bad line, ignored
         "utilization 9 300 sm=1\n";       // an undeclared device: ignored
  }
  ASSERT_TRUE(nvml->gpu_users(0, before - 1, users));  // the lines are read (stamped) now
  const uint64_t after = watchdog::nvml_clock_us();
  ASSERT_EQ(users.size(), 2u);
  for (int pid : {100, 101}) {
    ASSERT_TRUE(users.count(pid));
    EXPECT_GE(users[pid], before);
    EXPECT_LE(users[pid], after);
  }
  users.clear();
  ASSERT_TRUE(nvml->gpu_users(1, before - 1, users));
  EXPECT_EQ(users, (std::map<int, uint64_t>{{200, users[200]}}));
  // Samples no newer than since do not count; a later sample does, with its own time.
  users.clear();
  ASSERT_TRUE(nvml->gpu_users(0, after, users));
  EXPECT_TRUE(users.empty());
  usleep(2000);
  {
    std::ofstream f(path, std::ios::app);
    f << "utilization 0 101 sm=50\n";
  }
  ASSERT_TRUE(nvml->gpu_users(0, after, users));
  ASSERT_EQ(users.size(), 1u);
  EXPECT_GT(users[101], after);
  std::remove(path);
}

TEST(RealNvml, FailsCleanlyWithoutTheLibrary) {
  std::string error;
  auto nvml = watchdog::open_real_nvml(&error);
  if (nvml) GTEST_SKIP() << "NVML present on this machine";
  EXPECT_NE(error.find("libnvidia-ml"), std::string::npos) << error;
}
