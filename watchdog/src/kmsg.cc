#include "kmsg.h"

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <fcntl.h>
#include <unistd.h>

namespace watchdog {

namespace {

bool parse_int(const std::string& s, size_t& pos, int& out) {
  size_t start = pos;
  while (pos < s.size() && s[pos] >= '0' && s[pos] <= '9') ++pos;
  if (pos == start || pos - start > 9) return false;
  out = std::atoi(s.substr(start, pos - start).c_str());
  return true;
}

}  // namespace

std::optional<KmsgXid> parse_kmsg_line(const std::string& line) {
  static const std::string kTag = "NVRM: Xid (";
  size_t at = line.find(kTag);
  if (at == std::string::npos) return std::nullopt;
  size_t open = at + kTag.size();
  size_t close = line.find(')', open);
  if (close == std::string::npos) return std::nullopt;
  KmsgXid out;
  out.pci = line.substr(open, close - open);
  if (out.pci.rfind("PCI:", 0) == 0) out.pci = out.pci.substr(4);
  size_t pos = close + 1;
  if (pos >= line.size() || line[pos] != ':') return std::nullopt;
  ++pos;
  while (pos < line.size() && line[pos] == ' ') ++pos;
  if (!parse_int(line, pos, out.xid)) return std::nullopt;
  // Optional ", pid=684, name=python3, ..." (the pid may also read "'<unknown>'").
  static const std::string kPid = "pid=";
  size_t p = line.find(kPid, pos);
  if (p != std::string::npos && p < pos + 4) {
    size_t q = p + kPid.size();
    int pid = 0;
    if (parse_int(line, q, pid)) out.pid = pid;
    static const std::string kName = "name=";
    size_t n = line.find(kName, q);
    if (n != std::string::npos && n < q + 4) {
      size_t end = line.find(',', n);
      size_t begin = n + kName.size();
      out.name = line.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
    }
  }
  return out;
}

std::string pci_key(const std::string& address) {
  std::string a = address.substr(0, address.find('.'));  // drop the function
  size_t last = a.rfind(':');
  if (last == std::string::npos || last == 0) return "";
  size_t prev = a.rfind(':', last - 1);
  std::string key = a.substr(prev == std::string::npos ? 0 : prev + 1);
  for (char& c : key) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return key;
}

int KmsgReader::open(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return errno;
  fd_.reset(fd);
  ::lseek(fd, 0, SEEK_END);  // only XIDs from now on (works for /dev/kmsg and plain files)
  return 0;
}

void KmsgReader::poll(int64_t now_ms) {
  if (!fd_.valid()) return;
  char buf[8192];
  for (int i = 0; i < 256; ++i) {  // bounded per tick
    ssize_t n = ::read(fd_.get(), buf, sizeof buf);
    if (n < 0) {
      if (errno == EINTR || errno == EPIPE) continue;  // EPIPE: /dev/kmsg overwrote records
      break;                                           // EAGAIN: nothing more now
    }
    if (n == 0) break;  // end of a plain file; appended lines are read on a later tick
    partial_.append(buf, static_cast<size_t>(n));
    size_t start = 0, nl;
    while ((nl = partial_.find('\n', start)) != std::string::npos) {
      consume_line(partial_.substr(start, nl - start), now_ms);
      start = nl + 1;
    }
    partial_.erase(0, start);
    if (partial_.size() > 65536) partial_.clear();
  }
  while (!recent_.empty() && now_ms - recent_.front().first > 60000) recent_.pop_front();
}

void KmsgReader::consume_line(const std::string& line, int64_t now_ms) {
  auto x = parse_kmsg_line(line);
  if (!x) return;
  recent_.emplace_back(now_ms, *x);
  if (recent_.size() > 256) recent_.pop_front();
}

std::optional<KmsgXid> KmsgReader::take(int xid, const std::string& pci, int64_t now_ms,
                                        int64_t max_age_ms) {
  const std::string want = pci_key(pci);
  for (auto it = recent_.rbegin(); it != recent_.rend(); ++it) {
    const std::string have = pci_key(it->second.pci);
    if (!want.empty() && !have.empty() && want != have) continue;
    if (it->second.xid == xid && now_ms - it->first <= max_age_ms) {
      KmsgXid out = it->second;
      recent_.erase(std::next(it).base());
      return out;
    }
  }
  return std::nullopt;
}

}  // namespace watchdog
