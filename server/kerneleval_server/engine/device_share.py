"""Outputs handed to the judge by descriptor, not through the host record (issue 13).

A kernel's outputs over the host record's limit (KernelBench's activations: 1-8 GB a trial)
are copied into memory that a file descriptor names, and the descriptor is sent over the
record's socket (a unix stream socket pair the front end made and never reads): on a GPU, device
memory of the CUDA driver's virtual memory API exported as a POSIX descriptor
(cuMemCreate, cuMemExportToShareableHandle); on the CPU engine, a sealed memfd. The sender lets
go of its own mapping at once; the memory lives as long as a descriptor names it. Measured on
an H100 (bench/results/gpu/h100-vmm-probe): the exporter exited, a parent with no CUDA held
the descriptor, and a process in PID, IPC and mount namespaces of its own imported the bytes
intact; importing and mapping 1 GiB took 0.3 ms, copying it 0.8 ms.

The judge reads the socket only once the kernel's process has exited (nothing can write the
memory any more), imports each descriptor, copies its bytes into memory of its own and lets
the descriptor go. Everything it receives is hostile: a message's header, its descriptor's
kind and size are checked (`receive`), and a descriptor the driver will not import is
tampering, never a crash.

Each message: HEADER (kind, slot, size) with exactly one descriptor on its first byte, one
sendmsg each (a stream socket queues bytes, not messages: a datagram or seqpacket pair queues
at most net.unix.max_dgram_qlen, 10, and nobody reads it before the kernel's process exits;
Linux ends a read where a message's descriptors end). Slots count from 1, in the order sent; a
RecordedValue names its slot (`share`).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import socket
import stat
import struct
from dataclasses import dataclass

import torch

HEADER = struct.Struct(">BQQ")  # kind, slot, size in bytes
CUDA_VMM = 1
MEMFD = 2
MAX_SHARES = 256  # descriptors one record may hand over
SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL
GRANULARITY = 2 << 20  # the most the export rounds a value up (a GPU's allocation granularity)


class ShareError(Exception):
    """A share that is not what a sender writes (the judge), or one that could not be made."""


@dataclass
class Share:
    kind: int
    slot: int
    size: int
    fd: int


# ---- the sender: the kernel's process ---------------------------------------------------------


def send(sock_fd: int, slot: int, value: torch.Tensor) -> int:
    """Copies `value` into memory a descriptor names and sends that descriptor as `slot`.
    The bytes it holds (rounded up on a GPU). torch.OutOfMemoryError where the GPU has no room
    (the front end runs such a job again with the GPU to itself); ShareError otherwise."""
    src = value.detach()
    if src.device.type == "cuda":
        fd, size = _cuda().export(src)
        kind = CUDA_VMM
    else:
        fd, size, kind = _memfd_export(src), src.numel() * src.element_size(), MEMFD
    try:
        sock = socket.socket(fileno=os.dup(sock_fd))
        try:
            socket.send_fds(sock, [HEADER.pack(kind, slot, size)], [fd])
        finally:
            sock.close()
    except OSError as e:
        raise ShareError(f"the record's socket refused a descriptor: {e}") from None
    finally:
        os.close(fd)
    return size


def _memfd_export(src: torch.Tensor) -> int:
    data = src.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    fd = os.memfd_create("kerneleval-share", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, len(data))
        view, done = memoryview(data), 0
        while done < len(data):
            done += os.pwrite(fd, view[done:], done)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


# ---- the receiver: the judge ----------------------------------------------------------------


def receive(sock_fd: int, max_bytes: int, until_end: bool) -> list[Share]:
    """Every share queued on the record's socket, in order. `until_end`: the kernel's process
    is gone, so its end is closed and everything it sent is queued (no end: ShareError); else
    what is queued now (the judge then refuses any: that process said it sent none).
    ShareError for anything a sender would not send; a failed read's descriptors are closed."""
    sock = socket.socket(fileno=os.dup(sock_fd))
    sock.setblocking(False)
    shares: list[Share] = []
    total = 0
    try:
        while True:
            try:
                data, fds, flags, _ = socket.recv_fds(sock, HEADER.size, 2)
            except BlockingIOError:
                if not until_end:
                    return shares
                raise ShareError("the kernel's process still holds the record's socket") from None
            if not data and not fds:
                return shares  # end of stream: every sender gone
            got = [Share(0, 0, 0, fd) for fd in fds]
            shares.extend(got)  # closed with the rest on a failure
            if flags & socket.MSG_CTRUNC or len(data) != HEADER.size:
                raise ShareError("a share's message is not a share header and one descriptor")
            if len(fds) != 1:
                raise ShareError(f"a share came with {len(fds)} descriptors")
            kind, slot, size = HEADER.unpack(data)
            share = got[0]
            share.kind, share.slot, share.size = kind, slot, size
            if slot != len(shares) or len(shares) > MAX_SHARES:
                raise ShareError(f"share {slot} came as number {len(shares)}")
            total += size
            if total > max_bytes + GRANULARITY * len(shares):  # a GPU rounds each one up
                raise ShareError(f"the shares hold {total} bytes, over the limit of {max_bytes}")
            _check_kind(share)
    except BaseException:
        close(shares)
        raise
    finally:
        sock.close()


def _check_kind(share: Share) -> None:
    """The descriptor is what its kind says: a sealed memfd of `size` bytes, or (the driver
    checks the rest on import) not a regular file, pipe or socket."""
    st = os.fstat(share.fd)
    if share.kind == MEMFD:
        try:
            seals = fcntl.fcntl(share.fd, fcntl.F_GET_SEALS) if stat.S_ISREG(st.st_mode) else 0
        except OSError:  # a file that takes no seals
            seals = 0
        if seals & SEALS != SEALS or st.st_size != share.size:
            raise ShareError(f"share {share.slot} is not a sealed memfd of {share.size} bytes")
    elif share.kind == CUDA_VMM:
        if stat.S_ISREG(st.st_mode) or stat.S_ISFIFO(st.st_mode) or stat.S_ISSOCK(st.st_mode):
            raise ShareError(f"share {share.slot} is not GPU memory")
    else:
        raise ShareError(f"share {share.slot} is of kind {share.kind}")


def load(share: Share, device: torch.device) -> torch.Tensor:
    """The share's bytes as a flat uint8 tensor of this process's own, on `device`; the
    descriptor is closed (its memory goes once nobody else names it). ShareError where it
    cannot be read; torch.OutOfMemoryError where the copy does not fit."""
    try:
        if share.kind == CUDA_VMM:
            if device.type != "cuda":
                raise ShareError(f"share {share.slot} is GPU memory; this judge has no GPU")
            return _cuda().import_copy(share.fd, share.size, device)
        if device.type == "cuda":
            raise ShareError(f"share {share.slot} is host memory; the job ran on a GPU")
        if share.size == 0:
            return torch.empty(0, dtype=torch.uint8)
        mem = mmap.mmap(share.fd, share.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        try:
            return torch.frombuffer(bytearray(mem), dtype=torch.uint8)
        finally:
            mem.close()
    finally:
        _close_fd(share)


def close(shares: list[Share]) -> None:
    for share in shares:
        _close_fd(share)


def _close_fd(share: Share) -> None:
    if share.fd >= 0:
        try:
            os.close(share.fd)
        except OSError as e:
            if e.errno != errno.EBADF:
                raise
        share.fd = -1


# ---- the CUDA driver's virtual memory API, through ctypes ------------------------------------


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _AllocationProp(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_POSIX_FD = 1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
_OUT_OF_MEMORY = 2  # CUDA_ERROR_OUT_OF_MEMORY


class _CudaVmm:
    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")

    def _call(self, name: str, *args: object) -> None:
        rc = getattr(self.lib, name)(*args)
        if rc == 0:
            return
        text = ctypes.c_char_p()
        self.lib.cuGetErrorString(rc, ctypes.byref(text))
        said = text.value.decode() if text.value else str(rc)
        if rc == _OUT_OF_MEMORY:
            raise torch.OutOfMemoryError(f"CUDA out of memory ({name}: {said})")
        raise ShareError(f"{name} failed: {said} ({rc})")

    def _prop(self, device: torch.device) -> _AllocationProp:
        prop = _AllocationProp()
        prop.type = 1  # CU_MEM_ALLOCATION_TYPE_PINNED
        prop.requestedHandleTypes = _POSIX_FD
        prop.location = _Location(1, device.index or 0)  # CU_MEM_LOCATION_TYPE_DEVICE
        return prop

    def _create(self, size: int, prop: _AllocationProp) -> ctypes.c_ulonglong:
        """cuMemCreate; out of memory, again once torch's allocator has handed back the
        blocks it caches (a KernelBench job held 22 GB of them free and failed here)."""
        handle = ctypes.c_ulonglong()
        args = (ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(prop),
                ctypes.c_ulonglong(0))  # fmt: skip
        try:
            self._call("cuMemCreate", *args)
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            self._call("cuMemCreate", *args)
        return handle

    def _map(self, handle: ctypes.c_ulonglong, size: int, device: torch.device) -> int:
        ptr = ctypes.c_ulonglong()
        self._call("cuMemAddressReserve", ctypes.byref(ptr), ctypes.c_size_t(size),
                   ctypes.c_size_t(0), ctypes.c_ulonglong(0), ctypes.c_ulonglong(0))  # fmt: skip
        try:
            self._call("cuMemMap", ptr, ctypes.c_size_t(size), ctypes.c_size_t(0), handle,
                       ctypes.c_ulonglong(0))  # fmt: skip
            access = _AccessDesc(_Location(1, device.index or 0), 3)  # PROT_READWRITE
            self._call("cuMemSetAccess", ptr, ctypes.c_size_t(size), ctypes.byref(access),
                       ctypes.c_size_t(1))  # fmt: skip
        except BaseException:
            self.lib.cuMemUnmap(ptr, ctypes.c_size_t(size))
            self.lib.cuMemAddressFree(ptr, ctypes.c_size_t(size))
            raise
        return ptr.value

    def _unmap(self, ptr: int, size: int) -> None:
        self.lib.cuMemUnmap(ctypes.c_ulonglong(ptr), ctypes.c_size_t(size))
        self.lib.cuMemAddressFree(ctypes.c_ulonglong(ptr), ctypes.c_size_t(size))

    def _bytes_at(self, ptr: int, size: int, device: torch.device) -> torch.Tensor:
        """A uint8 tensor over mapped memory (torch does not own it)."""

        class _Array:
            __cuda_array_interface__ = {
                "shape": (size,), "typestr": "|u1", "data": (ptr, False), "version": 3,
            }  # fmt: skip

        return torch.as_tensor(_Array(), device=device)

    def export(self, src: torch.Tensor) -> tuple[int, int]:
        device = src.device
        torch.cuda.synchronize(device)  # the kernel's work on the outputs is done
        nbytes = src.numel() * src.element_size()
        prop = self._prop(device)
        granularity = ctypes.c_size_t()
        self._call("cuMemGetAllocationGranularity", ctypes.byref(granularity),
                   ctypes.byref(prop), 0)  # fmt: skip
        g = granularity.value
        size = max(g, (nbytes + g - 1) // g * g)
        handle = self._create(size, prop)
        try:
            ptr = self._map(handle, size, device)
            try:
                dst = self._bytes_at(ptr, nbytes, device)
                if nbytes:
                    dst.copy_(src.contiguous().reshape(-1).view(torch.uint8))
                torch.cuda.synchronize(device)
            finally:
                self._unmap(ptr, size)
            fd = ctypes.c_int(-1)
            self._call("cuMemExportToShareableHandle", ctypes.byref(fd), handle, _POSIX_FD,
                       ctypes.c_ulonglong(0))  # fmt: skip
        finally:
            self.lib.cuMemRelease(handle)  # the descriptor keeps the memory
        return fd.value, size

    def import_copy(self, fd: int, size: int, device: torch.device) -> torch.Tensor:
        torch.cuda.synchronize(device)  # the primary context is current
        handle = ctypes.c_ulonglong()
        self._call("cuMemImportFromShareableHandle", ctypes.byref(handle), ctypes.c_void_p(fd),
                   _POSIX_FD)  # fmt: skip
        try:
            ptr = self._map(handle, size, device)
            try:
                own = self._bytes_at(ptr, size, device).clone()
                torch.cuda.synchronize(device)
            finally:
                self._unmap(ptr, size)
        finally:
            self.lib.cuMemRelease(handle)
        return own


_vmm: _CudaVmm | None = None


def _cuda() -> _CudaVmm:
    global _vmm
    if _vmm is None:
        try:
            _vmm = _CudaVmm()
        except OSError as e:
            raise ShareError(f"the CUDA driver is not loadable: {e}") from None
    return _vmm
