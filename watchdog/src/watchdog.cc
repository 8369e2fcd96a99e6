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

int64_t now_ms() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000 + ts.tv_nsec / 1000000;
}

int64_t unix_now_ms() {
  using namespace std::chrono;
  return duration_cast<milliseconds>(system_clock::now().time_since_epoch()).count();
}

namespace {

constexpr int kAllDevices = -2;
constexpr int kAutoResetGraceMs = 1000;
constexpr int64_t kKmsgWaitMs = 1500;  // how long an XID waits for its kernel log line
// A job process named by an application XID gets this long to report its CUDA error and exit
// by itself (on the H200 the error and the XID arrive together) before it is killed.
constexpr int kXidReportGraceMs = 2000;
constexpr int64_t kZygoteReadyTimeoutMs = 180000;  // imports torch and triton: seconds
constexpr int64_t kEarlyExitKeepMs = 60000;
constexpr int64_t kDefaultMemory = int64_t{8} << 30;
constexpr int64_t kDefaultTmp = int64_t{1} << 30;
constexpr int64_t kDefaultPids = 1024;

bool matches(int wanted, int index) { return wanted == kAllDevices || wanted == index; }

}  // namespace

Watchdog::Watchdog(int control_fd) : control_(control_fd) {}

// ---------------------------------------------------------------- the story
//
// Like tini's main: become the reaper, take the signals, then loop: wait for something, handle
// the signals, reap every child, read the front end's commands and the zygotes' events, run
// the timers. When the front end goes away nothing may outlive it.

int Watchdog::run() {
  if (!become_subreaper_and_take_signals()) return 1;
  while (exit_code_ < 0) {
    wait_for_something();
    handle_signals();
    reap_children();
    read_commands();
    if (closed_) {  // the front end is gone: nothing may outlive it
      log_line("control channel closed: killing every job process and exiting");
      kill_everything();
      return shutting_down_ ? 0 : 1;
    }
    read_zygotes();
    reap_children();
    tick(now_ms());
  }
  kill_everything();
  flush_output(true);
  return exit_code_ < 0 ? 1 : exit_code_;
}

bool Watchdog::become_subreaper_and_take_signals() {
  ::signal(SIGPIPE, SIG_IGN);
  sigset_t mask;
  sigemptyset(&mask);
  for (int sig : {SIGCHLD, SIGTERM, SIGINT, SIGHUP}) sigaddset(&mask, sig);
  ::sigprocmask(SIG_BLOCK, &mask, nullptr);
  signals_.reset(::signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK));
  if (!signals_.valid()) {
    log_line("signalfd: " + errno_text(errno));
    return false;
  }
  // Job processes are forked by a zygote's child that exits at once: they are re-parented to
  // us, the nearest subreaper, and reaped here.
  if (::prctl(PR_SET_CHILD_SUBREAPER, 1) != 0) {
    log_line("PR_SET_CHILD_SUBREAPER: " + errno_text(errno));
    return false;
  }
  ::fcntl(control_.get(), F_SETFD, FD_CLOEXEC);
  ::fcntl(control_.get(), F_SETFL, ::fcntl(control_.get(), F_GETFL) | O_NONBLOCK);
  return true;
}

void Watchdog::wait_for_something() {
  std::vector<pollfd> fds;
  fds.push_back({control_.get(), static_cast<short>(POLLIN | (out_.empty() ? 0 : POLLOUT)), 0});
  fds.push_back({signals_.get(), POLLIN, 0});
  fds.push_back({nvml_ ? nvml_->event_fd() : -1, POLLIN, 0});
  for (auto& [i, d] : devices_)
    if (d.zygote.fd() >= 0)
      fds.push_back({d.zygote.fd(),
                     static_cast<short>(POLLIN | (d.zygote.wants_write() ? POLLOUT : 0)), 0});
  if (::poll(fds.data(), fds.size(), 50) < 0 && errno != EINTR)
    log_line("poll: " + errno_text(errno));
  if (fds[0].revents & POLLOUT) flush_output(false);
}

void Watchdog::handle_signals() {
  signalfd_siginfo si{};
  while (::read(signals_.get(), &si, sizeof si) == static_cast<ssize_t>(sizeof si)) {
    if (si.ssi_signo == SIGCHLD) continue;
    log_line(std::string("signal ") + strsignal(static_cast<int>(si.ssi_signo)) +
             ": shutting down");
    if (!shutting_down_) begin_shutdown(1000);
  }
}

void Watchdog::reap_children() {
  for (;;) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid <= 0) return;
    bool known = false;
    for (auto& [id, w] : workers_)
      if (w.pid == pid) {
        known = true;
        on_worker_exit(id, status);
        break;
      }
    if (known) continue;
    for (auto& [i, d] : devices_) {
      if (d.zygote.pid() == pid) {
        known = true;
        on_zygote_exit(d, status);
      }
      if (d.reset && d.reset->command_pid == pid) {
        known = true;
        d.reset->command_done = true;
        d.reset->command_status = status;
      }
    }
    // Else: a job process whose JobProcessSpawned has not come yet (kept for it), or a
    // zygote's short-lived intermediate child.
    if (!known) early_exits_[pid] = {status, now_ms()};
  }
}

void Watchdog::read_commands() {
  char buf[65536];
  while (!closed_) {
    long n = recv_with_fds(control_.get(), buf, sizeof buf, rx_fds_);
    rx_fds_.clear();  // no command carries descriptors
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (n <= 0) {
      closed_ = true;
      return;
    }
    auto result = decoder_.feed(buf, static_cast<size_t>(n));
    for (const auto& e : result.errors) {
      log_line("control channel: " + e);
      warned_.erase("protocol");
      warn_once("protocol", e);
    }
    for (const auto& f : result.frames) handle_frame(f);
  }
}

void Watchdog::read_zygotes() {
  for (auto& [i, d] : devices_) {
    if (d.zygote.fd() < 0) continue;
    bool closed = false;
    std::vector<std::string> errors;
    if (d.zygote.wants_write() && !d.zygote.flush()) closed = true;
    auto events = d.zygote.read(&closed, &errors);
    for (const auto& e : errors) log_line("zygote of device " + std::to_string(i) + ": " + e);
    for (const auto& ev : events) on_zygote_event(d, ev);
    // A closed channel: the zygote is exiting; its exit (reaped) does the rest. One that
    // stays up without its channel is killed after a moment.
    if (closed && d.zygote.pid() > 0 && !d.zygote.closed_ms) d.zygote.closed_ms = now_ms();
  }
}

void Watchdog::tick(int64_t now) {
  if (!configured_) return;
  poll_xids(now);
  for (auto& [id, w] : workers_)
    if (w.kill_at_ms && now >= w.kill_at_ms) {
      w.kill_at_ms = 0;
      kill_cgroup(w);
    }
  for (auto& [id, w] : workers_)  // a killed job process whose cgroup still has members
    if (w.spawned() && !w.exit_reason.empty() && !w.kill_at_ms) cgroups_.kill(w.cgroup);
  for (size_t i = 0; i < doomed_.size();) {
    cgroups_.kill(doomed_[i]);
    if (cgroups_.remove(doomed_[i])) doomed_.erase(doomed_.begin() + static_cast<long>(i));
    else ++i;
  }
  for (auto it = early_exits_.begin(); it != early_exits_.end();)
    it = now - it->second.second > kEarlyExitKeepMs ? early_exits_.erase(it) : std::next(it);
  for (auto& [i, d] : devices_) {
    if (d.zygote.state == Zygote::State::kStarting &&
        now - d.zygote.started_ms > kZygoteReadyTimeoutMs) {
      log_line("zygote of device " + std::to_string(i) + " did not get ready: killed");
      d.zygote.last_error = "not ready after " + std::to_string(kZygoteReadyTimeoutMs / 1000) + " s";
      d.zygote.kill_quietly();
    }
    if (d.zygote.closed_ms && now - d.zygote.closed_ms > 2000 && d.zygote.pid() > 0) {
      d.zygote.closed_ms = 0;
      d.zygote.kill_quietly();
    }
    if (now >= d.fill_due_ms) fill(d);
    if (d.reset) advance_reset(d, now);
  }
  read_health(now);
  if (shutting_down_) {
    bool busy = false;
    for (auto& [i, d] : devices_)
      busy = busy || (d.reset && d.reset->command_pid > 0) || d.zygote.pid() > 0;
    if ((workers_.empty() && !busy) || now >= shutdown_deadline_) exit_code_ = 0;
    else if (now >= shutdown_deadline_ - 2000) kill_everything();
  }
}

void Watchdog::kill_everything() {
  for (auto& [id, w] : workers_) {
    cgroups_.kill(w.cgroup);
    if (w.pid > 0) ::kill(w.pid, SIGKILL);
  }
  for (auto& [i, d] : devices_) {
    if (d.zygote.pid() > 0) d.zygote.kill();
    if (d.reset && d.reset->command_pid > 0) ::kill(-d.reset->command_pid, SIGKILL);
  }
  for (auto& cg : doomed_) cgroups_.kill(cg);
  // Whatever is left below our cgroup folder (a job process mid-spawn) dies with it.
  if (exit_code_ >= 0 || closed_) cgroups_.destroy_all();
}

// ---------------------------------------------------------------- channel

void Watchdog::emit(pb::WatchdogEvent& ev, std::vector<UniqueFd> fds) {
  std::string payload;
  if (!ev.SerializeToString(&payload)) return;
  out_.push(payload, std::move(fds));
  flush_output(false);
}

void Watchdog::ack(uint64_t id, bool ok, const std::string& message) {
  pb::WatchdogEvent ev;
  ev.set_command_id(id);
  ev.mutable_ack()->set_ok(ok);
  ev.mutable_ack()->set_message(message);
  if (!ok) log_line("command " + std::to_string(id) + " refused: " + message);
  emit(ev);
}

void Watchdog::warn_once(const std::string& feature, const std::string& message) {
  if (!warned_.insert(feature).second) return;
  log_line("warning: " + feature + ": " + message);
  pb::WatchdogEvent ev;
  ev.mutable_warning()->set_feature(feature);
  ev.mutable_warning()->set_message(message);
  emit(ev);
}

void Watchdog::flush_output(bool block) {
  if (closed_) return;
  if (!out_.flush(control_.get(), block)) closed_ = true;  // EPIPE: the front end is gone
}

void Watchdog::handle_frame(const std::string& payload) {
  pb::WatchdogCommand cmd;
  if (!cmd.ParseFromString(payload)) {
    const std::string why = "malformed command frame of " + std::to_string(payload.size()) +
                            " bytes rejected";
    log_line("control channel: " + why);
    warned_.erase("protocol");
    warn_once("protocol", why);
    return;
  }
  handle_command(cmd);
}
void Watchdog::handle_command(const pb::WatchdogCommand& cmd) {
  const uint64_t id = cmd.command_id();
  if (cmd.kind_case() == pb::WatchdogCommand::kConfigure) {
    if (configured_) return ack(id, false, "already configured");
    std::string error = configure(cmd.configure());
    ack(id, error.empty(), error);
    if (!error.empty()) return;
    for (auto& [i, d] : devices_) send_device_update(d);
    for (auto& [i, d] : devices_) {
      d.wanted = true;
      if (!no_user_reason_.empty())
        set_health(d, pb::HEALTH_UNHEALTHY, no_user_reason_);
      fill(d);
    }
    return;
  }
  if (!configured_) return ack(id, false, "not configured: send Configure first");
  if (shutting_down_) return ack(id, false, "shutting down");
  std::string why;
  switch (cmd.kind_case()) {
    case pb::WatchdogCommand::kStartWorkers: {
      bool ok = start_workers(cmd.start_workers().device_index(), &why);
      return ack(id, ok, why);
    }
    case pb::WatchdogCommand::kStopWorkers: {
      const auto& s = cmd.stop_workers();
      if (s.device_index() != kAllDevices && !device(s.device_index()))
        return ack(id, false, "no device " + std::to_string(s.device_index()));
      stop_workers(s.device_index(), s.grace_ms(), "stopped");
      return ack(id, true);
    }
    case pb::WatchdogCommand::kRestartWorkers: {
      bool ok = restart_workers(cmd.restart_workers().device_index(), &why);
      return ack(id, ok, why);
    }
    case pb::WatchdogCommand::kKillWorker: {
      Worker* w = find_worker(cmd.kill_worker().worker_id());
      if (!w) return ack(id, false, "no worker " + cmd.kill_worker().worker_id());
      terminate(*w, 0, "killed:" + cmd.kill_worker().reason(), true);
      return ack(id, true);
    }
    case pb::WatchdogCommand::kSetJob: {
      Worker* w = find_worker(cmd.set_job().worker_id());
      if (!w) return ack(id, false, "no worker " + cmd.set_job().worker_id());
      w->job_id = cmd.set_job().job_id();
      return ack(id, true);
    }
    case pb::WatchdogCommand::kGetStatus: {
      ack(id, true);
      pb::WatchdogEvent ev;
      ev.set_command_id(id);
      auto* report = ev.mutable_status();
      for (auto& [i, d] : devices_) fill_status(d, report->add_devices());
      for (auto& [wid, w] : workers_)
        if (w.spawned()) fill_worker(w, report->add_workers());
      return emit(ev);
    }
    case pb::WatchdogCommand::kResetGpu: {
      const auto& r = cmd.reset_gpu();
      Device* d = device(r.device_index());
      if (!d || r.device_index() < 0) return ack(id, false, "no GPU " + std::to_string(r.device_index()));
      if (d->reset) return ack(id, false, "a reset of this GPU is already running");
      ack(id, true);
      return begin_reset(*d, r.grace_ms(), id);
    }
    case pb::WatchdogCommand::kShutdown:
      ack(id, true);
      return begin_shutdown(cmd.shutdown().grace_ms());
    default:
      return ack(id, false, "unknown command");
  }
}

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
  for (int i : indices) {
    Device& d = devices_[i];
    d.info.index = i;
    d.info.name = i < 0 ? "cpu" : "gpu " + std::to_string(i);
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
    warn_once(feature, why + "; job processes run without it");
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
  stop_workers(kAllDevices, grace_ms, "shutdown");
  for (auto& [i, d] : devices_)
    if (d.reset && d.reset->command_pid > 0) ::kill(-d.reset->command_pid, SIGKILL);
  shutdown_deadline_ = now_ms() + grace_ms + 2000;
}

// ---------------------------------------------------------------- zygotes

void Watchdog::start_zygote(Device& d) {
  const int index = d.info.index;
  SandboxSpec spec;
  spec.argv.assign(config_.worker_command().begin(), config_.worker_command().end());
  // The environment: Configure.worker_env and the device's variables, nothing of ours.
  std::map<std::string, std::string> env(config_.worker_env().begin(), config_.worker_env().end());
  env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID";  // CUDA's numbering = NVML's (default: fastest first)
  env["CUDA_VISIBLE_DEVICES"] = index < 0 ? "" : std::to_string(index);
  env["KERNELEVAL_DEVICE_INDEX"] = std::to_string(index);
  env["TMPDIR"] = "/tmp";
  env["HOME"] = "/tmp";
  env["TRITON_CACHE_DIR"] = "/tmp/triton";
  env["TORCH_EXTENSIONS_DIR"] = "/tmp/torch_extensions";
  zpb::ZygoteConfig zc = zygote_config_;
  for (const auto& [k, v] : env) {
    spec.env.push_back(k + "=" + v);
    (*zc.mutable_job_env())[k] = v;
  }
  spec.fresh_root = true;
  const fs::path root = fs::path(state_dir_) / "roots" / (index < 0 ? "cpu" : "d" + std::to_string(index));
  std::error_code ec;
  fs::create_directories(root, ec);
  ::chmod(root.c_str(), 0755);
  spec.root_dir = root.string();
  spec.read_only_paths.assign(config_.sandbox().read_only_paths().begin(),
                              config_.sandbox().read_only_paths().end());
  spec.device_nodes = gpu_device_nodes(index, d.info.minor);
  spec.user_namespace = user_namespace_;

  SpawnResult r;
  const bool ok = d.zygote.start(spec, zc, &r);
  for (const auto& [feature, err] : r.refused)
    warn_once(feature, "the host refused " + feature + " (" + err + "); the sandbox runs without it");
  if (!r.error.empty()) {  // exec or a sandbox step failed: the child exits and counts as a failure
    log_line("zygote of device " + std::to_string(index) + ": " + r.error);
    d.zygote.last_error = r.error;
    const bool exec = r.error.rfind("exec", 0) == 0;
    warn_once(exec ? "worker_command" : "mount_namespace",
              (exec ? "cannot start " + spec.argv[0] + ": " : "cannot make the device sandbox: ") +
                  r.error);
  }
  if (!ok) {  // fork failed: count it like a crash so a broken host trips the intensity
    failed_start(d, "cannot start the zygote: " + r.error);
    return;
  }
  d.zygote.started_ms = now_ms();
  log_line("zygote of device " + std::to_string(index) + " started: pid " +
           std::to_string(d.zygote.pid()));
}

void Watchdog::stop_zygote(Device& d) {
  if (d.zygote.pid() > 0) d.zygote.kill();
}

void Watchdog::on_zygote_event(Device& d, const zpb::ZygoteEvent& ev) {
  if (ev.has_ready()) {
    d.zygote.state = Zygote::State::kReady;
    log_line("zygote of device " + std::to_string(d.info.index) + " ready (torch " +
             ev.ready().torch_version() + ", triton " + ev.ready().triton_version() + ")");
    fill(d);
  } else if (ev.has_spawned()) {
    on_spawned(d, ev.spawned());
  }
}

void Watchdog::on_zygote_exit(Device& d, int status) {
  const bool on_purpose = d.zygote.stopping;
  const bool was_ready = d.zygote.state == Zygote::State::kReady;
  d.zygote.exited();
  const std::string how = WIFSIGNALED(status) ? "signal " + std::to_string(WTERMSIG(status))
                                              : "exit code " + std::to_string(WEXITSTATUS(status));
  log_line("zygote of device " + std::to_string(d.info.index) + " exited (" + how + ")");
  // Job processes it was making will not come: their cgroups go, they are not announced.
  std::vector<std::string> lost;
  for (auto& [id, w] : workers_)
    if (w.device == d.info.index && !w.spawned()) lost.push_back(id);
  for (const auto& id : lost) {
    Worker& w = workers_.at(id);
    cgroups_.kill(w.cgroup);
    if (!cgroups_.remove(w.cgroup)) doomed_.push_back(w.cgroup);
    workers_.erase(id);
  }
  if (on_purpose || shutting_down_) return;
  std::string why = d.zygote.last_error.empty() ? how : d.zygote.last_error;
  d.zygote.last_error.clear();
  failed_start(d, "the zygote " + std::string(was_ready ? "died" : "did not start") + " (" +
                      why + ")");
}

// A zygote or a job process that could not be made: counts toward the restart intensity; the
// next try waits the backoff.
void Watchdog::failed_start(Device& d, const std::string& why) {
  const int64_t now = now_ms();
  if (d.intensity.record_failure(now)) {
    set_health(d, pb::HEALTH_UNHEALTHY,
               "restart intensity: more than " + std::to_string(config_.max_restarts()) +
                   " failures in " + std::to_string(config_.restart_window_seconds()) +
                   " s; no more restarts (last: " + why + ")");
    return;
  }
  const int64_t due = now + d.intensity.backoff_ms(now);
  d.fill_due_ms = std::max(d.fill_due_ms, due);
  d.zygote.due_ms = d.fill_due_ms;
}

// ---------------------------------------------------------------- job processes

int Watchdog::live_workers(int device, bool spare) const {
  int n = 0;
  for (const auto& [id, w] : workers_)
    if (w.device == device && w.spare == spare && w.exit_reason.empty()) ++n;
  return n;
}

int Watchdog::spares_wanted() const {
  return config_.warm_spare() ? std::max(1, config_.spare_count()) : 0;
}

void Watchdog::fill(Device& d) {
  if (!d.wanted || d.reset || d.health != pb::HEALTH_HEALTHY || shutting_down_) return;
  if (!no_user_reason_.empty()) return;
  const int64_t now = now_ms();
  if (now < d.fill_due_ms) return;
  if (d.zygote.state == Zygote::State::kDown) {
    if (now >= d.zygote.due_ms && d.zygote.pid() < 0) start_zygote(d);
    return;
  }
  if (d.zygote.state != Zygote::State::kReady) return;
  for (int n = live_workers(d.info.index, false); n < config_.workers_per_device(); ++n)
    spawn(d, false);
  for (int n = live_workers(d.info.index, true); n < spares_wanted(); ++n) spawn(d, true);
}

void Watchdog::promote_spare(Device& d) {
  if (!d.wanted || d.health != pb::HEALTH_HEALTHY || d.reset || shutting_down_) return;
  // Never more job-taking processes than workers_per_device (one on its way out is not one).
  if (live_workers(d.info.index, false) >= config_.workers_per_device()) return;
  for (auto& [id, s] : workers_) {
    if (s.device == d.info.index && s.spare && s.spawned() && s.exit_reason.empty()) {
      s.spare = false;
      pb::WatchdogEvent ev;
      ev.mutable_worker_promoted()->set_worker_id(id);
      emit(ev);
      return;
    }
  }
}

void Watchdog::spawn(Device& d, bool spare) {
  Worker w;
  const int index = d.info.index;
  w.id = (index < 0 ? std::string("cpu") : "d" + std::to_string(index)) + "-w" +
         std::to_string(next_worker_++);
  w.device = index;
  w.spare = spare;
  w.start_ms = unix_now_ms();
  std::vector<UniqueFd> procs;
  std::string error;
  if (cgroups_.usable()) w.cgroup = cgroups_.create(w.id, limits_, &procs, &error);
  int sv[2];
  if (error.empty() && ::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0)
    error = "socketpair: " + errno_text(errno);
  if (!error.empty()) {
    log_line("job process " + w.id + ": " + error);
    warn_once("cgroup", "cannot make a job cgroup: " + error);
    cgroups_.remove(w.cgroup);
    failed_start(d, error);
    return;
  }
  w.channel.reset(sv[0]);
  UniqueFd job_end(sv[1]);
  d.zygote.spawn(w.id, std::move(job_end), std::move(procs));
  workers_.emplace(w.id, std::move(w));
}

void Watchdog::on_spawned(Device& d, const zpb::JobProcessSpawned& s) {
  Worker* w = find_worker(s.worker_id());
  if (!w || w->spawned()) {
    log_line("zygote reported an unknown job process " + s.worker_id());
    if (s.pid() > 0) ::kill(s.pid(), SIGKILL);
    return;
  }
  if (s.pid() <= 0) {
    const std::string why = "the zygote could not make " + w->id + ": " + s.error();
    log_line(why);
    warn_once("zygote", why);
    cgroups_.kill(w->cgroup);
    if (!cgroups_.remove(w->cgroup)) doomed_.push_back(w->cgroup);
    workers_.erase(s.worker_id());
    failed_start(d, why);
    return;
  }
  w->pid = s.pid();
  pb::WatchdogEvent ev;
  fill_worker(*w, ev.mutable_worker_started()->mutable_worker());
  ev.mutable_worker_started()->set_channel_attached(true);
  std::vector<UniqueFd> fds;
  fds.push_back(std::move(w->channel));
  emit(ev, std::move(fds));
  if (!w->exit_reason.empty()) kill_cgroup(*w);  // stopped while it was being made
  auto early = early_exits_.find(s.pid());
  if (early != early_exits_.end()) {  // it exited before this frame came
    const int status = early->second.first;
    early_exits_.erase(early);
    on_worker_exit(w->id, status);
  }
}

void Watchdog::fill_worker(const Worker& w, pb::Worker* pw) const {
  pw->set_worker_id(w.id);
  pw->set_pid(w.pid);
  pw->set_device_index(w.device);
  pw->set_spare(w.spare);
  pw->set_job_id(w.job_id);
  pw->set_start_time_ms(w.start_ms);
}

void Watchdog::terminate(Worker& w, int grace_ms, const std::string& reason, bool replace,
                         bool quiet) {
  if (w.exit_reason.empty()) {
    w.exit_reason = reason;
    w.replace = replace;
    // A warm spare takes its place now, not when it has exited: a hung kernel's process may
    // take its whole grace to die, and the next job need not wait for that.
    if (replace && !w.spare) promote_spare(devices_[w.device]);
  }
  if (!w.spawned()) return;  // killed as soon as the zygote reports it
  if (grace_ms <= 0) {
    w.kill_at_ms = 0;
    kill_cgroup(w);
  } else {
    if (!quiet) ::kill(w.pid, SIGTERM);
    const int64_t at = now_ms() + grace_ms;
    w.kill_at_ms = w.kill_at_ms ? std::min(w.kill_at_ms, at) : at;
  }
}

void Watchdog::kill_cgroup(Worker& w) {
  if (w.cgroup.empty()) {
    if (w.pid > 0) ::kill(w.pid, SIGKILL);  // PID 1 of its namespace: every descendant dies
    return;
  }
  cgroups_.kill(w.cgroup);
}

Worker* Watchdog::find_worker(const std::string& id) {
  auto it = workers_.find(id);
  return it == workers_.end() ? nullptr : &it->second;
}

Worker* Watchdog::worker_for_pid(pid_t pid) {
  if (pid <= 0) return nullptr;
  // The pid's cgroup names its job process, so a job's child processes count too.
  if (Worker* w = find_worker(cgroups_.owner_of(pid))) return w;
  for (auto& [id, w] : workers_)
    if (w.pid == pid) return &w;
  return nullptr;
}

void Watchdog::on_worker_exit(std::string id, int status) {
  Worker w = std::move(workers_.at(id));
  workers_.erase(id);
  const bool oom = cgroups_.oom_killed(w.cgroup);  // read before the cgroup goes
  // Whatever it left behind (a setsid daemon, a fork bomb) dies with its cgroup.
  cgroups_.kill(w.cgroup);
  if (!cgroups_.remove(w.cgroup)) doomed_.push_back(w.cgroup);

  const bool signaled = WIFSIGNALED(status);
  const int code = signaled ? -1 : WEXITSTATUS(status);
  const int sig = signaled ? WTERMSIG(status) : 0;
  const bool on_purpose = !w.exit_reason.empty();
  const std::string reason =
      on_purpose ? w.exit_reason : (oom ? "oom" : (signaled ? "crashed" : "exited"));
  // Code 0 or a configured retire code: the job process finished (it takes one job) or retired
  // itself (e.g. after a poisoned CUDA context). One that dies while it runs a job was killed
  // by that job. Neither is the GPU's or the service's fault, so neither trips the intensity
  // nor waits a backoff: the intensity is for job processes that cannot even start or stay up.
  bool retired = !signaled && code == 0;
  for (int c : config_.retire_exit_codes()) retired = retired || (!signaled && code == c);
  const bool failure = !on_purpose && !retired && w.job_id.empty();
  const int64_t now = now_ms();

  Device& d = devices_[w.device];
  bool restarting = false, tripped = false;
  int64_t backoff = 0;
  bool promote = false;
  if (!on_purpose || w.replace) {
    if (failure) tripped = d.intensity.record_failure(now);
    if (!tripped && d.wanted && d.health == pb::HEALTH_HEALTHY && !d.reset && !shutting_down_) {
      restarting = true;
      backoff = failure ? d.intensity.backoff_ms(now) : 0;
      promote = !w.spare;  // a spare takes its place at once (if none did at the kill)
      if (backoff > 0) d.fill_due_ms = std::max(d.fill_due_ms, now + backoff);
    }
  }

  pb::WatchdogEvent ev;
  auto* ex = ev.mutable_worker_exited();
  fill_worker(w, ex->mutable_worker());
  ex->set_exit_code(code);
  ex->set_signal(sig);
  ex->set_reason(reason);
  ex->set_restarting(restarting);
  ex->set_backoff_ms(static_cast<int32_t>(backoff));
  emit(ev);
  if (promote) promote_spare(d);
  if (tripped) {
    set_health(d, pb::HEALTH_UNHEALTHY,
               "restart intensity: more than " + std::to_string(config_.max_restarts()) +
                   " worker failures in " + std::to_string(config_.restart_window_seconds()) +
                   " s; workers are no longer restarted");
    return;
  }
  if (restarting && backoff == 0) fill(d);  // the replacement is asked for at once
}

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
