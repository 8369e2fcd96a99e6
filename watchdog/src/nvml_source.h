// Where device information, health readings and XID events come from: the real NVML
// (nvml_real.cc, libnvidia-ml.so.1 opened with dlopen) or a fake fed by tests (nvml_fake.cc).
#pragma once

#include <time.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace watchdog {

struct DeviceInfo {
  int index = 0;
  std::string name, uuid, pci_bus_id, driver_version;
  int minor = -1;  // /dev/nvidia<minor>; -1: unknown (the index is used)
};

struct Reading {
  bool ok = true;             // the device answered and reports nothing that needs action
  std::string error;          // why not
  int64_t memory_total_bytes = 0, memory_used_bytes = 0;
  int temperature_celsius = 0, utilization_percent = 0, remapped_row_count = 0;
  bool remap_pending = false;
  std::string recovery_action;  // "", "none", "gpu_reset", "node_reboot", "drain_p2p", ...
};

// A GPU's clocks and what holds them back, read at the edges of a timing window
// (WindowReport.conditions); a field NVML cannot give is 0.
struct Conditions {
  bool known = false;  // a reading was taken (at least the clocks answered)
  int sm_clock_mhz = 0, memory_clock_mhz = 0, temperature_celsius = 0, power_milliwatts = 0;
  uint64_t throttle_reasons = 0;  // NVML's clocks event reasons bitmask
};

struct XidEvent {
  int device_index = 0;
  int xid = 0;
  int pid = 0;  // 0: unknown (real NVML never knows; the kernel log may)
};

class NvmlSource {
 public:
  virtual ~NvmlSource() = default;
  virtual std::vector<DeviceInfo> devices() = 0;
  virtual Reading read(int index) = 0;
  // Clocks, temperature, power and throttle reasons now; known=false for an unknown device.
  virtual Conditions conditions(int index) = 0;
  // Processes holding the GPU; false when this source cannot tell.
  virtual bool processes(int index, std::vector<int>& pids) = 0;
  // Processes that used the GPU after since_us (Unix time in microseconds, CLOCK_REALTIME, as
  // NVML stamps its samples): pid -> the time of its newest per-process utilization sample
  // newer than since_us with SM or memory utilization above 0. False when this source cannot
  // tell (no per-process utilization on this GPU or driver, an unknown device).
  virtual bool gpu_users(int index, uint64_t since_us, std::map<int, uint64_t>& users) = 0;
  // A descriptor that becomes readable when events may be waiting, or -1 (poll every tick).
  virtual int event_fd() const = 0;
  virtual std::vector<XidEvent> poll_events() = 0;
};

// Now on the clock of NVML's per-process utilization samples: Unix time in microseconds.
inline uint64_t nvml_clock_us() {
  timespec ts{};
  ::clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000u + static_cast<uint64_t>(ts.tv_nsec) / 1000u;
}

// Real NVML; nullptr and *error set when the library or its init fails.
std::unique_ptr<NvmlSource> open_real_nvml(std::string* error);
// Fake NVML reading lines from path (see nvml_fake.cc for the format).
std::unique_ptr<NvmlSource> open_fake_nvml(const std::string& path, std::string* error);

}  // namespace watchdog
