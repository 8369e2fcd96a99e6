"""Timed calls driven from outside the candidate's process (issue 40).

Whatever shares a process with the candidate can lie about its time: swap or rewrite the
clocks, rewrite the result through frames, return lazy outputs, cache on what it sees of its
inputs. So a kernel's timed calls are driven by a process that never loads its code (its
judge), through memory the two share:
- the driver (trusted) owns the call's arguments and outputs: buffers it makes and hands to
  the server by descriptor (device memory of the CUDA driver's VMM API exported as POSIX
  descriptors on a GPU, memfds on the CPU), and a control block (a memfd of int64 words);
- for each call it writes fresh inputs into the shared arguments itself (after the previous
  call was answered: one call's inputs at a time) and waits for the write, then says go,
  waits until the server says done, and copies the shared outputs into memory of its own;
  its clock spans go to copy. (What a candidate watching the buffer can start before the go
  is what lies between the write's end and the go: the driver's synchronize, microseconds.)
  Work
  the candidate leaves running after it says done either ran before that copy (and is inside
  the span: contexts of two processes share a GPU by time slices) or did not, and the copy
  holds unfinished outputs (which the driver's check of the call finds wrong);
- a call of no work through the same path (`NOOP`: the server copies outputs it kept, the
  same bytes) calibrates what the path itself costs, in the same pair of processes;
- the server (the candidate's process, `serve`) runs the candidate on views of the shared
  arguments and copies what it returns into the shared outputs, and reports the call's own
  device time (CUDA events around it; the host clock on the CPU): a claim, accepted only
  where it agrees with the driver's bound (time_bound.py's `decide`).
Everything the server writes is hostile: the driver reads only the control block's words
(their values bounded) and copies of the outputs, and never a byte of the server's otherwise.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import mmap
import os
import select
import socket
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from . import device_share, timing
from .inputs import seed_all

# The control block: int64 words, each written by one side only.
# GO, MODE, SEED: the driver's; the rest: the server's. SEED: what torch's generators are
# seeded with before the call (TrialArgs.seed; 0: not seeded), as the judge seeds before the
# reference's run on the same inputs.
GO, MODE, DONE, STATUS, INSIDE_NS, READY, SEED = range(7)
WORDS = 8
MESSAGE_AT = 256  # bytes from here: the server's message of a failed call (its words, hostile)
CONTROL_BYTES = 4096
CALL, NOOP, STOP = 1, 2, 3
NEXT = 4  # STOP, with another session to follow on the socket (a GPU MODE task's next case)
LEAD_NONE, LEAD_FLUSH, LEAD_IDLE = "none", "flush", "idle"  # queued before a call (Driver)
NOT_READY = 2  # READY's word when the server could not take the buffers (its message said)
OK, FAILED, BAD_OUTPUTS = 0, 1, 2
HEADER = struct.Struct(">I")
MAX_LAYOUT_BYTES = 1 << 20
SPIN_S = 200e-6  # spin this long, then sleep in short naps: two processes share the host's cores
# On a GPU host both sides spin through a call (and the server between calls) up to this
# long: a nap's wake-up (50-100 us, and not the same in a call as in a call of no work) would
# make the path's cost unpredictable, and it is capped near the driver's own measure of it.
CALL_SPIN_S = 0.5
NAP_S = 20e-6
GONE_EVERY_S = 0.01  # how often a waiting driver looks whether the kernel's process is gone
_perf_counter_ns = time.perf_counter_ns  # bound at import, before any candidate code runs


class TimedCallError(Exception):
    """The session failed: the server did not answer in time, or broke the protocol (the
    candidate's doing: a verdict on it)."""


@dataclass
class CallResult:
    outside_ns: int  # the driver's span: go, done seen, outputs copied (inputs written before)
    inside_ns: int  # the server's claim of the call's own time
    outputs: list[torch.Tensor]  # the driver's copies of the shared outputs


# ---- shared memory ------------------------------------------------------------------------


def _control_block(fd: int) -> tuple[mmap.mmap, np.ndarray]:
    block = mmap.mmap(fd, CONTROL_BYTES)
    words = np.frombuffer(block, dtype=np.int64, count=WORDS)
    return block, words


@dataclass
class _Buffer:
    tensor: torch.Tensor
    fd: int
    kind: int
    size: int
    release: Callable[[], None]


def _memfd_buffer(like: torch.Tensor | _Meta, fd: int | None = None) -> _Buffer:
    nbytes = like.numel() * like.element_size()
    if fd is None:
        fd = os.memfd_create("kerneleval-timed-call", os.MFD_CLOEXEC)
        os.ftruncate(fd, max(nbytes, 1))
    mapped = mmap.mmap(fd, max(nbytes, 1))
    flat = torch.frombuffer(mapped, dtype=torch.uint8, count=nbytes) if nbytes else None
    view = (
        flat.view(like.dtype).view(like.shape)
        if flat is not None
        else torch.empty(like.shape, dtype=like.dtype)
    )
    return _Buffer(view, fd, device_share.MEMFD, max(nbytes, 1), mapped.close)


# Device memory this process made for the timed calls' buffers, through the VMM API and so
# outside torch's allocator: the judge's arguments and outputs, gigabytes where the inputs
# are. The front end learns what a problem's jobs need of a GPU from what each job process
# reports (fleet/gpu_memory.py), which were torch's figures only (judge.py adds these).
_made = {"now": 0, "peak": 0}


def reset_made() -> None:
    """A job starts: its peak of made buffers from what is still held."""
    _made["peak"] = _made["now"]


def made_peak_bytes() -> int:
    """The most device memory this process's timed-call buffers held since reset_made."""
    return _made["peak"]


def _cuda_buffer(like: torch.Tensor | _Meta, fd: int | None = None, size: int = 0) -> _Buffer:
    """Device memory both processes map: made and exported here (fd None), or imported."""
    vmm = device_share._cuda()
    device = like.device
    nbytes = like.numel() * like.element_size()
    prop = vmm._prop(device)
    if fd is None:
        granularity = ctypes.c_size_t()
        vmm._call("cuMemGetAllocationGranularity", ctypes.byref(granularity),
                  ctypes.byref(prop), 0)  # fmt: skip
        g = granularity.value
        size = max(g, (nbytes + g - 1) // g * g)
        handle = vmm._create(size, prop)
        out = ctypes.c_int(-1)
        vmm._call("cuMemExportToShareableHandle", ctypes.byref(out), handle,
                  device_share._POSIX_FD, ctypes.c_ulonglong(0))  # fmt: skip
        fd = out.value
        made = size
    else:
        made = 0
        handle = ctypes.c_ulonglong()
        vmm._call("cuMemImportFromShareableHandle", ctypes.byref(handle), ctypes.c_void_p(fd),
                  device_share._POSIX_FD)  # fmt: skip
    ptr = vmm._map(handle, size, device)
    vmm.lib.cuMemRelease(handle)  # the mapping and the descriptor keep it
    raw = vmm._bytes_at(ptr, max(nbytes, 1), device)
    view = raw[:nbytes].view(like.dtype).view(like.shape)

    _made["now"] += made
    _made["peak"] = max(_made["peak"], _made["now"])

    def release() -> None:
        torch.cuda.synchronize(device)
        vmm._unmap(ptr, size)
        _made["now"] -= made

    return _Buffer(view, fd, device_share.CUDA_VMM, size, release)


def _buffer_like(like: torch.Tensor | _Meta) -> _Buffer:
    like = like.detach()
    return _cuda_buffer(like) if like.device.type == "cuda" else _memfd_buffer(like)


_DTYPES = {str(t).removeprefix("torch."): t for t in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
    torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128,
)}  # fmt: skip
# The narrow types of this torch (GPU MODE's tasks hand fp8 and fp4 tensors to their kernels).
_DTYPES.update({
    name: getattr(torch, name) for name in (
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
        "float4_e2m1fn_x2", "uint16", "uint32", "uint64",
    ) if isinstance(getattr(torch, name, None), torch.dtype)
})  # fmt: skip


def shareable_dtype(dtype: torch.dtype) -> bool:
    """Whether a tensor of `dtype` can be a shared argument or output."""
    return str(dtype).removeprefix("torch.") in _DTYPES


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _wait(
    words: np.ndarray, index: int, want: int, deadline: float, spin_s: float = SPIN_S,
    gone: Callable[[], bool] | None = None, fail: int | None = None,
) -> bool:  # fmt: skip
    """Until words[index] == want: a spin of `spin_s`, then naps. False at the deadline, or
    once `gone()` says the other side has left (asked every GONE_EVERY_S of napping), or
    the word is `fail`. With no spin (a CPU job: a spinning driver takes a core from the
    kernel it times) naps only."""
    now = time.monotonic()
    spin_until = now + spin_s
    ask_at = now + GONE_EVERY_S
    while (got := int(words[index])) != want:
        if got == fail:
            return False
        now = time.monotonic()
        if now > deadline:
            return False
        if now > spin_until:
            time.sleep(NAP_S)
            if gone is not None and now > ask_at:
                if gone():
                    return int(words[index]) == want
                ask_at = now + GONE_EVERY_S
    return True


def _peer_gone(sock_fd: int) -> bool:
    """Whether the other end of the session's socket is closed (its process exited)."""
    p = select.poll()
    p.register(sock_fd, select.POLLRDHUP | select.POLLHUP)
    return any(ev & (select.POLLRDHUP | select.POLLHUP) for _, ev in p.poll(0))


# ---- the driver: the trusted side ----------------------------------------------------------


class Driver:
    """Drives one kernel's timed calls in the server's process (module docstring)."""

    def __init__(self, sock_fd: int, args: Any, outputs_like: Sequence[torch.Tensor | _Meta],
                 device: torch.device, answer_s: float = 60.0,
                 prepare: Callable[[], None] | None = None,
                 lead: str = LEAD_NONE,
                 extra: dict[str, Any] | None = None) -> None:  # fmt: skip
        """Makes the shared arguments (like `args`, a TrialArgs: its tensors shared, its other
        values sent as they are) and outputs (like `outputs_like`) and the control block, and
        hands them to the server over `sock_fd`; returns once the server has mapped them.
        `prepare`: run here after each call's inputs are written, before the go (the L2
        flush: the inputs just written are not left in it). `lead`: what the server queues
        on its stream before each call's start event (LEAD_FLUSH, LEAD_IDLE or LEAD_NONE),
        as do_bench's loop does: the host queues the call's first launches meanwhile.
        `extra`: more of the layout, for the server's make_args (GPU MODE: the data's nest)."""
        self.device = device
        self.answer_s = answer_s
        self.prepare = prepare
        self.seq = 0
        self._written: Any = None  # the inputs the shared arguments hold
        self.sock_fd = os.dup(sock_fd)  # its own: whether the kernel's end is closed
        control_fd = os.memfd_create("kerneleval-timed-calls", os.MFD_CLOEXEC)
        os.ftruncate(control_fd, CONTROL_BYTES)
        self._block, self.words = _control_block(control_fd)
        self.args: list[_Buffer | None] = []
        layout_args = []
        for v in args.values:
            if isinstance(v, torch.Tensor):
                buf = _buffer_like(v)
                self.args.append(buf)
                layout_args.append({"tensor": _describe(buf)})
            else:
                self.args.append(None)
                layout_args.append({"value": _jsonable(v)})
        self.outputs = [_buffer_like(o) for o in outputs_like]
        layout = {
            "args": layout_args,
            "names": list(args.names), "roles": list(args.roles),
            "is_meta": list(args.is_meta), "from_get_inputs": bool(args.from_get_inputs),
            "outputs": [_describe(b) for b in self.outputs], "lead": lead,
        }  # fmt: skip
        for key, value in (extra or {}).items():
            layout.setdefault(key, value)
        data = json.dumps(layout).encode()
        fds = [control_fd] + [b.fd for b in self.args if b is not None]
        fds += [b.fd for b in self.outputs]
        sock = socket.socket(fileno=os.dup(sock_fd))
        try:
            socket.send_fds(sock, [HEADER.pack(len(data)) + data], fds)
        except OSError as e:
            raise TimedCallError(f"the kernel's process took no timed calls: {e}") from None
        finally:
            sock.close()
            for fd in fds:
                os.close(fd)
        gone = lambda: _peer_gone(sock_fd)  # noqa: E731
        deadline = time.monotonic() + answer_s
        if not _wait(self.words, READY, 1, deadline, gone=gone, fail=NOT_READY):
            said = self._said() if int(self.words[READY]) == NOT_READY else ""
            self.close()
            raise TimedCallError(
                "the kernel's process did not take its timed calls' buffers"
                + (f": {said}" if said else "")
            )

    def call(self, inputs: Any, noop: bool = False) -> CallResult:
        """One call: `inputs` (a TrialArgs like the session's) written into the shared
        arguments, then go, done, the outputs copied: that span is this process's clock.
        The write is outside it (its cost is the driver's, not the kernel's; inside, it made
        an honest claim read up to ~8% under a bound of gigabytes of inputs). The same
        `inputs` as the last call's are not written again: those of the calls of no work and
        of the warm-up, whose outputs nobody checks (gigabytes each: most of a calibration's
        time where the inputs are large)."""
        if inputs is not self._written:
            for buf, v in zip(self.args, inputs.values, strict=True):
                if buf is not None:
                    buf.tensor.copy_(v)
            self._written = inputs
        if self.prepare is not None:
            self.prepare()
        _sync(self.device)  # written before the go, and before the clock starts
        t0 = _perf_counter_ns()
        self.seq += 1
        self.words[SEED] = getattr(inputs, "seed", None) or 0
        self.words[MODE] = NOOP if noop else CALL
        self.words[GO] = self.seq
        deadline = time.monotonic() + self.answer_s
        gone: Callable[[], bool] = lambda: _peer_gone(self.sock_fd)  # noqa: E731
        spin = CALL_SPIN_S if self.device.type == "cuda" else 0.0
        if not _wait(self.words, DONE, self.seq, deadline, spin, gone):
            if gone():
                raise TimedCallError("the kernel's process ended during a timed call")
            raise TimedCallError(f"a timed call got no answer in {self.answer_s:.0f} s")
        copies = [b.tensor.clone() for b in self.outputs]
        _sync(self.device)
        t1 = _perf_counter_ns()
        status = int(self.words[STATUS])
        if status != OK:
            raise TimedCallError(self._message(status))
        inside = max(0, min(int(self.words[INSIDE_NS]), t1 - t0))
        return CallResult(t1 - t0, inside, copies)

    def settle(self) -> None:
        """A call of no work on the last call's inputs (nothing new is revealed by it), right
        before a call that follows GPU work of this process's own: a GPU MODE task's
        generate_input between calls (pmpp/sort_py's: a generator seeded per row, hundreds
        of small kernels) made the next call's path ~200 us slower than the calls of no work
        that calibrated it, back to back (bench/probe/path_gap_probe.py --busy-judge on an
        H200: honest adds and sorts flagged); after one, it is as theirs again."""
        self.call(self._written, noop=True)

    def own_path_ns(self, lead: Callable[[], None] | None, runs: int = 5) -> int:
        """own_path_ns on this session's shared outputs (the kernel's process may run
        meanwhile: a judge measures it before, with that process frozen)."""
        return own_path_ns(self.device, [b.tensor for b in self.outputs], lead, runs)

    def _said(self) -> str:
        said = bytes(self._block[MESSAGE_AT:CONTROL_BYTES]).split(b"\0", 1)[0]
        return said.decode("utf-8", "replace")[:1000]

    def _message(self, status: int) -> str:
        text = self._said()
        if status == BAD_OUTPUTS:
            return f"the kernel's outputs are not what the reference returns: {text}"
        return f"the kernel failed in a timed call: {text}"

    def close(self, more: bool = False) -> None:
        """Tells the server the calls are over (`more`: this session's; another layout
        follows on the socket); lets the shared memory go."""
        with contextlib.suppress(Exception):
            self.seq += 1
            self.words[MODE] = NEXT if more else STOP
            self.words[GO] = self.seq
            _wait(self.words, DONE, self.seq, time.monotonic() + 5.0)
        for buf in [b for b in self.args if b is not None] + self.outputs:
            with contextlib.suppress(Exception):
                buf.release()
        del self.words
        with contextlib.suppress(Exception):
            self._block.close()
        with contextlib.suppress(OSError):
            os.close(self.sock_fd)


def own_path_ns(
    device: torch.device, outputs: Sequence[torch.Tensor], lead: Callable[[], None] | None,
    runs: int = 5,
) -> int:  # fmt: skip
    """What this process measures, on its own clock, of what a call of no work costs: the
    GPU switched to another context and back (a call's path goes from this process's
    context to the server's and back: on an H200 that is most of its cost, ~0.35 ms), the
    server's lead and its copy of the outputs, and this side's copy of them (median of
    `runs`; `outputs`: tensors like the session's shared outputs). A server that slows its
    calls of no work to lower the bound is capped at this plus its slack (time_bound.decide), so
    it is measured while the kernel's process is frozen (the judge's window for the
    reference): one that runs meanwhile could take the host's cores, or the GPU, and raise
    the cap as far as it likes."""
    other = _other_context(device)
    spans = []
    for _ in range(runs):
        _sync(device)
        t0 = _perf_counter_ns()
        if other is not None:
            other.touch()
        if lead is not None:
            lead()
        for t in outputs:
            t.clone()
            t.clone()
        _sync(device)
        spans.append(_perf_counter_ns() - t0)
    unmeasured = device.type == "cuda" and other is None
    return int(np.median(spans)) + (NO_SWITCH_NS if unmeasured else 0)


def end_sessions(sock_fd: int) -> None:
    """Tells a server waiting for a session's layout that none follows (it returns)."""
    data = json.dumps({"end": True}).encode()
    sock = socket.socket(fileno=os.dup(sock_fd))
    try:
        with contextlib.suppress(OSError):
            sock.send(HEADER.pack(len(data)) + data)
    finally:
        sock.close()


class _OtherContext:
    """A second CUDA context of this (trusted) process on the device, with a small buffer of
    its own: `touch` makes the GPU switch to it and back, as a timed call's path does
    between the driver's and the server's contexts. Made once per process (~0.3-0.5 GiB of
    device memory, kept for the judge's next jobs)."""

    BYTES = 1 << 16

    def __init__(self, device: torch.device) -> None:
        self.vmm = device_share._cuda()
        dev = ctypes.c_int()
        self.vmm._call("cuDeviceGet", ctypes.byref(dev), device.index or 0)
        self.ctx = ctypes.c_void_p()
        self.vmm._call("cuCtxCreate_v2", ctypes.byref(self.ctx), ctypes.c_uint(0), dev)
        popped = ctypes.c_void_p()
        self.vmm._call("cuCtxPopCurrent_v2", ctypes.byref(popped))  # made current: undone
        self.ptr = ctypes.c_ulonglong()
        self._in(lambda: self.vmm._call("cuMemAlloc_v2", ctypes.byref(self.ptr),
                                         ctypes.c_size_t(self.BYTES)))  # fmt: skip

    def _in(self, work: Callable[[], None]) -> None:
        self.vmm._call("cuCtxPushCurrent_v2", self.ctx)
        try:
            work()
        finally:
            popped = ctypes.c_void_p()
            self.vmm._call("cuCtxPopCurrent_v2", ctypes.byref(popped))

    def touch(self) -> None:
        """A little work in this context, waited for."""

        def work() -> None:
            self.vmm._call("cuMemsetD8Async", self.ptr, ctypes.c_ubyte(0),
                           ctypes.c_size_t(self.BYTES), ctypes.c_void_p(0))  # fmt: skip
            self.vmm._call("cuCtxSynchronize")

        self._in(work)


_others: dict[int, _OtherContext | None] = {}


def _other_context(device: torch.device) -> _OtherContext | None:
    """This process's second context on `device` (None on the CPU, or where the driver
    refuses one: the cap then allows NO_SWITCH_NS for the switches instead)."""
    if device.type != "cuda":
        return None
    key = device.index or 0
    if key not in _others:
        try:
            _others[key] = _OtherContext(device)
        except (device_share.ShareError, torch.OutOfMemoryError, OSError, AttributeError):
            _others[key] = None
    return _others[key]


def _describe(buf: _Buffer) -> dict[str, Any]:
    t = buf.tensor
    return {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
            "kind": buf.kind, "size": buf.size}  # fmt: skip


def _jsonable(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)) and all(
        x is None or isinstance(x, (bool, int, float, str)) for x in v
    ):
        return list(v)
    raise TimedCallError(f"an argument of type {type(v).__name__} cannot be sent to a timed call")


NO_SWITCH_NS = 600_000  # the switches' cost where no second context could be made to measure


# ---- the server: the candidate's process ---------------------------------------------------


def serve(
    sock_fd: int,
    run: Callable[[Any], list[Any]],
    make_args: Callable[[list[Any], dict[str, Any]], Any],
    device: torch.device,
    idle_s: float = 600.0,
) -> None:
    """Takes the driver's buffers from `sock_fd`, then answers its calls until STOP: each
    runs `run(args)` on the shared arguments (`make_args(values, layout)` builds them: a
    TrialArgs, or a GPU MODE case's data) and copies its outputs into the shared outputs.
    Sessions follow one another on the socket: at NEXT (a GPU MODE task's next benchmark
    case, shapes of its own) the session's buffers are let go and the next layout awaited.
    Returns at STOP, when the driver sends no more sessions (`end_sessions`, or the socket
    closed), or when it is silent for `idle_s` (the front end ends the process anyway)."""
    got = _receive_layout(sock_fd)
    assert got is not None  # without wait_s: a layout, or raised
    layout, fds = got
    while not layout.get("end"):
        if not _session(layout, fds, run, make_args, device, idle_s):
            return
        got = _receive_layout(sock_fd, wait_s=idle_s)
        if got is None:
            return
        layout, fds = got
    for fd in fds:
        os.close(fd)


def _session(
    layout: dict[str, Any], fds: list[int], run: Callable[[Any], list[Any]],
    make_args: Callable[[list[Any], dict[str, Any]], Any], device: torch.device, idle_s: float,
) -> bool:  # fmt: skip
    """One session's calls (serve); True when another session follows (NEXT)."""
    block, words = _control_block(fds[0])
    os.close(fds[0])
    bufs: list[_Buffer] = []
    try:
        values: list[Any] = []
        i = 1
        for a in layout["args"]:
            if "tensor" in a:
                bufs.append(_import(a["tensor"], fds[i], device))
                values.append(bufs[-1].tensor)
                i += 1
            else:
                values.append(a["value"])
        for k, o in enumerate(layout["outputs"]):
            bufs.append(_import(o, fds[i + k], device))
        outputs = [b.tensor for b in bufs[len(bufs) - len(layout["outputs"]) :]]
        args = make_args(values, layout)
        lead = _lead(str(layout.get("lead", LEAD_NONE)), device)
    except Exception as e:  # out of memory, most likely: the driver says so, not a silence
        _say(block, f"{type(e).__name__}: {e}")
        words[READY] = NOT_READY
        raise
    # What a call of no work copies: made at the first, let go at the first real call (the
    # calls of no work come first), so that it never doubles the outputs' memory in a call.
    kept: list[torch.Tensor] = []
    spin = CALL_SPIN_S if device.type == "cuda" else SPIN_S
    words[READY] = 1
    last = 0
    cuda = device.type == "cuda"
    while True:
        if not _wait(words, GO, last + 1, time.monotonic() + idle_s, spin):
            return False
        last += 1
        mode = int(words[MODE])
        if mode in (STOP, NEXT):
            words[DONE] = last
            if mode == STOP:
                return False
            # The next session's buffers come next: this one's are let go first (what the
            # candidate still holds of them is its own affair).
            values.clear()
            outputs.clear()
            kept.clear()
            del args
            got = None
            _release(bufs, device)
            del words
            with contextlib.suppress(Exception):
                block.close()
            return True
        status, inside, message = OK, 0, ""
        try:
            seed = int(words[SEED])
            if seed:  # in a call of no work too: the same path
                seed_all(seed)
            # A call of no work takes a call's every step but the candidate's (its events,
            # its lead, the copy of its outputs), so that its span differs from a call's by
            # the candidate's work alone: whatever else differs is read as the candidate's.
            if mode == CALL:
                kept.clear()
            elif not kept:
                kept.extend(torch.zeros_like(o) for o in outputs)
                _sync(device)
            work = (lambda: run(args)) if mode == CALL else (lambda: list(kept))
            if cuda:
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                lead()
                start.record()
                got = work()
                end.record()
            else:
                t0 = time.perf_counter_ns()
                got = work()
                inside = time.perf_counter_ns() - t0
            message = _copy_outputs(got, outputs)
            got = None
            if message:
                status = BAD_OUTPUTS
            if cuda:
                torch.cuda.synchronize(device)
                inside = int(start.elapsed_time(end) * 1e6)
        except Exception as e:  # noqa: BLE001 - the candidate's failure: told to the driver
            status, message = FAILED, f"{type(e).__name__}: {e}"
        if message:
            _say(block, message)
        words[INSIDE_NS] = inside
        words[STATUS] = status
        words[DONE] = last


def _release(bufs: list[_Buffer], device: torch.device) -> None:
    """A finished session's buffers, unmapped once nothing of this side's refers to them."""
    gc.collect()
    _sync(device)
    for buf in bufs:
        with contextlib.suppress(Exception):  # a memfd a tensor still maps: freed with it
            buf.release()
    bufs.clear()


def _lead(kind: str, device: torch.device) -> Callable[[], None]:
    """The server's work queued before a call's start event, as timing.py's loop (and
    do_bench's) queues the L2 flush (or a short spin) before each trial's: the GPU runs it
    while the host queues the call's first launches, so a launch-bound call is not read at
    its host's pace from its first launch."""
    if device.type != "cuda" or kind == LEAD_NONE:
        return lambda: None
    return L2Flush(device, kind == LEAD_FLUSH).lead  # the judge's own lead, in this process


def _say(block: mmap.mmap, message: str) -> None:
    data = message.encode("utf-8", "replace")[: CONTROL_BYTES - MESSAGE_AT - 1]
    block[MESSAGE_AT : MESSAGE_AT + len(data) + 1] = data + b"\0"


def _copy_outputs(got: list[Any], outputs: list[torch.Tensor]) -> str:
    """The call's outputs into the shared ones; what does not fit them, said."""
    if len(got) != len(outputs):
        return f"{len(got)} outputs where {len(outputs)} are expected"
    for k, (value, dst) in enumerate(zip(got, outputs, strict=True)):
        if not isinstance(value, torch.Tensor):
            return f"output {k} is a {type(value).__name__}, not a tensor"
        if tuple(value.shape) != tuple(dst.shape):
            return f"output {k} has shape {tuple(value.shape)}, not {tuple(dst.shape)}"
        dst.copy_(value.detach())
    return ""


def _receive_layout(
    sock_fd: int, wait_s: float | None = None
) -> tuple[dict[str, Any], list[int]] | None:
    """The driver's next layout and its descriptors. With `wait_s` (a session after the
    first): None when none comes in that time or the socket is closed."""
    if wait_s is not None:
        p = select.poll()
        p.register(sock_fd, select.POLLIN | select.POLLHUP)
        if not p.poll(int(wait_s * 1000)):
            return None
    sock = socket.socket(fileno=os.dup(sock_fd))
    try:
        data, fds, _flags, _addr = socket.recv_fds(sock, 65536, 253)
        if not data and not fds and wait_s is not None:
            return None
        if len(data) < HEADER.size:
            for fd in fds:
                os.close(fd)
            raise TimedCallError("no layout from the driver")
        (n,) = HEADER.unpack(data[: HEADER.size])
        if n > MAX_LAYOUT_BYTES:
            raise TimedCallError("a layout over its limit")
        body = data[HEADER.size :]
        while len(body) < n:
            more = sock.recv(n - len(body))
            if not more:
                raise TimedCallError("the layout was cut short")
            body += more
    finally:
        sock.close()
    return json.loads(body), list(fds)


def _import(desc: dict[str, Any], fd: int, device: torch.device) -> _Buffer:
    like = torch.empty(desc["shape"], dtype=_DTYPES[desc["dtype"]], device="meta")
    if desc["kind"] == device_share.CUDA_VMM:
        buf = _cuda_buffer(_Meta(like, device), fd, int(desc["size"]))
    else:
        buf = _memfd_buffer(_Meta(like, torch.device("cpu")), fd)
    os.close(fd)
    return buf


def shape_of(like: torch.Tensor) -> _Meta:
    """What a shared buffer like `like` needs of it, without holding its memory."""
    return _Meta(like, like.device)


class _Meta:
    """What the buffer makers read of a tensor: its shape, dtype, device and size."""

    def __init__(self, like: torch.Tensor, device: torch.device) -> None:
        self.shape, self.dtype, self.device = like.shape, like.dtype, device
        self._numel, self._size = like.numel(), like.element_size()

    def numel(self) -> int:
        return self._numel

    def element_size(self) -> int:
        return self._size

    def detach(self) -> _Meta:
        return self


# ---- what the judge's drivers share (engine/judge.py, engine/gpumode_judge_timing.py) --

# Warm-up calls past the options' count (until timing.WARMUP_MS), at most: each goes through
# the timed calls' path, whose own cost is tens of microseconds.
MAX_WARMUP_CALLS = 200
CHECKED_MIN = 3  # timed calls checked against the reference, at least (else a quarter)


class L2Flush:
    """Before each timed call, once its inputs are written, the L2 flushed with timing.py's
    own buffer and write (timing.CudaOps; `enqueue`, waited for outside the call's span).
    Then, right before the call's start event, the lead timing.py's loop and do_bench's
    queue there (`lead`: the flush again, else a short spin), not waited for: the host
    queues the call's first launches while the GPU runs it, as it does in do_bench."""

    def __init__(self, device: torch.device, on: bool) -> None:
        self.device = device
        self.ops = timing.CudaOps()
        cuda = device.type == "cuda"
        self.buffer = self.ops.flush_buffer() if on and cuda else None
        self.lead_kind = (
            LEAD_NONE if not cuda
            else LEAD_FLUSH if self.buffer is not None
            else LEAD_IDLE
        )  # fmt: skip

    def enqueue(self) -> None:
        if self.buffer is not None:
            self.ops.flush(self.buffer)

    def lead(self) -> None:
        if self.buffer is not None:
            self.ops.flush(self.buffer)
        elif self.device.type == "cuda":
            self.ops.idle()


def warm_up(call: Callable[[], float], count: int) -> None:
    """`count` calls (at least one), then more until timing.WARMUP_MS have passed, as
    timing.py's warm-up and do_bench's 25 ms: the clocks settle under load. `call` runs one
    and returns its milliseconds."""
    spent = sum(call() for _ in range(max(1, count)))
    extra = 0
    while spent < timing.WARMUP_MS and extra < MAX_WARMUP_CALLS:
        spent += call()
        extra += 1
