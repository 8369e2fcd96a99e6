"""A stand-in for the C++ watchdog (stdlib + protobuf) for the front end's own end-to-end test.

It speaks watchdog.proto on --control-fd and runs job processes the way the real one does as
far as the front end can tell: each is a child with one end of a socketpair, whose other end
rides on its WorkerStarted frame (SCM_RIGHTS); it says Hello, takes one job, sends its outcome
and exits. No sandbox, no zygote, no GPU: one CPU pseudo-device, workers_per_device job-taking
processes plus spare_count spares. A job whose source contains FE_GARBAGE writes a 4 GiB frame
header on its channel instead of an outcome; one with FE_HANG sleeps.
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import socket
import sys
import time

from kerneleval.internal.v1 import job_channel_pb2, watchdog_pb2
from kerneleval.v1 import job_pb2
from kerneleval_server.framing import encode, recv_frame


def job_process(sock: socket.socket, worker_id: str) -> int:
    hello = job_channel_pb2.JobProcessMessage(hello=job_channel_pb2.Hello(worker_id=worker_id))
    sock.sendall(encode(hello.SerializeToString()))
    while True:
        frame = recv_frame(sock)
        if frame is None:
            return 0
        msg = job_channel_pb2.FrontendMessage.FromString(frame)
        if msg.HasField("assign"):
            break
    job_id, source = msg.assign.job_id, msg.assign.spec.kernel.source_code
    if "FE_GARBAGE" in source:
        sock.sendall(b"\xff\xff\xff\xff")
        time.sleep(60)
    if "FE_HANG" in source:
        time.sleep(3600)
    outcome = job_channel_pb2.JobOutcome(job_id=job_id)
    outcome.result.verdict = job_pb2.VERDICT_OK
    outcome.result.compiled = outcome.result.correctness = True
    sock.sendall(encode(job_channel_pb2.JobProcessMessage(outcome=outcome).SerializeToString()))
    return 0


class FakeWatchdog:
    def __init__(self, control: socket.socket) -> None:
        self.control = control
        self.workers: dict[int, watchdog_pb2.Worker] = {}  # by pid
        self.jobs = 1
        self.spares = 0
        self.next_id = 0
        self.running = False

    def send(self, event: watchdog_pb2.WatchdogEvent, fds: list[int] | None = None) -> None:
        frame = encode(event.SerializeToString())
        if fds:
            socket.send_fds(self.control, [frame], fds)
        else:
            self.control.sendall(frame)

    def spawn(self, spare: bool) -> None:
        self.next_id += 1
        worker_id = f"cpu-w{self.next_id}"
        front, theirs = socket.socketpair()
        pid = os.fork()
        if pid == 0:
            front.close()
            self.control.close()
            os._exit(job_process(theirs, worker_id))
        theirs.close()
        w = watchdog_pb2.Worker(worker_id=worker_id, pid=pid, device_index=-1, spare=spare)
        w.start_time_ms = int(time.time() * 1000)
        self.workers[pid] = w
        ev = watchdog_pb2.WatchdogEvent()
        ev.worker_started.worker.CopyFrom(w)
        ev.worker_started.channel_attached = True
        self.send(ev, [front.fileno()])
        front.close()

    def fill(self) -> None:
        if not self.running:
            return
        live = list(self.workers.values())
        taking = [w for w in live if not w.spare]
        spares = [w for w in live if w.spare]
        while len(taking) < self.jobs and spares:
            w = spares.pop(0)
            w.spare = False
            taking.append(w)
            self.send(
                watchdog_pb2.WatchdogEvent(
                    worker_promoted=watchdog_pb2.WorkerPromoted(worker_id=w.worker_id)
                )
            )
        for _ in range(self.jobs - len(taking)):
            self.spawn(False)
        for _ in range(self.spares - len(spares)):
            self.spawn(True)

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            w = self.workers.pop(pid, None)
            if w is None:
                continue
            ev = watchdog_pb2.WatchdogEvent()
            ev.worker_exited.worker.CopyFrom(w)
            if os.WIFSIGNALED(status):
                ev.worker_exited.exit_code = -1
                ev.worker_exited.signal = os.WTERMSIG(status)
                ev.worker_exited.reason = getattr(w, "_reason", "") or "crashed"
            else:
                ev.worker_exited.exit_code = os.WEXITSTATUS(status)
                ev.worker_exited.reason = "exited"
            ev.worker_exited.restarting = self.running
            self.send(ev)
            self.fill()

    def stop_all(self) -> None:
        for pid in list(self.workers):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def handle(self, cmd: watchdog_pb2.WatchdogCommand) -> bool:
        kind = cmd.WhichOneof("kind")
        reply = watchdog_pb2.WatchdogEvent(command_id=cmd.command_id)
        reply.ack.ok = True
        if kind == "configure":
            c = cmd.configure
            self.jobs = c.workers_per_device or 1
            self.spares = (c.spare_count or 1) if c.warm_spare else 0
            self.send(reply)
            self.send(
                watchdog_pb2.WatchdogEvent(
                    warning=watchdog_pb2.Warning(feature="pid_namespace", message="fake")
                )
            )
            self.running = True
            self.fill()
            return True
        if kind == "kill_worker":
            for pid, w in self.workers.items():
                if w.worker_id == cmd.kill_worker.worker_id:
                    os.kill(pid, signal.SIGKILL)
        elif kind == "get_status":
            reply = watchdog_pb2.WatchdogEvent(command_id=cmd.command_id)
            dev = reply.status.devices.add(device_index=-1, name="cpu")
            dev.health = watchdog_pb2.HEALTH_HEALTHY
            reply.status.workers.extend(self.workers.values())
        elif kind == "shutdown":
            self.running = False
            self.stop_all()
            self.send(reply)
            return False
        self.send(reply)
        return True

    def run(self) -> int:
        while True:
            ready, _, _ = select.select([self.control], [], [], 0.02)
            if ready:
                frame = recv_frame(self.control)
                if frame is None:
                    break
                if not self.handle(watchdog_pb2.WatchdogCommand.FromString(frame)):
                    break
            self.reap()
        self.running = False
        self.stop_all()
        return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--control-fd", type=int, required=True)
    args = parser.parse_args()
    control = socket.socket(fileno=args.control_fd)
    return FakeWatchdog(control).run()


if __name__ == "__main__":
    sys.exit(main())
