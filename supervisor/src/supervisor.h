// The supervision loop: one thread, poll() over the control channel, a signalfd (SIGCHLD,
// SIGTERM, SIGINT, SIGHUP) and the NVML event pipe, plus a 50 ms tick for timers (backoff,
// kill deadlines, reset stages, health readings, the fake NVML and the kernel log).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "fd.h"
#include "kerneleval/internal/v1/supervisor.pb.h"
#include "kmsg.h"
#include "nvml_source.h"
#include "policy.h"
#include "protocol.h"
#include "restart.h"
#include "sandbox.h"

namespace kew {

namespace pb = ::kerneleval::internal::v1;

struct Worker {
  std::string id;
  pid_t pid = -1;  // also its process group id
  int device = -1;
  std::string token;
  bool spare = false;
  std::string job_id;
  int64_t start_ms = 0;
  std::string dir;          // private folder, removed after exit
  std::string exit_reason;  // set when the watchdog ends it on purpose
  bool replace = false;     // start a replacement when it exits (KillWorker, XID)
  int64_t kill_at_ms = 0;   // SIGKILL deadline after a SIGTERM
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

struct Device {
  DeviceInfo info;
  pb::Health health = pb::HEALTH_HEALTHY;
  std::string reason;
  bool needs_reset = false;  // only ResetGpu brings it back
  bool wanted = false;       // workers should run (Configure/StartWorkers; StopWorkers clears)
  RestartIntensity intensity{5, 30000, 100, 5000};
  RestartIntensity auto_resets{3, 3600000, 0, 0};  // a GPU that keeps failing waits for a person
  Reading reading;
  std::unique_ptr<ResetRun> reset;
};

struct PendingStart {
  int device;
  bool spare;
  int64_t due_ms;
};

struct PendingXid {
  XidEvent event;
  int64_t deadline_ms;  // wait this long for the kernel log to name the pid
};

class Supervisor {
 public:
  explicit Supervisor(int control_fd);
  // Runs until Shutdown or the channel closes; returns the exit code.
  int run();

 private:
  // channel
  void on_control_readable();
  void handle_frame(const std::string& payload);
  void handle_command(const pb::SupervisorCommand& cmd);
  void emit(pb::SupervisorEvent& ev);
  void ack(uint64_t id, bool ok, const std::string& message = "");
  void warn_once(const std::string& feature, const std::string& message);
  void flush_output(bool block);
  // commands
  std::string configure(const pb::Configure& c);
  bool start_workers(int device_index, std::string* why);
  void stop_workers(int device_index, int grace_ms, const std::string& reason);
  bool restart_workers(int device_index, std::string* why);
  void begin_shutdown(int grace_ms);
  // workers
  void fill(Device& d);
  void spawn(Device& d, bool spare);
  // SIGTERM, then SIGKILL after grace_ms (at once when 0). With quiet, no SIGTERM: the
  // worker may finish what it is doing (report a fault) and exit by itself first.
  int spares_wanted() const;
  void terminate(Worker& w, int grace_ms, const std::string& reason, bool replace,
                 bool quiet = false);
  void reap();
  void on_worker_exit(std::string id, int status);  // id by value: its map node is erased
  Worker* find_worker(const std::string& id);
  Worker* worker_for_pid(pid_t pid);
  int live_workers(int device, bool spare) const;
  // devices, XIDs and health
  Device* device(int index);
  void set_health(Device& d, pb::Health h, const std::string& reason);
  void send_device_update(const Device& d);
  void fill_status(const Device& d, pb::DeviceStatus* out) const;
  void read_health(int64_t now);
  void poll_xids(int64_t now);
  void handle_xid(const XidEvent& e);
  void require_reset(Device& d, const std::string& why, bool auto_reset);
  // reset (reset.cc)
  void begin_reset(Device& d, int grace_ms, uint64_t command_id);
  void advance_reset(Device& d, int64_t now);
  void reset_step(Device& d, const std::string& step, bool ok, const std::string& message);
  void step_event(uint64_t command_id, int index, const std::string& step, bool ok,
                  const std::string& message);
  void finish_reset(Device& d, bool success, const std::string& message);
  // loop
  void tick(int64_t now);
  void kill_everything();

  UniqueFd control_;
  UniqueFd signals_;
  FrameDecoder decoder_;
  std::string out_;
  bool closed_ = false;
  bool configured_ = false;
  bool shutting_down_ = false;
  int64_t shutdown_deadline_ = 0;
  int exit_code_ = -1;

  pb::Configure config_;
  SandboxSpec sandbox_;  // argv/env base and limits; env completed per worker
  std::string state_dir_;
  XidPolicy policy_;
  std::unique_ptr<NvmlSource> nvml_;
  KmsgReader kmsg_;
  std::map<int, Device> devices_;
  std::map<std::string, Worker> workers_;
  std::vector<PendingStart> pending_;
  std::vector<PendingXid> xids_;
  std::set<std::string> warned_;
  uint64_t next_worker_ = 0;
  int64_t next_health_ms_ = 0;
};

int64_t now_ms();       // monotonic
int64_t unix_now_ms();  // wall clock

}  // namespace kew
