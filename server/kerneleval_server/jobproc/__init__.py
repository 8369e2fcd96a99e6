"""Job processes: the zygote that forks them warm and the runtime that runs one job in each.

    python -m kerneleval_server.jobproc.zygote      # the watchdog's per-device fork server
    kerneleval_server.jobproc.runtime:main(fd)      # a job process's main (KERNELEVAL_JOB_MAIN)
    kerneleval_server.jobproc.sandbox               # the per-job sandbox steps (ctypes)

See docs/INTERNALS.md ("Processes", "Zygote channel") for the sequence, docs/TRUST.md for
the trust boundary.
"""

from __future__ import annotations

from kerneleval.v1 import job_pb2

# Exit codes of a job process.
OK_EXIT = 0  # its job(s) done, or the front end went away before one came
POISONED_EXIT = 3  # the job left the CUDA context poisoned (the watchdog's retire_exit_codes)
CONFIG_EXIT = 78  # the zygote refused its ZygoteConfig (EX_CONFIG)
SETUP_FAILED_EXIT = 71  # a sandbox step or the warm-up failed before the job main ran (EX_OSERR)

# The variables that name the engine and the job process's main.
ENGINE_ENV = "KERNELEVAL_ENGINE"
DEFAULT_ENGINE = "kerneleval_server.engine"
JOB_MAIN_ENV = "KERNELEVAL_JOB_MAIN"
DEFAULT_JOB_MAIN = "kerneleval_server.jobproc.runtime:main"
WORKER_ID_ENV = "KERNELEVAL_WORKER_ID"
DEVICE_INDEX_ENV = "KERNELEVAL_DEVICE_INDEX"
# The pseudo-device of build processes (watchdog.proto Configure.build_processes): no GPU;
# they compile IOContract kernels into cubins for a launch process to run.
BUILD_DEVICE = -3
# Its zygote's niceness, inherited by every build process and what it runs (Config.build_nice).
BUILD_NICE_ENV = "KERNELEVAL_BUILD_NICE"
# A launch process (one that only ever ran prebuilt kernels) takes at most this many jobs,
# then exits and is replaced: whatever slowly accumulates (driver state, fragmentation) ends.
MAX_JOBS_PER_LAUNCH_PROCESS = 500

MAX_LOG_LINE_BYTES = 64 * 1024
# Where Triton keeps what it compiled; a job process gets a private, empty one.
TRITON_CACHE_ENV = "TRITON_CACHE_DIR"
TRITON_BINARY_ONLY_ENV = "TRITON_STORE_BINARY_ONLY"  # Triton's knob: cache binaries only
# A compile cache entry (jobs/builds/compile_cache.py): what a job process sends back of what its
# compile cache gained, at most. It travels with the spec in one frame.
MAX_CACHE_FILES = 256
MAX_CACHE_ENTRY_BYTES = 3 << 20
# The service's precompiled torch headers (fast_build/pch.py), read-only in build processes.
PCH_DIR_ENV = "KERNELEVAL_PCH_DIR"

# Phases whose GPU work waits for the front end's grant (the device's GPU gate): checks share
# the GPU with other jobs' checks, a timing window has it alone.
GATED_PHASES = (job_pb2.PHASE_VALIDATING, job_pb2.PHASE_PROFILING)
