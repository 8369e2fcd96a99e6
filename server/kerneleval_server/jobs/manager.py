"""The job life cycle, as its story: a job is submitted (`submit`: admission decides it,
admission.py), dispatched to a job process (`dispatch`, `start`), answered by it
(`on_outcome`), and finished (`finish`), unless it is cancelled (`cancel`), runs out of time
(`on_deadline`), loses its process (`process_exited`) or its GPU faults (`attribute_xid`).

A job process takes exactly one job: it is dispatched to only once it has said hello, is not
a spare and was never given a job; after its outcome it exits by itself (exit code 0, or
POISONED_EXIT when its CUDA context was poisoned) and is not a failure. Where a job is in its
story is its `Running` record's `Stage` (running.py). The rest is beside it, each part
reached through a small Protocol, never through the manager's private names:

    admission.py      idempotency, the result cache, jobs in flight, the queue limit
    intake.py         stored as it is sent, queued or waiting for an identical job, requeued
    builds/paths.py   built ahead then launched; load_inline builds
    messages.py       what a job process says on its channel
    processes.py      the job processes: told to the watchdog, watched to their exit, freed
    crowding.py       who shares a GPU; a job that ran out of memory crowded runs alone
    judging.py        compared jobs judged outside the kernel's process
    gpu_use.py        a running job's GPU: memory admission, the gate, timing windows
    endings.py        a job's final result, and who waits for it
    exits.py          its process killed, or gone before its outcome: it ends or runs again
    waits.py          every wait of a job named and bounded
    service.py        the one face the API's servicers call

Every state change is written to the store before anyone hears of it. The devices, their
health and XIDs (fleet/devices.py) and the watchdog's events (fleet/watchdog_events.py) call
back for what an event means for jobs. It all runs on the event loop; nothing here blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable

from kerneleval.internal.v1 import job_channel_pb2, watchdog_pb2
from kerneleval.v1 import job_pb2, kernel_pb2

from kerneleval_server import metrics as metrics_mod
from kerneleval_server.config import Config
from kerneleval_server.fleet import faults
from kerneleval_server.fleet.devices import Devices
from kerneleval_server.fleet.gpu_memory import GpuMemory
from kerneleval_server.fleet.job_processes import JobChannels, JobProcess, JobProcessTable
from kerneleval_server.fleet.timing_windows import WATCHDOG_REPLY_S, TimingWindows
from kerneleval_server.fleet.watchdog import WatchdogLike
from kerneleval_server.fleet.watchdog_events import WatchdogEvents
from kerneleval_server.framing import FrameError
from kerneleval_server.jobproc import BUILD_DEVICE
from kerneleval_server.jobs import endings, judging, static_checks
from kerneleval_server.jobs.admission import Admission, QueueFull, stored_key
from kerneleval_server.jobs.builds.build_cache import BuildCache
from kerneleval_server.jobs.builds.paths import BuildPaths
from kerneleval_server.jobs.crowding import Crowding
from kerneleval_server.jobs.deadline import Deadline, timeout_of
from kerneleval_server.jobs.endings import Endings
from kerneleval_server.jobs.events import EventHub, OpsLog
from kerneleval_server.jobs.exits import KILL_FALLBACK_S, Exits
from kerneleval_server.jobs.gpu_use import GpuUse
from kerneleval_server.jobs.intake import Intake
from kerneleval_server.jobs.messages import JobProcessMessages
from kerneleval_server.jobs.processes import OUTCOME_EXIT_GRACE_S, ProcessKeeper
from kerneleval_server.jobs.running import Kill, Running, Stage, copy_job, stamp, xid_suspects
from kerneleval_server.jobs.scheduler import FairQueue, GpuGate
from kerneleval_server.jobs.shared_queue import SharedQueue
from kerneleval_server.jobs.store import TERMINAL, JobStore
from kerneleval_server.jobs.tenant_load import TenantLoad
from kerneleval_server.jobs.waits import Waits
from kerneleval_server.metrics import Metrics

log = logging.getLogger("kerneleval.jobs")


class JobManager:
    def __init__(
        self,
        config: Config,
        store: JobStore,
        hub: EventHub,
        ops: OpsLog,
        metrics: Metrics,
        max_timeout_s: float,
    ) -> None:
        self.config = config
        self.store = store
        self.hub = hub
        self.ops = ops
        self.metrics = metrics
        self.max_timeout_s = max_timeout_s
        self.memory_limits = faults.MemoryLimits.of(config)  # what OOM results are told
        # Its job processes: the watchdog told which job each runs, each watched to its exit
        # and freed (processes.py).
        self.processes = p = ProcessKeeper(self)
        self.spawn, self.set_job, self.watch_exit = p.spawn, p.set_job, p.watch_exit
        self.free_process, self.kill_lost = p.free_process, p.kill_lost
        self.queue = FairQueue()
        self.tenants = TenantLoad(self)  # what a tenant's quotas are checked against
        if config.tenant_max_running > 0:  # a tenant at its share waits in the queue
            self.queue.lane_open = self.tenants.has_room
        # A running job's use of its GPU: memory admission, the gate's grants, timing windows.
        self.gpu_use = GpuUse(self)
        self.gate = GpuGate(self.gpu_use.grant, on_window=self.gpu_use.window_ended)
        self.windows = TimingWindows(freeze_others=config.freeze_during_timing)
        self.job_processes = JobProcessTable()
        # What its job processes say (messages.py), on their channels.
        self.messages = JobProcessMessages(self)
        # Where windows let warming processes run, one's first job waits for its freeze.
        warm = None if config.freeze_warming else p.mark_warm
        self.channels = JobChannels(self.messages, mark_warm=warm)
        # The devices (their health, XIDs, counters), and the watchdog's events that feed them
        # and the job process table; each calls back here for what an event means for jobs.
        self.fleet = Devices(self)
        self.watchdog_events = WatchdogEvents(self)
        # A job's builds outside its process: built ahead then launched, its load_inline
        # calls (builds/paths.py); what was built, on disk across restarts.
        built = BuildCache(config.state_path() / "builds", config.build_cache_mib << 20)
        self.builds = BuildPaths(self, built, config.compile_cache_mib << 20)
        self.running: dict[str, Running] = {}
        # Compared jobs whose kernel ran OK, waiting for their judges; the standing judges.
        self.judges = judging.Judges(self, OUTCOME_EXIT_GRACE_S, KILL_FALLBACK_S)
        # Who shares a GPU, and the jobs re-run with a GPU to themselves (crowding.py).
        self.crowding = Crowding(self)
        # What a problem's jobs need of a GPU's memory, and who holds it (gpu_use.waiting: the
        # jobs whose check waits for it).
        self.memory = GpuMemory(config.gpu_memory_share)
        self.watchdog: WatchdogLike | None = None
        self.draining = False
        # Started jobs the drain's grace ended on (main.py `_shutdown`): they run again at the
        # next start, as the log and their events say, so nothing of this run is recorded.
        self.cut_off: set[str] = set()
        self.on_health_change: Callable[[], None] = lambda: None
        self.started_at = time.time()
        self.queue_latency: deque[float] = deque(maxlen=2000)
        self.run_latency: deque[float] = deque(maxlen=2000)
        # Stored as it is sent, queued or waiting for an identical job, requeued (intake.py).
        self.intake = i = Intake(self)
        self.store_new, self.unstored, self.requeue = i.store_new, i.unstored, i.requeue
        # Its process killed, or gone before its outcome: it ends, or runs again (exits.py).
        self.exits = x = Exits(self)
        self.on_process_lost = x.lost
        # Who waits for a job's end, answered before the store has it (endings.py).
        self.endings = Endings(store, lambda: self.shared)
        # Idempotency, the result cache, jobs in flight, the queue limit (admission.py).
        self.admission = Admission(config, store, i.devices)
        # --role gateway or node: the queue is the shared store's (jobs/shared_queue.py).
        self.shared: SharedQueue | None = None
        # Every wait of a job named as it waits, and bounded (jobs/waits.py).
        self.waits = Waits(self, config.max_wait_s)

    # ---- a job comes in: submit (or a lease from the shared store, or a restart) ------------

    def submit(
        self,
        spec: kernel_pb2.JobSpec,
        flags: list[job_pb2.IntegrityFlag] | None = None,
        idempotency_key: str = "",
        tenant: str = "",
    ) -> job_pb2.Job:
        """Persists a new QUEUED job of `tenant` ("": none) and queues it (flags: the static
        checks' result, when the caller ran them off the event loop), or answers it from the
        result cache or an identical job in flight (admission.py). A Submit retried with its
        idempotency key gets the job the first one made. Raises QueueFull past the queue
        limit, KeyReused.

        Without `flags`, a job that runs here is started before its static checks (a
        millisecond of parsing on the way to every job's start): they run while its process
        starts, and what they flag joins its result (intake.flag_late). A job they may reject
        (reject_flagged), one from the cache and one for the shared queue are checked first."""
        idempotency_key = stored_key(idempotency_key, tenant)
        mine, ages = self.tenants.of(tenant)
        try:
            decision = self.admission.decide(
                spec, idempotency_key, len(self.queue), tenant, mine, ages
            )
        except QueueFull as exc:
            if tenant:
                self.metrics.tenant_rejected.labels(tenant, exc.quota).inc()
            raise
        if decision.earlier is not None:
            return decision.earlier
        if tenant:
            self.metrics.tenant_submitted.labels(tenant).inc()
        key, hit = decision.cache_key, decision.hit
        job = job_pb2.Job(job_id=uuid.uuid4().hex, state=job_pb2.JOB_STATE_QUEUED, tenant=tenant)
        job.spec.CopyFrom(spec)
        job.device_index = (
            spec.options.device_index if spec.options.HasField("device_index") else -1
        )
        stamp(job.create_time)
        # Static checks of the candidate, here on the trusted side, never in its process; the
        # flags stay in job.result until finish puts them in the final result.
        late = (
            flags is None and hit is None and self.shared is None
            and not spec.options.reject_flagged
        )  # fmt: skip
        if flags is None and not late:
            flags = static_checks.check(spec)
        job.result.flags.extend(flags or [])
        self.hub.set_labels(job.job_id, spec.labels)
        event = self.hub.next_event(job.job_id)
        event.queued.position = len(self.queue)
        rejected = bool(flags) and spec.options.reject_flagged
        if hit is None and self.shared is None and not rejected:
            # Stored as the dispatch below sends it to a process, or right after it if none
            # takes it (store_new): the process starts on it while the store is written.
            self.intake.hold(job, event, key, idempotency_key)
        else:
            self.store.insert(job, event, cache_key=key, idempotency_key=idempotency_key)
            self.hub.publish(event, persisted=True)
        if rejected:
            self.intake.reject(job)
            return job
        if hit is not None:
            self.metrics.result_cache.labels("hit").inc()
            self.intake.answer(job, hit, job_pb2.RESULT_ORIGIN_CACHE)
            return job
        if self.shared is not None:
            # In the shared store now (the insert NOTIFYs the nodes): a node takes it with a
            # lease. Identical jobs in flight are not shared across nodes.
            self.hub.forget(job.job_id)
            self.metrics.result_cache.labels("bypass" if not key else "miss").inc()
            log.info("job queued", extra={"job_id": job.job_id, "client_tag": spec.client_tag})
            return job
        cached = self.intake.enqueue_or_wait(job, key)
        try:
            self.dispatch()
        finally:
            self.store_new(job.job_id, as_it_is=True)
        self.metrics.result_cache.labels(cached).inc()
        log.info("job queued", extra={"job_id": job.job_id, "client_tag": spec.client_tag})
        if late:
            job.result.flags.extend(self.intake.flag_late(job.job_id, spec))
        return job

    def take(self, job: job_pb2.Job) -> None:
        """A job this node leased from the shared store (shared_queue.py) joins its queue."""
        if job.job_id not in self.queue and job.job_id not in self.running:
            self.intake.enqueue(job)

    def recover(self) -> None:
        """After a restart: queued jobs queue again; running ones re-run once or fail. (A
        shared store has no restart to recover from: nodes' leases expire instead.)"""
        if self.shared is not None:
            return
        for job in self.store.unfinished():
            self.hub.set_labels(job.job_id, job.spec.labels)
            key = self.store.cache_key(job.job_id)
            if job.state == job_pb2.JOB_STATE_QUEUED:
                self.intake.enqueue_or_wait(job, key)
                continue
            self.admission.lead_again(key, job.job_id)
            fault = job_pb2.FaultInfo(
                description=f"the front end restarted while the job ran on {job.worker_id}"
            )
            self.exits.retry_or_fail(job, fault, job_pb2.VERDICT_UNSPECIFIED, service_fault=True)
        self.dispatch()

    # ---- it goes to a job process: dispatch, start ---------------------------------------

    def dispatch(self) -> None:
        """Work to job processes. While draining (SIGTERM: main.py `_shutdown`), only what
        lets started jobs finish: their judges, launches of what was built for them, the
        load_inline builds they wait on; nothing new leaves the queue."""
        self.gpu_use.admit_waiting()
        ready = [w for w in self.job_processes.by_id.values() if w.ready]
        standing = [w for w in ready if w.judge_key]  # they judge their reference's jobs only
        ready = [w for w in ready if not w.judge_key]
        self.builds.dispatch_builds(ready, self.draining)  # build processes' work first
        ready = [w for w in ready if w.ready]
        gpu = [
            w
            for w in ready
            if w.device_index != BUILD_DEVICE and self.fleet.device_takes_jobs(w.device_index)
        ]
        # Built jobs to launch processes warm from the last one first; other jobs to fresh
        # processes first (a launch process that takes one runs its code, and then exits).
        # A job re-run alone (it ran out of memory beside others) holds its GPU: nothing else
        # starts there while it waits for the GPU to empty and while it runs.
        held = self.crowding.held_devices()
        if self.judges.queue:  # a job half done (its kernel ran) first
            self.judges.start(gpu, standing, held)
        for proc in gpu:
            if proc.device_index in held and proc.ready:
                self._start_alone(proc, held[proc.device_index])
        gpu = [w for w in gpu if w.device_index not in held]
        for proc in sorted(gpu, key=lambda w: -w.launches):
            if not proc.ready:  # a judge, or a job alone, took it above
                continue
            built = self.builds.next_launch(proc.device_index)
            if built:
                self.start(built, proc)
        for proc in sorted(gpu, key=lambda w: w.launches):
            if proc.ready and len(self.queue) and not self.draining:
                queued = self.queue.pop_for(
                    proc.device_index,
                    lambda q: (
                        not self.builds.built_ahead(q) and q.job_id not in self.crowding.alone
                    ),
                    self.fleet.device_name(proc.device_index),
                )
                if queued is not None:
                    self.start(queued.job_id, proc)
        self.metrics.queue_depth.set(len(self.queue))

    def _start_alone(self, proc: JobProcess, job_id: str) -> None:
        """Starts the job held for the process's GPU once the GPU runs nothing else."""
        if job_id in self.running or self.crowding.busy_on(proc.device_index, proc):
            return
        # It started before (and ran out of memory beside others): the same attempt, outside
        # --tenant-max-running's count again.
        queued = self.queue.pop_for(proc.device_index, lambda q: q.job_id == job_id, quota=False)
        if queued is not None:
            self.start(queued.job_id, proc)

    def start(self, job_id: str, proc: JobProcess, build_arch: str = "") -> None:
        """Starts the job on the job process: whole, as a build job (`build_arch`), or, for a job
        built ahead, its launch. A job just submitted is stored once it is sent (submit)."""
        waiting = self.running.get(job_id)  # built ahead: this is its launch
        new = self.intake.unstored(job_id)
        if new is not None:
            job: job_pb2.Job | None = waiting.job if waiting is not None else copy_job(new.job)
        else:
            job = self.store.get(job_id)
        if job is None or job.state in TERMINAL:
            return
        self.waits.started()
        prebuilt = waiting.built if waiting is not None else []
        given = self.builds.reference_built_before(job.spec, build_arch) if build_arch else []
        cached = (
            []
            if build_arch or prebuilt
            else self.builds.compile_cache.files_for(job.spec, proc.device_index)
        )
        # A compared job is judged outside its kernel's process, through its record.
        record, timed_by_judge = judging.record_for(
            job_id, job.spec, proc.hello, self.config, prebuilt, build_arch
        )
        try:
            sent = proc.assign(
                job_id,
                job.spec,
                job.attempt_count + (1 if waiting is None else 0),
                cached,
                build_arch=build_arch,
                prebuilt=prebuilt or given,
                record_fd=record.fd if record is not None else -1,
                record_max_bytes=record.max_bytes if record is not None else 0,
                share_fd=record.share_theirs if record is not None else -1,
                share_max_bytes=record.share_max_bytes if record is not None else 0,
                timed_by_judge=timed_by_judge,
            )
            if record is not None:
                record.given_to_kernel()
        except FrameError as exc:
            if record is not None:
                record.close()
            # Validation should have refused it; never leave it RUNNING on a process that
            # never got it. The process stays ready for the next job.
            reason = f"the job cannot be sent to a job process: {exc}"
            log.error(reason, extra={"job_id": job_id})
            self.store_new(job_id)
            self.finish(job, job_pb2.JOB_STATE_FAILED, job.result, reason)
            return
        try:
            self.store_new(job_id)
        except Exception:
            self.kill_lost(proc)  # it has a job the service could not keep
            raise
        if not build_arch:
            job.device_index = proc.device_index
        # A build and its launch are one attempt.
        self.mark_started(job, proc.worker_id, new_attempt=waiting is None)
        if waiting is None:
            run = self.track(job, proc, list(cached))
            run.build_arch, run.given_reference = build_arch, given
        else:
            run = waiting
            run.job, run.proc, run.phase = job, proc, 0
            run.stage, run.built = Stage.RUNNING, []
        run.record = record
        assert run.deadline is not None
        if waiting is not None:
            run.deadline.resume()
        proc.job_id = job_id
        if not build_arch:
            self.crowding.mark(run, proc)
        if self.windows.frozen(proc.device_index):
            run.deadline.pause()  # the watchdog freezes it at once: another job times
        where = {"worker_id": proc.worker_id, "device_index": proc.device_index}
        log.info("job started", extra={"job_id": job_id, **where})
        if self.watchdog is not None:
            self.spawn(self.watchdog.set_job(proc.worker_id, job_id))
        if not sent:
            self.kill_lost(proc)
            return
        if prebuilt:
            self.gpu_use.ask_early(run)
        if record is not None:
            self.judges.start_ahead(run)

    def track(
        self,
        job: job_pb2.Job,
        proc: JobProcess,
        compile_cache: list[job_channel_pb2.CacheFile] | None = None,
    ) -> Running:
        """A job that starts now: followed until it ends, its timeout running."""
        self.queue_latency.append(time.time() - job.create_time.ToNanoseconds() / 1e9)
        run = Running(
            job=job,
            proc=proc,
            timeout_s=timeout_of(job.spec, self.max_timeout_s),
            compile_cache=compile_cache or [],
        )
        self.running[job.job_id] = run
        self.metrics.running.set(len(self.running))
        run.deadline = Deadline(
            asyncio.get_running_loop(), run.timeout_s, lambda: self.on_deadline(job.job_id)
        )
        return run

    def mark_started(self, job: job_pb2.Job, worker_id: str, new_attempt: bool) -> None:
        """The job RUNNING on `worker_id` (a new attempt: counted, its start stamped): its
        `started` event, stored and published."""
        job.state = job_pb2.JOB_STATE_RUNNING
        if new_attempt:
            job.attempt_count += 1
            stamp(job.start_time)
        job.worker_id = worker_id
        event = self.hub.next_event(job.job_id)
        event.started.worker_id = worker_id
        event.started.device_index = job.device_index
        event.started.attempt = job.attempt_count
        self.store.update(job, event)
        self.hub.publish(event, persisted=True)

    # ---- its process answers: on_outcome (what else it says: messages.py) ----------------

    def on_outcome(self, proc: JobProcess, outcome: job_channel_pb2.JobOutcome) -> None:
        """Its process answered: its judge is next (its kernel ran OK and handed over), or it
        ends, once what its result may still carry is in (an XID, its window's reading)."""
        run = self.running.get(outcome.job_id)
        if self.judges.answers_ahead(proc, outcome.job_id, run):  # the job left it
            self.judges.ahead_answered(proc, outcome)
            return
        if run is None or run.proc is not proc:
            return
        run.outcome = outcome
        self.builds.keep_compiled(run, outcome)
        self.gpu_use.learn(run, outcome)
        judge = run.judged_now
        if judge:
            self.judges.judged(run, outcome)
        else:  # only a judge given an earlier job's time of the reference says its age
            outcome.result.ClearField("reference_runtime_age")
            judging.timed_by_itself(outcome.result)
        self.processes.after_outcome(proc, run, outcome, judge)
        if (
            run.record is not None
            and run.record.kernel_outcome is None
            and outcome.result.verdict == job_pb2.VERDICT_OK
            and not outcome.context_poisoned
        ):
            self.judges.await_judge(run, outcome)
            if run.job.job_id in self.builds.launched:
                # A launch process stays, for the next launch; it ran no job's host code and
                # let go of the record and its socket before it answered.
                self.judges.kernel_exited(run)
            self.dispatch()
            return
        result = outcome.result
        if run.record is not None and run.record.kernel_outcome is None:
            judging.unjudged(result)
        wait = self.config.effective_xid_wait_s()
        if (
            outcome.context_poisoned
            and result.verdict == job_pb2.VERDICT_DEVICE_FAULT
            and run.xid is None
            and wait > 0
        ):
            # NVML reports the XID up to ~2 s after the fault: give the result a chance to
            # carry it. Its process is already out of the pool, so no other job waits on this.
            run.outcome_wait = asyncio.get_running_loop().call_later(
                wait, self._finish_outcome, outcome.job_id
            )
        elif run.window is not None and not run.window.closed.is_set():
            self.spawn(self._finish_outcome_after_window(run))
        else:
            self._finish_outcome(outcome.job_id)
        self.dispatch()

    async def _finish_outcome_after_window(self, run: Running) -> None:
        """The result says how the GPU was when its window closed: wait for that reading."""
        assert run.window is not None
        try:
            await asyncio.wait_for(run.window.closed.wait(), WATCHDOG_REPLY_S + 1)
        except asyncio.TimeoutError:
            pass
        self._finish_outcome(run.job.job_id)

    def _finish_outcome(self, job_id: str) -> None:
        run = self.running.get(job_id)
        if run is None or run.outcome is None:
            return
        result = job_pb2.EvalResult()
        result.CopyFrom(run.outcome.result)
        if self._retry_alone(run, result):
            return
        self.finish(run.job, job_pb2.JOB_STATE_DONE, endings.from_outcome(run, result))

    def _retry_alone(self, run: Running, result: job_pb2.EvalResult) -> bool:
        """A job that ran out of GPU memory while other jobs held some of it ran on a GPU
        that was not its own: it runs again, once, with the GPU to itself, in the same attempt.
        Attempts (--max-attempts) count losses (a dead node, a lost process); the crowding was
        the service's doing, and must neither be stopped by a loss before it nor use up the
        retry of a loss after it (both seen on two H100s with a node killed)."""
        if not self.crowding.runs_alone(run, result):
            return False
        job = run.job
        self.running.pop(job.job_id, None)
        self.judges.drop_record(run)
        self.processes.let_go(run, completed=True)
        self.hub.log(
            job.job_id,
            "kerneleval: ran out of GPU memory while other jobs held some of it: runs again "
            f"with GPU {job.device_index} to itself (still attempt {job.attempt_count})",
        )
        # Which allocation failed, and what the GPU held then: what a re-run alone costs a
        # batch (its GPU takes no new job until it ends) is worth finding the cause of.
        why = (result.error.message or result.compilation_error).strip().splitlines()
        log.info(
            "job re-run alone after running out of memory",
            extra={"job_id": job.job_id, "why": why[0][:300] if why else "",
                   "gpus": self.waits.gpus()},
        )  # fmt: skip
        job.attempt_count -= 1  # the run alone is the same attempt
        self.requeue(job)
        self.dispatch()
        return True

    def on_protocol_violation(self, proc: JobProcess, what: str) -> None:
        """The job process sent what its channel does not allow: kill it; its job ends with
        a runtime error that says what it sent (not retried: the job's own code did it)."""
        proc.gone = True
        self.metrics.protocol_violations.inc()
        if self.watchdog is not None:
            self.spawn(self.watchdog.kill_worker(proc.worker_id, metrics_mod.KILL_PROTOCOL))
        run = next((r for r in self.running.values() if r.proc is proc), None)
        if run is None:
            why = f"job process {proc.worker_id} broke the protocol after its job: {what}"
            log.warning(why, extra={"worker_id": proc.worker_id})
            return
        if run.kill is Kill.CANCEL:
            return  # the kill is under way; the cancel ends the job
        result = endings.protocol_violation(run, what)
        event = self.hub.next_event(run.job.job_id)
        event.fault.CopyFrom(result.fault)
        self.hub.publish(event)
        self.finish(run.job, job_pb2.JOB_STATE_DONE, result)

    # ---- it ends: finish -----------------------------------------------------------------

    def finish(
        self,
        job: job_pb2.Job,
        state: job_pb2.JobState,
        result: job_pb2.EvalResult,
        reason: str = "",
    ) -> None:
        """Every end of a job comes here: nothing that follows it keeps it, its final result
        is made (endings.close), and whoever waits for it hears before the store has it."""
        if job.job_id in self.cut_off and state != job_pb2.JOB_STATE_CANCELLED:
            return  # it ended as the job processes stopped, past the grace: it runs again
        run = self.running.pop(job.job_id, None)
        self.builds.forget(job.job_id)
        self.crowding.alone.discard(job.job_id)
        self.judges.forget(job.job_id)
        if run is not None:
            self.judges.drop_record(run)
            self.processes.let_go(run, completed=False)
            self.run_latency.append(time.time() - job.start_time.ToNanoseconds() / 1e9)
            self.metrics.job_seconds.observe(self.run_latency[-1])
        endings.close(job, state, result, reason, self.memory_limits)
        event = self.hub.next_event(job.job_id)
        event.finished.CopyFrom(job)
        event.finished.ClearField("spec")
        if not self.endings.hand(job):
            self._stored_then_after(job, event, job.state, result)
            return
        # An Evaluate or a Compare waits for it: its task runs only once this callback
        # returns, so it answers first, from the job handed over here (finished()), and the
        # store's write, the event and the bookkeeping follow in the loop's next turn, before
        # any request that comes in meanwhile (~0.5 ms of each such call on an H100 host:
        # bench/probe/timeline_probe.py).
        asyncio.get_running_loop().call_soon(self._stored_then_after, job, event, job.state, result)

    def _stored_then_after(
        self,
        job: job_pb2.Job,
        event: job_pb2.JobEvent,
        state: job_pb2.JobState,
        result: job_pb2.EvalResult,
    ) -> None:
        """The ended job stored and its `finished` event published, then what follows: jobs
        identical to it answered or queued, its end counted, the next jobs."""
        try:
            self.store.update(job, event)
            self.hub.publish(event, persisted=True)
        finally:
            self.endings.stored(job.job_id)
            self.intake.leader_ended(job)
            self.metrics.running.set(len(self.running))
            endings.counted(job, state, result, self.metrics, self.fleet.counters)
            self.dispatch()
            if self.shared is not None:
                self.shared.claim_soon()

    # ---- or it is cancelled, runs out of time, or loses its process or its GPU -----------

    async def cancel(self, job_id: str) -> job_pb2.Job | None:
        """Cancels a queued or running job; returns it (as it ended), or None if unknown."""
        job = self.store.get(job_id)
        if job is None:
            return None
        if job.state in TERMINAL:
            return job
        if self.shared is not None and not self.shared.is_local(job_id):
            await self.shared.cancel_elsewhere(job_id, KILL_FALLBACK_S + 5)
            return self.store.get(job_id)
        if self.admission.inflight.drop_waiting(job_id):
            self.finish(job, job_pb2.JOB_STATE_CANCELLED, job.result, "cancelled by a client")
        elif self.queue.remove(job_id):
            self.metrics.queue_depth.set(len(self.queue))
            self.finish(job, job_pb2.JOB_STATE_CANCELLED, job.result, "cancelled by a client")
        else:
            run = self.running.get(job_id)
            if run is not None and run.stage in (Stage.AWAITING_LAUNCH, Stage.AWAITING_JUDGE):
                self.finish(
                    run.job, job_pb2.JOB_STATE_CANCELLED, job.result, "cancelled by a client"
                )
            elif run is not None and run.outcome is None and run.kill is None:
                run.kill = Kill.CANCEL
                self.exits.kill(run, metrics_mod.KILL_CANCEL)
            await self.endings.wait_finished(job_id, KILL_FALLBACK_S + 5)
        return self.store.get(job_id)

    def cancel_soon(self, job_id: str) -> None:
        """Cancels in the background (its client went away: nobody waits for the answer)."""
        self.spawn(self.cancel(job_id))

    def abandon(self, job_id: str) -> None:
        """This node lost the job's lease (another runs it now): its process is killed; what
        it still reports is not written (the store fences this node's writes)."""
        run = self.running.get(job_id)
        if run is not None and run.outcome is None and run.kill is None:
            run.kill = Kill.CANCEL
            self.exits.kill(run, metrics_mod.KILL_CANCEL)

    def on_deadline(self, job_id: str) -> None:
        """Its timeout ran out: its process is killed, and its exit ends it as timed out."""
        run = self.running.get(job_id)
        if run is None or run.outcome is not None:
            return
        if run.grant_asked_at and run.deadline is not None:
            # Waiting for the GPU (its memory, or other jobs' checks and windows) is not the
            # job's time: the wait so far goes onto its deadline (the grant adds the rest).
            now = asyncio.get_running_loop().time()
            run.deadline.push(now - run.grant_asked_at)
            run.grant_asked_at = now
            return
        run.kill = Kill.TIMEOUT
        self.exits.kill(run, metrics_mod.KILL_TIMEOUT)

    def process_exited(self, proc: JobProcess, exited: watchdog_pb2.WorkerExited) -> None:
        """A job process exited (out of the table already): what it held goes back (its GPU
        grant and memory), an extension build it ran is lost, its job ends or retries."""
        self.gate.release(proc.device_index, proc.worker_id)
        self.memory.release(proc.device_index, proc.worker_id)
        self.gpu_use.waiting.pop(proc.worker_id, None)
        self.builds.process_exited(proc, exited)
        for run in list(self.running.values()):
            if run.kernel_proc is proc:
                self.judges.kernel_exited(run)
            if run.ahead is proc:  # its judge starts afresh once its kernel is done
                run.ahead = None
            if run.proc is proc:
                self.exits.before_outcome(run, exited)

    def attribute_xid(self, x: watchdog_pb2.XidObserved) -> None:
        """An XID (recorded by fleet/devices.py): the jobs it belongs to carry it; one whose
        outcome waited for it ends now."""
        for run, sure in xid_suspects(self.running.values(), x):
            run.xid = faults.XidSeen(x.xid, x.category, x.message, named=sure)
            if run.outcome is not None:
                self._finish_outcome(run.job.job_id)

    # ---- the service around it -----------------------------------------------------------

    def serving(self) -> bool:
        """The health check: not draining, and a device serves (fleet/devices.py)."""
        return not self.draining and self.fleet.serving()

    def start_watching_waits(self) -> None:
        """From here on, every job's wait is named and bounded (jobs/waits.py)."""
        self.waits.start()

    # What judging.py and gpu_use.py ask of the crowding and the builds (their Protocols).

    @property
    def launched(self) -> set[str]:
        return self.builds.launched

    @property
    def alone(self) -> set[str]:
        return self.crowding.alone

    def held_devices(self) -> dict[int, str]:
        return self.crowding.held_devices()

    def busy_on(self, device: int, but: JobProcess | None = None) -> bool:
        return self.crowding.busy_on(device, but)
