// Kernel log reader: matches "NVRM: Xid (PCI:0000:00:06): 31, pid=684, name=python3, ..."
// records to the XID events NVML delivers, so an XID can be attributed to a process.
#pragma once

#include <cstdint>
#include <deque>
#include <optional>
#include <string>

#include "fd.h"

namespace kew {

struct KmsgXid {
  std::string pci;  // "0000:00:06" (as printed), may be empty
  int xid = 0;
  int pid = 0;  // 0 when the line names no pid
  std::string name;
};

// Parses one kernel log line (a /dev/kmsg record "6,123,456,-;NVRM: ..." or plain text).
std::optional<KmsgXid> parse_kmsg_line(const std::string& line);

class KmsgReader {
 public:
  // Opens path (non-blocking) positioned at its end; returns errno on failure, 0 on success.
  int open(const std::string& path);
  bool is_open() const { return fd_.valid(); }
  // Reads new records and remembers the XID lines among them.
  void poll(int64_t now_ms);
  // The latest unclaimed record for this XID seen within max_age_ms, removed when found.
  std::optional<KmsgXid> take(int xid, int64_t now_ms, int64_t max_age_ms);

 private:
  void consume_line(const std::string& line, int64_t now_ms);
  UniqueFd fd_;
  std::string partial_;
  std::deque<std::pair<int64_t, KmsgXid>> recent_;
};

}  // namespace kew
