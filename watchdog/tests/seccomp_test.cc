// The job processes' seccomp filter, installed for real in a forked child: the syscalls that
// reach outside the job answer EPERM, clone3 ENOSYS, and ordinary ones still work.
#include <gtest/gtest.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/ptrace.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <string>

#include "seccomp.h"

namespace {

// Runs body in a child with the filter installed; returns the child's exit code (0 = all good,
// otherwise the number of the failed check).
int in_filtered_child(int (*body)()) {
  const std::string prog = watchdog::build_seccomp_filter();
  if (prog.empty()) return -1;
  pid_t pid = ::fork();
  if (pid == 0) {
    sock_fprog fprog{};
    fprog.len = static_cast<unsigned short>(prog.size() / sizeof(sock_filter));
    fprog.filter = reinterpret_cast<sock_filter*>(const_cast<char*>(prog.data()));
    if (::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) ::_exit(100);
    if (::prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &fprog) != 0) ::_exit(101);
    ::_exit(body());
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 200 + WTERMSIG(status);
}

bool eperm(long r) { return r == -1 && errno == EPERM; }

int denied_checks() {
  if (!eperm(::unshare(CLONE_NEWNS))) return 1;
  if (!eperm(::unshare(CLONE_NEWUSER))) return 2;
  if (!eperm(::syscall(SYS_setns, 0, 0))) return 3;
  if (!eperm(::mount("none", "/tmp", "tmpfs", 0, nullptr))) return 4;
  if (!eperm(::ptrace(PTRACE_TRACEME, 0, nullptr, nullptr))) return 5;
  // clone(CLONE_NEWUSER) through the raw syscall (no child can start: EPERM before it).
  if (!eperm(::syscall(SYS_clone, CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0))) return 6;
  if (!eperm(::syscall(SYS_bpf, 0, 0, 0))) return 7;
  if (!eperm(::syscall(SYS_perf_event_open, 0, 0, -1, -1, 0))) return 8;
  if (!eperm(::syscall(SYS_keyctl, 0, 0, 0, 0, 0))) return 9;
  if (!eperm(::syscall(SYS_process_vm_writev, 1, 0, 0, 0, 0, 0))) return 10;
  long r = ::syscall(435 /* clone3 */, nullptr, 0);
  if (!(r == -1 && errno == ENOSYS)) return 11;
#if defined(__x86_64__)
  if (!eperm(::syscall(0x40000000 | SYS_getpid))) return 12;  // x32
#endif
  return 0;
}

int allowed_checks() {
  if (::getpid() <= 0) return 1;
  if (::syscall(SYS_getpid) <= 0) return 2;
  pid_t child = ::fork();  // plain fork (clone without CLONE_NEW*) still works
  if (child < 0) return 3;
  if (child == 0) ::_exit(7);
  int status = 0;
  if (::waitpid(child, &status, 0) != child || !WIFEXITED(status) || WEXITSTATUS(status) != 7)
    return 4;
  return 0;
}

}  // namespace

TEST(Seccomp, FilterIsWellFormed) {
  const std::string prog = watchdog::build_seccomp_filter();
#if defined(__x86_64__) || defined(__aarch64__)
  ASSERT_FALSE(prog.empty());
  EXPECT_EQ(prog.size() % sizeof(sock_filter), 0u);
  EXPECT_LE(prog.size() / sizeof(sock_filter), 4096u);  // BPF_MAXINSNS
#endif
}

TEST(Seccomp, DeniesEscapesWithEperm) {
  if (watchdog::build_seccomp_filter().empty()) GTEST_SKIP() << "architecture not covered";
  EXPECT_EQ(in_filtered_child(denied_checks), 0);
}

TEST(Seccomp, AllowsOrdinarySyscalls) {
  if (watchdog::build_seccomp_filter().empty()) GTEST_SKIP() << "architecture not covered";
  EXPECT_EQ(in_filtered_child(allowed_checks), 0);
}
