#include "seccomp.h"

#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sched.h>
#include <stddef.h>
#include <sys/syscall.h>

#include <cerrno>
#include <cstring>
#include <utility>

namespace watchdog {

namespace {

#if defined(__x86_64__)
constexpr unsigned kArch = AUDIT_ARCH_X86_64;
constexpr bool kKnownArch = true;
#elif defined(__aarch64__)
constexpr unsigned kArch = AUDIT_ARCH_AARCH64;
constexpr bool kKnownArch = true;
#else
constexpr unsigned kArch = 0;
constexpr bool kKnownArch = false;
#endif

#ifndef __NR_mount_setattr
#define __NR_mount_setattr 442
#endif
#ifndef __NR_clone3
#define __NR_clone3 435
#endif

#define KE_SYS(name) {#name, __NR_##name}

// Syscalls that cross the job's boundary. Some are missing on aarch64 (no such syscall there):
// those are simply left out by the preprocessor.
const std::pair<const char*, long> kDenied[] = {
    KE_SYS(unshare), KE_SYS(setns), KE_SYS(mount), KE_SYS(umount2), KE_SYS(pivot_root),
    KE_SYS(chroot), KE_SYS(ptrace), KE_SYS(process_vm_readv), KE_SYS(process_vm_writev),
    KE_SYS(bpf), KE_SYS(perf_event_open), KE_SYS(keyctl), KE_SYS(add_key), KE_SYS(request_key),
    KE_SYS(kexec_load), KE_SYS(kexec_file_load), KE_SYS(init_module), KE_SYS(finit_module),
    KE_SYS(delete_module), KE_SYS(open_by_handle_at), KE_SYS(name_to_handle_at),
    KE_SYS(userfaultfd), KE_SYS(io_uring_setup), KE_SYS(io_uring_enter),
    KE_SYS(io_uring_register), KE_SYS(swapon), KE_SYS(swapoff), KE_SYS(reboot), KE_SYS(acct),
    KE_SYS(quotactl), KE_SYS(fsopen), KE_SYS(fsmount), KE_SYS(fsconfig), KE_SYS(fspick),
    KE_SYS(move_mount), KE_SYS(open_tree), KE_SYS(mount_setattr),
#ifdef __NR_lookup_dcookie
    KE_SYS(lookup_dcookie),
#endif
};

constexpr unsigned kCloneNewFlags = CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER |
                                    CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWCGROUP;

sock_filter stmt(unsigned short code, unsigned k) { return sock_filter{code, 0, 0, k}; }
sock_filter jump(unsigned short code, unsigned k, unsigned char jt, unsigned char jf) {
  return sock_filter{code, jt, jf, k};
}

}  // namespace

std::string build_seccomp_filter() {
  if (!kKnownArch) return "";
  std::vector<sock_filter> p;
  const unsigned eperm = SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA);
  const unsigned enosys = SECCOMP_RET_ERRNO | (ENOSYS & SECCOMP_RET_DATA);
  // The architecture: anything else (i386 through int 0x80, say) kills the process.
  p.push_back(stmt(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, arch)));
  p.push_back(jump(BPF_JMP | BPF_JEQ | BPF_K, kArch, 1, 0));
  p.push_back(stmt(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS));
  p.push_back(stmt(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)));
#if defined(__x86_64__)
  // x32 syscalls (the same numbers with bit 30 set) would bypass the list below.
  p.push_back(jump(BPF_JMP | BPF_JSET | BPF_K, 0x40000000u, 0, 1));
  p.push_back(stmt(BPF_RET | BPF_K, eperm));
#endif
  for (const auto& [name, nr] : kDenied) {
    (void)name;
    p.push_back(jump(BPF_JMP | BPF_JEQ | BPF_K, static_cast<unsigned>(nr), 0, 1));
    p.push_back(stmt(BPF_RET | BPF_K, eperm));
  }
  p.push_back(jump(BPF_JMP | BPF_JEQ | BPF_K, __NR_clone3, 0, 1));
  p.push_back(stmt(BPF_RET | BPF_K, enosys));
  // clone: the flags are arg0 (the low 32 bits hold every CLONE_NEW* flag).
  p.push_back(jump(BPF_JMP | BPF_JEQ | BPF_K, __NR_clone, 0, 4));
  p.push_back(stmt(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, args[0])));
  p.push_back(jump(BPF_JMP | BPF_JSET | BPF_K, kCloneNewFlags, 0, 1));
  p.push_back(stmt(BPF_RET | BPF_K, eperm));
  p.push_back(stmt(BPF_RET | BPF_K, SECCOMP_RET_ALLOW));
  p.push_back(stmt(BPF_RET | BPF_K, SECCOMP_RET_ALLOW));
  std::string out(p.size() * sizeof(sock_filter), '\0');
  std::memcpy(out.data(), p.data(), out.size());
  return out;
}

std::vector<std::string> seccomp_denied_names() {
  std::vector<std::string> out;
  for (const auto& [name, nr] : kDenied) {
    (void)nr;
    out.emplace_back(name);
  }
  out.emplace_back("clone(CLONE_NEW*)");
  out.emplace_back("clone3 (ENOSYS)");
  return out;
}

}  // namespace watchdog
