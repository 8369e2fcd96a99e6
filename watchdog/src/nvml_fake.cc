// Fake NVML for tests. Reads lines from a file or FIFO that tests append to; each line is one
// record of whitespace-separated words ('#' starts a comment):
//
//   device <index> [name=<text>] [uuid=<text>] [pci=<bus id>] [memory_total=<bytes>]
//                                                                       declare a GPU
//   xid <index> <xid> [pid=<pid>]                                       an XID event
//   health <index> [memory_used=<bytes>] [temperature=<C>] [utilization=<%>]
//          [remapped_rows=<n>] [remap_pending=0|1] [recovery_action=<text>] [ok=0|1]
//          [error=<text>]                                               health readings
//   processes <index> [<pid> ...]                                       processes holding it
//   clocks <index> [sm=<MHz>] [mem=<MHz>] [temperature=<C>] [power_mw=<mW>]
//          [reasons=<bitmask, decimal or 0x hex>]                       GPU conditions
//   utilization <index> <pid> [sm=<percent>] [mem=<percent>]           a per-process sample
//
// Devices must be declared before Configure; the other records may come at any time. Like
// health, a clocks line sets only the fields it names. A declared device's conditions are
// known and 0 where no clocks line set them, but for the temperature: its health line's until
// a clocks line names one. An undeclared device's are not known.
//
// A utilization line adds one per-process utilization sample (as nvmlDeviceGetProcessUtilization
// gives them; sm and mem default to 0), stamped with the time the fake reads the line
// (CLOCK_REALTIME in microseconds, NVML's clock; the watchdog reads the file at least every
// 50 ms tick and whenever it asks the fake something). gpu_users(index, since) answers the
// pids with a sample newer than since whose sm or mem is above 0; a declared device without
// such samples has none; an undeclared device cannot tell.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <map>
#include <sstream>

#include "fd.h"
#include "log.h"
#include "nvml_source.h"

namespace watchdog {

namespace {

class FakeNvml : public NvmlSource {
 public:
  explicit FakeNvml(UniqueFd fd) : fd_(std::move(fd)) { pump(); }

  std::vector<DeviceInfo> devices() override {
    pump();
    std::vector<DeviceInfo> out;
    for (auto& [i, d] : devices_) out.push_back(d.info);
    return out;
  }
  Reading read(int index) override {
    pump();
    auto it = devices_.find(index);
    if (it == devices_.end()) {
      Reading r;
      r.ok = false;
      r.error = "no such device";
      return r;
    }
    return it->second.reading;
  }
  Conditions conditions(int index) override {
    pump();
    auto it = devices_.find(index);
    if (it == devices_.end()) return Conditions{};
    const Dev& d = it->second;
    Conditions c = d.conditions;
    c.known = true;
    if (!d.clocks_temperature) c.temperature_celsius = d.reading.temperature_celsius;
    return c;
  }
  bool processes(int index, std::vector<int>& pids) override {
    pump();
    auto it = devices_.find(index);
    if (it == devices_.end()) return false;
    pids = it->second.pids;
    return true;
  }
  bool gpu_users(int index, uint64_t since_us, std::map<int, uint64_t>& users) override {
    pump();
    auto it = devices_.find(index);
    if (it == devices_.end()) return false;
    for (const Sample& s : it->second.samples)
      if (s.time_us > since_us && (s.sm > 0 || s.mem > 0))
        users[s.pid] = std::max(users[s.pid], s.time_us);
    return true;
  }
  int event_fd() const override { return -1; }
  std::vector<XidEvent> poll_events() override {
    pump();
    return std::exchange(events_, {});
  }

 private:
  struct Sample {  // one per-process utilization sample
    int pid = 0;
    uint64_t time_us = 0;
    int sm = 0, mem = 0;
  };
  struct Dev {
    DeviceInfo info;
    Reading reading;
    std::vector<int> pids;
    Conditions conditions;            // as the clocks lines set them
    bool clocks_temperature = false;  // a clocks line named the temperature
    std::vector<Sample> samples;
  };

  static uint64_t parse_mask(const std::string& v) {
    const bool hex = v.size() > 2 && v[0] == '0' && (v[1] == 'x' || v[1] == 'X');
    return std::stoull(v, nullptr, hex ? 16 : 10);
  }

  void pump() {
    char buf[4096];
    for (;;) {
      ssize_t n = ::read(fd_.get(), buf, sizeof buf);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      partial_.append(buf, static_cast<size_t>(n));
    }
    size_t start = 0, nl;
    while ((nl = partial_.find('\n', start)) != std::string::npos) {
      handle(partial_.substr(start, nl - start));
      start = nl + 1;
    }
    partial_.erase(0, start);
  }

  static std::map<std::string, std::string> options(std::istringstream& in) {
    std::map<std::string, std::string> kv;
    std::string word;
    while (in >> word) {
      auto eq = word.find('=');
      if (eq != std::string::npos) kv[word.substr(0, eq)] = word.substr(eq + 1);
    }
    return kv;
  }

  void handle(const std::string& raw) {
    std::string line = raw.substr(0, raw.find('#'));
    std::istringstream in(line);
    std::string kind;
    int index = 0;
    if (!(in >> kind)) return;
    if (!(in >> index)) {
      log_line("fake nvml: bad line: " + raw);
      return;
    }
    try {
      if (kind == "device") {
        auto kv = options(in);
        Dev& d = devices_[index];
        d.info.index = index;
        d.info.name = kv.count("name") ? kv["name"] : "Fake GPU " + std::to_string(index);
        d.info.uuid = kv.count("uuid") ? kv["uuid"] : "GPU-fake-" + std::to_string(index);
        d.info.driver_version = "fake";
        d.info.pci_bus_id = kv.count("pci") ? kv["pci"] : "";
        d.reading.memory_total_bytes =
            kv.count("memory_total") ? std::stoll(kv["memory_total"]) : (80LL << 30);
      } else if (kind == "xid") {
        XidEvent e;
        e.device_index = index;
        if (!(in >> e.xid)) throw std::invalid_argument("xid");
        auto kv = options(in);
        if (kv.count("pid")) e.pid = std::stoi(kv["pid"]);
        events_.push_back(e);
      } else if (kind == "health") {
        Reading& r = devices_.at(index).reading;
        for (auto& [k, v] : options(in)) {
          if (k == "memory_used") r.memory_used_bytes = std::stoll(v);
          else if (k == "temperature") r.temperature_celsius = std::stoi(v);
          else if (k == "utilization") r.utilization_percent = std::stoi(v);
          else if (k == "remapped_rows") r.remapped_row_count = std::stoi(v);
          else if (k == "remap_pending") r.remap_pending = v == "1";
          else if (k == "recovery_action") r.recovery_action = v;
          else if (k == "ok") r.ok = v == "1";
          else if (k == "error") r.error = v;
        }
      } else if (kind == "clocks") {
        Dev& d = devices_.at(index);
        Conditions& c = d.conditions;
        for (auto& [k, v] : options(in)) {
          if (k == "sm") c.sm_clock_mhz = std::stoi(v);
          else if (k == "mem") c.memory_clock_mhz = std::stoi(v);
          else if (k == "temperature") {
            c.temperature_celsius = std::stoi(v);
            d.clocks_temperature = true;
          }
          else if (k == "power_mw") c.power_milliwatts = std::stoi(v);
          else if (k == "reasons") c.throttle_reasons = parse_mask(v);
        }
      } else if (kind == "processes") {
        std::vector<int> pids;
        int pid;
        while (in >> pid) pids.push_back(pid);
        devices_.at(index).pids = pids;
      } else if (kind == "utilization") {
        Sample s;
        s.time_us = nvml_clock_us();
        if (!(in >> s.pid)) throw std::invalid_argument("pid");
        for (auto& [k, v] : options(in)) {
          if (k == "sm") s.sm = std::stoi(v);
          else if (k == "mem") s.mem = std::stoi(v);
        }
        devices_.at(index).samples.push_back(s);
      } else {
        log_line("fake nvml: unknown record: " + raw);
      }
    } catch (const std::exception&) {
      log_line("fake nvml: bad line: " + raw);
    }
  }

  UniqueFd fd_;
  std::string partial_;
  std::map<int, Dev> devices_;
  std::vector<XidEvent> events_;
};

}  // namespace

std::unique_ptr<NvmlSource> open_fake_nvml(const std::string& path, std::string* error) {
  // O_RDWR on a FIFO keeps it open without a writer (no EOF storm, no blocking open).
  int fd = ::open(path.c_str(), O_RDWR | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    *error = "open " + path + ": " + errno_text(errno);
    return nullptr;
  }
  return std::make_unique<FakeNvml>(UniqueFd(fd));
}

}  // namespace watchdog
