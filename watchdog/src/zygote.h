// A device's zygote: the fork server of its job processes (kerneleval_server.jobproc.zygote),
// spawned in the device sandbox with its channel (zygote.proto) as descriptor 3.
//
//   start()        socketpair, spawn_in_sandbox, queue ZygoteConfig      -> kStarting
//   ZygoteReady                                                          -> kReady
//   spawn()        SpawnJobProcess with [job channel end, cgroup.procs...] attached
//   JobProcessSpawned{worker_id, pid}   the watchdog registers the job process
//   exit           reaped by the watchdog                                -> kDown
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "fd.h"
#include "kerneleval/internal/v1/zygote.pb.h"
#include "protocol.h"
#include "sandbox.h"

namespace watchdog {

namespace zpb = ::kerneleval::internal::v1;

class Zygote {
 public:
  enum class State { kDown, kStarting, kReady };

  // Spawns it and queues the config; on failure (fork) returns false with r->error set.
  bool start(SandboxSpec spec, const zpb::ZygoteConfig& config, SpawnResult* r);
  // Asks for one job process; the descriptors are closed here once sent.
  void spawn(const std::string& worker_id, UniqueFd job_end, std::vector<UniqueFd> cgroup_fds);
  // Reads what its socket has. Returns the events; sets *closed when the socket closed.
  std::vector<zpb::ZygoteEvent> read(bool* closed, std::vector<std::string>* errors);
  // Sends what is queued; false when the zygote is gone.
  bool flush() { return sock_.valid() && out_.flush(sock_.get(), false); }
  bool wants_write() const { return !out_.empty(); }
  // SIGKILL on purpose (stop, restart, reset, exit): its exit is no failure. (It may be
  // mid-fork: its intermediate children are reaped by the watchdog.)
  void kill();
  // SIGKILL of a broken zygote (channel closed, never ready): its exit counts as a failure.
  void kill_quietly();
  // After its exit was reaped.
  void exited();

  int fd() const { return sock_.get(); }
  pid_t pid() const { return pid_; }
  State state = State::kDown;
  int64_t started_ms = 0;
  int64_t due_ms = 0;        // earliest (re)start after a failure
  bool stopping = false;     // killed on purpose: its exit is no failure
  int64_t closed_ms = 0;     // when its channel closed (it is exiting)
  std::string last_error;    // why it failed to start (exec, a sandbox step)

 private:
  pid_t pid_ = -1;
  UniqueFd sock_;
  FrameDecoder decoder_;
  FrameWriter out_;
  std::deque<UniqueFd> rx_fds_;  // a zygote sends none; closed as they come
};

}  // namespace watchdog
