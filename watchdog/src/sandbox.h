// The device sandbox: the zygote of a device is forked and exec'd into new mount, network, IPC
// and UTS namespaces with a fresh root (sandbox.cc's comment lists what it holds), as root (or,
// when the watchdog is not root, in a user namespace where it is root), with no_new_privs, a
// parent-death SIGKILL, and only its channel as descriptor 3. Also: the reset command.
#pragma once

#include <sys/types.h>

#include <string>
#include <utility>
#include <vector>

namespace watchdog {

struct SandboxSpec {
  std::vector<std::string> argv;
  std::vector<std::string> env;  // "KEY=VALUE": the whole environment
  int channel_fd = -1;           // becomes descriptor 3
  bool fresh_root = true;        // mount namespace + fresh root (else only the other namespaces)
  std::string root_dir;          // empty folder the fresh root's tmpfs is mounted on
  std::vector<std::string> read_only_paths;  // shown at the same path, read-only
  std::vector<std::string> device_nodes;     // /dev/... of the GPU, bound into the new /dev
  bool user_namespace = false;               // not root: map 0 -> our uid first
};

struct SpawnResult {
  pid_t pid = -1;     // -1: fork failed
  std::string error;  // fork, exec or a fatal sandbox step
  // Sandbox features the host refused: (feature, what and errno text). The process still runs.
  std::vector<std::pair<std::string, std::string>> refused;
};

// Forks and execs into the device sandbox. Blocks until the child has exec'd or failed (a
// close-on-exec pipe reports which). A fresh-root step that fails is fatal (exit 126): a
// zygote never runs with half a sandbox; a namespace the kernel refuses is a warning.
SpawnResult spawn_in_sandbox(const SandboxSpec& spec);

// The device nodes of a GPU (nvidiactl, nvidia-uvm, nvidia-uvm-tools, nvidia<minor>,
// nvidia-caps) that exist on this host; none for the CPU (index < 0).
std::vector<std::string> gpu_device_nodes(int index, int minor);

// Runs "/bin/sh -c command" in its own process group with stdout and stderr sent to log_path.
pid_t spawn_shell(const std::string& command, const std::string& log_path);

// Unblocks every signal and restores default dispositions (in a child before exec).
void reset_signals_in_child();

}  // namespace watchdog
