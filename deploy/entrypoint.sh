#!/bin/sh
# The image's entry point: runs `kerneleval-server "$@"` (default: serve).
#
# One step first, only for a node or a builder (root: they sandbox job and build processes)
# in a container on cgroup v2 with its own cgroup namespace: the watchdog makes its job cgroups
# beside its own cgroup and enables the memory and pids controllers in the parent's
# cgroup.subtree_control, which cgroup v2 refuses (EBUSY) while
# processes sit in that parent (here the container's root cgroup). So move this process into a
# child cgroup, "service", first, with every other process of the container (tini, PID 1), as
# docker's dind image does. Where that cannot be done (not
# root, cgroup v1, a read-only /sys/fs/cgroup), nothing changes and the service reports the
# missing limits as sandbox warnings (docs/OPERATIONS.md, "The sandbox").
set -eu
if [ "$(id -u)" = 0 ] && [ -f /sys/fs/cgroup/cgroup.controllers ] \
   && [ "$(cat /proc/self/cgroup)" = "0::/" ] && [ -w /sys/fs/cgroup/cgroup.procs ]; then
  moved=1
  mkdir -p /sys/fs/cgroup/service 2>/dev/null || moved=0
  for pid in $(cat /sys/fs/cgroup/cgroup.procs); do
    [ "$moved" = 1 ] || break
    # (a pid gone meanwhile, such as cat's own, is no failure)
    echo "$pid" > /sys/fs/cgroup/service/cgroup.procs 2>/dev/null || [ ! -d "/proc/$pid" ] \
      || moved=0
  done
  if [ "$moved" = 0 ]; then
    echo "kerneleval-entrypoint: could not move into /sys/fs/cgroup/service;" \
         "job cgroups may lack memory and pids limits" >&2
  fi
fi
exec kerneleval-server "$@"
