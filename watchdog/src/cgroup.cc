#include "cgroup.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "log.h"

namespace watchdog {

std::string read_small_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) return "";
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

int write_small_file(const std::string& path, const std::string& text) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
  if (fd < 0) return errno;
  ssize_t n = ::write(fd, text.data(), text.size());
  int err = n == static_cast<ssize_t>(text.size()) ? 0 : (n < 0 ? errno : EIO);
  ::close(fd);
  return err;
}

namespace {

bool exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

std::string parent_of(const std::string& rel) {
  auto slash = rel.rfind('/');
  if (slash == std::string::npos || slash == 0) return "";
  return rel.substr(0, slash);
}

// The watchdog's own cgroup path in a hierarchy ("" for v2's line "0::"), from /proc/self/cgroup.
std::string own_path(const std::string& controller) {
  std::istringstream in(read_small_file("/proc/self/cgroup"));
  std::string line;
  while (std::getline(in, line)) {
    auto a = line.find(':');
    auto b = line.find(':', a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    std::string list = line.substr(a + 1, b - a - 1);
    std::string path = line.substr(b + 1);
    if (controller.empty() ? list.empty() && line.compare(0, a, "0") == 0 : false) return path;
    std::istringstream names(list);
    std::string n;
    while (std::getline(names, n, ','))
      if (!controller.empty() && n == controller) return path;
  }
  return "/";
}

// Where a v1 hierarchy with this controller is mounted ("" if nowhere).
std::string v1_mount(const std::string& controller) {
  const std::string guess = "/sys/fs/cgroup/" + controller;
  if (exists(guess + "/cgroup.procs")) return guess;
  std::istringstream in(read_small_file("/proc/self/mounts"));
  std::string dev, dir, type, opts;
  std::string rest;
  while (in >> dev >> dir >> type >> opts) {
    std::getline(in, rest);
    if (type != "cgroup") continue;
    std::istringstream o(opts);
    std::string opt;
    while (std::getline(o, opt, ','))
      if (opt == controller) return dir;
  }
  return "";
}

std::vector<pid_t> members(const std::string& dir) {
  std::vector<pid_t> out;
  std::istringstream in(read_small_file(dir + "/cgroup.procs"));
  long pid;
  while (in >> pid)
    if (pid > 0) out.push_back(static_cast<pid_t>(pid));
  return out;
}

void sleep_ms(int ms) {
  timespec ts{0, ms * 1000000L};
  ::nanosleep(&ts, nullptr);
}

// Kills every process of one folder (and its subfolders), then removes them, deepest first.
void kill_and_remove_tree(const std::string& dir, bool v2) {
  if (DIR* d = ::opendir(dir.c_str())) {
    std::vector<std::string> subs;
    while (dirent* e = ::readdir(d)) {
      std::string name = e->d_name;
      if (name == "." || name == "..") continue;
      if (e->d_type == DT_DIR) subs.push_back(dir + "/" + name);
    }
    ::closedir(d);
    for (const auto& s : subs) kill_and_remove_tree(s, v2);
  }
  for (int i = 0; i < 50; ++i) {
    if (v2 && exists(dir + "/cgroup.kill")) write_small_file(dir + "/cgroup.kill", "1");
    auto pids = members(dir);
    for (pid_t p : pids) ::kill(p, SIGKILL);
    if (::rmdir(dir.c_str()) == 0 || errno == ENOENT) return;
    sleep_ms(20);
  }
  log_line("cannot remove cgroup " + dir + ": " + errno_text(errno));
}

}  // namespace

void Cgroups::init(const std::string& cgroup_root,
                   std::vector<std::pair<std::string, std::string>>* warnings) {
  v2_ = exists("/sys/fs/cgroup/cgroup.controllers");
  const std::string mine = "kerneleval-" + std::to_string(::getpid());
  auto add_root = [&](const std::string& controller, const std::string& mount) -> bool {
    std::string base;
    if (!cgroup_root.empty()) {
      base = cgroup_root;
      if (base.rfind(mount, 0) == 0) base = base.substr(mount.size());
      if (!base.empty() && base[0] != '/') base = "/" + base;
      while (base.size() > 1 && base.back() == '/') base.pop_back();
      if (base == "/") base = "";
    } else {
      base = parent_of(own_path(controller));  // beside the watchdog's own cgroup
    }
    // Folders of dead watchdogs: kerneleval-<pid> whose pid is gone.
    if (DIR* d = ::opendir((mount + base).c_str())) {
      std::vector<std::string> stale;
      while (dirent* e = ::readdir(d)) {
        std::string name = e->d_name;
        if (name.rfind("kerneleval-", 0) != 0 || name == mine) continue;
        const std::string num = name.substr(11);
        if (num.empty() || num.find_first_not_of("0123456789") != std::string::npos) continue;
        if (exists("/proc/" + num)) continue;
        stale.push_back(mount + base + "/" + name);
      }
      ::closedir(d);
      for (const auto& s : stale) {
        log_line("removing the stale cgroup " + s);
        kill_and_remove_tree(s, v2_);
      }
    }
    const std::string rel = base + "/" + mine;
    if (::mkdir((mount + rel).c_str(), 0755) != 0 && errno != EEXIST) {
      const std::string why = "mkdir " + mount + rel + ": " + errno_text(errno);
      if (controller == "memory" || controller.empty())
        warnings->emplace_back("cgroup_memory", why);
      if (controller == "pids" || controller.empty()) warnings->emplace_back("cgroup_pids", why);
      return false;
    }
    roots_.push_back({controller, mount, rel});
    return true;
  };
  if (v2_) {
    const std::string mount = "/sys/fs/cgroup";
    if (!add_root("", mount)) return;
    // Enable memory and pids for the job folders: in the parent (for our folder) and ours.
    const std::string ours = mount + roots_[0].rel;
    for (const std::string& c : {std::string("memory"), std::string("pids")}) {
      int e1 = write_small_file(parent_of(ours) + "/cgroup.subtree_control", "+" + c);
      int e2 = write_small_file(ours + "/cgroup.subtree_control", "+" + c);
      if (e2 != 0)
        warnings->emplace_back("cgroup_" + c, "cannot enable the " + c + " controller for job "
                                              "cgroups (" + errno_text(e2 ? e2 : e1) + ")");
    }
    return;
  }
  for (const std::string& c : {std::string("memory"), std::string("pids"), std::string("freezer")}) {
    const std::string mount = v1_mount(c);
    if (mount.empty()) {
      if (c != "freezer")
        warnings->emplace_back("cgroup_" + c, "no cgroup v1 " + c + " hierarchy is mounted");
      continue;
    }
    add_root(c, mount);
  }
}

std::vector<std::string> Cgroups::roots() const {
  std::vector<std::string> out;
  for (const auto& r : roots_) out.push_back(r.mount + r.rel);
  return out;
}

JobCgroup Cgroups::create(const std::string& name, const CgroupLimits& limits,
                          std::vector<UniqueFd>* procs_fds, std::string* error) {
  JobCgroup cg;
  for (const auto& r : roots_) {
    const std::string dir = r.mount + r.rel + "/" + name;
    if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) {
      *error = "mkdir " + dir + ": " + errno_text(errno);
      return cg;
    }
    cg.dirs.push_back(dir);
    int err = 0;
    const std::string mem = std::to_string(limits.memory_bytes);
    if (v2_) {
      if (limits.memory_bytes > 0) err = write_small_file(dir + "/memory.max", mem);
      if (!err && exists(dir + "/memory.swap.max")) write_small_file(dir + "/memory.swap.max", "0");
      if (!err && limits.max_pids > 0)
        err = write_small_file(dir + "/pids.max", std::to_string(limits.max_pids));
    } else if (r.controller == "memory" && limits.memory_bytes > 0) {
      err = write_small_file(dir + "/memory.limit_in_bytes", mem);
      if (!err && exists(dir + "/memory.memsw.limit_in_bytes"))
        write_small_file(dir + "/memory.memsw.limit_in_bytes", mem);  // no swap either
    } else if (r.controller == "pids" && limits.max_pids > 0) {
      err = write_small_file(dir + "/pids.max", std::to_string(limits.max_pids));
    }
    if (err) {
      *error = "limits of " + dir + ": " + errno_text(err);
      return cg;
    }
    int fd = ::open((dir + "/cgroup.procs").c_str(), O_WRONLY | O_CLOEXEC);
    if (fd < 0) {
      *error = "open " + dir + "/cgroup.procs: " + errno_text(errno);
      return cg;
    }
    procs_fds->emplace_back(fd);
  }
  return cg;
}

bool Cgroups::is_empty(const JobCgroup& cg) const {
  for (const auto& d : cg.dirs)
    if (!members(d).empty()) return false;
  return true;
}

bool Cgroups::oom_killed(const JobCgroup& cg) const {
  // v2: memory.events; v1: memory.oom_control (kernel 4.13+). Both have "oom_kill N".
  for (const auto& d : cg.dirs) {
    std::string text = read_small_file(d + (v2_ ? "/memory.events" : "/memory.oom_control"));
    const auto at = text.find("oom_kill ");
    if (at != std::string::npos && std::atoll(text.c_str() + at + 9) > 0) return true;
  }
  return false;
}

bool Cgroups::kill(const JobCgroup& cg) const {
  if (cg.dirs.empty()) return true;
  if (v2_) {
    const std::string& d = cg.dirs[0];
    if (write_small_file(d + "/cgroup.kill", "1") != 0) {  // before 5.14: freeze, kill, thaw
      write_small_file(d + "/cgroup.freeze", "1");
      for (pid_t p : members(d)) ::kill(p, SIGKILL);
      write_small_file(d + "/cgroup.freeze", "0");
    }
    return is_empty(cg);
  }
  std::string freezer;
  for (const auto& d : cg.dirs)
    if (d.find("/freezer/") != std::string::npos && exists(d + "/freezer.state")) freezer = d;
  // Frozen, nothing in the cgroup can fork between reading its members and killing them.
  if (!freezer.empty()) {
    write_small_file(freezer + "/freezer.state", "FROZEN");
    for (int i = 0; i < 20; ++i) {
      if (read_small_file(freezer + "/freezer.state").rfind("FROZEN", 0) == 0) break;
      sleep_ms(1);
    }
  }
  for (const auto& d : cg.dirs)
    for (pid_t p : members(d)) ::kill(p, SIGKILL);
  if (!freezer.empty()) write_small_file(freezer + "/freezer.state", "THAWED");
  return is_empty(cg);
}

bool Cgroups::remove(JobCgroup& cg) const {
  std::vector<std::string> left;
  for (const auto& d : cg.dirs)
    if (::rmdir(d.c_str()) != 0 && errno != ENOENT) left.push_back(d);
  cg.dirs = left;
  return left.empty();
}

std::string Cgroups::owner_of(pid_t pid) const {
  if (pid <= 0) return "";
  std::istringstream in(read_small_file("/proc/" + std::to_string(pid) + "/cgroup"));
  std::string line;
  while (std::getline(in, line)) {
    auto b = line.find(':', line.find(':') + 1);
    if (b == std::string::npos) continue;
    const std::string path = line.substr(b + 1);
    for (const auto& r : roots_) {
      const std::string prefix = r.rel + "/";
      if (path.rfind(prefix, 0) != 0) continue;
      std::string rest = path.substr(prefix.size());
      return rest.substr(0, rest.find('/'));
    }
  }
  return "";
}

void Cgroups::destroy_all() {
  for (const auto& r : roots_) kill_and_remove_tree(r.mount + r.rel, v2_);
  roots_.clear();
}

}  // namespace watchdog
