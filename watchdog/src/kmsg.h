// Kernel log reader: matches "NVRM: Xid (PCI:0000:00:06): 31, pid=684, name=python3, ..."
// records to the XID events NVML delivers, so an XID can be attributed to a process.
#pragma once

#include <cstdint>
#include <deque>
#include <optional>
#include <string>

#include "fd.h"

namespace watchdog {

struct KmsgXid {
  std::string pci;  // "0000:00:06" (as printed), may be empty
  int xid = 0;
  int pid = 0;  // 0 when the line names no pid
  std::string name;
};

// Parses one kernel log line (a /dev/kmsg record "6,123,456,-;NVRM: ..." or plain text).
std::optional<KmsgXid> parse_kmsg_line(const std::string& line);

// "bus:device" in lower case from a PCI address as the kernel log ("0000:06:00") or NVML
// ("00000000:06:00.0") writes it, so the two can be compared; empty if it has no such part.
std::string pci_key(const std::string& address);

class KmsgReader {
 public:
  // Opens path (non-blocking) positioned at its end; returns errno on failure, 0 on success.
  int open(const std::string& path);
  bool is_open() const { return fd_.valid(); }
  // Reads new records and remembers the XID lines among them.
  void poll(int64_t now_ms);
  // The latest unclaimed record for this XID seen within max_age_ms, removed when found. With a
  // device PCI address, records naming another device are skipped.
  std::optional<KmsgXid> take(int xid, const std::string& pci, int64_t now_ms,
                              int64_t max_age_ms);

 private:
  void consume_line(const std::string& line, int64_t now_ms);
  UniqueFd fd_;
  std::string partial_;
  std::deque<std::pair<int64_t, KmsgXid>> recent_;
};

}  // namespace watchdog
