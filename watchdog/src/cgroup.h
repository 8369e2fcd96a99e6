// One cgroup per job process, killed as a whole when the job ends.
//
// cgroup v2 (where /sys/fs/cgroup/cgroup.controllers exists): one folder with memory.max,
// memory.swap.max = 0 and pids.max, killed with cgroup.kill. cgroup v1: one folder in each of
// the memory (memory.limit_in_bytes), pids (pids.max) and freezer hierarchies, killed by
// freezing, SIGKILLing every pid in cgroup.procs and thawing, until it is empty.
// A timing window freezes the other job processes of its GPU (freeze(): v2 cgroup.freeze, v1
// freezer.state). A frozen process takes a SIGKILL only when thawed (v1) or at once (v2), so
// every kill here thaws after it signals.
// The job cgroups live in a "kerneleval-<watchdog pid>" folder beside the watchdog's own cgroup
// (in each v1 hierarchy), or under SandboxConfig.cgroup_root; folders of watchdogs that are
// gone are removed at start.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "fd.h"

namespace watchdog {

struct CgroupLimits {
  int64_t memory_bytes = 0;
  int64_t max_pids = 0;
};

// The cgroup folders of one job process (one for v2; up to three for v1).
struct JobCgroup {
  std::vector<std::string> dirs;
  bool empty() const { return dirs.empty(); }
};

class Cgroups {
 public:
  // Finds the hierarchies and makes the watchdog's folder(s). Refused features are appended to
  // warnings as (feature, message): cgroup_memory, cgroup_pids, cgroup_freezer.
  void init(const std::string& cgroup_root,
            std::vector<std::pair<std::string, std::string>>* warnings);
  bool v2() const { return v2_; }
  bool usable() const { return !roots_.empty(); }
  // Makes the job's cgroup(s) with the limits and opens each cgroup.procs for writing
  // (O_CLOEXEC; handed to the zygote, whose child writes "0" into them to join). On failure
  // returns what exists so far and sets *error.
  JobCgroup create(const std::string& name, const CgroupLimits& limits,
                   std::vector<UniqueFd>* procs_fds, std::string* error);
  // One kill pass: cgroup.kill (v2), or freeze + SIGKILL every member + thaw. Returns true when
  // no process is left in it.
  bool kill(const JobCgroup& cg) const;
  bool is_empty(const JobCgroup& cg) const;
  // Whether job cgroups can be frozen (v2 cgroup.freeze, or a v1 freezer hierarchy).
  bool can_freeze() const;
  // Freezes (frozen) or thaws the job's cgroup, then waits up to wait_ms for it to read so
  // (v1 freezer.state FROZEN/THAWED, v2 "frozen 1"/"frozen 0" in cgroup.events): a process in
  // the kernel may take a moment to stop. Writing again is harmless, so a caller may ask
  // several cgroups with wait_ms 0 first and then wait for each. False with *error when it
  // cannot be written or does not read so in time.
  bool freeze(const JobCgroup& cg, bool frozen, int wait_ms, std::string* error) const;
  // Whether the kernel's OOM killer killed a process of it (its memory limit was reached).
  bool oom_killed(const JobCgroup& cg) const;
  // rmdir of each folder; true when all are gone.
  bool remove(JobCgroup& cg) const;
  // The job cgroup name (worker id) that pid belongs to, from /proc/<pid>/cgroup; "" if none.
  std::string owner_of(pid_t pid) const;
  // Kills and thaws whatever is left below the watchdog's folder(s) and removes them (exit).
  void destroy_all();
  // Folders of the watchdog's cgroups (tests, logs).
  std::vector<std::string> roots() const;

 private:
  struct Root {
    std::string controller;  // "memory", "pids", "freezer"; "" for v2
    std::string mount;       // e.g. /sys/fs/cgroup/memory
    std::string rel;         // the watchdog's folder relative to the mount, "/x/kerneleval-1"
  };
  // The folder of cg whose freezer this is ("" when none).
  std::string freezer_dir(const JobCgroup& cg) const;

  bool v2_ = false;
  std::vector<Root> roots_;
};

// Reads a whole small file ("" when it cannot).
std::string read_small_file(const std::string& path);
// Writes text to an existing file; returns 0 or errno.
int write_small_file(const std::string& path, const std::string& text);

}  // namespace watchdog
