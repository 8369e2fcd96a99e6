#include "log.h"

#include <cstdio>
#include <cstring>

namespace watchdog {

void log_line(const std::string& text) {
  std::fprintf(stderr, "kerneleval-watchdog: %s\n", text.c_str());
  std::fflush(stderr);
}

std::string errno_text(int err) { return std::strerror(err); }

}  // namespace watchdog
