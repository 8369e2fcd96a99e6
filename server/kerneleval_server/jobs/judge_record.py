"""A compared job's record (judging.py): the memfd its kernel's process writes the kernel's
outputs to, sealed and handed to its judge; and the key that says which judge may judge it.
Its own module, below judging.py and the job's `Running` (running.py), which both hold one."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import socket
from dataclasses import dataclass

from kerneleval.internal.v1 import job_channel_pb2
from kerneleval.v1 import kernel_pb2

SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL


def reference_key(spec: kernel_pb2.JobSpec) -> str:
    """What a standing judge may judge next: jobs whose reference is this one, byte for byte
    (its source, type, entry points and I/O). A reference can leave state in its process, but
    only for the same code, which could do the same in a process of its own."""
    data = spec.reference.SerializeToString(deterministic=True)
    # A GPU MODE task's shared modules are imported beside its reference.
    files = kernel_pb2.GpuModeTask(files=spec.gpu_mode.files)
    return hashlib.sha256(data + files.SerializeToString(deterministic=True)).hexdigest()


@dataclass
class Record:
    """One job's record: the memfd, its limit, who may judge it (`reference_key`), and the
    kernel's process's outcome once in. With `share_max_bytes`, the record's socket: outputs
    past the record go by descriptor (engine/device_share.py) from the kernel's end
    (`share_theirs`, given to its process and closed here) to the judge's (`share_ours`),
    which the front end only passes on, never reads."""

    fd: int
    max_bytes: int
    reference_key: str
    kernel_outcome: job_channel_pb2.JobOutcome | None = None
    share_max_bytes: int = 0
    share_ours: int = -1
    share_theirs: int = -1
    gpu_held_on: int | None = None  # the GPU whose memory admission holds the shares' bytes
    holder: str = ""  # the shares' name there
    timed_by_judge: bool = False  # its kernel's process was given its timed calls to serve

    @classmethod
    def make(
        cls, job_id: str, max_bytes: int, spec: kernel_pb2.JobSpec, share_max_bytes: int = 0
    ) -> Record:
        fd = os.memfd_create(f"kerneleval-record-{job_id}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        record = cls(fd, max_bytes, reference_key(spec), share_max_bytes=share_max_bytes)
        record.holder = f"shares:{job_id}"
        if share_max_bytes > 0:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            record.share_ours, record.share_theirs = ours.detach(), theirs.detach()
        return record

    @property
    def shared_bytes(self) -> int:
        """What the kernel's process says it handed over by descriptor (its claim, at most
        the limit): memory on its GPU until the judge has read it."""
        said = self.kernel_outcome.shared_bytes if self.kernel_outcome is not None else 0
        return min(said, self.share_max_bytes) if self.share_ours >= 0 else 0

    def given_to_kernel(self) -> None:
        """The kernel's process has its end of the socket: once it is gone, the judge's end
        reads to the end of what it sent."""
        _close(self, "share_theirs")

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
        for name in ("fd", "share_ours", "share_theirs"):
            _close(self, name)


def _close(record: Record, name: str) -> None:
    fd = getattr(record, name)
    if fd >= 0:
        os.close(fd)
        setattr(record, name, -1)
