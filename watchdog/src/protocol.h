// Frame codec of the watchdog's channels (the control channel to the front end, and each
// zygote's channel): a 4-byte big-endian length, then that many bytes of a serialized protobuf
// message. Frames over kMaxFrame are rejected; the decoder then skips the announced payload so
// that a well-behaved peer stays in sync, and never allocates it.
//
// Descriptors (SCM_RIGHTS) ride on a SOCK_STREAM socket attached to the FIRST bytes of the
// frame they belong to, sent in one sendmsg; the receiver keeps a FIFO of the descriptors it got
// and pops them when it decodes a frame that declares them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "fd.h"

namespace watchdog {

constexpr uint32_t kMaxFrame = 16u * 1024u * 1024u;
constexpr size_t kMaxFdsPerFrame = 16;

// Length prefix + payload.
std::string encode_frame(const std::string& payload);

class FrameDecoder {
 public:
  struct Result {
    std::vector<std::string> frames;  // complete payloads, in order
    std::vector<std::string> errors;  // why frames were rejected
  };

  // Feeds bytes read from the channel; returns the frames completed by them.
  Result feed(const char* data, size_t size);
  // Bytes held for an incomplete frame (tests; bounded by kMaxFrame + 4).
  size_t buffered() const { return buffer_.size(); }

 private:
  std::string buffer_;
  uint64_t skip_ = 0;  // bytes of an oversized frame still to discard
};

// Outgoing frames of one non-blocking socket, each with the descriptors it carries; the
// descriptors are closed once the frame's first bytes (which carry them) are sent.
class FrameWriter {
 public:
  void push(const std::string& payload, std::vector<UniqueFd> fds = {});
  // Sends what the socket takes. Returns false when the peer is gone (EPIPE and friends).
  // With block, waits (poll, up to 1 s a step) until everything is sent.
  bool flush(int fd, bool block);
  bool empty() const { return queue_.empty(); }

 private:
  struct Out {
    std::string bytes;
    size_t sent = 0;
    std::vector<UniqueFd> fds;
  };
  std::deque<Out> queue_;
};

// Reads what a non-blocking socket has: bytes into `data`, received descriptors (close-on-exec)
// appended to `fds`. Returns >0 bytes read, 0 at the end of the stream, -1 with errno
// (EAGAIN: nothing now).
long recv_with_fds(int fd, char* data, size_t size, std::deque<UniqueFd>& fds);

// One blocking sendmsg of `data` with `fds` attached, then the rest of `data` (tests and
// simple peers). Returns false on error.
bool send_with_fds(int fd, const std::string& data, const std::vector<int>& fds);

}  // namespace watchdog
