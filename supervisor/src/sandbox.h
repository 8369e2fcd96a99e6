// Starting processes: workers in their sandbox, and the reset command.
#pragma once

#include <sys/types.h>

#include <string>
#include <utility>
#include <vector>

namespace kew {

struct SandboxSpec {
  std::vector<std::string> argv;
  std::vector<std::string> env;  // "KEY=VALUE"
  long max_open_files = 4096;
  long max_processes = 4096;
  bool isolate_network = false;
  bool drop_user = false;  // switch to uid/gid below (the watchdog runs as root)
  uid_t uid = 0;
  gid_t gid = 0;
};

struct SpawnResult {
  pid_t pid = -1;      // -1: fork failed
  std::string error;   // fork or exec failure
  // Sandbox features the host refused: (feature, errno text). The worker still runs.
  std::vector<std::pair<std::string, std::string>> refused;
};

// Forks and execs a worker: own session and process group, network namespace (if asked),
// unprivileged user (if asked), parent-death SIGKILL, no new privileges, rlimits (core 0,
// open files, processes; never RLIMIT_AS, which breaks CUDA's address-space reservation).
// Blocks until the child has exec'd or failed (a close-on-exec pipe reports which).
SpawnResult spawn_sandboxed(const SandboxSpec& spec);

// Runs "/bin/sh -c command" in its own process group with stdout and stderr sent to log_path.
pid_t spawn_shell(const std::string& command, const std::string& log_path);

// Whether uid/gid can execute (or, for a folder, enter) path; checked in a short-lived child
// that switches to them.
// Returns 0 or the errno of the failed check.
int probe_user_access(const std::string& path, uid_t uid, gid_t gid);

// Unblocks every signal and restores default dispositions (in a child before exec).
void reset_signals_in_child();

}  // namespace kew
