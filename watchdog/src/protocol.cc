#include "protocol.h"

#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>

namespace watchdog {

std::string encode_frame(const std::string& payload) {
  const auto n = static_cast<uint32_t>(payload.size());
  std::string out;
  out.reserve(payload.size() + 4);
  out.push_back(static_cast<char>((n >> 24) & 0xff));
  out.push_back(static_cast<char>((n >> 16) & 0xff));
  out.push_back(static_cast<char>((n >> 8) & 0xff));
  out.push_back(static_cast<char>(n & 0xff));
  out += payload;
  return out;
}

FrameDecoder::Result FrameDecoder::feed(const char* data, size_t size) {
  Result result;
  while (size > 0 && skip_ > 0) {  // discard the rest of an oversized frame
    const size_t n = skip_ < size ? static_cast<size_t>(skip_) : size;
    skip_ -= n;
    data += n;
    size -= n;
  }
  buffer_.append(data, size);
  size_t pos = 0;
  while (buffer_.size() - pos >= 4) {
    const auto* p = reinterpret_cast<const unsigned char*>(buffer_.data() + pos);
    const uint32_t len = (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) |
                         (uint32_t{p[2]} << 8) | uint32_t{p[3]};
    if (len > kMaxFrame) {
      result.errors.push_back("frame of " + std::to_string(len) + " bytes exceeds the " +
                              std::to_string(kMaxFrame) + "-byte limit; skipped");
      pos += 4;
      const size_t avail = buffer_.size() - pos;
      if (avail >= len) {
        pos += len;
      } else {
        skip_ = len - avail;
        pos = buffer_.size();
      }
      continue;
    }
    if (buffer_.size() - pos - 4 < len) break;
    result.frames.emplace_back(buffer_, pos + 4, len);
    pos += 4 + len;
  }
  buffer_.erase(0, pos);
  return result;
}

namespace {

// sendmsg of data[0..size) with fds as SCM_RIGHTS (none when fds is empty).
ssize_t send_some(int fd, const char* data, size_t size, const std::vector<int>& fds) {
  iovec iov{const_cast<char*>(data), size};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerFrame)];
  if (!fds.empty()) {
    if (fds.size() > kMaxFdsPerFrame) {
      errno = EINVAL;
      return -1;
    }
    const size_t bytes = sizeof(int) * fds.size();
    std::memset(control, 0, sizeof control);
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(bytes);
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(bytes);
    std::memcpy(CMSG_DATA(c), fds.data(), bytes);
  }
  return ::sendmsg(fd, &msg, MSG_NOSIGNAL);
}

}  // namespace

void FrameWriter::push(const std::string& payload, std::vector<UniqueFd> fds) {
  Out o;
  o.bytes = encode_frame(payload);
  o.fds = std::move(fds);
  queue_.push_back(std::move(o));
}

bool FrameWriter::flush(int fd, bool block) {
  while (!queue_.empty()) {
    Out& o = queue_.front();
    std::vector<int> raw;
    if (o.sent == 0)
      for (auto& f : o.fds) raw.push_back(f.get());
    ssize_t n = send_some(fd, o.bytes.data() + o.sent, o.bytes.size() - o.sent, raw);
    if (n > 0) {
      o.sent += static_cast<size_t>(n);
      o.fds.clear();  // in flight now: our copies are closed
      if (o.sent == o.bytes.size()) queue_.pop_front();
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (!block) return true;
      pollfd p{fd, POLLOUT, 0};
      if (::poll(&p, 1, 1000) <= 0) return true;
      continue;
    }
    return false;
  }
  return true;
}

long recv_with_fds(int fd, char* data, size_t size, std::deque<UniqueFd>& fds) {
  iovec iov{data, size};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerFrame)];
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  ssize_t n;
  do {
    n = ::recvmsg(fd, &msg, MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return -1;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int got;
      std::memcpy(&got, CMSG_DATA(c) + i * sizeof(int), sizeof got);
      fds.emplace_back(got);
    }
  }
  return static_cast<long>(n);
}

bool send_with_fds(int fd, const std::string& data, const std::vector<int>& fds) {
  size_t sent = 0;
  bool first = true;
  while (sent < data.size() || first) {
    ssize_t n = send_some(fd, data.data() + sent, data.size() - sent,
                          first ? fds : std::vector<int>{});
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd p{fd, POLLOUT, 0};
      ::poll(&p, 1, 1000);
      continue;
    }
    if (n < 0) return false;
    sent += static_cast<size_t>(n);
    first = false;
  }
  return true;
}

}  // namespace watchdog
