// The XID policy table: what each XID means and what the watchdog does about it.
#pragma once

#include <map>
#include <string>

namespace watchdog {

// Actions, as in XidPolicyEntry.action.
inline constexpr const char* kRestartWorker = "restart_worker";
inline constexpr const char* kResetGpu = "reset_gpu";
inline constexpr const char* kMarkUnhealthy = "mark_unhealthy";
inline constexpr const char* kIgnore = "ignore";

struct XidRule {
  std::string category;  // "application", "reset", "reboot", "informational", "unknown"
  std::string action;    // one of the actions above
  std::string description;
};

class XidPolicy {
 public:
  // The built-in table (see policy.cc for sources).
  XidPolicy();
  // Adds or replaces one entry (Configure.xid_policy). Returns false for an unknown action.
  bool set(int xid, const std::string& category, const std::string& action);
  // The rule for an XID; unknown XIDs are reported and otherwise ignored.
  XidRule lookup(int xid) const;
  // Action for an NVML GPU recovery action ("gpu_reset", "node_reboot", ...); empty if none.
  static std::string action_for_recovery(const std::string& recovery_action);

 private:
  std::map<int, XidRule> rules_;
};

}  // namespace watchdog
