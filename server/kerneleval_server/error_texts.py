"""Error texts that both the sandboxed engine and the front end read (the ground floor: it
imports nothing)."""

# What torch's allocator raises instead of its out-of-memory error where NVML cannot start (in
# the sandbox): read as an out-of-memory by the engine and by the front end.
NVML_OOM_ASSERT = "nvmlInit_v2_() INTERNAL ASSERT FAILED"
