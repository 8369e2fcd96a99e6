// kerneleval-watchdog --control-fd N
// Owns the zygotes and job processes and every GPU-level action; driven by the front end over the
// control channel (proto/kerneleval/internal/v1/watchdog.proto, framing in protocol.h).
#include <fcntl.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "log.h"
#include "watchdog.h"

int main(int argc, char** argv) {
  int fd = -1;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--control-fd") == 0 && i + 1 < argc) {
      fd = std::atoi(argv[++i]);
    } else if (std::strcmp(argv[i], "--help") == 0) {
      std::fprintf(stdout, "usage: %s --control-fd N\n", argv[0]);
      return 0;
    }
  }
  if (fd < 0 || ::fcntl(fd, F_GETFD) < 0) {
    watchdog::log_line("usage: kerneleval-watchdog --control-fd N (an open socket)");
    return 2;
  }
  GOOGLE_PROTOBUF_VERIFY_VERSION;
  watchdog::Watchdog wd(fd);
  return wd.run();
}
