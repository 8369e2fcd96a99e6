#include "restart.h"

namespace watchdog {

void RestartIntensity::expire(int64_t now_ms) {
  while (!times_.empty() && now_ms - times_.front() >= window_ms_) times_.pop_front();
}

bool RestartIntensity::record_failure(int64_t now_ms) {
  expire(now_ms);
  times_.push_back(now_ms);
  return static_cast<int>(times_.size()) > max_;
}

int RestartIntensity::failures(int64_t now_ms) {
  expire(now_ms);
  return static_cast<int>(times_.size());
}

int64_t RestartIntensity::backoff_ms(int64_t now_ms) {
  const int n = failures(now_ms);
  if (n == 0) return 0;
  int64_t b = initial_ms_;
  for (int i = 1; i < n && b < max_backoff_ms_; ++i) b *= 2;
  return b < max_backoff_ms_ ? b : max_backoff_ms_;
}

}  // namespace watchdog
