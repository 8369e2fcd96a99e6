"""kerneleval server: front end, job store, scheduler, worker runtime and kernel backends."""

import os

# gRPC reads its experiments once, as it loads: set here, before any module of the server
# imports grpc. Without its EventEngine listener, a server connection's reads are polled by
# the thread that serves grpc.aio's completion queue, not handed from an EventEngine poller
# to a worker thread and on to it: two thread wake-ups fewer per request, up to 0.5 ms of a
# paced Evaluate on an H100 host (bench/README.md, "latency-trims"). An operator's own
# GRPC_EXPERIMENTS wins.
GRPC_EXPERIMENTS = "-event_engine_listener"
os.environ.setdefault("GRPC_EXPERIMENTS", GRPC_EXPERIMENTS)
