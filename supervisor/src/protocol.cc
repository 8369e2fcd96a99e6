#include "protocol.h"

namespace kew {

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

}  // namespace kew
