// The seccomp filter of every job process, built here and installed by the job process itself
// (zygote.proto: ZygoteConfig.seccomp_filter) with SECCOMP_MODE_FILTER after no_new_privs.
//
// Kill if the architecture is not the build's; EPERM for x32 syscalls and for every syscall that
// reaches outside the job's namespaces or into the kernel's administration (unshare, setns,
// mount, ptrace, bpf, perf_event_open, keyctl, io_uring, ...); EPERM for clone with any
// CLONE_NEW* flag; ENOSYS for clone3 (its flags are behind a pointer; glibc falls back to
// clone). Everything else is allowed.
#pragma once

#include <string>
#include <vector>

namespace watchdog {

// The program as bytes: struct sock_filter entries (8 bytes each, host byte order). Empty on
// an architecture the filter does not know (only x86_64 and aarch64).
std::string build_seccomp_filter();

// The syscalls answered EPERM (names, for docs and tests).
std::vector<std::string> seccomp_denied_names();

}  // namespace watchdog
