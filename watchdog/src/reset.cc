// The GPU reset procedure, one stage per tick: drain (no new jobs; running jobs get the grace
// period), stop every job process and the zygote of the GPU, check no process still holds it, run the reset
// command, check health, start workers. Each step is reported (ResetStepReport), then
// ResetFinished; the command id is the ResetGpu's, or 0 for an automatic reset.
#include <signal.h>
#include <sys/wait.h>

#include <fstream>
#include <sstream>

#include "log.h"
#include "watchdog.h"

namespace watchdog {

namespace {

constexpr int kStopGraceMs = 2000;
constexpr int64_t kStopTimeoutMs = 6000;
constexpr int64_t kCommandTimeoutMs = 120000;
constexpr int64_t kProcessesTimeoutMs = 3000;

std::string replace_all(std::string s, const std::string& from, const std::string& to) {
  for (size_t at = s.find(from); at != std::string::npos; at = s.find(from, at + to.size()))
    s.replace(at, from.size(), to);
  return s;
}

std::string tail_of(const std::string& path, size_t max) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  std::string s = ss.str();
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s.size() > max ? "..." + s.substr(s.size() - max) : s;
}

}  // namespace

void Watchdog::reset_step(Device& d, const std::string& step, bool ok,
                            const std::string& message) {
  step_event(d.reset->command_id, d.info.index, step, ok, message);
}

void Watchdog::step_event(uint64_t command_id, int index, const std::string& step, bool ok,
                            const std::string& message) {
  log_line("reset of GPU " + std::to_string(index) + ": " + step + (ok ? " ok" : " FAILED") +
           (message.empty() ? "" : ": " + message));
  pb::WatchdogEvent ev;
  ev.set_command_id(command_id);
  auto* r = ev.mutable_reset_step();
  r->set_device_index(index);
  r->set_step(step);
  r->set_ok(ok);
  r->set_message(message);
  emit(ev);
}

void Watchdog::finish_reset(Device& d, bool success, const std::string& message) {
  const uint64_t id = d.reset->command_id;
  d.reset.reset();
  if (success) {
    d.needs_reset = false;
    d.intensity.clear();
    set_health(d, pb::HEALTH_HEALTHY, "");
    d.wanted = true;
    fill(d);
    const bool started = d.zygote.pid() > 0;
    step_event(id, d.info.index, "start_workers", started,
               started ? "zygote started; job processes follow when it is ready"
                       : "the zygote did not start");
  } else {
    d.needs_reset = true;
    set_health(d, pb::HEALTH_UNHEALTHY, "reset failed: " + message);
  }
  pb::WatchdogEvent ev;
  ev.set_command_id(id);
  ev.mutable_reset_finished()->set_device_index(d.info.index);
  ev.mutable_reset_finished()->set_success(success);
  emit(ev);
}

void Watchdog::begin_reset(Device& d, int grace_ms, uint64_t command_id) {
  d.reset = std::make_unique<ResetRun>();
  d.reset->command_id = command_id;
  d.reset->deadline_ms = now_ms() + (grace_ms > 0 ? grace_ms : 0);
  set_health(d, pb::HEALTH_DRAINING, d.reason.empty() ? "reset requested" : d.reason);
}

void Watchdog::advance_reset(Device& d, int64_t now) {
  ResetRun& r = *d.reset;
  const int index = d.info.index;
  switch (r.stage) {
    case ResetRun::Stage::kDrain: {
      int busy = 0;
      for (auto& [id, w] : workers_)
        if (w.device == index && !w.job_id.empty() && w.exit_reason.empty()) ++busy;
      if (busy > 0 && now < r.deadline_ms) return;
      reset_step(d, "drain", true,
                 busy ? std::to_string(busy) + " job(s) still running after the grace period"
                      : "no jobs running");
      set_health(d, pb::HEALTH_RESETTING, d.reason);
      for (auto& [id, w] : workers_)
        if (w.device == index) terminate(w, kStopGraceMs, "reset", false);
      stop_zygote(d);
      r.stage = ResetRun::Stage::kStop;
      r.deadline_ms = now + kStopTimeoutMs;
      return;
    }
    case ResetRun::Stage::kStop: {
      int left = 0;
      for (auto& [id, w] : workers_) left += w.device == index ? 1 : 0;
      left += d.zygote.pid() > 0 ? 1 : 0;
      if (left > 0 && now < r.deadline_ms) return;
      if (left > 0) {
        reset_step(d, "stop_workers", false, std::to_string(left) + " worker(s) did not exit");
        return finish_reset(d, false, "workers did not exit");
      }
      reset_step(d, "stop_workers", true, "every worker on the GPU exited");
      r.stage = ResetRun::Stage::kCheck;
      r.deadline_ms = now + kProcessesTimeoutMs;
      return;
    }
    case ResetRun::Stage::kCheck: {
      // The driver may list a just-killed process for a moment: retry until the deadline.
      std::vector<int> pids;
      if (!nvml_) {
        reset_step(d, "check_processes", true, "no NVML: process list not available");
      } else if (!nvml_->processes(index, pids)) {
        reset_step(d, "check_processes", true, "NVML cannot list processes on this GPU");
      } else if (!pids.empty()) {
        if (now < r.deadline_ms) return;
        std::string list;
        for (int pid : pids) list += (list.empty() ? "" : " ") + std::to_string(pid);
        reset_step(d, "check_processes", false, "processes still hold the GPU: " + list);
        return finish_reset(d, false, "processes still hold the GPU: " + list);
      } else {
        reset_step(d, "check_processes", true, "no process holds the GPU");
      }
      const std::string cmd =
          replace_all(config_.reset_command(), "{index}", std::to_string(index));
      r.command_pid = spawn_shell(cmd, state_dir_ + "/reset-" + std::to_string(index) + ".log");
      if (r.command_pid < 0) {
        reset_step(d, "reset", false, "fork: " + errno_text(errno));
        return finish_reset(d, false, "cannot run the reset command");
      }
      r.stage = ResetRun::Stage::kCommand;
      r.deadline_ms = now + kCommandTimeoutMs;
      return;
    }
    case ResetRun::Stage::kCommand: {
      const std::string cmd =
          replace_all(config_.reset_command(), "{index}", std::to_string(index));
      if (!r.command_done && now < r.deadline_ms) return;
      if (!r.command_done) {
        ::kill(-r.command_pid, SIGKILL);
        reset_step(d, "reset", false, "'" + cmd + "' timed out");
        return finish_reset(d, false, "reset command timed out");
      }
      const int st = r.command_status;
      const bool ok = WIFEXITED(st) && WEXITSTATUS(st) == 0;
      const std::string out = tail_of(state_dir_ + "/reset-" + std::to_string(index) + ".log", 500);
      const std::string how = WIFEXITED(st) ? "exit code " + std::to_string(WEXITSTATUS(st))
                                            : "signal " + std::to_string(WTERMSIG(st));
      reset_step(d, "reset", ok, "'" + cmd + "': " + how + (out.empty() ? "" : ": " + out));
      if (!ok) return finish_reset(d, false, "reset command failed (" + how + ")");
      r.command_pid = -1;
      if (nvml_) {
        d.reading = nvml_->read(index);
        const bool needs = !XidPolicy::action_for_recovery(d.reading.recovery_action).empty();
        const bool healthy = d.reading.ok && !needs;
        reset_step(d, "check_health", healthy,
                   healthy ? "device answers" : (d.reading.error.empty()
                                                     ? "recovery action " + d.reading.recovery_action
                                                     : d.reading.error));
        if (!healthy) return finish_reset(d, false, "unhealthy after the reset");
      } else {
        reset_step(d, "check_health", true, "no NVML: nothing to read");
      }
      return finish_reset(d, true, "");
    }
    case ResetRun::Stage::kDone:
      return;
  }
}

}  // namespace watchdog
