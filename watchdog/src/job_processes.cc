// Zygotes and the job processes they make: filling each GPU's pool, spares, promotion,
// termination by cgroup, exits. Part of class Watchdog (watchdog.h).
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

// ---------------------------------------------------------------- zygotes

void Watchdog::start_zygote(Device& d) {
  const int index = d.info.index;
  SandboxSpec spec;
  spec.argv.assign(config_.worker_command().begin(), config_.worker_command().end());
  // The environment: Configure.worker_env and the device's variables, nothing of ours.
  std::map<std::string, std::string> env(config_.worker_env().begin(), config_.worker_env().end());
  env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID";  // CUDA's numbering = NVML's (default: fastest first)
  // The GPU by its UUID: the sandbox shows only this GPU's device node, so CUDA enumerates it
  // alone (as ordinal 0) and an index past 0 would name no device at all.
  env["CUDA_VISIBLE_DEVICES"] =
      index < 0 ? "" : (d.info.uuid.empty() ? std::to_string(index) : d.info.uuid);
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
  const fs::path root = fs::path(state_dir_) / "roots" / device_name(index);
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
    if (w.device == device && w.spare == spare && w.exit_reason.empty() && !w.finished) ++n;
  return n;
}

int Watchdog::workers_wanted(int device) const {
  return device == kBuildDevice ? config_.build_processes() : config_.workers_per_device();
}

int Watchdog::spares_wanted(int device) const {
  // A build process needs no CUDA context: one starts in milliseconds, no spare is kept.
  if (device == kBuildDevice) return 0;
  return config_.warm_spare() ? std::max(1, config_.spare_count()) : 0;
}

std::string device_name(int index) {
  if (index == kBuildDevice) return "build";
  return index < 0 ? "cpu" : "d" + std::to_string(index);
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
  for (int n = live_workers(d.info.index, false); n < workers_wanted(d.info.index); ++n)
    spawn(d, false);
  for (int n = live_workers(d.info.index, true); n < spares_wanted(d.info.index); ++n)
    spawn(d, true);
}

void Watchdog::promote_spare(Device& d) {
  if (!d.wanted || d.health != pb::HEALTH_HEALTHY || d.reset || shutting_down_) return;
  // Never more job-taking processes than workers_per_device (one on its way out is not one).
  if (live_workers(d.info.index, false) >= workers_wanted(d.info.index)) return;
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
  w.id = device_name(index) + "-w" + std::to_string(next_worker_++);
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
  if (w->exit_reason.empty()) freeze_for_window(*w);  // its device's window is open
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
  window_worker_exited(w);

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
      promote = !w.spare && !w.finished;  // a spare takes its place (if none did already)
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

}  // namespace watchdog
