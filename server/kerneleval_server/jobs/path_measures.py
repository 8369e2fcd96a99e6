"""Judges' measures of their own path, kept across judge processes (issue 44).

A judge caps what a kernel's process may make its calibration read by its own measure of a
call of no work (engine/timed_calls.py own_path_ns), taken in a window with every other job
process of the GPU frozen. A judge process measured it itself, once, in a window of its
first job of a reference, even where that reference's time was given: a fresh judge per job
of an RL step (more problems than standing judges) opened a window for the measure alone and
spent ~60 ms of it copying gigabytes. The front end keeps the last measures per GPU and
reference (JobOutcome.path_measures) and gives them to the reference's next judges
(JudgeRequest.path_measures). They are the judges' own, taken with the kernels frozen, as a
standing judge's kept ones were; one over MAX_NS is nobody's path and is not kept.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable

from kerneleval.internal.v1 import job_channel_pb2

KEPT = 16  # per GPU and reference (a judge takes the median of the last 9 that fit it)
KNOWN_REFERENCES = 4096  # the least recently used forgotten past this
MAX_NS = 1_000_000_000


class PathMeasures:
    def __init__(self) -> None:
        self._by: OrderedDict[tuple[int, str], deque[job_channel_pb2.PathMeasure]] = OrderedDict()

    def given(self, device: int, reference_key: str) -> list[job_channel_pb2.PathMeasure]:
        """The reference's measures on the GPU, oldest first, for its next judge."""
        kept = self._by.get((device, reference_key))
        if not kept:
            return []
        self._by.move_to_end((device, reference_key))
        return list(kept)

    def learn(
        self, device: int, reference_key: str, measures: Iterable[job_channel_pb2.PathMeasure]
    ) -> None:
        """A judge's outcome's measures, kept for the reference's next judges on the GPU."""
        fresh = [m for m in measures if 0 < m.ns <= MAX_NS and m.output_bytes]
        if not fresh or not reference_key:
            return
        key = (device, reference_key)
        self._by.setdefault(key, deque(maxlen=KEPT)).extend(fresh)
        self._by.move_to_end(key)
        while len(self._by) > KNOWN_REFERENCES:
            self._by.popitem(last=False)
