"""Compared jobs judged outside the kernel's process (issue 13; docs/INTERNALS.md "The judge").

A compared job whose kernel's host code runs in its job process gets a record: a memfd the
front end makes and hands to that process with its AssignJob. The process writes the kernel's
outputs there (engine/record.py). When it answers OK, the record is sealed (no more writes,
no resizing: the kernel's code cannot change it after the fact) and handed to a second, fresh
job process on the same GPU, the judge, which imports only the reference and answers the
job's final result. The front end never reads the record: it only makes, seals and passes it.

A judge process that judged cleanly stays for the next job with the same reference (a
standing judge, keyed by `reference_key`): only the reference's own code ever ran in it, and
the next reference to run there is that same code.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
from dataclasses import dataclass

from kerneleval.internal.v1 import job_channel_pb2
from kerneleval.v1 import job_pb2, kernel_pb2

SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL


def wanted(spec: kernel_pb2.JobSpec, hello: job_channel_pb2.Hello | None) -> bool:
    """A compared job run whole by an engine that judges (test engines do not). GPU MODE
    tasks bring their own checker, and the debug aids re-run the job in a child process of
    its own (engine/isolated.py): both are judged in the kernel's process, as the docs say."""
    if hello is None or not hello.judges or not spec.HasField("reference"):
        return False
    if spec.kernel.type == kernel_pb2.KERNEL_TYPE_GPU_MODE:
        return False
    o = spec.options
    return not (o.sanitize or o.device_metrics or o.launch_blocking or o.device_side_assertions)


def reference_key(spec: kernel_pb2.JobSpec) -> str:
    """What a standing judge may judge next: jobs whose reference is this one, byte for byte
    (its source, type, entry points and I/O). A reference can leave state in its process, but
    only for the same code, which could do the same in a process of its own."""
    data = spec.reference.SerializeToString(deterministic=True)
    return hashlib.sha256(data).hexdigest()


@dataclass
class Record:
    """One job's record: the memfd, its limit, who may judge it (`reference_key`), and the
    kernel's process's outcome once in."""

    fd: int
    max_bytes: int
    reference_key: str
    kernel_outcome: job_channel_pb2.JobOutcome | None = None

    @classmethod
    def make(cls, job_id: str, max_bytes: int, spec: kernel_pb2.JobSpec) -> Record:
        fd = os.memfd_create(f"kerneleval-record-{job_id}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        return cls(fd, max_bytes, reference_key(spec))

    def seal(self) -> bool:
        """No writes, no resizing from now on. False while a process still maps it writable
        (the kernel's, not yet gone): try again once it is."""
        try:
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SEALS)
        except OSError as e:
            if e.errno == errno.EBUSY:
                return False
            if e.errno != errno.EPERM:  # EPERM: sealed already (F_SEAL_SEAL)
                raise
        return True

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def judge_request(kernel: job_pb2.EvalResult) -> job_channel_pb2.JudgeRequest:
    return job_channel_pb2.JudgeRequest(candidate=kernel)


def tampered(why: str) -> job_pb2.EvalResult:
    result = job_pb2.EvalResult(verdict=job_pb2.VERDICT_RUNTIME_ERROR)
    result.failed_side = job_pb2.SIDE_KERNEL
    result.error.exception_type = "Tampering"
    result.error.message = "tampering: " + why
    return result
