// Restart intensity (as in Erlang/OTP supervisors) and restart backoff for one device.
#pragma once

#include <cstdint>
#include <deque>

namespace watchdog {

class RestartIntensity {
 public:
  RestartIntensity(int max_restarts, int64_t window_ms, int64_t backoff_initial_ms,
                   int64_t backoff_max_ms)
      : max_(max_restarts), window_ms_(window_ms), initial_ms_(backoff_initial_ms),
        max_backoff_ms_(backoff_max_ms) {}

  // Records a failure at now_ms; returns true when failures in the window exceed the maximum
  // (the device must stop restarting).
  bool record_failure(int64_t now_ms);
  // Failures within the window ending at now_ms.
  int failures(int64_t now_ms);
  // Backoff before the next restart: initial * 2^(failures-1) capped, 0 without failures.
  int64_t backoff_ms(int64_t now_ms);
  void clear() { times_.clear(); }

 private:
  void expire(int64_t now_ms);
  int max_;
  int64_t window_ms_, initial_ms_, max_backoff_ms_;
  std::deque<int64_t> times_;
};

}  // namespace watchdog
