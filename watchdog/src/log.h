// Logging to stderr (the front end forwards it to its own log).
#pragma once

#include <string>

namespace watchdog {

void log_line(const std::string& text);
// strerror(err) as a std::string.
std::string errno_text(int err);

}  // namespace watchdog
