"""A job's end: its final result (`close`), and those who wait for it (`Endings`).

No job leaves without a verdict; its static flags are the front end's and its runtime flags
the engine's (of the rules the front end knows); a job that asked to be rejected when flagged
is. Whoever waits for a job's end (an Evaluate, a Compare, a cancel) is answered from the job
handed over at once, before the store has it (manager.py `finish`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from kerneleval.v1 import job_pb2

from kerneleval_server.fleet import faults
from kerneleval_server.jobs.running import Running, stamp
from kerneleval_server.jobs.shared_queue import SharedQueue
from kerneleval_server.jobs.store import TERMINAL, JobStore
from kerneleval_server.metrics import Metrics

log = logging.getLogger("kerneleval.jobs")

# engine/integrity.py's rules (the front end does not import the engine: torch).
RUNTIME_RULES = (
    "output_aliases_input",
    "output_aliases_reference",
    "faster_than_memory",
    "replayed_outputs",
    "persisting_l2",
    "lower_precision",
    "timer_tampered",
    "time_outside_bound",
)


def close(
    job: job_pb2.Job,
    state: job_pb2.JobState,
    result: job_pb2.EvalResult,
    reason: str,
    memory_limits: faults.MemoryLimits,
) -> None:
    """Ends `job` in `state` with `result`: its final state, result, flags and reason."""
    if not result.verdict and state in (job_pb2.JOB_STATE_DONE, job_pb2.JOB_STATE_FAILED):
        # No job leaves without a verdict: one its process ended without is the service's
        # failure to get one (the engine's own verdicts are on the kernel or reference).
        result.verdict = job_pb2.VERDICT_SERVICE_ERROR
        if state == job_pb2.JOB_STATE_DONE:
            state = job_pb2.JOB_STATE_FAILED
            reason = reason or "the job process answered without a verdict"
        if not result.error.message:
            result.error.message = reason or result.fault.description
    job.state = state
    faults.explain_memory(result, job.device_index, memory_limits)
    if job.HasField("start_time") and not job.result_origin:
        job.result_origin = job_pb2.RESULT_ORIGIN_RUN
    # The static flags are the front end's (submit), whatever the job process says; the
    # engine adds runtime ones (engine/integrity.py), only of the rules it knows.
    flags = job_pb2.EvalResult()
    flags.flags.extend(job.result.flags)
    runtime = [
        job_pb2.IntegrityFlag(rule_id=f.rule_id, message=f.message[:500], source=f.source)
        for f in result.flags
        if f.source == job_pb2.FLAG_SOURCE_RUNTIME and f.rule_id in RUNTIME_RULES
    ][: len(RUNTIME_RULES)]
    job.result.CopyFrom(result)
    job.result.ClearField("flags")
    job.result.flags.extend(flags.flags)
    job.result.flags.extend(runtime)
    if runtime and job.spec.options.reject_flagged and result.verdict == job_pb2.VERDICT_OK:
        job.result.verdict = job_pb2.VERDICT_REJECTED
        job.result.correctness = False
        reason = reason or f"rejected: runtime checks flagged {[f.rule_id for f in runtime]}"
    job.state_reason = reason
    stamp(job.end_time)


def from_outcome(run: Running, result: job_pb2.EvalResult) -> job_pb2.EvalResult:
    """A job's result from its process's outcome (`result`, a copy of the outcome's): what
    the service says besides (its timing window, an XID seen, a poisoned context)."""
    assert run.outcome is not None
    result.ClearField("timing_window")  # the service's to say, not the job's
    # A judged job's time is its kernel's: the window it was timed in, as its process said.
    kernel = run.record.kernel_outcome if run.record is not None else None
    window = run.kernel_window if kernel is not None else run.window
    timed = kernel or run.outcome
    if window is not None:
        window.fill(result.timing_window)
        # The job process's own report of its wait for others' queued GPU work: it can
        # only make its own window look worse.
        result.timing_window.drain.CopyFrom(timed.window_drain)
        result.timing_window.drained = timed.window_drained
    if run.xid is not None and (run.xid.named or result.verdict != job_pb2.VERDICT_OK):
        result.fault.xid = run.xid.xid
        result.fault.xid_category = run.xid.category
        if result.verdict in (job_pb2.VERDICT_OK, job_pb2.VERDICT_RUNTIME_ERROR):
            result.verdict = job_pb2.VERDICT_DEVICE_FAULT
    if run.outcome.context_poisoned:
        result.fault.worker_restarted = True
        result.fault.worker_pid = run.proc.pid
        if not result.fault.description:
            result.fault.description = (
                f"the CUDA context of worker {run.proc.worker_id} is poisoned; "
                "it exited and was replaced"
            )
    return result


def from_exit(run: Running, decision: faults.Decision) -> job_pb2.EvalResult:
    """A job's result when its process exited before its outcome (faults.classify_exit)."""
    result = job_pb2.EvalResult(fault=decision.fault)
    result.verdict = decision.verdict
    result.compiled = run.phase >= job_pb2.PHASE_VALIDATING
    if decision.error is not None:
        result.error.CopyFrom(decision.error)
    return result


def protocol_violation(run: Running, what: str) -> job_pb2.EvalResult:
    """A job's result when its process broke the job channel's protocol and was killed: a
    runtime error that says what it sent (not retried: the job's own code did it)."""
    result = job_pb2.EvalResult(verdict=job_pb2.VERDICT_RUNTIME_ERROR)
    result.compiled = run.phase >= job_pb2.PHASE_VALIDATING
    result.error.exception_type = "ProtocolViolation"
    result.error.message = what
    result.fault.worker_pid = run.proc.pid
    result.fault.worker_restarted = True
    result.fault.description = (
        f"job process {run.proc.worker_id} broke the job channel's protocol and was killed"
    )
    return result


def counted(
    job: job_pb2.Job,
    state: job_pb2.JobState,
    result: job_pb2.EvalResult,
    metrics: Metrics,
    counters: dict[str, int],
) -> None:
    """A job's end in the metrics, the fleet's counters (GetStats: its faults) and the log."""
    state_name = job_pb2.JobState.Name(state).removeprefix("JOB_STATE_")
    verdict = job_pb2.Verdict.Name(result.verdict).removeprefix("VERDICT_")
    metrics.jobs.labels(state_name).inc()
    if job.tenant:  # a name from the tenants file, stored with the job (metrics.py)
        metrics.tenant_finished.labels(job.tenant, state_name).inc()
    if result.verdict:
        metrics.verdicts.labels(verdict).inc()
    if result.verdict in (
        job_pb2.VERDICT_DEVICE_FAULT,
        job_pb2.VERDICT_CRASHED,
        job_pb2.VERDICT_TIMEOUT,
    ):
        counters["faults"] += 1
    log.info("job finished", extra={"job_id": job.job_id, "verdict": verdict, "event": state_name})


class Endings:
    """Who waits for which job's end, and the jobs just ended that their waiters take before
    the store has them."""

    def __init__(self, store: JobStore, shared: Callable[[], SharedQueue | None]) -> None:
        self.store = store
        self.shared = shared  # a gateway's or a node's shared queue, once set
        self._waited: dict[str, asyncio.Event] = {}
        self._handed: dict[str, job_pb2.Job] = {}

    def hand(self, job: job_pb2.Job) -> bool:
        """The job ended: handed to its waiters, if any wait (True), until it is stored."""
        done = self._waited.pop(job.job_id, None)
        if done is None:
            return False
        self._handed[job.job_id] = job
        done.set()
        return True

    def stored(self, job_id: str) -> None:
        self._handed.pop(job_id, None)

    async def finished(self, job_id: str) -> job_pb2.Job | None:
        """The job once it has ended: as it finished, when it ends while awaited here (its
        waiters answer before the store has it), else as the store has it."""
        await self._until_finished(job_id, None)
        return self._handed.get(job_id) or self.store.get(job_id)

    async def wait_finished(self, job_id: str, timeout: float | None = None) -> None:
        """Until the job has ended and the store has it (or `timeout`)."""
        await self._until_finished(job_id, timeout)
        if job_id in self._handed:
            await asyncio.sleep(0)  # its write comes in the loop's next turn (finish)

    async def _until_finished(self, job_id: str, timeout: float | None) -> None:
        if job_id in self._handed:
            return
        job = self.store.get(job_id, include_spec=False)
        if job is None or job.state in TERMINAL:
            return
        shared = self.shared()
        if shared is not None and not shared.is_local(job_id):
            await shared.wait_finished(job_id, timeout)
            return
        event = self._waited.setdefault(job_id, asyncio.Event())
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except asyncio.TimeoutError:
            pass
