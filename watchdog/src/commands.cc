// The front end's commands: Configure (users, sandbox, cgroups, devices), Start/Stop/
// RestartWorkers and Shutdown (OpenWindow, CloseWindow and StopGpuUsers: windows.cc). Part of
// class Watchdog (watchdog.h).
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

namespace fs = std::filesystem;

namespace {

constexpr int64_t kDefaultMemory = int64_t{8} << 30;
constexpr int64_t kDefaultTmp = int64_t{1} << 30;
constexpr int64_t kDefaultPids = 1024;

bool matches(int wanted, int index) { return wanted == kAllDevices || wanted == index; }

}  // namespace

// ---------------------------------------------------------------- commands

std::string Watchdog::configure(const pb::Configure& c) {
  if (c.worker_command().empty()) return "worker_command is empty";
  for (const auto& e : c.xid_policy())
    if (!policy_.set(e.xid(), e.category(), e.action()))
      return "xid_policy: unknown action '" + e.action() + "' for XID " + std::to_string(e.xid());
  config_ = c;
  if (config_.workers_per_device() <= 0) config_.set_workers_per_device(1);
  if (config_.max_restarts() <= 0) config_.set_max_restarts(5);
  if (config_.restart_window_seconds() <= 0) config_.set_restart_window_seconds(30);
  if (config_.backoff_initial_ms() <= 0) config_.set_backoff_initial_ms(100);
  if (config_.backoff_max_ms() <= 0) config_.set_backoff_max_ms(5000);
  if (config_.reset_command().empty())
    config_.set_reset_command("nvidia-smi --gpu-reset -i {index}");
  if (config_.health_interval_seconds() <= 0) config_.set_health_interval_seconds(5);

  std::string error;
  switch (c.nvml_source()) {
    case pb::NVML_SOURCE_REAL:
      nvml_ = open_real_nvml(&error);
      if (!nvml_) return "NVML: " + error;
      break;
    case pb::NVML_SOURCE_FAKE:
      nvml_ = open_fake_nvml(c.fake_nvml_path(), &error);
      if (!nvml_) return "fake NVML: " + error;
      break;
    case pb::NVML_SOURCE_NONE:
      break;
    default:
      nvml_ = open_real_nvml(&error);
      if (!nvml_) log_line("no NVML (" + error + "); CPU pseudo-device only");
  }

  std::vector<DeviceInfo> found = nvml_ ? nvml_->devices() : std::vector<DeviceInfo>{};
  std::vector<int> indices(c.device_indices().begin(), c.device_indices().end());
  if (indices.empty())
    for (const auto& d : found) indices.push_back(d.index);
  if (indices.empty()) indices.push_back(-1);
  if (config_.build_processes() > 0) indices.push_back(kBuildDevice);
  for (int i : indices) {
    Device& d = devices_[i];
    d.info.index = i;
    d.info.name = i == kBuildDevice ? "build" : i < 0 ? "cpu" : "gpu " + std::to_string(i);
    for (const auto& f : found)
      if (f.index == i) d.info = f;
    d.intensity = RestartIntensity(config_.max_restarts(),
                                   int64_t{config_.restart_window_seconds()} * 1000,
                                   config_.backoff_initial_ms(), config_.backoff_max_ms());
    if (nvml_ && i >= 0) d.reading = nvml_->read(i);
  }

  if (nvml_) {
    const std::string path = c.kmsg_path().empty() ? "/dev/kmsg" : c.kmsg_path();
    if (int err = kmsg_.open(path); err != 0)
      warn_once("kmsg", "cannot read " + path + " (" + errno_text(err) +
                            "); XIDs without a pid go to the workers running jobs on that GPU");
  }

  state_dir_ = c.state_dir().empty() ? "/tmp/kerneleval-watchdog-" + std::to_string(::getpid())
                                     : c.state_dir();
  std::error_code ec;
  fs::create_directories(fs::path(state_dir_) / "roots", ec);
  if (ec) return "state_dir " + state_dir_ + ": " + ec.message();

  const auto& sb = c.sandbox();
  limits_.memory_bytes = sb.memory_bytes() > 0 ? sb.memory_bytes() : kDefaultMemory;
  limits_.max_pids = sb.max_pids() > 0 ? sb.max_pids() : kDefaultPids;

  // The job user: never root. Root watchdog: SandboxConfig.user, else kerneleval-job, else
  // nobody. Not root: a user namespace makes the zygote root inside it; the job processes stay
  // the service's own uid.
  zygote_config_.Clear();
  if (::geteuid() == 0) {
    std::string user = sb.user();
    if (user.empty()) user = ::getpwnam("kerneleval-job") ? "kerneleval-job" : "nobody";
    passwd* pw = ::getpwnam(user.c_str());
    if (user == "root" || (pw && pw->pw_uid == 0))
      return "sandbox.user: job processes never run as root";
    if (!pw) {
      no_user_reason_ = "no user '" + user + "' to run job processes as (never root)";
      warn_once("unprivileged_user", no_user_reason_ + "; no job processes start");
    } else {
      zygote_config_.set_uid(static_cast<int32_t>(pw->pw_uid));
      zygote_config_.set_gid(static_cast<int32_t>(pw->pw_gid));
    }
  } else {
    user_namespace_ = true;
    zygote_config_.set_uid(0);  // inside the zygote's user namespace: our own uid outside
    zygote_config_.set_gid(0);
    warn_once("unprivileged_user", "the watchdog is not root: job processes run as its own uid "
                                   "(" + std::to_string(::getuid()) + ") in a user namespace");
  }
  const std::string filter = build_seccomp_filter();
  if (filter.empty())
    warn_once("seccomp", "no seccomp filter for this architecture (x86_64 and aarch64 only)");
  zygote_config_.set_seccomp_filter(filter);
  const int64_t tmp = sb.tmp_bytes() > 0 ? sb.tmp_bytes() : kDefaultTmp;
  zygote_config_.set_tmp_bytes(tmp);
  zygote_config_.set_shm_bytes(tmp);
  zygote_config_.set_max_open_files(sb.max_open_files() > 0 ? sb.max_open_files() : 4096);
  zygote_config_.set_new_namespaces(true);

  std::vector<std::pair<std::string, std::string>> refused;
  cgroups_.init(sb.cgroup_root(), &refused);
  for (const auto& [feature, why] : refused)
    warn_once(feature, why + (feature == "cgroup_freezer"
                                  ? "; timing windows cannot freeze a GPU's other job processes"
                                  : "; job processes run without it"));
  configured_ = true;
  next_health_ms_ = now_ms() + int64_t{config_.health_interval_seconds()} * 1000;
  return "";
}

bool Watchdog::start_workers(int index, std::string* why) {
  bool any = false;
  for (auto& [i, d] : devices_) {
    if (!matches(index, i)) continue;
    any = true;
    if (d.needs_reset || d.reset) {
      *why = "device " + std::to_string(i) + " needs ResetGpu";
      if (index != kAllDevices) return false;
      continue;
    }
    if (!no_user_reason_.empty()) {
      *why = no_user_reason_;
      return false;
    }
    if (d.health == pb::HEALTH_UNHEALTHY) {  // restart intensity: an operator says go again
      d.intensity.clear();
      d.fill_due_ms = 0;
      d.zygote.due_ms = 0;
      set_health(d, pb::HEALTH_HEALTHY, "");
    }
    d.wanted = true;
    fill(d);
  }
  if (!any) *why = "no device " + std::to_string(index);
  return any;
}

void Watchdog::stop_workers(int index, int grace_ms, const std::string& reason) {
  for (auto& [i, d] : devices_)
    if (matches(index, i)) {
      d.wanted = false;
      stop_zygote(d);
    }
  for (auto& [id, w] : workers_)
    if (matches(index, w.device) && w.exit_reason.empty()) terminate(w, grace_ms, reason, false);
}

bool Watchdog::restart_workers(int index, std::string* why) {
  // Stop what runs (a device waiting for ResetGpu keeps its state), then start as
  // StartWorkers does, which also reports the devices that need a reset.
  if (index != kAllDevices && !device(index)) {
    *why = "no device " + std::to_string(index);
    return false;
  }
  for (auto& [i, d] : devices_) {
    if (!matches(index, i) || d.needs_reset || d.reset) continue;
    stop_workers(i, 0, "restart");
    d.intensity.clear();
  }
  return start_workers(index, why);
}

void Watchdog::begin_shutdown(int grace_ms) {
  shutting_down_ = true;
  thaw_windows();  // nothing is timed any more, and a frozen process could not take its SIGTERM
  stop_workers(kAllDevices, grace_ms, "shutdown");
  for (auto& [i, d] : devices_)
    if (d.reset && d.reset->command_pid > 0) ::kill(-d.reset->command_pid, SIGKILL);
  shutdown_deadline_ = now_ms() + grace_ms + 2000;
}

}  // namespace watchdog
