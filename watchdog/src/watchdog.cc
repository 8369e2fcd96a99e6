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

constexpr int64_t kZygoteReadyTimeoutMs = 180000;  // imports torch and triton: seconds
constexpr int64_t kEarlyExitKeepMs = 60000;

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
  thaw_windows();  // the kills thawed what they killed; nothing else stays frozen either
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
      if (cmd.set_job().finished() && !w->finished && !w->spare) {
        w->finished = true;  // no longer a job-taking process: a spare takes its slot now
        promote_spare(devices_[w->device]);
      }
      return ack(id, true);
    }
    case pb::WatchdogCommand::kJobProcessWarm: {
      // Acknowledged once frozen where its device's window is open: the front end gives it
      // its first job only after this, so no job's code runs in a window unfrozen.
      Worker* w = find_worker(cmd.job_process_warm().worker_id());
      if (!w) return ack(id, false, "no worker " + cmd.job_process_warm().worker_id());
      w->warm = true;
      if (w->exit_reason.empty()) freeze_for_window(*w);
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
    case pb::WatchdogCommand::kOpenWindow:
    case pb::WatchdogCommand::kCloseWindow:
    case pb::WatchdogCommand::kStopGpuUsers:
      return window_command(cmd);
    case pb::WatchdogCommand::kShutdown:
      ack(id, true);
      return begin_shutdown(cmd.shutdown().grace_ms());
    default:
      return ack(id, false, "unknown command");
  }
}

}  // namespace watchdog
