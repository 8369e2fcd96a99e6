#include "sandbox.h"

#include <fcntl.h>
#include <grp.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "fd.h"
#include "log.h"

namespace kew {

namespace {

// Child-side report over the sync pipe: "W<feature> <errno>\n" or "E<what> <errno>\n".
// Only async-signal-safe calls here (the parent may have a second thread).
void report(int fd, char kind, const char* what, int err) {
  char buf[128];
  int n = std::snprintf(buf, sizeof buf, "%c%s %d\n", kind, what, err);
  if (n > 0) {
    ssize_t w = ::write(fd, buf, static_cast<size_t>(n));
    (void)w;
  }
}

// Closes every descriptor from 3 up except keep (-1: keep none).
void close_other_fds(int keep) {
  if (keep < 3) keep = 2;
#ifdef SYS_close_range
  if (keep > 3) ::syscall(SYS_close_range, 3u, static_cast<unsigned>(keep - 1), 0u);
  if (::syscall(SYS_close_range, static_cast<unsigned>(keep + 1), ~0u, 0u) == 0) return;
#endif
  for (int fd = 3; fd < 65536; ++fd)
    if (fd != keep) ::close(fd);
}

void set_limit(int sync, int resource, rlim_t value, const char* name) {
  struct rlimit cur {};
  ::getrlimit(resource, &cur);
  struct rlimit lim {};
  lim.rlim_cur = value;
  lim.rlim_max = value;
  if (cur.rlim_max != RLIM_INFINITY && cur.rlim_max < value) lim.rlim_cur = lim.rlim_max = cur.rlim_max;
  if (::setrlimit(resource, &lim) != 0) report(sync, 'W', name, errno);
}

[[noreturn]] void child_main(const SandboxSpec& spec, char* const* argv, char* const* envp,
                             int sync, pid_t parent) {
  if (::setsid() < 0) report(sync, 'W', "process_group", errno);
  if (spec.isolate_network && ::unshare(CLONE_NEWNET) != 0)
    report(sync, 'W', "network_namespace", errno);
  if (spec.drop_user) {
    // Credentials first: changing them clears PR_SET_PDEATHSIG, which is set after.
    if (::setgroups(1, &spec.gid) != 0) report(sync, 'W', "supplementary_groups", errno);
    if (::setgid(spec.gid) != 0 || ::setuid(spec.uid) != 0) {
      report(sync, 'E', "unprivileged_user", errno);  // never run a worker as root by surprise
      ::_exit(126);
    }
  }
  if (::prctl(PR_SET_PDEATHSIG, SIGKILL) != 0) report(sync, 'W', "parent_death_signal", errno);
  if (::getppid() != parent) ::_exit(0);  // the watchdog died before the prctl
  if (::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) report(sync, 'W', "no_new_privs", errno);
  set_limit(sync, RLIMIT_CORE, 0, "rlimit_core");
  set_limit(sync, RLIMIT_NOFILE, static_cast<rlim_t>(spec.max_open_files), "rlimit_nofile");
  set_limit(sync, RLIMIT_NPROC, static_cast<rlim_t>(spec.max_processes), "rlimit_nproc");
  int devnull = ::open("/dev/null", O_RDONLY);
  if (devnull >= 0) {
    ::dup2(devnull, 0);
    if (devnull != 0) ::close(devnull);
  }
  close_other_fds(sync);
  reset_signals_in_child();
  ::execvpe(argv[0], argv, envp);
  report(sync, 'E', "exec", errno);
  ::_exit(127);
}

std::vector<char*> c_strings(const std::vector<std::string>& v) {
  std::vector<char*> out;
  for (const auto& s : v) out.push_back(const_cast<char*>(s.c_str()));
  out.push_back(nullptr);
  return out;
}

}  // namespace

void reset_signals_in_child() {
  sigset_t all;
  sigemptyset(&all);
  ::sigprocmask(SIG_SETMASK, &all, nullptr);
  for (int sig : {SIGPIPE, SIGCHLD, SIGTERM, SIGINT, SIGHUP}) ::signal(sig, SIG_DFL);
}

SpawnResult spawn_sandboxed(const SandboxSpec& spec) {
  SpawnResult result;
  if (spec.argv.empty()) {
    result.error = "empty worker command";
    return result;
  }
  auto argv = c_strings(spec.argv);
  auto envp = c_strings(spec.env);
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) {
    result.error = "pipe: " + errno_text(errno);
    return result;
  }
  UniqueFd read_end(fds[0]), write_end(fds[1]);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) {
    result.error = "fork: " + errno_text(errno);
    return result;
  }
  if (pid == 0) child_main(spec, argv.data(), envp.data(), write_end.get(), parent);
  result.pid = pid;
  write_end.reset();
  std::string text;
  char buf[512];
  for (;;) {  // until exec closes the pipe (or the child exits)
    ssize_t n = ::read(read_end.get(), buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    text.append(buf, static_cast<size_t>(n));
  }
  size_t start = 0, nl;
  while ((nl = text.find('\n', start)) != std::string::npos) {
    std::string rec = text.substr(start, nl - start);
    start = nl + 1;
    auto sp = rec.rfind(' ');
    if (rec.size() < 2 || sp == std::string::npos) continue;
    std::string what = rec.substr(1, sp - 1);
    std::string err = errno_text(std::atoi(rec.c_str() + sp + 1));
    if (rec[0] == 'W') result.refused.emplace_back(what, err);
    else result.error = what + ": " + err;
  }
  return result;
}

pid_t spawn_shell(const std::string& command, const std::string& log_path) {
  const pid_t pid = ::fork();
  if (pid != 0) return pid;
  ::setpgid(0, 0);
  int out = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (out >= 0) {
    ::dup2(out, 1);
    ::dup2(out, 2);
  }
  int devnull = ::open("/dev/null", O_RDONLY);
  if (devnull >= 0) ::dup2(devnull, 0);
  close_other_fds(-1);
  reset_signals_in_child();
  ::execl("/bin/sh", "sh", "-c", command.c_str(), static_cast<char*>(nullptr));
  ::_exit(127);
}

int probe_user_access(const std::string& path, uid_t uid, gid_t gid) {
  const pid_t pid = ::fork();
  if (pid < 0) return errno;
  if (pid == 0) {
    if (::setgroups(1, &gid) != 0 || ::setgid(gid) != 0 || ::setuid(uid) != 0) ::_exit(EPERM);
    ::_exit(::access(path.c_str(), X_OK) == 0 ? 0 : (errno & 0xff));
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : EINVAL;
}

}  // namespace kew
