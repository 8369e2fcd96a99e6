"""The kernel's outputs, recorded by its own process for a judge process to compare (issue 13).

The writer runs in the candidate's process, so the reader trusts nothing in the file: every
length, offset, dtype and shape is checked against the file and the limits before a byte is
read (`RecordError` says what was wrong). The format is job_channel.proto's RecordedTrial.
A trial whose outputs do not fit the file goes by descriptor instead (device_share.py: GPU
memory on a GPU), up to a limit of its own: its header is in the file, each tensor names its
share.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch
from kerneleval.internal.v1 import job_channel_pb2

from . import device_share

MAGIC = b"KEREC001"
ALIGN = 64
MAX_HEADER = 1 << 20  # a trial's header: a few hundred bytes per output
MAX_DIMS = 32

# The dtypes an output may have, by the name the record uses (torch's, without "torch.").
DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.complex64,
        torch.complex128,
        # GPU MODE's fp8 tasks (a submission's output as its checker reads it)
        *(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)),
    )  # fmt: skip
}


# How far under the limit a reference's outputs must be for the judge to call a kernel's
# "over the limit" a lie (alignment and headers differ a little between the two counts).
MARGIN = 1 << 16


def trial_bytes(outputs: list[Any]) -> int:
    """What a trial of these outputs adds to a record, room for its header included (the
    limit counts it): sized where the tensors are."""
    size = 0
    for v in outputs:
        if isinstance(v, torch.Tensor):
            size += _aligned(v.numel() * v.element_size())
    return MAX_HEADER + size


class RecordError(Exception):
    """The record is not what a recorder writes."""


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Recorder:
    """Appends each trial's outputs to `fd` (a memfd of the front end's), up to `max_bytes`;
    a trial that does not fit there is handed over by descriptor on `share_fd` (the record's
    socket), up to `share_max_bytes` in all. A trial that fits neither is written as
    over_limit, and nothing after it."""

    def __init__(
        self, fd: int, max_bytes: int, share_fd: int = -1, share_max_bytes: int = 0
    ) -> None:
        self._fd = fd
        self._max = max_bytes
        self._end = len(MAGIC)
        self._share_fd = share_fd
        self._share_max = share_max_bytes if share_fd >= 0 else 0
        self.shared_bytes = 0  # what the shares hold (device memory the judge will read)
        self._slots = 0
        self.full = False  # a trial did not fit: the rest is judged here
        os.pwrite(fd, MAGIC, 0)

    def record(
        self, trial: int, outputs: list[Any], replay: bool = False, structure: str = "",
        aliased: Collection[int] = (),
    ) -> bool:  # fmt: skip
        """Writes one trial's outputs (`structure`: RecordedTrial.structure; `aliased`: the
        outputs that share memory with an input, RecordedValue.aliases_input); False when they
        did not fit (or an earlier one did not)."""
        if self.full:
            return False
        head = job_channel_pb2.RecordedTrial(trial=trial, replay=replay, structure=structure)
        # Sized on the device first: KernelBench's 6.4 GB outputs must not reach the host.
        need = trial_bytes(outputs)
        if self._end + need > self._max:
            if self._share(head, outputs, aliased):
                return True
            self.full = True
            head.over_limit, head.bytes = True, need - MAX_HEADER
            self._append(head, [])
            return False
        values = [_host_value(v) for v in outputs]
        offset = _aligned(self._end + 4 + MAX_HEADER)  # data after the largest header
        for v, t in zip(outputs, values, strict=True):
            if t is None:
                head.values.add(not_a_tensor=type(v).__name__ or "object")
                continue
            entry = head.values.add(dtype=str(t.dtype).removeprefix("torch."), offset=offset)
            entry.shape.extend(t.shape)
            entry.nbytes = t.numel() * t.element_size()
            offset = _aligned(offset + entry.nbytes)
        self._append(head, values, aliased)
        return True

    def _share(
        self, head: job_channel_pb2.RecordedTrial, outputs: list[Any], aliased: Collection[int]
    ) -> bool:
        """The trial's tensors by descriptor, its header in the file; False when they would
        not fit the shares' limit (nothing is sent then)."""
        tensors = [_device_value(v) for v in outputs]
        need = shares_need(tensors)
        if self._end + MAX_HEADER > self._max or self.shared_bytes + need > self._share_max:
            return False
        if self._slots + sum(t is not None for t in tensors) > device_share.MAX_SHARES:
            return False
        for v, t in zip(outputs, tensors, strict=True):
            if t is None:
                head.values.add(not_a_tensor=type(v).__name__ or "object")
                continue
            self._slots += 1
            self.shared_bytes += device_share.send(self._share_fd, self._slots, t)
            entry = head.values.add(dtype=str(t.dtype).removeprefix("torch."), share=self._slots)
            entry.shape.extend(t.shape)
            entry.nbytes = t.numel() * t.element_size()
        self._append(head, [None] * len(head.values), aliased)
        return True

    def _append(
        self, head: job_channel_pb2.RecordedTrial, values: list[torch.Tensor | None],
        aliased: Collection[int] = (),
    ) -> None:  # fmt: skip
        for i in aliased:
            if 0 <= i < len(head.values):
                head.values[i].aliases_input = True
        data = head.SerializeToString()
        os.pwrite(self._fd, struct.pack(">I", len(data)) + data, self._end)
        end = self._end + 4 + len(data)
        for entry, t in zip(head.values, values, strict=False):
            if t is None:
                continue
            if entry.nbytes:
                os.pwrite(self._fd, t.reshape(-1).view(torch.uint8).numpy().data, entry.offset)
            end = max(end, entry.offset + entry.nbytes)
        self._end = _aligned(end) if head.values else end


def _host_value(v: Any) -> torch.Tensor | None:
    """An output as a contiguous host tensor (a number becomes a 0-d one, as the comparison
    makes it); None when it is no tensor."""
    t = _device_value(v)
    return None if t is None else t.to("cpu").contiguous()


def _device_value(v: object) -> torch.Tensor | None:
    """An output as a tensor where it is (a number becomes a 0-d one on the host); None when
    it is no tensor of a recorded dtype."""
    if not isinstance(v, torch.Tensor):
        try:
            v = torch.as_tensor(v)
        except Exception:  # noqa: BLE001 - the comparison says what it was
            return None
    if str(v.dtype).removeprefix("torch.") not in DTYPES:
        return None
    return v.detach()


def shares_need(tensors: list[torch.Tensor | None]) -> int:
    """What handing these over by descriptor takes of the shares' limit, at most (a GPU rounds
    each allocation up to its granularity); None stands for an output that is no tensor."""
    need, g = 0, device_share.GRANULARITY
    for t in tensors:
        if t is None:
            continue
        nbytes = t.numel() * t.element_size()
        need += max(g, (nbytes + g - 1) // g * g) if t.device.type == "cuda" else nbytes
    return need


@dataclass
class Trial:
    trial: int
    replay: bool
    over_limit: bool
    bytes: int
    values: list[Any]  # host tensors, or _NotATensor stand-ins
    at: int = 0  # where its header starts: what the record held before it
    structure: str = ""  # RecordedTrial.structure: "" for a Model's outputs
    aliased: frozenset[int] = frozenset()  # outputs said to share memory with an input


def fits_after(at: int, outputs: list[Any], max_bytes: int, share_room: int = 0) -> bool:
    """Whether a record that held `at` bytes had room for these outputs, in the file or in
    the shares' `share_room` left (Recorder.record's tests, with MARGIN to spare): a kernel's
    "over the limit" is then a lie."""
    if at + trial_bytes(outputs) + MARGIN <= max_bytes:
        return True
    need = shares_need([_device_value(v) for v in outputs])
    return at + MAX_HEADER + MARGIN <= max_bytes and need + MARGIN <= share_room


def _stand_in(type_name: str) -> Any:
    """An object of a class with the kernel's output's type name: the comparison's message
    names it, and it converts to no tensor."""
    return type(type_name[:64] or "object", (), {})()


def read(fd: int, shares: dict[int, torch.Tensor] | None = None) -> list[Trial]:
    """Every trial the record holds, as host tensors backed by a private copy of the file,
    and tensors over `shares` (slot -> its bytes, loaded by device_share) where a value names
    one. RecordError for anything a recorder would not have written."""
    shares = shares or {}
    taken: set[int] = set()
    size = os.fstat(fd).st_size
    if size < len(MAGIC):
        raise RecordError("no record was written")
    mem = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    if mem[: len(MAGIC)] != MAGIC:
        raise RecordError("the record does not start as a record")
    trials: list[Trial] = []
    pos = len(MAGIC)
    used: list[tuple[int, int]] = []
    while pos < size:
        if pos + 4 > size:
            raise RecordError("the record ends inside a header's length")
        (n,) = struct.unpack(">I", mem[pos : pos + 4])
        if n > MAX_HEADER or pos + 4 + n > size:
            raise RecordError(f"a header of {n} bytes at {pos} does not fit")
        head = job_channel_pb2.RecordedTrial()
        try:
            head.ParseFromString(mem[pos + 4 : pos + 4 + n])
        except Exception as e:  # noqa: BLE001 - DecodeError and friends
            raise RecordError(f"a header at {pos} does not decode: {e}") from None
        end = pos + 4 + n
        values: list[Any] = []
        for v in head.values:
            if v.not_a_tensor:
                values.append(_stand_in(v.not_a_tensor))
                continue
            if v.share:
                values.append(_shared(shares, taken, v))
                continue
            t, stop = _tensor(mem, size, v, used)
            values.append(t)
            end = max(end, stop)
        aliased = frozenset(i for i, v in enumerate(head.values) if v.aliases_input)
        trials.append(
            Trial(
                head.trial, head.replay, head.over_limit, head.bytes, values, pos,
                head.structure, aliased,
            )
        )  # fmt: skip
        pos = _aligned(end) if head.values else end
        if head.over_limit:
            break
    if set(shares) - taken:
        raise RecordError(f"shares {sorted(set(shares) - taken)[:8]} belong to no output")
    return trials


def _dtype_and_size(v: job_channel_pb2.RecordedValue) -> torch.dtype:
    dtype = DTYPES.get(v.dtype)
    if dtype is None:
        raise RecordError(f"dtype {v.dtype[:32]!r} is not an output dtype")
    if len(v.shape) > MAX_DIMS or any(d < 0 for d in v.shape):
        raise RecordError(f"shape {list(v.shape)[:8]} is not a tensor's")
    itemsize = torch.empty((), dtype=dtype).element_size()
    if v.nbytes != math.prod(v.shape) * itemsize:
        raise RecordError(f"{v.nbytes} bytes for shape {list(v.shape)} of {v.dtype}")
    return dtype


def _shared(
    shares: dict[int, torch.Tensor], taken: set[int], v: job_channel_pb2.RecordedValue
) -> torch.Tensor:
    """A value handed over by descriptor: its share's first nbytes, as the header says."""
    dtype = _dtype_and_size(v)
    data = shares.get(v.share)
    if data is None:
        raise RecordError(f"share {v.share} was never handed over")
    if v.share in taken:
        raise RecordError(f"share {v.share} is named by two outputs")
    if v.nbytes > data.numel():
        raise RecordError(f"{v.nbytes} bytes said to be in share {v.share} of {data.numel()}")
    taken.add(v.share)
    if v.nbytes == 0:
        return torch.empty(tuple(v.shape), dtype=dtype, device=data.device)
    return data[: v.nbytes].view(dtype).reshape(tuple(v.shape))


def _tensor(
    mem: mmap.mmap, size: int, v: job_channel_pb2.RecordedValue, used: list[tuple[int, int]]
) -> tuple[torch.Tensor, int]:
    dtype = _dtype_and_size(v)
    start, stop = v.offset, v.offset + v.nbytes
    if start % ALIGN or stop > size:
        raise RecordError(f"bytes {start}..{stop} are not in the record of {size}")
    if any(start < b and a < stop for a, b in used):
        raise RecordError(f"bytes {start}..{stop} overlap another output's")
    used.append((start, stop))
    if v.nbytes == 0:
        return torch.empty(tuple(v.shape), dtype=dtype), stop
    flat = torch.frombuffer(mem, dtype=torch.uint8, count=v.nbytes, offset=start)
    return flat.view(dtype).reshape(tuple(v.shape)), stop
