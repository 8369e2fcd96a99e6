#include "supervisor.h"

#include <fcntl.h>
#include <poll.h>
#include <pwd.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <random>

#include "log.h"

extern char** environ;

namespace kew {

namespace fs = std::filesystem;

int64_t now_ms() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000 + ts.tv_nsec / 1000000;
}

int64_t unix_now_ms() {
  using namespace std::chrono;
  return duration_cast<milliseconds>(system_clock::now().time_since_epoch()).count();
}

namespace {

constexpr int kAllDevices = -2;
constexpr int kAutoResetGraceMs = 1000;
constexpr int64_t kKmsgWaitMs = 1500;  // how long an XID waits for its kernel log line
// A worker named by an application XID gets this long to report its CUDA error and exit by
// itself (on the H200 the error and the XID arrive together) before it is killed.
constexpr int kXidReportGraceMs = 2000;

// 128 random bits in hex: the secret a worker shows the front end.
std::string random_token() {
  unsigned char raw[16] = {0};
  size_t got = 0;
  while (got < sizeof raw) {
    ssize_t n = ::getrandom(raw + got, sizeof raw - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += static_cast<size_t>(n);
  }
  if (got < sizeof raw) {  // no getrandom (old kernel, seccomp): the C++ library's source
    std::random_device rd;
    for (auto& b : raw) b = static_cast<unsigned char>(rd());
  }
  static const char* hex = "0123456789abcdef";
  std::string out;
  for (unsigned char c : raw) {
    out.push_back(hex[c >> 4]);
    out.push_back(hex[c & 15]);
  }
  return out;
}

bool matches(int wanted, int index) { return wanted == kAllDevices || wanted == index; }

void chown_tree(const fs::path& root, uid_t uid, gid_t gid) {
  std::error_code ec;
  int failed = ::chown(root.c_str(), uid, gid);
  for (auto& entry : fs::recursive_directory_iterator(root, ec))
    failed |= ::chown(entry.path().c_str(), uid, gid);
  if (failed != 0) log_line("chown " + root.string() + ": " + errno_text(errno));
}

}  // namespace

Supervisor::Supervisor(int control_fd) : control_(control_fd) {}

// ---------------------------------------------------------------- channel

void Supervisor::emit(pb::SupervisorEvent& ev) {
  std::string payload;
  if (!ev.SerializeToString(&payload)) return;
  out_ += encode_frame(payload);
  flush_output(false);
}

void Supervisor::ack(uint64_t id, bool ok, const std::string& message) {
  pb::SupervisorEvent ev;
  ev.set_command_id(id);
  ev.mutable_ack()->set_ok(ok);
  ev.mutable_ack()->set_message(message);
  if (!ok) log_line("command " + std::to_string(id) + " refused: " + message);
  emit(ev);
}

void Supervisor::warn_once(const std::string& feature, const std::string& message) {
  if (!warned_.insert(feature).second) return;
  log_line("warning: " + feature + ": " + message);
  pb::SupervisorEvent ev;
  ev.mutable_warning()->set_feature(feature);
  ev.mutable_warning()->set_message(message);
  emit(ev);
}

void Supervisor::flush_output(bool block) {
  while (!out_.empty() && !closed_) {
    ssize_t n = ::send(control_.get(), out_.data(), out_.size(), MSG_NOSIGNAL);
    if (n > 0) {
      out_.erase(0, static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (!block) return;
      pollfd p{control_.get(), POLLOUT, 0};
      if (::poll(&p, 1, 1000) <= 0) return;
      continue;
    }
    closed_ = true;  // EPIPE and friends: the front end is gone
  }
}

void Supervisor::on_control_readable() {
  char buf[65536];
  for (;;) {
    ssize_t n = ::recv(control_.get(), buf, sizeof buf, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (n <= 0) {
      closed_ = true;
      return;
    }
    auto result = decoder_.feed(buf, static_cast<size_t>(n));
    for (const auto& e : result.errors) {
      log_line("control channel: " + e);
      warned_.erase("protocol");
      warn_once("protocol", e);
    }
    for (const auto& f : result.frames) handle_frame(f);
  }
}

void Supervisor::handle_frame(const std::string& payload) {
  pb::SupervisorCommand cmd;
  if (!cmd.ParseFromString(payload)) {
    const std::string why = "malformed command frame of " + std::to_string(payload.size()) +
                            " bytes rejected";
    log_line("control channel: " + why);
    warned_.erase("protocol");
    warn_once("protocol", why);
    return;
  }
  handle_command(cmd);
}

void Supervisor::handle_command(const pb::SupervisorCommand& cmd) {
  const uint64_t id = cmd.command_id();
  if (cmd.kind_case() == pb::SupervisorCommand::kConfigure) {
    if (configured_) return ack(id, false, "already configured");
    std::string error = configure(cmd.configure());
    ack(id, error.empty(), error);
    if (!error.empty()) return;
    for (auto& [i, d] : devices_) send_device_update(d);
    for (auto& [i, d] : devices_) {
      d.wanted = true;
      fill(d);
    }
    return;
  }
  if (!configured_) return ack(id, false, "not configured: send Configure first");
  if (shutting_down_) return ack(id, false, "shutting down");
  std::string why;
  switch (cmd.kind_case()) {
    case pb::SupervisorCommand::kStartWorkers: {
      bool ok = start_workers(cmd.start_workers().device_index(), &why);
      return ack(id, ok, why);
    }
    case pb::SupervisorCommand::kStopWorkers: {
      const auto& s = cmd.stop_workers();
      if (s.device_index() != kAllDevices && !device(s.device_index()))
        return ack(id, false, "no device " + std::to_string(s.device_index()));
      stop_workers(s.device_index(), s.grace_ms(), "stopped");
      return ack(id, true);
    }
    case pb::SupervisorCommand::kRestartWorkers: {
      bool ok = restart_workers(cmd.restart_workers().device_index(), &why);
      return ack(id, ok, why);
    }
    case pb::SupervisorCommand::kKillWorker: {
      Worker* w = find_worker(cmd.kill_worker().worker_id());
      if (!w) return ack(id, false, "no worker " + cmd.kill_worker().worker_id());
      terminate(*w, 0, "killed:" + cmd.kill_worker().reason(), true);
      return ack(id, true);
    }
    case pb::SupervisorCommand::kSetJob: {
      Worker* w = find_worker(cmd.set_job().worker_id());
      if (!w) return ack(id, false, "no worker " + cmd.set_job().worker_id());
      w->job_id = cmd.set_job().job_id();
      return ack(id, true);
    }
    case pb::SupervisorCommand::kGetStatus: {
      ack(id, true);
      pb::SupervisorEvent ev;
      ev.set_command_id(id);
      auto* report = ev.mutable_status();
      for (auto& [i, d] : devices_) fill_status(d, report->add_devices());
      for (auto& [wid, w] : workers_) {
        auto* pw = report->add_workers();
        pw->set_worker_id(w.id);
        pw->set_pid(w.pid);
        pw->set_device_index(w.device);
        pw->set_token(w.token);
        pw->set_spare(w.spare);
        pw->set_job_id(w.job_id);
        pw->set_start_time_ms(w.start_ms);
      }
      return emit(ev);
    }
    case pb::SupervisorCommand::kResetGpu: {
      const auto& r = cmd.reset_gpu();
      Device* d = device(r.device_index());
      if (!d || r.device_index() < 0) return ack(id, false, "no GPU " + std::to_string(r.device_index()));
      if (d->reset) return ack(id, false, "a reset of this GPU is already running");
      ack(id, true);
      return begin_reset(*d, r.grace_ms(), id);
    }
    case pb::SupervisorCommand::kShutdown:
      ack(id, true);
      return begin_shutdown(cmd.shutdown().grace_ms());
    default:
      return ack(id, false, "unknown command");
  }
}

// ---------------------------------------------------------------- commands

std::string Supervisor::configure(const pb::Configure& c) {
  if (c.worker_command().empty()) return "worker_command is empty";
  for (const auto& e : c.xid_policy())
    if (!policy_.set(e.xid(), e.category(), e.action()))
      return "xid_policy: unknown action '" + e.action() + "' for XID " + std::to_string(e.xid());
  config_ = c;
  if (config_.workers_per_device() <= 0) config_.set_workers_per_device(1);
  if (config_.max_restarts() <= 0) config_.set_max_restarts(5);
  if (config_.restart_window_seconds() <= 0) config_.set_restart_window_seconds(30);
  if (config_.backoff_initial_ms() <= 0) config_.set_backoff_initial_ms(100);
  if (config_.backoff_max_ms() <= 0) config_.set_backoff_max_ms(5000);
  if (config_.reset_command().empty())
    config_.set_reset_command("nvidia-smi --gpu-reset -i {index}");
  if (config_.health_interval_seconds() <= 0) config_.set_health_interval_seconds(5);

  std::string error;
  switch (c.nvml_source()) {
    case pb::NVML_SOURCE_REAL:
      nvml_ = open_real_nvml(&error);
      if (!nvml_) return "NVML: " + error;
      break;
    case pb::NVML_SOURCE_FAKE:
      nvml_ = open_fake_nvml(c.fake_nvml_path(), &error);
      if (!nvml_) return "fake NVML: " + error;
      break;
    case pb::NVML_SOURCE_NONE:
      break;
    default:
      nvml_ = open_real_nvml(&error);
      if (!nvml_) log_line("no NVML (" + error + "); CPU pseudo-device only");
  }

  std::vector<DeviceInfo> found = nvml_ ? nvml_->devices() : std::vector<DeviceInfo>{};
  std::vector<int> indices(c.device_indices().begin(), c.device_indices().end());
  if (indices.empty())
    for (const auto& d : found) indices.push_back(d.index);
  if (indices.empty()) indices.push_back(-1);
  for (int i : indices) {
    Device& d = devices_[i];
    d.info.index = i;
    d.info.name = i < 0 ? "cpu" : "gpu " + std::to_string(i);
    for (const auto& f : found)
      if (f.index == i) d.info = f;
    d.intensity = RestartIntensity(config_.max_restarts(),
                                   int64_t{config_.restart_window_seconds()} * 1000,
                                   config_.backoff_initial_ms(), config_.backoff_max_ms());
    if (nvml_ && i >= 0) d.reading = nvml_->read(i);
  }

  if (nvml_) {
    const std::string path = c.kmsg_path().empty() ? "/dev/kmsg" : c.kmsg_path();
    if (int err = kmsg_.open(path); err != 0)
      warn_once("kmsg", "cannot read " + path + " (" + errno_text(err) +
                            "); XIDs without a pid go to the workers running jobs on that GPU");
  }

  state_dir_ = c.state_dir().empty() ? "/tmp/kerneleval-watchdog-" + std::to_string(::getpid())
                                     : c.state_dir();
  std::error_code ec;
  fs::create_directories(fs::path(state_dir_) / "workers", ec);
  if (ec) return "state_dir " + state_dir_ + ": " + ec.message();

  sandbox_.argv.assign(c.worker_command().begin(), c.worker_command().end());
  const auto& sb = c.sandbox();
  sandbox_.max_open_files = sb.max_open_files() > 0 ? sb.max_open_files() : 4096;
  sandbox_.max_processes = sb.max_processes() > 0 ? sb.max_processes() : 4096;
  sandbox_.isolate_network = sb.isolate_network();
  if (::geteuid() == 0) {
    const std::string user = sb.user().empty() ? "nobody" : sb.user();
    passwd* pw = ::getpwnam(user.c_str());
    if (user == "root") {
      // Explicitly asked for: no drop, no warning.
    } else if (!pw) {
      warn_once("unprivileged_user", "no user '" + user + "'; workers run as root");
    } else {
      // The worker must be able to run its command and reach its private folder.
      const std::string workers_dir = (fs::path(state_dir_) / "workers").string();
      ::chmod(workers_dir.c_str(), 0755);
      std::string blocked;
      int err = 0;
      for (const std::string& path : {sandbox_.argv[0], workers_dir}) {
        if (path.find('/') == std::string::npos) continue;  // found through PATH at exec
        if ((err = probe_user_access(path, pw->pw_uid, pw->pw_gid)) != 0) {
          blocked = path;
          break;
        }
      }
      if (!blocked.empty()) {
        warn_once("unprivileged_user", "user '" + user + "' cannot reach " + blocked + " (" +
                                           errno_text(err) + "); workers run as root");
      } else {
        sandbox_.drop_user = true;
        sandbox_.uid = pw->pw_uid;
        sandbox_.gid = pw->pw_gid;
      }
    }
  }
  configured_ = true;
  next_health_ms_ = now_ms() + int64_t{config_.health_interval_seconds()} * 1000;
  return "";
}

bool Supervisor::start_workers(int index, std::string* why) {
  bool any = false;
  for (auto& [i, d] : devices_) {
    if (!matches(index, i)) continue;
    any = true;
    if (d.needs_reset || d.reset) {
      *why = "device " + std::to_string(i) + " needs ResetGpu";
      if (index != kAllDevices) return false;
      continue;
    }
    if (d.health == pb::HEALTH_UNHEALTHY) {  // restart intensity: an operator says go again
      d.intensity.clear();
      set_health(d, pb::HEALTH_HEALTHY, "");
    }
    d.wanted = true;
    fill(d);
  }
  if (!any) *why = "no device " + std::to_string(index);
  return any;
}

void Supervisor::stop_workers(int index, int grace_ms, const std::string& reason) {
  for (auto& [i, d] : devices_)
    if (matches(index, i)) d.wanted = false;
  pending_.erase(std::remove_if(pending_.begin(), pending_.end(),
                                [&](const PendingStart& p) { return matches(index, p.device); }),
                 pending_.end());
  for (auto& [id, w] : workers_)
    if (matches(index, w.device) && w.exit_reason.empty()) terminate(w, grace_ms, reason, false);
}

bool Supervisor::restart_workers(int index, std::string* why) {
  // Stop what runs (a device waiting for ResetGpu keeps its state), then start as
  // StartWorkers does, which also reports the devices that need a reset.
  for (auto& [i, d] : devices_) {
    if (!matches(index, i) || d.needs_reset || d.reset) continue;
    stop_workers(i, 0, "restart");
    d.intensity.clear();
  }
  return start_workers(index, why);
}

void Supervisor::begin_shutdown(int grace_ms) {
  shutting_down_ = true;
  stop_workers(kAllDevices, grace_ms, "shutdown");
  for (auto& [i, d] : devices_)
    if (d.reset && d.reset->command_pid > 0) ::kill(-d.reset->command_pid, SIGKILL);
  shutdown_deadline_ = now_ms() + grace_ms + 2000;
}

// ---------------------------------------------------------------- workers

int Supervisor::live_workers(int device, bool spare) const {
  int n = 0;
  for (const auto& [id, w] : workers_)
    if (w.device == device && w.spare == spare && w.exit_reason.empty()) ++n;
  return n;
}

void Supervisor::fill(Device& d) {
  if (!d.wanted || d.reset || d.health != pb::HEALTH_HEALTHY || shutting_down_) return;
  const int index = d.info.index;
  pending_.erase(std::remove_if(pending_.begin(), pending_.end(),
                                [&](const PendingStart& p) { return p.device == index; }),
                 pending_.end());
  for (int n = live_workers(index, false); n < config_.workers_per_device(); ++n) spawn(d, false);
  for (int n = live_workers(index, true); n < spares_wanted(); ++n) spawn(d, true);
}

int Supervisor::spares_wanted() const {
  return config_.warm_spare() ? std::max(1, config_.spare_count()) : 0;
}

void Supervisor::spawn(Device& d, bool spare) {
  Worker w;
  const int index = d.info.index;
  w.id = (index < 0 ? std::string("cpu") : "d" + std::to_string(index)) + "-w" +
         std::to_string(next_worker_++);
  w.device = index;
  w.spare = spare;
  w.token = random_token();
  w.start_ms = unix_now_ms();
  const fs::path dir = fs::path(state_dir_) / "workers" / w.id;
  std::error_code ec;
  for (const char* sub : {"tmp", "triton", "torch_extensions"}) fs::create_directories(dir / sub, ec);
  fs::permissions(dir, fs::perms::owner_all, ec);
  if (sandbox_.drop_user) chown_tree(dir, sandbox_.uid, sandbox_.gid);
  w.dir = dir.string();

  SandboxSpec spec = sandbox_;
  std::map<std::string, std::string> env;
  for (char** e = environ; *e; ++e) {
    std::string kv(*e);
    auto eq = kv.find('=');
    if (eq != std::string::npos) env[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID";  // CUDA's numbering = NVML's (default: fastest first)
  for (const auto& [k, v] : config_.worker_env()) env[k] = v;
  env["KERNELEVAL_WORKER_ID"] = w.id;
  env["KERNELEVAL_WORKER_TOKEN"] = w.token;
  env["KERNELEVAL_DEVICE_INDEX"] = std::to_string(index);
  env["CUDA_VISIBLE_DEVICES"] = index < 0 ? "" : std::to_string(index);
  env["KERNELEVAL_WORKER_DIR"] = w.dir;
  env["TMPDIR"] = (dir / "tmp").string();
  env["TRITON_CACHE_DIR"] = (dir / "triton").string();
  env["TORCH_EXTENSIONS_DIR"] = (dir / "torch_extensions").string();
  if (sandbox_.drop_user) env["HOME"] = w.dir;  // root's home is not readable to the worker
  for (const auto& [k, v] : env) spec.env.push_back(k + "=" + v);

  SpawnResult r = spawn_sandboxed(spec);
  for (const auto& [feature, err] : r.refused)
    warn_once(feature, "the host refused " + feature + " (" + err + "); workers run without it");
  if (!r.error.empty()) {  // e.g. exec failed: the child exits 127 and counts as a failure
    log_line("worker " + w.id + ": " + r.error);
    warn_once("worker_command", "cannot start " + sandbox_.argv[0] + ": " + r.error);
  }
  if (r.pid < 0) {  // fork failed: count it like a crash so a broken host trips the intensity
    fs::remove_all(dir, ec);
    if (d.intensity.record_failure(now_ms())) {
      set_health(d, pb::HEALTH_UNHEALTHY, "cannot start workers: " + r.error);
    } else {
      pending_.push_back({index, spare, now_ms() + d.intensity.backoff_ms(now_ms())});
    }
    return;
  }
  w.pid = r.pid;
  pb::SupervisorEvent ev;
  auto* pw = ev.mutable_worker_started()->mutable_worker();
  pw->set_worker_id(w.id);
  pw->set_pid(w.pid);
  pw->set_device_index(w.device);
  pw->set_token(w.token);
  pw->set_spare(w.spare);
  pw->set_start_time_ms(w.start_ms);
  workers_[w.id] = w;
  emit(ev);
}

void Supervisor::terminate(Worker& w, int grace_ms, const std::string& reason, bool replace,
                           bool quiet) {
  if (w.exit_reason.empty()) {
    w.exit_reason = reason;
    w.replace = replace;
  }
  if (grace_ms <= 0) {
    ::kill(-w.pid, SIGKILL);
    w.kill_at_ms = 0;
  } else {
    if (!quiet) ::kill(-w.pid, SIGTERM);
    const int64_t at = now_ms() + grace_ms;
    w.kill_at_ms = w.kill_at_ms ? std::min(w.kill_at_ms, at) : at;
  }
}

Worker* Supervisor::find_worker(const std::string& id) {
  auto it = workers_.find(id);
  return it == workers_.end() ? nullptr : &it->second;
}

Worker* Supervisor::worker_for_pid(pid_t pid) {
  if (pid <= 0) return nullptr;
  const pid_t group = ::getpgid(pid);  // a worker's children share its process group
  for (auto& [id, w] : workers_)
    if (w.pid == pid || w.pid == group) return &w;
  return nullptr;
}

void Supervisor::reap() {
  for (;;) {
    // Peek first: while the exited worker is still a zombie its pid cannot be reused, so
    // killing its process group (whatever it left behind) cannot hit a stranger.
    siginfo_t info{};
    if (::waitid(P_ALL, 0, &info, WEXITED | WNOHANG | WNOWAIT) != 0 || info.si_pid == 0) return;
    for (auto& [id, w] : workers_)
      if (w.pid == info.si_pid) ::kill(-w.pid, SIGKILL);
    int status = 0;
    const pid_t pid = ::waitpid(info.si_pid, &status, WNOHANG);
    if (pid <= 0) return;
    bool known = false;
    for (auto& [id, w] : workers_)
      if (w.pid == pid) {
        known = true;
        on_worker_exit(id, status);
        break;
      }
    if (known) continue;
    for (auto& [i, d] : devices_)
      if (d.reset && d.reset->command_pid == pid) {
        d.reset->command_done = true;
        d.reset->command_status = status;
      }
    // Anything else is an orphan of a worker, reaped because we are the child subreaper.
  }
}

void Supervisor::on_worker_exit(std::string id, int status) {
  Worker w = workers_.at(id);
  workers_.erase(id);
  std::error_code ec;
  fs::remove_all(w.dir, ec);

  const bool signaled = WIFSIGNALED(status);
  const int code = signaled ? -1 : WEXITSTATUS(status);
  const int sig = signaled ? WTERMSIG(status) : 0;
  const bool on_purpose = !w.exit_reason.empty();
  const std::string reason = on_purpose ? w.exit_reason : (signaled ? "crashed" : "exited");
  // Code 0 or a configured retire code: the worker retired itself (e.g. after a poisoned CUDA
  // context). A worker that dies while it runs a job was killed by that job's kernel. Neither
  // is the GPU's or the worker's own fault, so neither trips the intensity nor waits a
  // backoff: the intensity is for workers that cannot even start or stay up idle.
  bool retired = !signaled && code == 0;
  for (int c : config_.retire_exit_codes()) retired = retired || (!signaled && code == c);
  const bool failure = !on_purpose && !retired && w.job_id.empty();
  const int64_t now = now_ms();

  Device& d = devices_[w.device];
  bool restarting = false, tripped = false;
  int64_t backoff = 0;
  std::string promoted;
  if (!on_purpose || w.replace) {
    if (failure) tripped = d.intensity.record_failure(now);
    if (!tripped && d.wanted && d.health == pb::HEALTH_HEALTHY && !d.reset && !shutting_down_) {
      restarting = true;
      backoff = failure ? d.intensity.backoff_ms(now) : 0;
      bool start_spare = w.spare;
      if (!w.spare) {
        for (auto& [sid, s] : workers_)
          if (s.device == w.device && s.spare && s.exit_reason.empty()) {
            s.spare = false;
            promoted = sid;
            start_spare = true;
            break;
          }
      }
      pending_.push_back({w.device, start_spare, now + backoff});
    }
  }

  pb::SupervisorEvent ev;
  auto* ex = ev.mutable_worker_exited();
  auto* pw = ex->mutable_worker();
  pw->set_worker_id(w.id);
  pw->set_pid(w.pid);
  pw->set_device_index(w.device);
  pw->set_spare(w.spare);
  pw->set_job_id(w.job_id);
  pw->set_start_time_ms(w.start_ms);
  ex->set_exit_code(code);
  ex->set_signal(sig);
  ex->set_reason(reason);
  ex->set_restarting(restarting);
  ex->set_backoff_ms(static_cast<int32_t>(backoff));
  emit(ev);
  if (!promoted.empty()) {
    pb::SupervisorEvent pe;
    pe.mutable_worker_promoted()->set_worker_id(promoted);
    emit(pe);
  }
  if (tripped) {
    pending_.erase(std::remove_if(pending_.begin(), pending_.end(),
                                  [&](const PendingStart& p) { return p.device == w.device; }),
                   pending_.end());
    set_health(d, pb::HEALTH_UNHEALTHY,
               "restart intensity: more than " + std::to_string(config_.max_restarts()) +
                   " worker failures in " + std::to_string(config_.restart_window_seconds()) +
                   " s; workers are no longer restarted");
  }
}

// ---------------------------------------------------------------- devices, health, XIDs

Device* Supervisor::device(int index) {
  auto it = devices_.find(index);
  return it == devices_.end() ? nullptr : &it->second;
}

void Supervisor::set_health(Device& d, pb::Health h, const std::string& reason) {
  if (d.health == h && d.reason == reason) return;
  d.health = h;
  d.reason = reason;
  log_line("device " + std::to_string(d.info.index) + ": " + pb::Health_Name(h) +
           (reason.empty() ? "" : " (" + reason + ")"));
  send_device_update(d);
}

void Supervisor::fill_status(const Device& d, pb::DeviceStatus* s) const {
  s->set_device_index(d.info.index);
  s->set_name(d.info.name);
  s->set_uuid(d.info.uuid);
  s->set_health(d.health);
  s->set_health_reason(d.reason);
  s->set_memory_total_bytes(d.reading.memory_total_bytes);
  s->set_memory_used_bytes(d.reading.memory_used_bytes);
  s->set_temperature_celsius(d.reading.temperature_celsius);
  s->set_utilization_percent(d.reading.utilization_percent);
  s->set_remapped_row_count(d.reading.remapped_row_count);
  s->set_remap_pending(d.reading.remap_pending);
  s->set_recovery_action(d.reading.recovery_action);
  s->set_driver_version(d.info.driver_version);
}

void Supervisor::send_device_update(const Device& d) {
  pb::SupervisorEvent ev;
  fill_status(d, ev.mutable_device()->mutable_device());
  emit(ev);
}

void Supervisor::require_reset(Device& d, const std::string& why, bool auto_reset) {
  if (why.empty() || d.reset) return;  // a reset in progress ends with its own health check
  d.needs_reset = true;
  set_health(d, pb::HEALTH_UNHEALTHY, why);
  if (!auto_reset) return;
  if (d.auto_resets.record_failure(now_ms())) {
    set_health(d, pb::HEALTH_UNHEALTHY, why + "; more than 3 automatic resets in an hour: "
                                              "waiting for ResetGpu");
    return;
  }
  begin_reset(d, kAutoResetGraceMs, 0);
}

void Supervisor::read_health(int64_t now) {
  if (now < next_health_ms_) return;
  next_health_ms_ = now + int64_t{config_.health_interval_seconds()} * 1000;
  for (auto& [i, d] : devices_) {
    if (nvml_ && i >= 0 && !d.reset) {
      d.reading = nvml_->read(i);
      const std::string action = XidPolicy::action_for_recovery(d.reading.recovery_action);
      if (!d.needs_reset && action == kResetGpu)
        require_reset(d, "NVML recovery action: " + d.reading.recovery_action, config_.auto_reset());
      else if (!d.needs_reset && action == kMarkUnhealthy)
        require_reset(d, "NVML recovery action: " + d.reading.recovery_action, false);
      else if (!d.reading.ok && d.health == pb::HEALTH_HEALTHY)
        set_health(d, pb::HEALTH_UNHEALTHY, "health reading: " + d.reading.error);
    }
    send_device_update(d);
  }
}

void Supervisor::poll_xids(int64_t now) {
  kmsg_.poll(now);
  if (nvml_)
    for (const XidEvent& e : nvml_->poll_events()) {
      const bool wait = e.pid == 0 && kmsg_.is_open();
      xids_.push_back({e, wait ? now + kKmsgWaitMs : now});
    }
  for (size_t i = 0; i < xids_.size();) {
    PendingXid& p = xids_[i];
    bool matched = p.event.pid != 0;
    if (!matched && kmsg_.is_open()) {
      const Device* d = device(p.event.device_index);
      if (auto k = kmsg_.take(p.event.xid, d ? d->info.pci_bus_id : "", now, 10000)) {
        p.event.pid = k->pid;  // may stay 0: the line said pid='<unknown>'
        matched = true;
      }
    }
    if (matched || now >= p.deadline_ms) {
      XidEvent e = p.event;
      xids_.erase(xids_.begin() + static_cast<long>(i));
      handle_xid(e);
    } else {
      ++i;
    }
  }
}

void Supervisor::handle_xid(const XidEvent& e) {
  const XidRule rule = policy_.lookup(e.xid);
  pb::SupervisorEvent ev;
  auto* x = ev.mutable_xid();
  x->set_device_index(e.device_index);
  x->set_xid(e.xid);
  x->set_category(rule.category);
  x->set_action(rule.action);
  x->set_pid(e.pid);
  x->set_time_ms(unix_now_ms());
  x->set_message(rule.description);
  Device* d = device(e.device_index);
  std::vector<Worker*> victims;
  if (d) {
    Worker* named = worker_for_pid(e.pid);
    if (named && named->device == e.device_index) {
      victims.push_back(named);
    } else if (e.pid == 0 || rule.action != std::string(kRestartWorker)) {
      for (auto& [id, w] : workers_)  // without a pid: whoever runs a job on that GPU
        if (w.device == e.device_index && !w.job_id.empty() && w.exit_reason.empty())
          victims.push_back(&w);
    }
  } else {
    x->set_message(rule.description + " (device not supervised)");
  }
  for (Worker* w : victims) {
    x->add_worker_ids(w->id);
    if (!w->job_id.empty()) x->add_job_ids(w->job_id);
  }
  log_line("XID " + std::to_string(e.xid) + " on device " + std::to_string(e.device_index) +
           " pid " + std::to_string(e.pid) + ": " + rule.category + " -> " + rule.action);
  emit(ev);
  if (!d) return;
  const std::string why = "XID " + std::to_string(e.xid) + " (" + rule.description + ")";
  if (rule.action == kRestartWorker) {
    for (Worker* w : victims) terminate(*w, kXidReportGraceMs, "xid", true, /*quiet=*/true);
  } else if (rule.action == kResetGpu) {
    require_reset(*d, why + " needs a GPU reset", config_.auto_reset());
  } else if (rule.action == kMarkUnhealthy) {
    require_reset(*d, why + " needs an operator", false);
  }
}

// ---------------------------------------------------------------- loop

void Supervisor::kill_everything() {
  for (auto& [id, w] : workers_) ::kill(-w.pid, SIGKILL);
  for (auto& [i, d] : devices_)
    if (d.reset && d.reset->command_pid > 0) ::kill(-d.reset->command_pid, SIGKILL);
}

void Supervisor::tick(int64_t now) {
  if (!configured_) return;
  poll_xids(now);
  for (auto& [id, w] : workers_)
    if (w.kill_at_ms && now >= w.kill_at_ms) {
      ::kill(-w.pid, SIGKILL);
      w.kill_at_ms = 0;
    }
  std::vector<PendingStart> due;
  for (size_t i = 0; i < pending_.size();) {
    if (pending_[i].due_ms <= now) {
      due.push_back(pending_[i]);
      pending_.erase(pending_.begin() + static_cast<long>(i));
    } else {
      ++i;
    }
  }
  for (const PendingStart& p : due) {
    Device* d = device(p.device);
    if (!d || !d->wanted || d->reset || d->health != pb::HEALTH_HEALTHY || shutting_down_) continue;
    const int want = p.spare ? spares_wanted() : config_.workers_per_device();
    if (live_workers(p.device, p.spare) < want) spawn(*d, p.spare);
  }
  for (auto& [i, d] : devices_)
    if (d.reset) advance_reset(d, now);
  read_health(now);
  if (shutting_down_) {
    bool commands = false;
    for (auto& [i, d] : devices_) commands = commands || (d.reset && d.reset->command_pid > 0);
    if ((workers_.empty() && !commands) || now >= shutdown_deadline_) exit_code_ = 0;
    else if (now >= shutdown_deadline_ - 2000) kill_everything();
  }
}

int Supervisor::run() {
  ::signal(SIGPIPE, SIG_IGN);
  sigset_t mask;
  sigemptyset(&mask);
  for (int sig : {SIGCHLD, SIGTERM, SIGINT, SIGHUP}) sigaddset(&mask, sig);
  ::sigprocmask(SIG_BLOCK, &mask, nullptr);
  signals_.reset(::signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK));
  if (!signals_.valid()) {
    log_line("signalfd: " + errno_text(errno));
    return 1;
  }
  // Orphans of workers (a worker's own children) are re-parented to us and reaped here.
  if (::prctl(PR_SET_CHILD_SUBREAPER, 1) != 0) log_line("PR_SET_CHILD_SUBREAPER failed");
  ::fcntl(control_.get(), F_SETFD, FD_CLOEXEC);
  ::fcntl(control_.get(), F_SETFL, ::fcntl(control_.get(), F_GETFL) | O_NONBLOCK);

  while (exit_code_ < 0) {
    pollfd fds[3] = {};
    fds[0] = {control_.get(), static_cast<short>(POLLIN | (out_.empty() ? 0 : POLLOUT)), 0};
    fds[1] = {signals_.get(), POLLIN, 0};
    fds[2] = {nvml_ ? nvml_->event_fd() : -1, POLLIN, 0};
    int n = ::poll(fds, 3, 50);
    if (n < 0 && errno != EINTR) {
      log_line("poll: " + errno_text(errno));
      break;
    }
    if (fds[1].revents & POLLIN) {
      signalfd_siginfo si{};
      while (::read(signals_.get(), &si, sizeof si) == static_cast<ssize_t>(sizeof si)) {
        if (si.ssi_signo == SIGCHLD) continue;
        log_line(std::string("signal ") + strsignal(static_cast<int>(si.ssi_signo)) +
                 ": shutting down");
        if (!shutting_down_) begin_shutdown(1000);
      }
      reap();
    }
    if (fds[0].revents & POLLOUT) flush_output(false);
    if (fds[0].revents & (POLLIN | POLLHUP | POLLERR)) on_control_readable();
    if (closed_) {  // the front end is gone: nothing may outlive it
      log_line("control channel closed: killing every worker and exiting");
      kill_everything();
      return shutting_down_ ? 0 : 1;
    }
    reap();
    tick(now_ms());
  }
  kill_everything();
  flush_output(true);
  return exit_code_ < 0 ? 1 : exit_code_;
}

}  // namespace kew
