"""Outputs past the record's limit handed to the judge by descriptor (engine/device_share.py):
on the CPU engine each share is a sealed memfd (on a GPU, device memory exported by the CUDA
driver; tests/engine/test_gpu.py). The kernel runs with a Recorder whose record holds headers
only, as in its own job process, its end of the record's socket closed after it (the process
is gone); judge_job reads the shares from the other end. Everything the kernel's process sends
on that socket is hostile: each attack ends `tampering: `."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from engine_helpers import TORCH, RecordingReporter, V, job, source
from kerneleval_server.engine import EngineConfig, Outcome, Recorder, compare, judge_job, run_job
from kerneleval_server.engine import device_share as share
from kerneleval_server.engine import record as rec
from test_judge import FORGED_COMPARE  # its own comparison forged, zeros handed back

# Outputs of 2 MiB a trial against a record with room for headers only.
BIG_MODEL = """
import torch
class Model(torch.nn.Module):
    def forward(self, a, b):
        return a + b
def get_inputs():
    return [torch.randn(512, 1024), torch.randn(512, 1024)]
def get_init_inputs():
    return []
"""
BIG_NEW = BIG_MODEL.replace("class Model(", "class ModelNew(")
LIMIT = 2 * rec.MAX_HEADER  # headers fit, a trial's outputs do not
SHARES = 64 << 20


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    yield ours, theirs
    ours.close()
    theirs.close()


def judged(
    engine_dir: Path,
    spec: V.JobSpec,  # type: ignore[name-defined]
    pair: tuple[socket.socket, socket.socket],
    *,
    as_kernel: Callable[[int], None] | None = None,
    kernel_gone: bool = True,
    shares: int = SHARES,
) -> tuple[Outcome, Outcome | None, int]:
    """(the kernel's process's outcome, the judge's or None, the bytes it handed over).
    `as_kernel` sends more on the socket, as the kernel's process could."""
    ours, theirs = pair
    fd = os.memfd_create("record")
    clean = compare.compare_outputs
    try:
        recorder = Recorder(fd, LIMIT, theirs.fileno(), shares)
        own = run_job(
            spec, RecordingReporter(), EngineConfig(work_dir=engine_dir, recorder=recorder)
        )
        compare.compare_outputs = clean
        if as_kernel is not None:
            as_kernel(theirs.fileno())
        if kernel_gone:
            theirs.close()
        if own.result.verdict != V.VERDICT_OK:
            return own, None, recorder.shared_bytes
        final = judge_job(
            spec, RecordingReporter(), EngineConfig(work_dir=engine_dir), own.result, fd, LIMIT,
            ours.fileno(), shares, kernel_gone,
        )  # fmt: skip
        return own, final, recorder.shared_bytes
    finally:
        compare.compare_outputs = clean
        os.close(fd)


def big_job(kernel: str = BIG_NEW, **options: object) -> V.JobSpec:  # type: ignore[name-defined]
    return job(source(TORCH, kernel), source(TORCH, BIG_MODEL), **options)


def test_outputs_past_the_record_are_judged_from_their_shares(
    engine_dir: Path, pair: tuple[socket.socket, socket.socket]
) -> None:
    own, final, shared = judged(engine_dir, big_job(perf_trial_count=10), pair)
    assert final is not None and final.result.verdict == V.VERDICT_OK, final.result
    # Five correctness trials and the timed trial on fresh inputs, 2 MiB each.
    assert shared == 6 * (2 << 20)
    assert final.result.validation.trials_passed == 5
    assert not any("kernel's own process" in n for n in final.result.notes), final.result.notes
    assert not any("judged outside" in n for n in final.result.notes)
    # The kernel's process did not judge or time the reference: the judge did.
    assert not own.result.HasField("reference_runtime")
    assert final.result.reference_runtime.median_ms > 0


def test_on_a_gpu_the_shares_are_device_memory(
    engine_dir: Path, pair: tuple[socket.socket, socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the job runs on a GPU its outputs never reach the host: each share is device
    memory exported by the driver (on the CPU engine, a sealed memfd)."""
    kinds: list[int] = []
    receive = share.receive

    def spy(*a: object, **k: object) -> list[share.Share]:
        got = receive(*a, **k)  # type: ignore[arg-type]
        kinds.extend(s.kind for s in got)
        return got

    monkeypatch.setattr(share, "receive", spy)
    _, final, _ = judged(engine_dir, big_job(), pair)
    assert final is not None and final.result.verdict == V.VERDICT_OK, final.result
    want = share.CUDA_VMM if torch.cuda.is_available() else share.MEMFD
    assert kinds and set(kinds) == {want}, kinds


def test_a_forger_with_outputs_past_the_record_is_incorrect(
    engine_dir: Path, pair: tuple[socket.socket, socket.socket]
) -> None:
    own, final, shared = judged(engine_dir, big_job(FORGED_COMPARE), pair)
    assert own.result.verdict == V.VERDICT_OK  # its own process believed the forgery
    assert shared > 0
    assert final is not None and final.result.verdict == V.VERDICT_INCORRECT, final.result
    # The next tenant's job, with the same record machinery: right.
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        _, after, _ = judged(engine_dir, big_job(), (ours, theirs))
        assert after is not None and after.result.verdict == V.VERDICT_OK, after.result
    finally:
        ours.close()
        theirs.close()


def _extra_share(fd: int) -> None:
    """One more sealed share, numbered next, that no output names."""
    share.send(fd, 7, torch.ones(16))


def _out_of_order(fd: int) -> None:
    share.send(fd, 42, torch.ones(16))


def _pipe(fd: int) -> None:
    r, w = os.pipe()
    sock = socket.socket(fileno=os.dup(fd))
    socket.send_fds(sock, [share.HEADER.pack(share.MEMFD, 7, 64)], [r])
    sock.close()
    os.close(r)
    os.close(w)


def _unsealed(fd: int) -> None:
    m = os.memfd_create("unsealed", os.MFD_ALLOW_SEALING)
    os.ftruncate(m, 64)
    sock = socket.socket(fileno=os.dup(fd))
    socket.send_fds(sock, [share.HEADER.pack(share.MEMFD, 7, 64)], [m])
    sock.close()
    os.close(m)


def _memfd_said_gpu_memory(fd: int) -> None:
    """A sealed memfd said to be device memory: the driver (or a judge without a GPU) refuses
    it, and that is tampering, not a crash."""
    m = share._memfd_export(torch.ones(1 << 19))
    sock = socket.socket(fileno=os.dup(fd))
    socket.send_fds(sock, [share.HEADER.pack(share.CUDA_VMM, 7, 2 << 20)], [m])
    sock.close()
    os.close(m)


def _no_descriptor(fd: int) -> None:
    os.write(fd, share.HEADER.pack(share.MEMFD, 7, 64))


@pytest.mark.parametrize(
    "attack",
    [_extra_share, _out_of_order, _pipe, _unsealed, _memfd_said_gpu_memory, _no_descriptor],
)
def test_what_the_kernels_process_sends_on_the_socket_is_checked(
    engine_dir: Path, pair: tuple[socket.socket, socket.socket], attack: Callable[[int], None]
) -> None:
    _, final, _ = judged(engine_dir, big_job(), pair, as_kernel=attack)
    assert final is not None and final.result.verdict == V.VERDICT_RUNTIME_ERROR, final.result
    assert final.result.error.message.startswith("tampering: "), final.result.error
    assert final.result.failed_side == V.SIDE_KERNEL


def test_shares_from_a_process_said_to_have_sent_none_are_tampering(
    engine_dir: Path, pair: tuple[socket.socket, socket.socket]
) -> None:
    """The front end starts the judge before the kernel's process has exited only when that
    process said it handed nothing over: shares found then are a lie (they could still change)."""
    _, final, _ = judged(engine_dir, big_job(), pair, kernel_gone=False)
    assert final is not None and final.result.verdict == V.VERDICT_RUNTIME_ERROR
    assert "said it handed over none" in final.result.error.message


def test_the_socket_must_reach_its_end_once_the_process_is_gone(
    engine_dir: Path, pair: tuple[socket.socket, socket.socket]
) -> None:
    """Said gone, yet its end is open (a descendant kept it): tampering, not a hang."""
    ours, theirs = pair
    keep = os.dup(theirs.fileno())
    try:
        _, final, _ = judged(engine_dir, big_job(), pair)
    finally:
        os.close(keep)
    assert final is not None and final.result.verdict == V.VERDICT_RUNTIME_ERROR
    assert "still holds the record's socket" in final.result.error.message


def test_outputs_past_both_limits_are_judged_in_the_kernels_process(
    engine_dir: Path, pair: tuple[socket.socket, socket.socket]
) -> None:
    """Room for two trials' shares: the rest was judged in the kernel's process, and the note
    names both limits; no tampering."""
    _, final, shared = judged(engine_dir, big_job(), pair, shares=2 * (2 << 20) + 1024)
    assert shared == 2 * (2 << 20)
    assert final is not None and final.result.verdict == V.VERDICT_OK, final.result
    note = next(n for n in final.result.notes if "judged outside" in n)
    assert "2 of 5" in note and "handed over by descriptor" in note


def test_a_false_claim_of_no_room_for_shares_is_tampering(
    engine_dir: Path, pair: tuple[socket.socket, socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kernel's process that hands nothing over and says its outputs fit nowhere, where the
    shares had room: the judge would see nothing."""
    monkeypatch.setattr(Recorder, "_share", lambda self, head, outputs, aliased: False)
    _, final, shared = judged(engine_dir, big_job(), pair)
    assert shared == 0
    assert final is not None and final.result.verdict == V.VERDICT_RUNTIME_ERROR, final.result
    assert "recorded none of its outputs" in final.result.error.message


class _DriverOutOfMemoryOnce:
    """libcuda as the kernel's process finds it with torch's allocator caching free blocks:
    cuMemCreate says out of memory until those blocks are handed back."""

    def __init__(self) -> None:
        self.cached_blocks_held = True
        self.creates = 0

    def cuMemCreate(self, *_args: object) -> int:
        self.creates += 1
        return 2 if self.cached_blocks_held else 0  # CUDA_ERROR_OUT_OF_MEMORY

    def cuGetErrorString(self, _rc: int, _text: object) -> int:
        return 0


def test_a_share_out_of_gpu_memory_tries_again_once_torch_hands_back_its_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A KernelBench job (L1Norm) ended OUT_OF_MEMORY on the H100 handing its outputs over:
    cuMemCreate bypasses torch's allocator, which held 22 GB free. The share now asks torch
    for its cached blocks back and tries once more; a second refusal is the job's."""
    driver = _DriverOutOfMemoryOnce()
    vmm = object.__new__(share._CudaVmm)
    vmm.lib = driver  # type: ignore[assignment]
    monkeypatch.setattr(
        torch.cuda, "empty_cache", lambda: setattr(driver, "cached_blocks_held", False)
    )
    vmm._create(2 << 20, share._AllocationProp())
    assert driver.creates == 2 and not driver.cached_blocks_held

    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)  # nothing cached to give
    driver.cached_blocks_held, driver.creates = True, 0
    with pytest.raises(torch.OutOfMemoryError, match="cuMemCreate"):
        vmm._create(2 << 20, share._AllocationProp())
    assert driver.creates == 2
