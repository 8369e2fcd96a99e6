// The fresh root of a device sandbox, made in the child between fork and exec:
//   unshare(NEWNS|NEWNET|NEWIPC|NEWUTS); "/" made private (MS_REC|MS_PRIVATE)
//   tmpfs on root_dir (folders 0755), then inside it:
//     /usr /bin /sbin /lib /lib32 /lib64 /libx32 /etc   read-only recursive binds (a symlink such
//                                                        as /bin -> usr/bin stays a symlink)
//     every read_only_path, at the same path             read-only recursive binds
//     /sys                                               read-only, not recursive (no cgroupfs)
//     /dev: tmpfs with null zero full random urandom tty and the GPU's nodes bound in,
//           fd stdin stdout stderr symlinks, an empty shm folder
//     /proc                                              a new proc mount
//     /tmp                                               64 MiB tmpfs, 1777
//   pivot_root(root_dir, root_dir/.old), chdir /, detach .old, remount the root read-only.
// Nothing else of the host is visible: no state folder, no repository beyond the read-only
// code paths, no /root, no /home.
//
// Everything the child does is planned in the parent (strings built before fork), so the
// child only makes syscalls.
#include "sandbox.h"

#include <fcntl.h>
#include <grp.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "fd.h"
#include "log.h"

#ifndef MOUNT_ATTR_RDONLY
#define MOUNT_ATTR_RDONLY 0x00000001
#endif
#ifndef AT_RECURSIVE
#define AT_RECURSIVE 0x8000
#endif
#ifndef __NR_mount_setattr
#define __NR_mount_setattr 442
#endif

namespace watchdog {

namespace {

struct MountAttr {
  uint64_t attr_set, attr_clr, propagation, userns_fd;
};

enum class Op { kMkdir, kSymlink, kBindRo, kBindRoTop, kBindNode, kTmpfs, kProc };

struct Step {
  Op op;
  std::string a;  // source / link target / tmpfs options
  std::string b;  // destination (absolute, inside the new root)
};

// Child-side report over the sync pipe: "W<feature> <errno>\n" or "E<what> <errno>\n".
void report(int fd, char kind, const char* what, int err) {
  char buf[600];
  int n = std::snprintf(buf, sizeof buf, "%c%s %d\n", kind, what, err);
  if (n > 0) {
    ssize_t w = ::write(fd, buf, static_cast<size_t>(std::min(n, 599)));
    (void)w;
  }
}

void close_fds_from(int first) {
#ifdef SYS_close_range
  if (::syscall(SYS_close_range, static_cast<unsigned>(first), ~0u, 0u) == 0) return;
#endif
  for (int fd = first; fd < 65536; ++fd) ::close(fd);
}

void close_other_fds(int keep) {
  if (keep < 3) {
    close_fds_from(3);
    return;
  }
  for (int fd = 3; fd < keep; ++fd) ::close(fd);
  close_fds_from(keep + 1);
}

// Read-only: mount_setattr(AT_RECURSIVE) where the kernel has it, else a remount of the top
// that keeps the flags the kernel locks (nosuid, nodev, noexec).
int make_read_only(const char* path, bool recursive) {
  if (recursive) {
    MountAttr attr{MOUNT_ATTR_RDONLY, 0, 0, 0};
    if (::syscall(__NR_mount_setattr, AT_FDCWD, path, AT_RECURSIVE, &attr, sizeof attr) == 0)
      return 0;
    if (errno != ENOSYS && errno != EINVAL) return errno;
  }
  struct statvfs sv {};
  unsigned long flags = MS_REMOUNT | MS_BIND | MS_RDONLY;
  if (::statvfs(path, &sv) == 0) {
    if (sv.f_flag & ST_NOSUID) flags |= MS_NOSUID;
    if (sv.f_flag & ST_NODEV) flags |= MS_NODEV;
    if (sv.f_flag & ST_NOEXEC) flags |= MS_NOEXEC;
  }
  return ::mount(nullptr, path, nullptr, flags, nullptr) == 0 ? 0 : errno;
}

// One step; 0 or errno.
int run_step(const Step& s) {
  switch (s.op) {
    case Op::kMkdir:
      return ::mkdir(s.b.c_str(), 0755) == 0 || errno == EEXIST ? 0 : errno;
    case Op::kSymlink:
      return ::symlink(s.a.c_str(), s.b.c_str()) == 0 ? 0 : errno;
    case Op::kBindRo:
    case Op::kBindRoTop: {
      const bool rec = s.op == Op::kBindRo;
      if (::mount(s.a.c_str(), s.b.c_str(), nullptr, MS_BIND | (rec ? MS_REC : 0), nullptr) != 0)
        return errno;
      return make_read_only(s.b.c_str(), rec);
    }
    case Op::kBindNode: {
      int fd = ::open(s.b.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
      if (fd < 0) return errno;
      ::close(fd);
      return ::mount(s.a.c_str(), s.b.c_str(), nullptr, MS_BIND, nullptr) == 0 ? 0 : errno;
    }
    case Op::kTmpfs:
      return ::mount("tmpfs", s.b.c_str(), "tmpfs", MS_NOSUID | MS_NODEV, s.a.c_str()) == 0
                 ? 0 : errno;
    case Op::kProc:
      if (::mount("proc", s.b.c_str(), "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, nullptr) == 0)
        return 0;
      // In a user namespace without its own PID namespace proc cannot be mounted: bind it.
      return ::mount("/proc", s.b.c_str(), nullptr, MS_BIND | MS_REC, nullptr) == 0 ? 0 : errno;
  }
  return EINVAL;
}

struct Plan {
  std::vector<Step> steps;
  std::vector<std::string> what;  // "fresh_root: <op> <path>" per step (reports)
  std::string root, old_root, uid_map, gid_map;
};

bool is_dir(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

Plan make_plan(const SandboxSpec& spec) {
  Plan plan;
  const std::string& r = spec.root_dir;
  plan.root = r;
  plan.old_root = r + "/.old";
  auto add = [&](Op op, const std::string& a, const std::string& b, const char* name) {
    plan.steps.push_back({op, a, b});
    plan.what.push_back(std::string("fresh_root: ") + name + " " + b.substr(r.size()));
  };
  std::vector<std::string> made{"/"};
  auto mkdirs = [&](const std::string& path) {  // every parent folder, 0755
    std::string cur;
    size_t at = 1;
    while (at <= path.size()) {
      size_t next = path.find('/', at);
      if (next == std::string::npos) next = path.size();
      cur = path.substr(0, next);
      if (!cur.empty() && std::find(made.begin(), made.end(), cur) == made.end()) {
        made.push_back(cur);
        add(Op::kMkdir, "", r + cur, "mkdir");
      }
      at = next + 1;
    }
  };
  add(Op::kTmpfs, "size=16m,mode=0755", r, "tmpfs");
  std::vector<std::string> base;
  for (const char* top : {"/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc"}) {
    struct stat st {};
    if (::lstat(top, &st) != 0) continue;
    if (S_ISLNK(st.st_mode)) {
      char target[4096];
      ssize_t n = ::readlink(top, target, sizeof target - 1);
      if (n <= 0) continue;
      add(Op::kSymlink, std::string(target, static_cast<size_t>(n)), r + top, "symlink");
      continue;
    }
    if (!S_ISDIR(st.st_mode)) continue;
    mkdirs(top);
    add(Op::kBindRo, top, r + top, "bind");
    base.push_back(top);
  }
  mkdirs("/sys");
  add(Op::kBindRoTop, "/sys", r + "/sys", "bind");
  mkdirs("/dev");
  add(Op::kTmpfs, "size=64k,mode=0755", r + "/dev", "tmpfs");
  for (const char* n : {"null", "zero", "full", "random", "urandom", "tty"})
    if (::access((std::string("/dev/") + n).c_str(), F_OK) == 0)
      add(Op::kBindNode, std::string("/dev/") + n, r + "/dev/" + n, "bind");
  for (const auto& node : spec.device_nodes) {
    if (is_dir(node)) {
      mkdirs(node);
      add(Op::kBindRoTop, node, r + node, "bind");
      plan.steps.back().op = Op::kBindRo;
    } else {
      add(Op::kBindNode, node, r + node, "bind");
    }
  }
  add(Op::kSymlink, "/proc/self/fd", r + "/dev/fd", "symlink");
  add(Op::kSymlink, "/proc/self/fd/0", r + "/dev/stdin", "symlink");
  add(Op::kSymlink, "/proc/self/fd/1", r + "/dev/stdout", "symlink");
  add(Op::kSymlink, "/proc/self/fd/2", r + "/dev/stderr", "symlink");
  mkdirs("/dev/shm");
  mkdirs("/proc");
  add(Op::kProc, "", r + "/proc", "proc");
  mkdirs("/tmp");
  add(Op::kTmpfs, "size=64m,mode=1777", r + "/tmp", "tmpfs");
  std::vector<std::string> extra(spec.read_only_paths.begin(), spec.read_only_paths.end());
  std::sort(extra.begin(), extra.end());
  std::vector<std::string> bound = base;
  for (std::string p : extra) {
    while (p.size() > 1 && p.back() == '/') p.pop_back();
    if (p.empty() || p[0] != '/' || p == "/") continue;
    bool covered = false;
    for (const auto& b : bound) covered = covered || p == b || p.rfind(b + "/", 0) == 0;
    struct stat st {};
    if (covered || ::stat(p.c_str(), &st) != 0) continue;
    if (S_ISDIR(st.st_mode)) {
      mkdirs(p);
      add(Op::kBindRo, p, r + p, "bind");
    } else {
      mkdirs(p.substr(0, p.rfind('/')));
      add(Op::kBindNode, p, r + p, "bind");
      add(Op::kBindRoTop, p, r + p, "bind");
    }
    bound.push_back(p);
  }
  mkdirs("/.old");
  return plan;
}

std::vector<char*> c_strings(const std::vector<std::string>& v) {
  std::vector<char*> out;
  for (const auto& s : v) out.push_back(const_cast<char*>(s.c_str()));
  out.push_back(nullptr);
  return out;
}

int write_all(const char* path, const char* text) {
  int fd = ::open(path, O_WRONLY | O_CLOEXEC);
  if (fd < 0) return errno;
  ssize_t n = ::write(fd, text, std::strlen(text));
  int err = n < 0 ? errno : 0;
  ::close(fd);
  return err;
}

[[noreturn]] void child_main(const SandboxSpec& spec, const Plan& plan, char* const* argv,
                             char* const* envp, int sync_in, int channel_in, pid_t parent) {
  // Park the two descriptors we keep above 3 first, so that dup2(..., 3) cannot hit them.
  int sync = ::fcntl(sync_in, F_DUPFD_CLOEXEC, 100);
  int channel = ::fcntl(channel_in, F_DUPFD_CLOEXEC, 100);
  if (sync < 0 || channel < 0) ::_exit(126);
  ::umask(022);
  if (::setsid() < 0) report(sync, 'W', "process_group", errno);
  if (spec.user_namespace) {
    if (::unshare(CLONE_NEWUSER) != 0) {
      report(sync, 'E', "user_namespace", errno);
      ::_exit(126);
    }
    write_all("/proc/self/setgroups", "deny");
    if (write_all("/proc/self/uid_map", plan.uid_map.c_str()) != 0 ||
        write_all("/proc/self/gid_map", plan.gid_map.c_str()) != 0) {
      report(sync, 'E', "user_namespace: uid_map", errno);
      ::_exit(126);
    }
  }
  bool fresh = spec.fresh_root;
  if (::unshare(CLONE_NEWNS) != 0) {
    report(sync, 'W', "mount_namespace", errno);
    fresh = false;
  }
  if (::unshare(CLONE_NEWNET) != 0) report(sync, 'W', "network_namespace", errno);
  if (::unshare(CLONE_NEWIPC) != 0) report(sync, 'W', "ipc_namespace", errno);
  if (::unshare(CLONE_NEWUTS) != 0) report(sync, 'W', "uts_namespace", errno);
  if (fresh) {
    if (::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) {
      report(sync, 'E', "fresh_root: private /", errno);
      ::_exit(126);
    }
    for (size_t i = 0; i < plan.steps.size(); ++i) {
      int err = run_step(plan.steps[i]);
      if (err != 0) {
        report(sync, 'E', plan.what[i].c_str(), err);
        ::_exit(126);
      }
    }
    if (::syscall(SYS_pivot_root, plan.root.c_str(), plan.old_root.c_str()) != 0) {
      report(sync, 'E', "fresh_root: pivot_root", errno);
      ::_exit(126);
    }
    if (::chdir("/") != 0 || ::umount2("/.old", MNT_DETACH) != 0) {
      report(sync, 'E', "fresh_root: detach the old root", errno);
      ::_exit(126);
    }
    ::rmdir("/.old");
    if (::mount(nullptr, "/", nullptr, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, nullptr) != 0)
      report(sync, 'W', "read_only_root", errno);
  }
  if (::prctl(PR_SET_PDEATHSIG, SIGKILL) != 0) report(sync, 'W', "parent_death_signal", errno);
  if (::getppid() != parent) ::_exit(0);  // the watchdog died before the prctl
  if (::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) report(sync, 'W', "no_new_privs", errno);
  int devnull = ::open("/dev/null", O_RDONLY);
  if (devnull >= 0 && devnull != 0) {
    ::dup2(devnull, 0);
    ::close(devnull);
  }
  if (::dup2(channel, 3) != 3) {
    report(sync, 'E', "channel descriptor", errno);
    ::_exit(126);
  }
  ::close(channel);
  // Keep 0, 1, 2, 3 and the sync pipe (close-on-exec).
  for (int fd = 4; fd < sync; ++fd) ::close(fd);
  close_fds_from(sync + 1);
  reset_signals_in_child();
  ::execvpe(argv[0], argv, envp);
  report(sync, 'E', "exec", errno);
  ::_exit(127);
}

}  // namespace

void reset_signals_in_child() {
  sigset_t all;
  sigemptyset(&all);
  ::sigprocmask(SIG_SETMASK, &all, nullptr);
  for (int sig : {SIGPIPE, SIGCHLD, SIGTERM, SIGINT, SIGHUP}) ::signal(sig, SIG_DFL);
}

std::vector<std::string> gpu_device_nodes(int index, int minor) {
  std::vector<std::string> out;
  if (index < 0) return out;
  const std::string own = "/dev/nvidia" + std::to_string(minor >= 0 ? minor : index);
  for (const std::string& n : {std::string("/dev/nvidiactl"), std::string("/dev/nvidia-uvm"),
                               std::string("/dev/nvidia-uvm-tools"), own,
                               std::string("/dev/nvidia-caps")})
    if (::access(n.c_str(), F_OK) == 0) out.push_back(n);
  return out;
}

SpawnResult spawn_in_sandbox(const SandboxSpec& spec) {
  SpawnResult result;
  if (spec.argv.empty()) {
    result.error = "empty worker command";
    return result;
  }
  Plan plan;
  if (spec.fresh_root) plan = make_plan(spec);
  plan.uid_map = "0 " + std::to_string(::getuid()) + " 1\n";
  plan.gid_map = "0 " + std::to_string(::getgid()) + " 1\n";
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
  if (pid == 0)
    child_main(spec, plan, argv.data(), envp.data(), write_end.get(), spec.channel_fd, parent);
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

}  // namespace watchdog
