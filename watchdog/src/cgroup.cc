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

int64_t monotonic_ms() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000 + ts.tv_nsec / 1000000;
}

// A freezer folder's state as v1 names it: FROZEN, FREEZING (asked, not there yet), THAWED.
std::string freezer_state(const std::string& dir, bool v2) {
  if (!v2) {
    std::string s = read_small_file(dir + "/freezer.state");
    while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
    return s.empty() ? "unreadable" : s;
  }
  if (read_small_file(dir + "/cgroup.events").find("frozen 1") != std::string::npos)
    return "FROZEN";
  return read_small_file(dir + "/cgroup.freeze").rfind("1", 0) == 0 ? "FREEZING" : "THAWED";
}

// Thaws a folder, whichever freezer file it has (none: nothing to do).
void thaw(const std::string& dir) {
  if (exists(dir + "/freezer.state")) write_small_file(dir + "/freezer.state", "THAWED");
  if (exists(dir + "/cgroup.freeze")) write_small_file(dir + "/cgroup.freeze", "0");
}

std::vector<std::string> subfolders(const std::string& dir) {
  std::vector<std::string> subs;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d)) {
      std::string name = e->d_name;
      if (name == "." || name == "..") continue;
      if (e->d_type == DT_DIR) subs.push_back(dir + "/" + name);
    }
    ::closedir(d);
  }
  return subs;
}

// SIGKILL to every process of a folder and its subfolders, then thaws them: a process frozen by
// a timing window (or a dead watchdog's) takes the signal only when thawed (v1).
void kill_tree(const std::string& dir, bool v2) {
  for (const auto& s : subfolders(dir)) kill_tree(s, v2);
  if (v2 && exists(dir + "/cgroup.kill")) write_small_file(dir + "/cgroup.kill", "1");
  for (pid_t p : members(dir)) ::kill(p, SIGKILL);
  thaw(dir);
}

// Removes a folder and its subfolders, deepest first, killing what is still in them while the
// processes die.
void remove_tree(const std::string& dir, bool v2) {
  for (const auto& s : subfolders(dir)) remove_tree(s, v2);
  for (int i = 0; i < 50; ++i) {
    if (v2 && exists(dir + "/cgroup.kill")) write_small_file(dir + "/cgroup.kill", "1");
    for (pid_t p : members(dir)) ::kill(p, SIGKILL);
    if (::rmdir(dir.c_str()) == 0 || errno == ENOENT) return;
    sleep_ms(20);
  }
  log_line("cannot remove cgroup " + dir + ": " + errno_text(errno));
}

// Kills every process below these folders and removes them. Every tree is killed and thawed
// before any is removed: in v1 a process frozen in the freezer hierarchy keeps its memory and
// pids folders busy until it is thawed and dies.
void kill_and_remove_trees(const std::vector<std::string>& dirs, bool v2) {
  for (const auto& d : dirs) kill_tree(d, v2);
  for (const auto& d : dirs) remove_tree(d, v2);
}

}  // namespace

void Cgroups::init(const std::string& cgroup_root,
                   std::vector<std::pair<std::string, std::string>>* warnings) {
  v2_ = exists("/sys/fs/cgroup/cgroup.controllers");
  const std::string mine = "kerneleval-" + std::to_string(::getpid());
  std::vector<std::string> stale;  // folders of dead watchdogs, removed once all are found
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
    for (const auto& dir : subfolders(mount + base)) {
      const std::string name = dir.substr(dir.rfind('/') + 1);
      if (name.rfind("kerneleval-", 0) != 0 || name == mine) continue;
      const std::string num = name.substr(11);
      if (num.empty() || num.find_first_not_of("0123456789") != std::string::npos) continue;
      if (exists("/proc/" + num)) continue;
      log_line("removing the stale cgroup " + dir);
      stale.push_back(dir);
    }
    const std::string rel = base + "/" + mine;
    if (::mkdir((mount + rel).c_str(), 0755) != 0 && errno != EEXIST) {
      const std::string why = "mkdir " + mount + rel + ": " + errno_text(errno);
      for (const std::string c : {"memory", "pids", "freezer"})
        if (controller == c || controller.empty()) warnings->emplace_back("cgroup_" + c, why);
      return false;
    }
    roots_.push_back({controller, mount, rel});
    return true;
  };
  if (v2_) {
    const std::string mount = "/sys/fs/cgroup";
    const bool made = add_root("", mount);
    kill_and_remove_trees(stale, true);
    if (!made) return;
    // Enable memory and pids for the job folders: in the parent (for our folder) and ours.
    const std::string ours = mount + roots_[0].rel;
    if (!exists(ours + "/cgroup.freeze"))
      warnings->emplace_back("cgroup_freezer", "no cgroup.freeze in " + ours + " (before 5.2)");
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
    if (mount.empty()) {  // without a freezer a kill still works, but no timing window freezes
      warnings->emplace_back("cgroup_" + c, "no cgroup v1 " + c + " hierarchy is mounted");
      continue;
    }
    add_root(c, mount);
  }
  kill_and_remove_trees(stale, false);
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

bool Cgroups::can_freeze() const {
  if (v2_) return !roots_.empty() && exists(roots_[0].mount + roots_[0].rel + "/cgroup.freeze");
  for (const auto& r : roots_)
    if (r.controller == "freezer") return true;
  return false;
}

std::string Cgroups::freezer_dir(const JobCgroup& cg) const {
  if (cg.dirs.empty()) return "";
  if (v2_) return exists(cg.dirs[0] + "/cgroup.freeze") ? cg.dirs[0] : "";
  for (const auto& r : roots_) {
    if (r.controller != "freezer") continue;
    const std::string prefix = r.mount + r.rel + "/";
    for (const auto& d : cg.dirs)
      if (d.rfind(prefix, 0) == 0) return d;
  }
  return "";
}

bool Cgroups::freeze(const JobCgroup& cg, bool frozen, int wait_ms, std::string* error) const {
  const std::string dir = freezer_dir(cg);
  if (dir.empty()) {
    *error = "no cgroup freezer for this job process";
    return false;
  }
  const std::string file = dir + (v2_ ? "/cgroup.freeze" : "/freezer.state");
  const std::string value = v2_ ? (frozen ? "1" : "0") : (frozen ? "FROZEN" : "THAWED");
  if (int err = write_small_file(file, value); err != 0) {
    *error = "write " + file + ": " + errno_text(err);
    return false;
  }
  const std::string wanted = frozen ? "FROZEN" : "THAWED";
  const int64_t deadline = monotonic_ms() + wait_ms;
  std::string state = freezer_state(dir, v2_);
  while (state != wanted && monotonic_ms() < deadline) {
    sleep_ms(1);
    state = freezer_state(dir, v2_);
  }
  if (state == wanted) return true;
  *error = dir + " is " + state + " after " + std::to_string(wait_ms) + " ms";
  return false;
}

bool Cgroups::kill(const JobCgroup& cg) const {
  if (cg.dirs.empty()) return true;
  if (v2_) {  // cgroup.kill kills frozen processes too
    const std::string& d = cg.dirs[0];
    if (write_small_file(d + "/cgroup.kill", "1") != 0) {  // before 5.14: freeze, kill, thaw
      write_small_file(d + "/cgroup.freeze", "1");
      for (pid_t p : members(d)) ::kill(p, SIGKILL);
      write_small_file(d + "/cgroup.freeze", "0");
    }
    return is_empty(cg);
  }
  const std::string freezer = freezer_dir(cg);
  // Frozen, nothing in the cgroup can fork between reading its members and killing them; the
  // thaw after the kills also lets a job process that a timing window froze take its SIGKILL.
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
  kill_and_remove_trees(roots(), v2_);
  roots_.clear();
}

}  // namespace watchdog
