"""The shared artifact store's part of the job store (schema step 5), on both engines: artifacts
by content key, build requests leased by builders, the builders' list."""

from __future__ import annotations

import time

from kerneleval_server.jobs.store import JobStore
from kerneleval_server.jobs.store.base import (
    BUILD_FAILED,
    LOST_BUILDER_KEPT_S,
    MAX_BUILD_ATTEMPTS,
)

V1, V2 = "torch 2.11|cuda 13.0|g++|nvcc|recipe 3", "torch 2.12|cuda 13.0|g++|nvcc|recipe 3"


def test_artifacts_are_kept_once_by_key_and_dropped_when_unused(store: JobStore) -> None:
    assert store.artifact("k1") is None
    store.request_build("k1", V1, "sm_90", "{}", "node-a")
    store.put_artifact("k1", b"\x00first", V1, "builder-1")
    store.put_artifact("k1", b"second", V1, "node-b")  # a key builds to one thing: the first
    assert store.artifact("k1") == (b"\x00first", "builder-1")
    assert store.build_request("k1") is None  # done with it
    assert store.forget_artifacts_before(time.time() - 60) == 0
    assert store.forget_artifacts_before(time.time() + 60) == 1
    assert store.artifact("k1") is None


def test_build_requests_are_leased_by_versions_renewed_and_ended(store: JobStore) -> None:
    store.request_build("k1", V1, "sm_90", '{"name": "a"}', "node-a")
    store.request_build("k1", V1, "sm_90", '{"name": "a"}', "node-b")  # joins: one request
    store.request_build("k2", V2, "sm_80", '{"name": "b"}', "node-c")
    assert sorted(store.waiting_builds()) == [(V1, 1), (V2, 1)]
    assert store.claim_builds("b1", V1, 5, 30.0) == [("k1", "sm_90", '{"name": "a"}')]
    assert store.claim_builds("b2", V1, 5, 30.0) == []  # held; V2's is not for V1
    held = store.build_request("k1")
    assert held is not None and held.held(time.time()) and held.attempts == 1
    assert store.renew_builds("b1", 30.0) == {"k1"} and store.renew_builds("b2", 30.0) == set()
    assert store.waiting_builds() == [(V2, 1)]
    store.drop_build_request("k1")  # a live builder holds it: kept
    assert store.build_request("k1") is not None
    store.end_build("k1", "b2", BUILD_FAILED, "not its to end")
    assert store.build_request("k1").state == ""  # type: ignore[union-attr]
    store.end_build("k1", "b1", BUILD_FAILED, "the build process exited")
    ended = store.build_request("k1")
    assert ended is not None and ended.state == BUILD_FAILED and not ended.lease_builder
    assert ended.error == "the build process exited"
    assert store.claim_builds("b2", V1, 5, 30.0) == []  # ended: nobody takes it again
    store.drop_build_request("k1")
    assert store.build_request("k1") is None


def test_an_expired_lease_is_taken_again_a_few_times_at_most(store: JobStore) -> None:
    store.request_build("k", V1, "", "{}", "node-a")
    for attempt in range(1, MAX_BUILD_ATTEMPTS + 1):
        assert [r[0] for r in store.claim_builds(f"b{attempt}", V1, 1, -1.0)] == ["k"]
        request = store.build_request("k")
        assert request is not None and request.attempts == attempt
        assert not request.held(time.time())  # expired at once (the builder "died")
    assert store.claim_builds("b9", V1, 1, 30.0) == []
    store.drop_build_request("k")  # its requester builds it: expired, so it goes
    assert store.build_request("k") is None
    # A builder that stops gives back what it took and had not started, attempt uncounted.
    store.request_build("k3", V1, "", "{}", "node-a")
    assert store.claim_builds("b1", V1, 1, 30.0)
    store.release_builds("b1", ["k3"])
    again = store.build_request("k3")
    assert again is not None and not again.lease_builder and again.attempts == 0


def test_builders_register_and_expire(store: JobStore) -> None:
    store.register_builder("b1", "10.0.0.1:50051", V1, 6, 30.0)
    store.register_builder("b2", "10.0.0.2:50051", V2, 2, -1.0)  # already expired
    store.register_builder("b1", "10.0.0.1:50052", V1, 8, 30.0)  # again: updated
    (b,) = store.builders()
    assert (b.builder_id, b.address, b.versions, b.slots, b.built) == (
        "b1", "10.0.0.1:50052", V1, 8, 0,
    )  # fmt: skip
    store.put_artifact("k", b"lib", V1, "b1")
    assert store.builders()[0].built == 1
    store.forget_builder("b1")
    assert store.builders() == []


def test_list_builders_counts_their_requests_and_keeps_the_lost_a_while(store: JobStore) -> None:
    assert store.list_builders() == []  # no builder (the SQLite store of --role all: always)
    before = time.time()
    store.register_builder("b1", "10.0.0.1:50051", V1, 6, 30.0)
    store.register_builder("b2", "10.0.0.2:50051", V1, 2, 30.0)
    store.register_builder("lost", "10.0.0.3:50051", V2, 4, -5.0)  # ran out 5 s ago
    store.register_builder("long-gone", "", V2, 4, -LOST_BUILDER_KEPT_S - 60)
    for key, versions in (("k1", V1), ("k2", V1), ("k3", V1), ("k4", V2)):
        store.request_build(key, versions, "sm_90", "{}", "node-a")
    assert len(store.claim_builds("b1", V1, 2, 30.0)) == 2  # b1 holds two, one V1 left free
    listed = {s.builder.builder_id: s for s in store.list_builders()}
    assert sorted(listed) == ["b1", "b2", "lost"]  # the long-gone one is dropped
    b1, b2, lost = listed["b1"], listed["b2"], listed["lost"]
    assert (b1.leased, b1.waiting, b2.leased, b2.waiting) == (2, 1, 0, 1)
    assert (lost.leased, lost.waiting) == (0, 1)  # V2's request: nobody of V2 holds it
    assert before <= b1.builder.heartbeat <= time.time() < b1.builder.expires
    assert lost.builder.expires < time.time() and lost.builder.slots == 4
    assert (b1.builder.address, b1.builder.versions, b1.builder.slots) == ("10.0.0.1:50051", V1, 6)
    # What nodes ask builders of: the live ones only.
    assert [b.builder_id for b in store.builders()] == ["b1", "b2"]
    # An ended request is nobody's to take; a lease that ran out makes its request free again.
    store.end_build("k1", "b1", BUILD_FAILED, "the build process exited")
    store.renew_builds("b1", -1.0)  # b1's other lease runs out (as when b1 is lost)
    listed = {s.builder.builder_id: s for s in store.list_builders()}
    assert (listed["b1"].leased, listed["b1"].waiting) == (0, 2)  # k2 and k3, k1 ended
    store.forget_builder("b2")  # stopped normally: gone at once
    assert [s.builder.builder_id for s in store.list_builders()] == ["b1", "lost"]
