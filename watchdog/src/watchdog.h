// The watchdog: one thread, poll() over the control channel, a signalfd (SIGCHLD, SIGTERM,
// SIGINT, SIGHUP), the NVML event pipe and each zygote's channel, plus a 50 ms tick for timers
// (backoff, kill deadlines, reset stages, health readings, the fake NVML and the kernel log).
//
// Per device it keeps one zygote (zygote.h) and, made by it, workers_per_device job-taking job
// processes plus spare_count warm spares ("workers" in the protocol: a worker takes one job and
// exits). Each job process has its own cgroup (cgroup.h), killed as a whole when it ends.
// While one job process times on a GPU (a timing window, windows.cc) the device's other job
// processes are frozen.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "cgroup.h"
#include "fd.h"
#include "kerneleval/internal/v1/watchdog.pb.h"
#include "kerneleval/internal/v1/zygote.pb.h"
#include "kmsg.h"
#include "nvml_source.h"
#include "policy.h"
#include "protocol.h"
#include "restart.h"
#include "sandbox.h"
#include "zygote.h"

namespace watchdog {

namespace pb = ::kerneleval::internal::v1;

// A command's device_index meaning every device.
constexpr int kAllDevices = -2;
// The pseudo-device of build processes (Configure.build_processes): no GPU, never frozen.
constexpr int kBuildDevice = -3;

// "d0", "cpu", "build": worker ids and sandbox root folders.
std::string device_name(int index);

struct Worker {
  std::string id;
  pid_t pid = 0;  // 0 until the zygote reports it (JobProcessSpawned)
  int device = -1;
  bool spare = false;
  std::string job_id;
  int64_t start_ms = 0;
  JobCgroup cgroup;
  UniqueFd channel;         // the front end's end, until WorkerStarted carries it
  std::string exit_reason;  // set when the watchdog ends it on purpose
  bool replace = false;     // start a replacement when it exits (KillWorker, XID)
  bool finished = false;    // sent its outcome: its slot went to a spare (SetJob.finished)
  // Said warm (JobProcessWarm): from then on a window freezes it. Before, where windows let
  // warming processes run (Configure.warming_runs_in_windows), it runs the service's code only.
  bool warm = false;
  int64_t kill_at_ms = 0;   // cgroup kill deadline after a SIGTERM
  bool spawned() const { return pid > 0; }
};

// One GPU reset procedure in progress (reset.cc).
struct ResetRun {
  enum class Stage { kDrain, kStop, kCheck, kCommand, kDone };
  uint64_t command_id = 0;
  Stage stage = Stage::kDrain;
  int64_t deadline_ms = 0;
  pid_t command_pid = -1;
  bool command_done = false;
  int command_status = 0;
};

// A device's timing window, from OpenWindow to CloseWindow (windows.cc): the job process that
// times, its partners (job processes that must run beside it, e.g. the kernel's process its
// judge drives), and the other job processes frozen meanwhile.
struct Window {
  std::string holder;
  std::set<std::string> partners;  // dropped when they exit
  bool freeze_others = false;
  // Job processes not yet said warm run on (Configure.warming_runs_in_windows).
  bool warming_runs = false;
  // Worker ids whose cgroups it froze (dropped when they exit) -> when their freeze completed
  // (nvml_clock_us(): NVML's sample clock), the start of what StopGpuUsers counts as theirs.
  std::map<std::string, uint64_t> frozen;
  // The holder or a partner: never frozen, never killed by StopGpuUsers.
  bool runs(const std::string& id) const { return id == holder || partners.count(id) > 0; }
  // Whether it leaves `w` running: its holder, a partner, or one still warming up.
  bool leaves(const Worker& w) const { return runs(w.id) || (warming_runs && !w.warm); }
};

// Why OpenWindow o cannot open on device `index` ("" when it can): its holder or a partner is
// not a job process of that device. Frozen with the others, such a holder's or partner's job
// would wait for ever, so nothing changes.
std::string window_refusal(const pb::OpenWindow& o, int index,
                           const std::map<std::string, Worker>& workers);
// The job processes of device `index` that win freezes: every spawned one it does not run,
// but one already SIGKILLed (dying, it must run: v1 delivers no signal to a frozen process)
// and, where warming_runs, one not yet said warm.
// None when it does not freeze the others.
std::set<std::string> window_wants_frozen(const Window& win, int index,
                                          const std::map<std::string, Worker>& workers);

struct Device {
  DeviceInfo info;
  pb::Health health = pb::HEALTH_HEALTHY;
  std::string reason;
  bool needs_reset = false;  // only ResetGpu brings it back
  bool wanted = false;       // job processes should run (Configure/StartWorkers)
  RestartIntensity intensity{5, 30000, 100, 5000};
  RestartIntensity auto_resets{3, 3600000, 0, 0};  // a GPU that keeps failing waits for a person
  Reading reading;
  std::unique_ptr<ResetRun> reset;
  Zygote zygote;
  int64_t fill_due_ms = 0;  // no new job processes before (backoff after a failure)
  std::optional<Window> window;
};

struct PendingXid {
  XidEvent event;
  int64_t deadline_ms;  // wait this long for the kernel log to name the pid
};

class Watchdog {
 public:
  explicit Watchdog(int control_fd);
  // Runs until Shutdown or the channel closes; returns the exit code.
  int run();

 private:
  // the story's steps (run())
  bool become_subreaper_and_take_signals();
  void wait_for_something();
  void handle_signals();
  void reap_children();
  void read_commands();
  void read_zygotes();
  void tick(int64_t now);
  void kill_everything();
  // channel
  void handle_frame(const std::string& payload);
  void handle_command(const pb::WatchdogCommand& cmd);
  void emit(pb::WatchdogEvent& ev, std::vector<UniqueFd> fds = {});
  void ack(uint64_t id, bool ok, const std::string& message = "");
  void warn_once(const std::string& feature, const std::string& message);
  void flush_output(bool block);
  // commands
  std::string configure(const pb::Configure& c);
  bool start_workers(int device_index, std::string* why);
  void stop_workers(int device_index, int grace_ms, const std::string& reason);
  bool restart_workers(int device_index, std::string* why);
  void begin_shutdown(int grace_ms);
  // zygotes and job processes
  void fill(Device& d);
  void start_zygote(Device& d);
  void on_zygote_event(Device& d, const zpb::ZygoteEvent& ev);
  void on_zygote_exit(Device& d, int status);
  void stop_zygote(Device& d);
  void spawn(Device& d, bool spare);
  void promote_spare(Device& d);
  void on_spawned(Device& d, const zpb::JobProcessSpawned& s);
  void failed_start(Device& d, const std::string& why);
  int workers_wanted(int device) const;
  int spares_wanted(int device) const;
  // SIGTERM, then a cgroup kill after grace_ms (at once when 0). With quiet, no SIGTERM: the
  // job process may finish what it is doing (report a fault) and exit by itself first.
  void terminate(Worker& w, int grace_ms, const std::string& reason, bool replace,
                 bool quiet = false);
  void kill_cgroup(Worker& w);
  void on_worker_exit(std::string id, int status);  // id by value: its map node is erased
  Worker* find_worker(const std::string& id);
  Worker* worker_for_pid(pid_t pid);
  int live_workers(int device, bool spare) const;
  void fill_worker(const Worker& w, pb::Worker* out) const;
  // devices, XIDs and health
  Device* device(int index);
  void set_health(Device& d, pb::Health h, const std::string& reason);
  void send_device_update(const Device& d);
  void fill_status(const Device& d, pb::DeviceStatus* out) const;
  void read_health(int64_t now);
  void poll_xids(int64_t now);
  void handle_xid(const XidEvent& e);
  void require_reset(Device& d, const std::string& why, bool auto_reset);
  // timing windows (windows.cc)
  void window_command(const pb::WatchdogCommand& cmd);
  void open_window(Device& d, uint64_t command_id, const pb::OpenWindow& o);
  void close_window(Device& d, uint64_t command_id);
  bool match_window(Device& d, std::string* why);
  void freeze_for_window(Worker& w);
  void window_worker_exited(const Worker& w);
  void thaw_windows();
  void fill_conditions(const Device& d, pb::GpuConditions* out);
  void stop_gpu_users(Device& d, uint64_t command_id);
  // reset (reset.cc)
  void begin_reset(Device& d, int grace_ms, uint64_t command_id);
  void advance_reset(Device& d, int64_t now);
  void reset_step(Device& d, const std::string& step, bool ok, const std::string& message);
  void step_event(uint64_t command_id, int index, const std::string& step, bool ok,
                  const std::string& message);
  void finish_reset(Device& d, bool success, const std::string& message);

  UniqueFd control_;
  UniqueFd signals_;
  FrameDecoder decoder_;
  FrameWriter out_;
  std::deque<UniqueFd> rx_fds_;  // the front end sends none; closed as they come
  bool closed_ = false;
  bool configured_ = false;
  bool shutting_down_ = false;
  int64_t shutdown_deadline_ = 0;
  int exit_code_ = -1;

  pb::Configure config_;
  zpb::ZygoteConfig zygote_config_;  // job_env completed per device
  std::string state_dir_;
  std::string no_user_reason_;  // non-empty: no unprivileged job user, no job processes
  bool user_namespace_ = false;
  Cgroups cgroups_;
  CgroupLimits limits_;
  XidPolicy policy_;
  std::unique_ptr<NvmlSource> nvml_;
  KmsgReader kmsg_;
  std::map<int, Device> devices_;
  std::map<std::string, Worker> workers_;
  std::map<pid_t, std::pair<int, int64_t>> early_exits_;  // pid -> (status, when)
  std::vector<JobCgroup> doomed_;  // cgroups of exited job processes not yet removable
  std::vector<PendingXid> xids_;
  std::set<std::string> warned_;
  uint64_t next_worker_ = 0;
  int64_t next_health_ms_ = 0;
};

int64_t now_ms();       // monotonic
int64_t unix_now_ms();  // wall clock

}  // namespace watchdog
