// Timing windows. While one job process times its kernels on a GPU (the front end's GPU gate
// gave it the window: OpenWindow .. CloseWindow), the device's other job processes are frozen
// through their cgroups' freezer, so that none of them starts GPU work meanwhile. Part of class
// Watchdog (watchdog.h).
//
// Partners: when a trusted judge process drives and times each call of the kernel's job
// process from outside it, both must run during the window; the holder (the judge) names the
// others (OpenWindow.partner_worker_ids). They are never frozen: one frozen for an earlier
// window is thawed, and StopGpuUsers never kills one.
//
// Freezing stops a process's threads, not the GPU: work it queued before keeps running (the
// holder's job process waits for the GPU to drain before it times). A job process started while
// the window is open is frozen when the zygote reports it, before WorkerStarted; not when its
// cgroup is made, because the zygote's child that joins the cgroup must run on to fork it.
// Frozen processes can be killed (v2 cgroup.kill takes them as they are; v1 Cgroups::kill thaws
// after it signals). A window never outlives its holder, and nothing stays frozen after
// Shutdown or the watchdog's exit.
//
// StopGpuUsers: when the holder finds the GPU still busy (a frozen process's queued kernels),
// NVML's per-process utilization samples since each frozen process's freeze completed name the
// ones whose work still runs; they are killed ("killed:gpu_outside_phase").
#include <algorithm>

#include "log.h"
#include "watchdog.h"

namespace watchdog {

namespace {

// NVML samples per-process utilization about every 200 ms, so a sample taken soon after a
// freeze can still cover work from before it (an innocent check's last kernel): only samples
// this long after a process's freeze count against it.
constexpr uint64_t kSampleMarginUs = 250'000;

// How long OpenWindow waits, for all the others together, until they read frozen: a process
// in the kernel (a driver call) stops only when it leaves it.
constexpr int kFreezeWaitMs = 500;

}  // namespace

// OpenWindow, CloseWindow, StopGpuUsers: an Ack (refused for an unknown device), then the
// command's report with the same id.
void Watchdog::window_command(const pb::WatchdogCommand& cmd) {
  const uint64_t id = cmd.command_id();
  const int index = cmd.has_open_window()    ? cmd.open_window().device_index()
                    : cmd.has_close_window() ? cmd.close_window().device_index()
                                             : cmd.stop_gpu_users().device_index();
  Device* d = device(index);
  if (!d) return ack(id, false, "no device " + std::to_string(index));
  ack(id, true);
  if (cmd.has_open_window()) return open_window(*d, id, cmd.open_window());
  if (cmd.has_close_window()) return close_window(*d, id);
  stop_gpu_users(*d, id);
}

void Watchdog::open_window(Device& d, uint64_t command_id, const pb::OpenWindow& o) {
  pb::WatchdogEvent ev;
  ev.set_command_id(command_id);
  auto* report = ev.mutable_window();
  report->set_device_index(d.info.index);
  std::string why = window_refusal(o, d.info.index, workers_);
  bool ok = false;
  if (why.empty()) {
    if (!d.window) d.window.emplace();
    d.window->holder = o.holder_worker_id();
    d.window->partners = {o.partner_worker_ids().begin(), o.partner_worker_ids().end()};
    d.window->freeze_others = o.freeze_others();
    d.window->warming_runs = config_.warming_runs_in_windows();
    ok = match_window(d, &why);
    for (const auto& [id, at] : d.window->frozen) report->add_frozen_worker_ids(id);
  }
  if (!ok) log_line("OpenWindow on device " + std::to_string(d.info.index) + ": " + why);
  report->set_ok(ok);
  report->set_message(why);
  fill_conditions(d, report->mutable_conditions());  // the GPU as the holder starts
  emit(ev);
}

void Watchdog::close_window(Device& d, uint64_t command_id) {
  pb::WatchdogEvent ev;
  ev.set_command_id(command_id);
  auto* report = ev.mutable_window();
  report->set_device_index(d.info.index);
  fill_conditions(d, report->mutable_conditions());  // before the others run again
  std::string why;
  if (d.window) {
    d.window->freeze_others = false;
    match_window(d, &why);
    d.window.reset();
  }
  report->set_ok(why.empty());
  report->set_message(why);
  emit(ev);
}

std::string window_refusal(const pb::OpenWindow& o, int index,
                           const std::map<std::string, Worker>& workers) {
  auto on_device = [&](const std::string& id) {
    const auto it = workers.find(id);
    return it != workers.end() && it->second.device == index;
  };
  const std::string where = " on device " + std::to_string(index) + "; the window is unchanged";
  if (!on_device(o.holder_worker_id()))
    return "no job process '" + o.holder_worker_id() + "'" + where;
  for (const auto& id : o.partner_worker_ids())
    if (!on_device(id)) return "no job process '" + id + "' (a partner)" + where;
  return "";
}

std::set<std::string> window_wants_frozen(const Window& win, int index,
                                          const std::map<std::string, Worker>& workers) {
  std::set<std::string> wanted;
  if (!win.freeze_others) return wanted;
  for (const auto& [id, w] : workers) {
    const bool killed = !w.exit_reason.empty() && !w.kill_at_ms;
    if (w.device == index && w.spawned() && !killed && !win.leaves(w)) wanted.insert(id);
  }
  return wanted;
}

// Makes what is frozen match the window: every job process of the device it does not run when
// it freezes the others, none otherwise. Thaws first (a new holder or partner may have been
// frozen for the last one), then asks every cgroup to freeze before waiting for any, so that
// they stop together. A cgroup that does not read frozen in time stays on the list:
// CloseWindow thaws it. Each newly frozen one's time is taken once all have been waited for.
bool Watchdog::match_window(Device& d, std::string* why) {
  Window& win = *d.window;
  std::set<std::string> wanted;
  if (cgroups_.can_freeze()) wanted = window_wants_frozen(win, d.info.index, workers_);
  std::vector<std::string> failed;
  std::string error;
  for (auto it = win.frozen.begin(); it != win.frozen.end();) {
    if (wanted.count(it->first)) {
      ++it;
      continue;
    }
    Worker* w = find_worker(it->first);
    if (w && !cgroups_.freeze(w->cgroup, false, 0, &error))
      failed.push_back("thaw " + it->first + ": " + error);
    it = win.frozen.erase(it);
  }
  for (const auto& id : wanted)
    if (win.frozen.emplace(id, 0).second) cgroups_.freeze(workers_.at(id).cgroup, true, 0, &error);
  const int64_t deadline = now_ms() + kFreezeWaitMs;
  for (const auto& [id, at] : win.frozen) {
    const int left = static_cast<int>(std::max<int64_t>(0, deadline - now_ms()));
    if (!cgroups_.freeze(workers_.at(id).cgroup, true, left, &error))
      failed.push_back("freeze " + id + ": " + error);
  }
  const uint64_t frozen_us = nvml_clock_us();
  for (auto& [id, at] : win.frozen)
    if (at == 0) at = frozen_us;
  if (win.freeze_others && !cgroups_.can_freeze())
    failed.insert(failed.begin(), "this host has no cgroup freezer: nothing is frozen");
  if (failed.empty()) return true;
  *why = failed[0];
  if (failed.size() > 1) *why += " (and " + std::to_string(failed.size() - 1) + " more)";
  return false;
}

// A job process started while its device's window is open: frozen before anyone hears of it.
void Watchdog::freeze_for_window(Worker& w) {
  Device* d = device(w.device);
  if (!d || !d->window || !d->window->freeze_others || !cgroups_.can_freeze()) return;
  if (d->window->leaves(w) || d->window->frozen.count(w.id)) return;
  std::string error;
  if (!cgroups_.freeze(w.cgroup, true, kFreezeWaitMs, &error))
    log_line("job process " + w.id + ", started in a timing window: " + error);
  d->window->frozen[w.id] = nvml_clock_us();
}

// A job process exited: it is off its window's lists. When it held the window, nothing times
// any more: the others run again (a later CloseWindow finds no window). A partner's exit leaves
// the window to its holder (a judge reports its kernel's crash).
void Watchdog::window_worker_exited(const Worker& w) {
  Device* d = device(w.device);
  if (!d || !d->window) return;
  d->window->frozen.erase(w.id);
  d->window->partners.erase(w.id);
  if (w.id != d->window->holder) return;
  log_line("the holder of device " + std::to_string(w.device) + "'s timing window exited: closed");
  d->window->freeze_others = false;
  std::string why;
  if (!match_window(*d, &why)) log_line(why);
  d->window.reset();
}

// Shutdown and exit: no cgroup is left frozen, and job processes take their SIGTERM.
void Watchdog::thaw_windows() {
  for (auto& [i, d] : devices_) {
    if (!d.window) continue;
    d.window->freeze_others = false;
    std::string why;
    if (!match_window(d, &why)) log_line(why);
    d.window.reset();
  }
}

// StopGpuUsers: the frozen job processes of the device's window that NVML saw use the GPU after
// their freeze completed are killed as KillWorker kills (their slots go to spares). The holder,
// its partners, other devices' job processes, the zygote and anything outside a job cgroup are
// never touched: only a sampled pid whose cgroup (or own pid) is a frozen job process of this
// window counts.
void Watchdog::stop_gpu_users(Device& d, uint64_t command_id) {
  pb::WatchdogEvent ev;
  ev.set_command_id(command_id);
  auto* report = ev.mutable_gpu_users();
  const int index = d.info.index;
  report->set_device_index(index);
  const bool window = d.window && !d.window->frozen.empty();
  uint64_t since = nvml_clock_us();
  if (window)
    for (const auto& [id, at] : d.window->frozen) since = std::min(since, at);
  std::map<int, uint64_t> users;  // pid -> its newest sample with SM or memory use
  const bool known = nvml_ && index >= 0 && nvml_->gpu_users(index, since, users);
  report->set_known(known);
  const std::string where = "device " + std::to_string(index);
  if (!window) {
    report->set_message("no timing window with frozen job processes is open on " + where +
                        ": nothing killed");
    return emit(ev);
  }
  if (!known) {
    report->set_message(std::string(!nvml_ || index < 0 ? "no NVML for " + where
                                                        : "NVML gives no per-process "
                                                          "utilization for " + where) +
                        ": cannot tell which processes use the GPU; nothing killed");
    return emit(ev);
  }
  std::vector<std::string> culprits, kept;  // "pid (worker)" for the message
  std::set<std::string> doomed;             // worker ids to kill
  for (const auto& [pid, last_us] : users) {
    Worker* w = worker_for_pid(pid);
    // One the window runs is never on its frozen list; checked anyway, as a kill is final.
    const bool runs = w && d.window->runs(w->id);
    const auto f = w && !runs ? d.window->frozen.find(w->id) : d.window->frozen.end();
    if (w && f != d.window->frozen.end() && last_us > f->second + kSampleMarginUs) {
      culprits.push_back(std::to_string(pid) + " (" + w->id + ")");
      doomed.insert(w->id);
    } else {
      std::string who = "not a frozen job process";
      if (w && w->id == d.window->holder) who = w->id + ", the holder";
      else if (runs) who = w->id + ", a partner";
      else if (w && f != d.window->frozen.end()) who = w->id + ", before its freeze";
      else if (w) who = w->id + ", not frozen here";
      kept.push_back(std::to_string(pid) + " (" + who + ")");
    }
  }
  auto join = [](const std::vector<std::string>& items) {
    std::string out;
    for (const auto& item : items) out += (out.empty() ? "" : ", ") + item;
    return out;
  };
  std::string message =
      culprits.empty() ? "NVML: no frozen job process used the GPU since its freeze"
                       : "NVML: pids " + join(culprits) + " used the GPU while frozen";
  if (!kept.empty()) message += "; left alone: pids " + join(kept);
  for (const auto& id : doomed) {
    Worker& w = workers_.at(id);
    if (w.exit_reason.empty()) report->add_killed_worker_ids(id);
    else message += "; " + id + " was already being stopped (" + w.exit_reason + ")";
  }
  report->set_message(message);
  log_line("StopGpuUsers on " + where + ": " + message);
  emit(ev);
  // As KillWorker: at once, replaced, a spare takes the slot. One already being stopped
  // (its SIGTERM grace running) is killed now too.
  for (const auto& id : doomed) terminate(workers_.at(id), 0, "killed:gpu_outside_phase", true);
}

void Watchdog::fill_conditions(const Device& d, pb::GpuConditions* out) {
  if (!nvml_ || d.info.index < 0) return;  // known = false: no NVML, or the CPU
  const Conditions c = nvml_->conditions(d.info.index);
  out->set_known(c.known);
  out->set_sm_clock_mhz(c.sm_clock_mhz);
  out->set_memory_clock_mhz(c.memory_clock_mhz);
  out->set_temperature_celsius(c.temperature_celsius);
  out->set_power_milliwatts(c.power_milliwatts);
  out->set_throttle_reasons(c.throttle_reasons);
}

}  // namespace watchdog
