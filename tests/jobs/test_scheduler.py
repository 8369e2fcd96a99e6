"""The queue (FairQueue) and the per-GPU gate (GpuGate), alone."""

from __future__ import annotations

from kerneleval_server.jobs.scheduler import FairQueue, GpuGate, QueuedJob


def test_fair_queue_round_robin_and_devices() -> None:
    q = FairQueue()
    for i in range(3):
        q.push(QueuedJob(f"a{i}", "alice", None))
    q.push(QueuedJob("b0", "bob", None))
    q.push(QueuedJob("b1", "bob", 1))
    q.push(QueuedJob("c0", "carol", None))
    order = []
    while (j := q.pop_for(0)) is not None:
        order.append(j.job_id)
    # Clients take turns; the job pinned to device 1 waits for that device.
    assert order == ["a0", "b0", "c0", "a1", "a2"]
    assert "b1" in q and len(q) == 1
    popped = q.pop_for(1)
    assert popped is not None and popped.job_id == "b1"
    q.push(QueuedJob("x", "t", None))
    assert q.remove("x") and not q.remove("x") and len(q) == 0


def test_gpu_gate_checks_share_a_window_is_alone_per_device() -> None:
    granted: list[tuple[str, bool]] = []
    gate = GpuGate(lambda w, x: granted.append((w, x)))
    gate.request(0, "c1", False)
    gate.request(0, "c2", False)  # checks share the GPU
    gate.request(1, "t9", True)  # another device: independent
    assert granted == [("c1", False), ("c2", False), ("t9", True)]
    gate.request(0, "t1", True)  # a window waits for the checks that hold the GPU
    gate.request(0, "c3", False)  # a check that asks after a waiting window waits behind it
    assert gate.holders(0) == (None, {"c1", "c2"}) and len(granted) == 3
    gate.release(0, "c1")
    assert len(granted) == 3  # c2 still checks
    gate.request(0, "c2", True)  # c2 goes on to time: gives its share back, queues after t1
    assert granted[3:] == [("t1", True)] and gate.holders(0) == ("t1", set())
    gate.release(0, "t1")
    # In order of request: c3 (asked before c2's window), then c2's window once c3 is done.
    assert granted[4:] == [("c3", False)]
    gate.release(0, "c3")
    assert granted[5:] == [("c2", True)]
    gate.request(0, "c4", False)
    gate.release(0, "c4")  # a waiter that leaves is dropped
    gate.release(0, "c2")
    assert gate.holders(0) == (None, set()) and granted[6:] == []


def test_gpu_gate_counts_the_time_windows_are_held() -> None:
    now = [100.0]
    ended: list[tuple[int, str, float]] = []
    gate = GpuGate(lambda w, x: None, on_window=lambda d, w, s: ended.append((d, w, s)),
                   clock=lambda: now[0])  # fmt: skip
    gate.request(0, "c", False)
    now[0] += 5.0  # checks are no window
    gate.request(0, "t1", True)  # waits for the check
    now[0] += 1.0
    gate.release(0, "c")  # t1's window opens at 106
    now[0] += 2.0
    gate.release(0, "t1")
    gate.request(0, "t2", True)
    gate.request(1, "u", True)
    now[0] += 0.5
    assert ended == [(0, "t1", 2.0)]
    # the windows held now count too: 2 + 0.5 on device 0, 0.5 on device 1; a window was
    # wanted on device 0 from t1's request at 105 (it waited 1 s for the check) on
    assert gate.occupancy() == {0: (2.5, 2, 3.5), 1: (0.5, 1, 0.5)}


def test_gpu_gate_devices_on_the_hosts_cpu_time_one_at_a_time() -> None:
    """Issue 41: devices whose job processes see no GPU (fake-NVML devices on a CPU host) time
    on the same cores: one window at a time on the host, its end told for its own device;
    a device with a GPU stays independent."""
    granted: list[tuple[str, bool]] = []
    ended: list[tuple[int, str]] = []
    gate = GpuGate(
        lambda w, x: granted.append((w, x)), on_window=lambda d, w, s: ended.append((d, w))
    )
    for device in (0, 1):
        gate.share_host(device)
    assert gate.on_host(0) and gate.on_host(1) and not gate.on_host(2)
    gate.request(0, "a", True)
    gate.request(1, "b", True)  # another device of the host: waits for a's window
    gate.request(2, "g", True)  # a device with a GPU: independent
    assert granted == [("a", True), ("g", True)]
    assert gate.holders(1) == ("a", set())
    gate.release(0, "a")
    assert granted[2:] == [("b", True)] and ended == [(0, "a")]
    gate.request(0, "c", False)  # a check on the host waits for the window too
    assert len(granted) == 3
    gate.release(1, "b")
    assert granted[3:] == [("c", False)] and ended[1:] == [(1, "b")]
    # A device whose own gate is in use joins the host's gate once it is idle.
    gate.request(3, "d", True)
    gate.share_host(3)
    assert not gate.on_host(3)
    gate.release(3, "d")
    gate.share_host(3)
    assert gate.on_host(3)


def test_gpu_gate_is_fair_to_windows_under_a_stream_of_checks() -> None:
    """Checks that keep coming never starve a window, and windows never starve checks."""
    granted: list[str] = []
    gate = GpuGate(lambda w, x: granted.append(w))
    gate.request(0, "c0", False)
    gate.request(0, "t0", True)
    for i in range(1, 4):
        gate.request(0, f"c{i}", False)
    gate.request(0, "t1", True)
    gate.request(0, "c4", False)
    for holder in ("c0", "t0", "c1", "c2", "c3", "t1", "c4"):
        gate.release(0, holder)
    assert granted == ["c0", "t0", "c1", "c2", "c3", "t1", "c4"]
