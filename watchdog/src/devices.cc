// Devices: health readings, XIDs and what the XID policy does about them. Part of class
// Watchdog (watchdog.h).
#include "watchdog.h"

#include <fcntl.h>
#include <poll.h>
#include <pwd.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>

#include "log.h"
#include "seccomp.h"

namespace watchdog {

namespace {

constexpr int kAutoResetGraceMs = 1000;
constexpr int64_t kKmsgWaitMs = 1500;  // how long an XID waits for its kernel log line
// A job process named by an application XID gets this long to report its CUDA error and exit
// by itself (on the H200 the error and the XID arrive together) before it is killed.
constexpr int kXidReportGraceMs = 2000;

}  // namespace

// ---------------------------------------------------------------- devices, health, XIDs

Device* Watchdog::device(int index) {
  auto it = devices_.find(index);
  return it == devices_.end() ? nullptr : &it->second;
}

void Watchdog::set_health(Device& d, pb::Health h, const std::string& reason) {
  if (d.health == h && d.reason == reason) return;
  d.health = h;
  d.reason = reason;
  log_line("device " + std::to_string(d.info.index) + ": " + pb::Health_Name(h) +
           (reason.empty() ? "" : " (" + reason + ")"));
  send_device_update(d);
}

void Watchdog::fill_status(const Device& d, pb::DeviceStatus* s) const {
  s->set_device_index(d.info.index);
  s->set_name(d.info.name);
  s->set_uuid(d.info.uuid);
  s->set_health(d.health);
  s->set_health_reason(d.reason);
  s->set_memory_total_bytes(d.reading.memory_total_bytes);
  s->set_memory_used_bytes(d.reading.memory_used_bytes);
  s->set_temperature_celsius(d.reading.temperature_celsius);
  s->set_utilization_percent(d.reading.utilization_percent);
  s->set_remapped_row_count(d.reading.remapped_row_count);
  s->set_remap_pending(d.reading.remap_pending);
  s->set_recovery_action(d.reading.recovery_action);
  s->set_driver_version(d.info.driver_version);
}

void Watchdog::send_device_update(const Device& d) {
  pb::WatchdogEvent ev;
  fill_status(d, ev.mutable_device()->mutable_device());
  emit(ev);
}

void Watchdog::require_reset(Device& d, const std::string& why, bool auto_reset) {
  if (why.empty() || d.reset) return;  // a reset in progress ends with its own health check
  d.needs_reset = true;
  set_health(d, pb::HEALTH_UNHEALTHY, why);
  if (!auto_reset) return;
  if (d.auto_resets.record_failure(now_ms())) {
    set_health(d, pb::HEALTH_UNHEALTHY, why + "; more than 3 automatic resets in an hour: "
                                              "waiting for ResetGpu");
    return;
  }
  begin_reset(d, kAutoResetGraceMs, 0);
}

void Watchdog::read_health(int64_t now) {
  if (now < next_health_ms_) return;
  next_health_ms_ = now + int64_t{config_.health_interval_seconds()} * 1000;
  for (auto& [i, d] : devices_) {
    if (nvml_ && i >= 0 && !d.reset) {
      d.reading = nvml_->read(i);
      const std::string action = XidPolicy::action_for_recovery(d.reading.recovery_action);
      if (!d.needs_reset && action == kResetGpu)
        require_reset(d, "NVML recovery action: " + d.reading.recovery_action, config_.auto_reset());
      else if (!d.needs_reset && action == kMarkUnhealthy)
        require_reset(d, "NVML recovery action: " + d.reading.recovery_action, false);
      else if (!d.reading.ok && d.health == pb::HEALTH_HEALTHY)
        set_health(d, pb::HEALTH_UNHEALTHY, "health reading: " + d.reading.error);
    }
    send_device_update(d);
  }
}

void Watchdog::poll_xids(int64_t now) {
  kmsg_.poll(now);
  if (nvml_)
    for (const XidEvent& e : nvml_->poll_events()) {
      const bool wait = e.pid == 0 && kmsg_.is_open();
      xids_.push_back({e, wait ? now + kKmsgWaitMs : now});
    }
  for (size_t i = 0; i < xids_.size();) {
    PendingXid& p = xids_[i];
    bool matched = p.event.pid != 0;
    if (!matched && kmsg_.is_open()) {
      const Device* d = device(p.event.device_index);
      if (auto k = kmsg_.take(p.event.xid, d ? d->info.pci_bus_id : "", now, 10000)) {
        p.event.pid = k->pid;  // may stay 0: the line said pid='<unknown>'
        matched = true;
      }
    }
    if (matched || now >= p.deadline_ms) {
      XidEvent e = p.event;
      xids_.erase(xids_.begin() + static_cast<long>(i));
      handle_xid(e);
    } else {
      ++i;
    }
  }
}

void Watchdog::handle_xid(const XidEvent& e) {
  const XidRule rule = policy_.lookup(e.xid);
  pb::WatchdogEvent ev;
  auto* x = ev.mutable_xid();
  x->set_device_index(e.device_index);
  x->set_xid(e.xid);
  x->set_category(rule.category);
  x->set_action(rule.action);
  x->set_pid(e.pid);
  x->set_time_ms(unix_now_ms());
  x->set_message(rule.description);
  Device* d = device(e.device_index);
  std::vector<Worker*> victims;
  if (d) {
    Worker* named = worker_for_pid(e.pid);
    if (named && named->device == e.device_index) {
      victims.push_back(named);
    } else if (e.pid == 0 || rule.action != std::string(kRestartWorker)) {
      for (auto& [id, w] : workers_)  // without a pid: whoever runs a job on that GPU
        if (w.device == e.device_index && !w.job_id.empty() && w.exit_reason.empty())
          victims.push_back(&w);
    }
  } else {
    x->set_message(rule.description + " (device not supervised)");
  }
  for (Worker* w : victims) {
    x->add_worker_ids(w->id);
    if (!w->job_id.empty()) x->add_job_ids(w->job_id);
  }
  log_line("XID " + std::to_string(e.xid) + " on device " + std::to_string(e.device_index) +
           " pid " + std::to_string(e.pid) + ": " + rule.category + " -> " + rule.action);
  emit(ev);
  if (!d) return;
  const std::string why = "XID " + std::to_string(e.xid) + " (" + rule.description + ")";
  if (rule.action == kRestartWorker) {
    for (Worker* w : victims) terminate(*w, kXidReportGraceMs, "xid", true, /*quiet=*/true);
  } else if (rule.action == kResetGpu) {
    require_reset(*d, why + " needs a GPU reset", config_.auto_reset());
  } else if (rule.action == kMarkUnhealthy) {
    require_reset(*d, why + " needs an operator", false);
  }
}

}  // namespace watchdog
