"""Following one job to its end on the client's `run` or `watch`: the client re-attaches, this
shows the progress and says what the stream goes through."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from kerneleval import errors, progress, render
from kerneleval.cli.output import Output
from kerneleval.client import Client, StreamNote
from kerneleval.v1 import job_pb2, kernel_pb2


class _StreamNotes:
    """Says what a followed job's stream goes through (the client's StreamNotes: it is the
    client that re-attaches), and words the error when the client gives up."""

    def __init__(self, c: Client, out: Output, view: progress.JobView) -> None:
        self.c, self.out, self.view = c, out, view
        self.waiting = False  # "waiting" said, and the server has not answered since
        self.lost = False  # "lost" said, and no event came since

    def __call__(self, note: StreamNote) -> None:
        if note.kind == "waiting":
            self.waiting = True
            budget = render.fmt_duration(note.seconds)
            self.out.note(f"waiting for the server at {self.c.address} (up to {budget}) ...")
            self.view.status("waiting for the server")
        elif note.kind == "answers":
            self.waiting = False
            self.out.note(f"the server at {self.c.address} answers")
        elif note.kind == "lost":
            self.lost = True
            code = note.code.name if note.code is not None else "UNAVAILABLE"
            self.out.note(
                f"lost the stream of job {note.job_id} after event #{note.sequence} ({code}); "
                "re-attaching ..."
            )
        else:
            self.lost = False
            self.out.note(f"re-attached to job {note.job_id} at event #{note.sequence}")

    def gave_up(self, e: errors.Unavailable, job_id: str, last: int) -> errors.KernelEvalError:
        """The error to show for the client's Unavailable: what to do next, when it gave up."""
        if self.waiting:
            return errors.Unavailable(
                f"the server at {self.c.address} did not answer in time "
                "(is it running? `kerneleval serve`; --reconnect-timeout waits longer)"
            )
        if self.lost:
            return errors.Unavailable(
                f"could not re-attach to job {job_id} within "
                f"{render.fmt_duration(self.c.reconnect_timeout)}; it may still run: "
                f"kerneleval watch {job_id} --after {last}"
            )
        return e


class Follower:
    """Follows one job to its end on the client's `run` or `watch` (which re-attach within
    --reconnect-timeout): its progress, each event to `emit`, what the stream goes through."""

    def __init__(
        self,
        c: Client,
        out: Output,
        view: progress.JobView,
        emit: Callable[[job_pb2.JobEvent], None],
    ) -> None:
        self.c, self.view, self.emit = c, view, emit
        self.notes = _StreamNotes(c, out, view)
        self.job_id, self.last = "", 0

    def run(self, spec: kernel_pb2.JobSpec) -> job_pb2.Job:
        return self._follow(self.c.run(spec, on_note=self.notes))

    def watch(self, job_id: str, after: int) -> job_pb2.Job:
        self.job_id, self.last = job_id, after
        return self._follow(self.c.watch(job_id, after, on_note=self.notes))

    def _follow(self, events: Iterator[job_pb2.JobEvent]) -> job_pb2.Job:
        try:
            for ev in events:
                self.job_id, self.last = self.job_id or ev.job_id, ev.sequence
                self.view.event(ev)
                self.emit(ev)
                if ev.HasField("finished"):
                    return ev.finished
        except errors.Unavailable as e:
            raise self.notes.gave_up(e, self.job_id, self.last) from e
        raise errors.Unavailable(f"the stream of job {self.job_id} ended early")
