// Frame codec of the control channel: a 4-byte big-endian length, then that many bytes of a
// serialized protobuf message. Frames over kMaxFrame are rejected; the decoder then skips the
// announced payload so that a well-behaved peer stays in sync, and never allocates it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace kew {

constexpr uint32_t kMaxFrame = 16u * 1024u * 1024u;

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

}  // namespace kew
