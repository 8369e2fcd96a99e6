// Real NVML: libnvidia-ml.so.1 opened with dlopen at run time (no link-time dependency), the
// few declarations we need written out below (ABI as in nvml.h). XID events are waited for in
// one helper thread (nvmlEventSetWait_v2 with a timeout), which writes them into a pipe that
// the single-threaded event loop polls; the thread touches nothing else.
#include <dlfcn.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <thread>

#include "fd.h"
#include "log.h"
#include "nvml_source.h"

namespace watchdog {

namespace {

using nvmlReturn_t = int;
using nvmlDevice_t = struct nvmlDevice_st*;
using nvmlEventSet_t = struct nvmlEventSet_st*;
constexpr nvmlReturn_t NVML_SUCCESS = 0;
constexpr nvmlReturn_t NVML_ERROR_TIMEOUT = 10;
constexpr nvmlReturn_t NVML_ERROR_NOT_SUPPORTED = 3;
constexpr nvmlReturn_t NVML_ERROR_NOT_FOUND = 6;
constexpr nvmlReturn_t NVML_ERROR_INSUFFICIENT_SIZE = 7;
constexpr unsigned long long nvmlEventTypeXidCriticalError = 0x0000000000000008LL;
constexpr unsigned int NVML_TEMPERATURE_GPU = 0;
constexpr unsigned int NVML_CLOCK_SM = 1;  // nvmlClockType_t
constexpr unsigned int NVML_CLOCK_MEM = 2;
constexpr unsigned int NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = 230;

struct nvmlMemory_t {
  unsigned long long total, free, used;
};
struct nvmlPciInfo_t {  // nvmlPciInfo_t as filled by nvmlDeviceGetPciInfo_v3
  char busIdLegacy[16];
  unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
  char busId[32];
};
struct nvmlUtilization_t {
  unsigned int gpu, memory;
};
struct nvmlEventData_t {
  nvmlDevice_t device;
  unsigned long long eventType;
  unsigned long long eventData;
  unsigned int gpuInstanceId;
  unsigned int computeInstanceId;
};
struct nvmlProcessInfo_t {  // nvmlProcessInfo_v2_t, used by the _v3 process queries
  unsigned int pid;
  unsigned long long usedGpuMemory;
  unsigned int gpuInstanceId;
  unsigned int computeInstanceId;
};
struct nvmlProcessUtilizationSample_t {
  unsigned int pid;
  unsigned long long timeStamp;  // CPU timestamp, microseconds
  unsigned int smUtil, memUtil, encUtil, decUtil;
};
union nvmlValue_t {
  double dVal;
  unsigned int uiVal;
  unsigned long ulVal;
  unsigned long long ullVal;
  signed long long sllVal;
  signed int siVal;
  unsigned short usVal;
};
struct nvmlFieldValue_t {
  unsigned int fieldId;
  unsigned int scopeId;
  long long timestamp;
  long long latencyUsec;
  int valueType;
  nvmlReturn_t nvmlReturn;
  nvmlValue_t value;
};

struct Api {
  nvmlReturn_t (*Init)();
  nvmlReturn_t (*Shutdown)();
  const char* (*ErrorString)(nvmlReturn_t);
  nvmlReturn_t (*GetCount)(unsigned int*);
  nvmlReturn_t (*GetHandleByIndex)(unsigned int, nvmlDevice_t*);
  nvmlReturn_t (*GetName)(nvmlDevice_t, char*, unsigned int);
  nvmlReturn_t (*GetUUID)(nvmlDevice_t, char*, unsigned int);
  nvmlReturn_t (*GetPciInfo)(nvmlDevice_t, nvmlPciInfo_t*);
  nvmlReturn_t (*GetMinorNumber)(nvmlDevice_t, unsigned int*);
  nvmlReturn_t (*DriverVersion)(char*, unsigned int);
  nvmlReturn_t (*GetMemoryInfo)(nvmlDevice_t, nvmlMemory_t*);
  nvmlReturn_t (*GetTemperature)(nvmlDevice_t, unsigned int, unsigned int*);
  nvmlReturn_t (*GetUtilization)(nvmlDevice_t, nvmlUtilization_t*);
  nvmlReturn_t (*GetRemappedRows)(nvmlDevice_t, unsigned int*, unsigned int*, unsigned int*,
                                  unsigned int*);
  nvmlReturn_t (*GetFieldValues)(nvmlDevice_t, int, nvmlFieldValue_t*);
  nvmlReturn_t (*GetClockInfo)(nvmlDevice_t, unsigned int, unsigned int*);
  nvmlReturn_t (*GetPowerUsage)(nvmlDevice_t, unsigned int*);
  nvmlReturn_t (*GetClocksEventReasons)(nvmlDevice_t, unsigned long long*);
  nvmlReturn_t (*GetComputeProcs)(nvmlDevice_t, unsigned int*, nvmlProcessInfo_t*);
  nvmlReturn_t (*GetGraphicsProcs)(nvmlDevice_t, unsigned int*, nvmlProcessInfo_t*);
  nvmlReturn_t (*GetProcessUtilization)(nvmlDevice_t, nvmlProcessUtilizationSample_t*,
                                        unsigned int*, unsigned long long);
  nvmlReturn_t (*EventSetCreate)(nvmlEventSet_t*);
  nvmlReturn_t (*RegisterEvents)(nvmlDevice_t, unsigned long long, nvmlEventSet_t);
  nvmlReturn_t (*EventSetWait)(nvmlEventSet_t, nvmlEventData_t*, unsigned int);
  nvmlReturn_t (*EventSetFree)(nvmlEventSet_t);
};

template <typename F>
bool bind(void* lib, const char* name, F& out, bool required, std::string* error) {
  out = reinterpret_cast<F>(dlsym(lib, name));
  if (!out && required) *error = std::string("missing symbol ") + name;
  return out != nullptr || !required;
}

std::string recovery_name(unsigned int v) {
  switch (v) {
    case 0: return "none";
    case 1: return "gpu_reset";
    case 2: return "node_reboot";
    case 3: return "drain_p2p";
    case 4: return "drain_and_reset";
    default: return "unknown_" + std::to_string(v);
  }
}

class RealNvml : public NvmlSource {
 public:
  RealNvml(void* lib, const Api& api) : lib_(lib), api_(api) {}

  bool start(std::string* error) {
    if (nvmlReturn_t r = api_.Init(); r != NVML_SUCCESS) {
      *error = std::string("nvmlInit_v2: ") + api_.ErrorString(r);
      return false;
    }
    initialized_ = true;
    unsigned int count = 0;
    if (nvmlReturn_t r = api_.GetCount(&count); r != NVML_SUCCESS) {
      *error = std::string("nvmlDeviceGetCount_v2: ") + api_.ErrorString(r);
      return false;
    }
    char driver[96] = {0};
    api_.DriverVersion(driver, sizeof driver);
    for (unsigned int i = 0; i < count; ++i) {
      nvmlDevice_t h = nullptr;
      if (api_.GetHandleByIndex(i, &h) != NVML_SUCCESS) continue;
      DeviceInfo d;
      d.index = static_cast<int>(i);
      char buf[128] = {0};
      if (api_.GetName(h, buf, sizeof buf) == NVML_SUCCESS) d.name = buf;
      std::memset(buf, 0, sizeof buf);
      if (api_.GetUUID(h, buf, sizeof buf) == NVML_SUCCESS) d.uuid = buf;
      nvmlPciInfo_t pci{};
      if (api_.GetPciInfo && api_.GetPciInfo(h, &pci) == NVML_SUCCESS) {
        pci.busId[sizeof pci.busId - 1] = 0;
        d.pci_bus_id = pci.busId;  // "00000000:06:00.0"
      }
      unsigned int minor = 0;
      if (api_.GetMinorNumber && api_.GetMinorNumber(h, &minor) == NVML_SUCCESS)
        d.minor = static_cast<int>(minor);  // the /dev/nvidia<minor> node of this GPU
      d.driver_version = driver;
      handles_.push_back(h);
      devices_.push_back(d);
    }
    if (api_.EventSetCreate(&set_) != NVML_SUCCESS) {
      *error = "nvmlEventSetCreate failed";
      return false;
    }
    for (size_t i = 0; i < handles_.size(); ++i) {
      nvmlReturn_t r = api_.RegisterEvents(handles_[i], nvmlEventTypeXidCriticalError, set_);
      if (r != NVML_SUCCESS)
        log_line("nvmlDeviceRegisterEvents(GPU " + std::to_string(i) + "): " +
                 api_.ErrorString(r));
    }
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC | O_NONBLOCK) != 0) {
      *error = "pipe: " + errno_text(errno);
      return false;
    }
    read_end_.reset(fds[0]);
    write_end_.reset(fds[1]);
    waiter_ = std::thread([this] { wait_loop(); });
    return true;
  }

  ~RealNvml() override {
    stop_ = true;
    if (waiter_.joinable()) waiter_.join();
    if (set_) api_.EventSetFree(set_);
    if (initialized_) api_.Shutdown();
    dlclose(lib_);
  }

  std::vector<DeviceInfo> devices() override { return devices_; }

  Reading read(int index) override {
    Reading r;
    nvmlDevice_t h = handle(index);
    if (!h) {
      r.ok = false;
      r.error = "no such device";
      return r;
    }
    nvmlMemory_t mem{};
    if (nvmlReturn_t e = api_.GetMemoryInfo(h, &mem); e != NVML_SUCCESS) {
      r.ok = false;  // the one reading every working GPU answers
      r.error = std::string("memory info: ") + api_.ErrorString(e);
      return r;
    }
    r.memory_total_bytes = static_cast<int64_t>(mem.total);
    r.memory_used_bytes = static_cast<int64_t>(mem.used);
    unsigned int t = 0;
    if (api_.GetTemperature(h, NVML_TEMPERATURE_GPU, &t) == NVML_SUCCESS)
      r.temperature_celsius = static_cast<int>(t);
    nvmlUtilization_t u{};
    if (api_.GetUtilization(h, &u) == NVML_SUCCESS) r.utilization_percent = static_cast<int>(u.gpu);
    if (api_.GetRemappedRows) {
      unsigned int corr = 0, unc = 0, pending = 0, failed = 0;
      if (api_.GetRemappedRows(h, &corr, &unc, &pending, &failed) == NVML_SUCCESS) {
        r.remapped_row_count = static_cast<int>(corr + unc);
        r.remap_pending = pending != 0;
        if (failed) {
          r.ok = false;
          r.error = "row remapping failed";
        }
      }
    }
    if (api_.GetFieldValues) {  // absent or unsupported on older drivers: left empty
      nvmlFieldValue_t fv{};
      fv.fieldId = NVML_FI_DEV_GET_GPU_RECOVERY_ACTION;
      if (api_.GetFieldValues(h, 1, &fv) == NVML_SUCCESS && fv.nvmlReturn == NVML_SUCCESS)
        r.recovery_action = recovery_name(fv.value.uiVal);
    }
    return r;
  }

  Conditions conditions(int index) override {
    Conditions c;
    nvmlDevice_t h = handle(index);
    if (!h) return c;
    unsigned int v = 0;
    if (api_.GetClockInfo) {
      if (api_.GetClockInfo(h, NVML_CLOCK_SM, &v) == NVML_SUCCESS) {
        c.known = true;
        c.sm_clock_mhz = static_cast<int>(v);
      }
      if (api_.GetClockInfo(h, NVML_CLOCK_MEM, &v) == NVML_SUCCESS) {
        c.known = true;
        c.memory_clock_mhz = static_cast<int>(v);
      }
    }
    if (api_.GetTemperature(h, NVML_TEMPERATURE_GPU, &v) == NVML_SUCCESS)
      c.temperature_celsius = static_cast<int>(v);
    if (api_.GetPowerUsage && api_.GetPowerUsage(h, &v) == NVML_SUCCESS)
      c.power_milliwatts = static_cast<int>(v);
    unsigned long long reasons = 0;
    if (api_.GetClocksEventReasons && api_.GetClocksEventReasons(h, &reasons) == NVML_SUCCESS)
      c.throttle_reasons = reasons;
    return c;
  }

  bool processes(int index, std::vector<int>& pids) override {
    nvmlDevice_t h = handle(index);
    if (!h) return false;
    for (auto fn : {api_.GetComputeProcs, api_.GetGraphicsProcs}) {
      if (!fn) continue;
      std::vector<nvmlProcessInfo_t> infos(64);
      auto n = static_cast<unsigned int>(infos.size());
      nvmlReturn_t r = fn(h, &n, infos.data());
      if (r == NVML_ERROR_INSUFFICIENT_SIZE) {
        infos.resize(n + 16);
        n = static_cast<unsigned int>(infos.size());
        r = fn(h, &n, infos.data());
      }
      if (r != NVML_SUCCESS) return false;
      for (unsigned int i = 0; i < n && i < infos.size(); ++i)
        pids.push_back(static_cast<int>(infos[i].pid));
    }
    return true;
  }

  // nvmlDeviceGetProcessUtilization: first without a buffer for the count, then with one
  // (a little larger: samples may come in between). NOT_FOUND: no sample since since_us.
  // Seen on an H100 (driver 580): the first call answers INSUFFICIENT_SIZE; pids are those of
  // our PID namespace; a new sample comes about every 200 ms, and a call returns one sample per
  // process whose utilization is averaged over the time since since_us (a process whose queued
  // kernels ran for 1 s after since_us read sm 100, then decayed: 48 at 2 s, 24 at 4 s), so any
  // GPU use after since_us keeps it above 0; an idle process has samples with sm 0 and mem 0.
  bool gpu_users(int index, uint64_t since_us, std::map<int, uint64_t>& users) override {
    nvmlDevice_t h = handle(index);
    if (!h || !api_.GetProcessUtilization) return false;
    unsigned int count = 0;
    nvmlReturn_t r = api_.GetProcessUtilization(h, nullptr, &count, since_us);
    if (r == NVML_ERROR_NOT_FOUND) return true;
    if (r != NVML_SUCCESS && r != NVML_ERROR_INSUFFICIENT_SIZE) return false;
    std::vector<nvmlProcessUtilizationSample_t> samples;
    for (int attempt = 0; attempt < 3; ++attempt) {
      samples.assign(count + 16, nvmlProcessUtilizationSample_t{});
      count = static_cast<unsigned int>(samples.size());
      r = api_.GetProcessUtilization(h, samples.data(), &count, since_us);
      if (r != NVML_ERROR_INSUFFICIENT_SIZE) break;
    }
    if (r == NVML_ERROR_NOT_FOUND) return true;
    if (r != NVML_SUCCESS) {
      if (r != NVML_ERROR_NOT_SUPPORTED)
        log_line("nvmlDeviceGetProcessUtilization(GPU " + std::to_string(index) + "): " +
                 api_.ErrorString(r));
      return false;
    }
    for (unsigned int i = 0; i < count && i < samples.size(); ++i) {
      const auto& s = samples[i];
      if (s.timeStamp <= since_us || (s.smUtil == 0 && s.memUtil == 0)) continue;
      uint64_t& last = users[static_cast<int>(s.pid)];
      last = std::max<uint64_t>(last, s.timeStamp);
    }
    return true;
  }

  int event_fd() const override { return read_end_.get(); }

  std::vector<XidEvent> poll_events() override {
    std::vector<XidEvent> out;
    XidEvent e;
    while (::read(read_end_.get(), &e, sizeof e) == static_cast<ssize_t>(sizeof e))
      out.push_back(e);
    return out;
  }

 private:
  nvmlDevice_t handle(int index) const {
    for (size_t i = 0; i < devices_.size(); ++i)
      if (devices_[i].index == index) return handles_[i];
    return nullptr;
  }

  void wait_loop() {
    while (!stop_) {
      nvmlEventData_t data{};
      nvmlReturn_t r = api_.EventSetWait(set_, &data, 500);
      if (r == NVML_ERROR_TIMEOUT) continue;
      if (r != NVML_SUCCESS) {
        ::usleep(200000);  // e.g. GPU lost; keep trying without spinning
        continue;
      }
      if (!(data.eventType & nvmlEventTypeXidCriticalError)) continue;
      XidEvent e;
      e.device_index = -1;
      for (size_t i = 0; i < handles_.size(); ++i)
        if (handles_[i] == data.device) e.device_index = devices_[i].index;
      e.xid = static_cast<int>(data.eventData);
      ssize_t n = ::write(write_end_.get(), &e, sizeof e);  // atomic: smaller than PIPE_BUF
      (void)n;
    }
  }

  void* lib_;
  Api api_;
  bool initialized_ = false;
  std::vector<nvmlDevice_t> handles_;
  std::vector<DeviceInfo> devices_;
  nvmlEventSet_t set_ = nullptr;
  UniqueFd read_end_, write_end_;
  std::atomic<bool> stop_{false};
  std::thread waiter_;
};

}  // namespace

std::unique_ptr<NvmlSource> open_real_nvml(std::string* error) {
  void* lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char* e = dlerror();
    *error = std::string("dlopen libnvidia-ml.so.1: ") + (e ? e : "failed");
    return nullptr;
  }
  Api api{};
  bool ok = bind(lib, "nvmlInit_v2", api.Init, true, error) &&
            bind(lib, "nvmlShutdown", api.Shutdown, true, error) &&
            bind(lib, "nvmlErrorString", api.ErrorString, true, error) &&
            bind(lib, "nvmlDeviceGetCount_v2", api.GetCount, true, error) &&
            bind(lib, "nvmlDeviceGetHandleByIndex_v2", api.GetHandleByIndex, true, error) &&
            bind(lib, "nvmlDeviceGetName", api.GetName, true, error) &&
            bind(lib, "nvmlDeviceGetUUID", api.GetUUID, true, error) &&
            bind(lib, "nvmlDeviceGetPciInfo_v3", api.GetPciInfo, false, error) &&
            bind(lib, "nvmlDeviceGetMinorNumber", api.GetMinorNumber, false, error) &&
            bind(lib, "nvmlSystemGetDriverVersion", api.DriverVersion, true, error) &&
            bind(lib, "nvmlDeviceGetMemoryInfo", api.GetMemoryInfo, true, error) &&
            bind(lib, "nvmlDeviceGetTemperature", api.GetTemperature, true, error) &&
            bind(lib, "nvmlDeviceGetUtilizationRates", api.GetUtilization, true, error) &&
            bind(lib, "nvmlDeviceGetRemappedRows", api.GetRemappedRows, false, error) &&
            bind(lib, "nvmlDeviceGetFieldValues", api.GetFieldValues, false, error) &&
            bind(lib, "nvmlDeviceGetClockInfo", api.GetClockInfo, false, error) &&
            bind(lib, "nvmlDeviceGetPowerUsage", api.GetPowerUsage, false, error) &&
            bind(lib, "nvmlDeviceGetComputeRunningProcesses_v3", api.GetComputeProcs, false,
                 error) &&
            bind(lib, "nvmlDeviceGetGraphicsRunningProcesses_v3", api.GetGraphicsProcs, false,
                 error) &&
            bind(lib, "nvmlDeviceGetProcessUtilization", api.GetProcessUtilization, false,
                 error) &&
            bind(lib, "nvmlEventSetCreate", api.EventSetCreate, true, error) &&
            bind(lib, "nvmlDeviceRegisterEvents", api.RegisterEvents, true, error) &&
            bind(lib, "nvmlEventSetWait_v2", api.EventSetWait, true, error) &&
            bind(lib, "nvmlEventSetFree", api.EventSetFree, true, error);
  // The throttle reasons' newer name (drivers 535 and later), else the older one.
  bind(lib, "nvmlDeviceGetCurrentClocksEventReasons", api.GetClocksEventReasons, false, error);
  if (!api.GetClocksEventReasons)
    bind(lib, "nvmlDeviceGetCurrentClocksThrottleReasons", api.GetClocksEventReasons, false,
         error);
  if (!ok) {
    dlclose(lib);
    return nullptr;
  }
  auto nvml = std::make_unique<RealNvml>(lib, api);
  if (!nvml->start(error)) return nullptr;
  return nvml;
}

}  // namespace watchdog
