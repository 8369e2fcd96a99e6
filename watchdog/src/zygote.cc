#include "zygote.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>

#include <cerrno>

#include "log.h"

namespace watchdog {

bool Zygote::start(SandboxSpec spec, const zpb::ZygoteConfig& config, SpawnResult* r) {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
    r->error = "socketpair: " + errno_text(errno);
    return false;
  }
  UniqueFd ours(sv[0]), theirs(sv[1]);
  spec.channel_fd = theirs.get();
  *r = spawn_in_sandbox(spec);
  if (r->pid < 0) return false;
  pid_ = r->pid;
  sock_ = std::move(ours);
  ::fcntl(sock_.get(), F_SETFL, ::fcntl(sock_.get(), F_GETFL) | O_NONBLOCK);
  decoder_ = FrameDecoder();
  out_ = FrameWriter();
  rx_fds_.clear();
  state = State::kStarting;
  stopping = false;
  closed_ms = 0;
  zpb::ZygoteRequest req;
  *req.mutable_config() = config;
  std::string payload;
  req.SerializeToString(&payload);
  out_.push(payload);
  flush();
  return true;
}

void Zygote::spawn(const std::string& worker_id, UniqueFd job_end,
                   std::vector<UniqueFd> cgroup_fds) {
  zpb::ZygoteRequest req;
  req.mutable_spawn()->set_worker_id(worker_id);
  req.mutable_spawn()->set_cgroup_fd_count(static_cast<int32_t>(cgroup_fds.size()));
  std::vector<UniqueFd> fds;
  fds.push_back(std::move(job_end));
  for (auto& f : cgroup_fds) fds.push_back(std::move(f));
  std::string payload;
  req.SerializeToString(&payload);
  out_.push(payload, std::move(fds));
  flush();
}

std::vector<zpb::ZygoteEvent> Zygote::read(bool* closed, std::vector<std::string>* errors) {
  std::vector<zpb::ZygoteEvent> events;
  char buf[65536];
  while (sock_.valid()) {
    long n = recv_with_fds(sock_.get(), buf, sizeof buf, rx_fds_);
    rx_fds_.clear();
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    if (n <= 0) {
      *closed = true;
      sock_.reset();
      break;
    }
    auto result = decoder_.feed(buf, static_cast<size_t>(n));
    for (auto& e : result.errors) errors->push_back(e);
    for (auto& f : result.frames) {
      zpb::ZygoteEvent ev;
      if (!ev.ParseFromString(f)) {
        errors->push_back("undecodable frame of " + std::to_string(f.size()) + " bytes");
        continue;
      }
      events.push_back(std::move(ev));
    }
  }
  return events;
}

void Zygote::kill() {
  if (pid_ > 0) ::kill(pid_, SIGKILL);
  stopping = true;
}

void Zygote::kill_quietly() {
  if (pid_ > 0) ::kill(pid_, SIGKILL);
}

void Zygote::exited() {
  pid_ = -1;
  sock_.reset();
  out_ = FrameWriter();
  state = State::kDown;
  closed_ms = 0;
}

}  // namespace watchdog
