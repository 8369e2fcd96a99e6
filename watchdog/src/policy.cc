#include "policy.h"

namespace watchdog {

namespace {

struct Row {
  int xid;
  const char* category;
  const char* action;
  const char* description;
};

// Built-in XID table. Sources: NVIDIA's XID catalog ("Resolution Bucket": RESTART_APP,
// RESET_GPU, RESTART_BM/reboot) and the Kubernetes device plugin, which treats 13, 31, 43, 45,
// 68 and 109 as application errors that leave the GPU usable. Application faults end the
// faulting process's CUDA context only: restart that worker, never the GPU. Faults that leave the
// GPU itself in a bad state need a reset. Configure.xid_policy overrides any row.
constexpr Row kTable[] = {
    {8, "application", kRestartWorker, "GPU stopped processing (channel idle timeout)"},
    {13, "application", kRestartWorker, "Graphics engine exception (e.g. illegal instruction)"},
    {31, "application", kRestartWorker, "GPU memory page fault (illegal address)"},
    {32, "application", kRestartWorker, "Invalid or corrupted push buffer stream"},
    {43, "application", kRestartWorker, "GPU stopped processing (reset channel verification)"},
    {45, "application", kRestartWorker, "Preemptive cleanup after a previous error"},
    {68, "application", kRestartWorker, "Video decoder (NVDEC) exception"},
    {69, "application", kRestartWorker, "Graphics engine class error"},
    {48, "reset", kResetGpu, "Double-bit ECC error (DBE)"},
    {61, "reset", kResetGpu, "Internal micro-controller breakpoint/warning"},
    {62, "reset", kResetGpu, "Internal micro-controller halt"},
    {63, "informational", kIgnore, "Row remapping / page retirement recorded"},
    {64, "reset", kResetGpu, "Row remapping or page retirement failure"},
    {74, "reset", kResetGpu, "NVLink error"},
    {79, "reset", kResetGpu, "GPU has fallen off the bus"},
    {92, "reset", kResetGpu, "High single-bit ECC error rate"},
    {94, "reset", kResetGpu, "Contained ECC error"},
    {95, "reset", kResetGpu, "Uncontained ECC error"},
    {109, "reset", kResetGpu, "Context switch timeout"},
    {119, "reset", kResetGpu, "GSP RPC timeout"},
    {120, "reset", kResetGpu, "GSP error"},
    {140, "reboot", kMarkUnhealthy, "Unrecovered ECC error"},
    {154, "informational", kIgnore, "GPU recovery action changed (read the recovery action)"},
};

bool known_action(const std::string& a) {
  return a == kRestartWorker || a == kResetGpu || a == kMarkUnhealthy || a == kIgnore;
}

}  // namespace

XidPolicy::XidPolicy() {
  for (const Row& r : kTable) rules_[r.xid] = XidRule{r.category, r.action, r.description};
}

bool XidPolicy::set(int xid, const std::string& category, const std::string& action) {
  if (!known_action(action)) return false;
  auto& rule = rules_[xid];
  rule.category = category;
  rule.action = action;
  if (rule.description.empty()) rule.description = "configured";
  return true;
}

XidRule XidPolicy::lookup(int xid) const {
  auto it = rules_.find(xid);
  if (it != rules_.end()) return it->second;
  return XidRule{"unknown", kIgnore, "not in the policy table"};
}

std::string XidPolicy::action_for_recovery(const std::string& recovery_action) {
  if (recovery_action == "gpu_reset" || recovery_action == "drain_and_reset") return kResetGpu;
  if (recovery_action == "node_reboot") return kMarkUnhealthy;
  return "";
}

}  // namespace watchdog
