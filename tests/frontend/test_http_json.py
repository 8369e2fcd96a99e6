"""HTTP/JSON (Connect) with `curl` against a real service (--http-port, workers on the CPU).

The bodies are written by hand in the proto3 JSON mapping, as a person with curl would; the
streaming calls use the Connect streaming protocol (an envelope: 1 flag byte, a 4-byte
big-endian length, the JSON; the last one, flag 2, is the end-of-stream message).
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fe_kernels as k
import pytest
from google.rpc import error_details_pb2
from ke_service import REPO, ServiceProcess, free_port
from kerneleval.v1 import kernel_eval_service_pb2, kernel_pb2

pytest.importorskip("connectrpc", reason="connectrpc (Python >= 3.11) serves --http-port")
pytest.importorskip("kerneleval.v1.kernel_eval_service_connect", reason="`make gen` makes it")
if shutil.which("curl") is None:
    pytest.skip("curl is not installed", allow_module_level=True)

KES = "kerneleval.v1.KernelEvalService"
OPS = "kerneleval.v1.OperationsService"
SPEC = {
    "kernel": {"type": "KERNEL_TYPE_TORCH", "sourceCode": k.GOOD},
    "options": {"correctTrialCount": 1, "perfTrialCount": 3, "warmupCount": 1},
}
END_STREAM = 0x02


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    root = tmp_path_factory.mktemp("http-json")
    http_port = free_port()
    service = ServiceProcess(root / "state", ["--nvml", "none", "--http-port", str(http_port)])
    service.http_url = f"http://127.0.0.1:{http_port}"  # type: ignore[attr-defined]
    try:
        service.start()
        yield service
    finally:
        service.stop()


class Reply:
    def __init__(self, status: int, content_type: str, body: bytes) -> None:
        self.status, self.content_type, self.body = status, content_type, body

    def json(self) -> Any:
        return json.loads(self.body)

    def frames(self) -> list[tuple[int, Any]]:
        """A streaming response's envelopes: (flags, JSON)."""
        out, pos = [], 0
        while pos < len(self.body):
            flags, size = struct.unpack(">BI", self.body[pos : pos + 5])
            out.append((flags, json.loads(self.body[pos + 5 : pos + 5 + size])))
            pos += 5 + size
        assert pos == len(self.body), self.body[-200:]
        return out


def curl(
    tmp_path: Path,
    url: str,
    body: bytes,
    content_type: str = "application/json",
    headers: tuple[str, ...] = (),
    extra: tuple[str, ...] = (),
    max_time: float = 60,
) -> Reply:
    """POST `body` (from a file, as `--data-binary @file`) with the curl command."""
    request, response = tmp_path / "request.bin", tmp_path / "response.bin"
    request.write_bytes(body)
    response.unlink(missing_ok=True)
    command = ["curl", "-sS", "--max-time", str(max_time), "-o", str(response)]
    command += ["-w", "%{http_code} %{content_type}", "-H", f"Content-Type: {content_type}"]
    for header in headers:
        command += ["-H", header]
    command += [*extra, "--data-binary", f"@{request}", url]
    done = subprocess.run(command, capture_output=True, text=True, timeout=max_time + 10)
    status, _, ctype = done.stdout.partition(" ")
    body_out = response.read_bytes() if response.exists() else b""
    return Reply(int(status or 0), ctype, body_out)


def envelope(message: dict[str, Any]) -> bytes:
    data = json.dumps(message).encode()
    return struct.pack(">BI", 0, len(data)) + data


def events_of(reply: Reply) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The data messages and the end-of-stream message of a Connect stream."""
    assert reply.status == 200 and reply.content_type == "application/connect+json", reply.body
    frames = reply.frames()
    assert frames and frames[-1][0] == END_STREAM, frames
    assert all(flags == 0 for flags, _ in frames[:-1])
    return [m for _, m in frames[:-1]], frames[-1][1]


def test_evaluate_and_get_job(svc: ServiceProcess, tmp_path: Path) -> None:
    url = svc.http_url  # type: ignore[attr-defined]
    body = json.dumps({"spec": {**SPEC, "clientTag": "http"}}).encode()
    reply = curl(tmp_path, f"{url}/{KES}/Evaluate", body)
    assert (reply.status, reply.content_type) == (200, "application/json"), reply.body
    job = reply.json()["job"]
    assert job["state"] == "JOB_STATE_DONE" and job["result"]["verdict"] == "VERDICT_OK", job
    assert job["spec"]["clientTag"] == "http"
    assert job["result"]["runtime"]["trialCount"] == 3  # lowerCamelCase names
    again = curl(tmp_path, f"{url}/{KES}/GetJob", json.dumps({"jobId": job["jobId"]}).encode())
    assert again.status == 200 and again.json()["job"]["jobId"] == job["jobId"]


def test_client_mistakes_are_4xx_with_connect_codes(svc: ServiceProcess, tmp_path: Path) -> None:
    url = svc.http_url  # type: ignore[attr-defined]
    # A JobSpec without a kernel: the servicer's INVALID_ARGUMENT, message and details kept.
    reply = curl(tmp_path, f"{url}/{KES}/Evaluate", b'{"spec": {"clientTag": "x"}}')
    assert reply.status == 400, reply.body
    error = reply.json()
    assert error["code"] == "invalid_argument" and "spec.kernel" in error["message"], error
    assert [d["type"] for d in error["details"]] == ["google.rpc.BadRequest"]
    # The details as JSON too, and the fields named as the JSON request named them.
    body = b'{"spec": {"kernel": {"type": "KERNEL_TYPE_TORCH"}, "options": {"perfTrialCount": -1}}}'
    error = curl(tmp_path, f"{url}/{KES}/Evaluate", body).json()
    assert error["message"] == (
        "invalid JobSpec: spec.kernel.sourceCode: required; "
        "spec.options.perfTrialCount: must be in [0, 10000]"
    ), error
    (detail,) = error["details"]
    assert detail["debug"] == {"fieldViolations": [
        {"field": "spec.kernel.sourceCode", "description": "required"},
        {"field": "spec.options.perfTrialCount", "description": "must be in [0, 10000]"},
    ]}  # fmt: skip
    bad = error_details_pb2.BadRequest.FromString(base64.b64decode(detail["value"] + "=="))
    assert [v.field for v in bad.field_violations][0] == "spec.kernel.sourceCode"
    # A binary (protobuf) request keeps the proto's own names.
    request = kernel_eval_service_pb2.EvaluateRequest()
    request.spec.kernel.type = kernel_pb2.KERNEL_TYPE_TORCH
    reply = curl(
        tmp_path, f"{url}/{KES}/Evaluate", request.SerializeToString(), "application/proto"
    )
    assert reply.status == 400 and "spec.kernel.source_code: required" in reply.json()["message"]
    # JSON that is not JSON, and a wrong type for a field: the Connect layer's own refusal.
    for body in (b'{"spec": ', b'{"spec": {"kernel": {"type": 3.5}}}'):
        reply = curl(tmp_path, f"{url}/{KES}/Submit", body)
        assert (reply.status, reply.json()["code"]) == (400, "invalid_argument"), reply.body
    reply = curl(tmp_path, f"{url}/{KES}/GetJob", b'{"jobId": "no-such-job"}')
    assert (reply.status, reply.json()["code"]) == (404, "not_found"), reply.body
    reply = curl(tmp_path, f"{url}/{KES}/NoSuchMethod", b"{}")
    assert reply.status == 404
    reply = curl(tmp_path, f"{url}/{KES}/GetJob", b"{}", content_type="text/plain")
    assert reply.status == 415


def test_list_devices_needs_the_admin_token(svc: ServiceProcess, tmp_path: Path) -> None:
    url = f"{svc.http_url}/{OPS}/ListDevices"  # type: ignore[attr-defined]
    for headers in ((), ("Authorization: Bearer wrong",)):
        reply = curl(tmp_path, url, b"{}", headers=headers)
        assert reply.status == 401, reply.body
        assert reply.json()["code"] == "unauthenticated"
        assert "admin token" in reply.json()["message"]
    reply = curl(tmp_path, url, b"{}", headers=(f"Authorization: Bearer {svc.admin_token}",))
    assert reply.status == 200, reply.body
    (cpu,) = reply.json()["devices"]
    assert cpu["name"] == "cpu" and cpu["health"] == "DEVICE_HEALTH_HEALTHY", cpu


def test_run_and_watch_stream_events(svc: ServiceProcess, tmp_path: Path) -> None:
    url = svc.http_url  # type: ignore[attr-defined]
    body = envelope({"spec": {**SPEC, "clientTag": "http-run"}})
    messages, end = events_of(curl(tmp_path, f"{url}/{KES}/Run", body, "application/connect+json"))
    assert end == {}, end  # no error
    events = [m["event"] for m in messages]
    assert [int(e["sequence"]) for e in events] == list(range(1, len(events) + 1))  # int64: str
    assert "queued" in events[0] and "finished" in events[-1], events
    assert events[-1]["finished"]["result"]["verdict"] == "VERDICT_OK"  # the Job
    job_id = events[0]["jobId"]
    # Watch replays the events after a sequence number, then ends with the job.
    body = envelope({"jobId": job_id, "afterSequence": "1"})
    reply = curl(tmp_path, f"{url}/{KES}/Watch", body, "application/connect+json")
    messages, end = events_of(reply)
    assert end == {} and [m["event"] for m in messages] == events[1:]
    # An error in a stream is its end-of-stream message (the HTTP status is 200).
    body = envelope({"jobId": "no-such-job"})
    messages, end = events_of(
        curl(tmp_path, f"{url}/{KES}/Watch", body, "application/connect+json")
    )
    assert messages == [] and end["error"]["code"] == "not_found", end


def test_the_readme_examples_run_as_written(svc: ServiceProcess, tmp_path: Path) -> None:
    """The README's HTTP/JSON examples, run by bash from a folder with the repository's proto/
    and the service's state/, as a person would after `make serve` (the line that starts the
    service is the only one left out; the port is this service's)."""
    buf = Path(sys.executable).with_name("buf")
    if shutil.which("jq") is None or not buf.exists():
        pytest.skip("the examples use jq and buf (buf-bin, in .venv after make)")
    readme = (REPO / "README.md").read_text()
    section = readme.split("### HTTP/JSON (Connect)", 1)[1].split("\n### ", 1)[0]
    blocks = re.findall(r"```sh\n(.*?)```", section, flags=re.S)
    script = "".join(blocks).replace("8080", svc.http_url.rsplit(":", 1)[1])  # type: ignore[attr-defined]
    lines = [ln for ln in script.splitlines() if not ln.startswith("KERNELEVAL_HTTP_PORT=")]
    (tmp_path / "proto").symlink_to(REPO / "proto")
    (tmp_path / "state").symlink_to(svc.state_dir)
    env = {**os.environ, "PATH": f"{buf.parent}:{os.environ['PATH']}"}
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", "\n".join(lines)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr + done.stdout
    out = done.stdout
    assert '"verdict": "VERDICT_OK"' in out and '"timing": "TIMING_SOURCE_CPU_WALL_CLOCK"' in out
    assert "JOB_STATE_" in out and '"field": "spec.kernel.sourceCode"' in out
    assert '{"index":-1,"name":"cpu","health":"DEVICE_HEALTH_HEALTHY"}' in out
    assert '"phase":{"phase":"PHASE_PROFILING"}' in out and '"verdict":"VERDICT_OK"}' in out
    assert (
        '{"requestTag":"b","verdict":null,"error":"invalid JobSpec: spec.kernel: required"}' in out
    )
    assert '{"requestTag":"a","verdict":"VERDICT_OK","error":null}' in out


@pytest.mark.parametrize("http2", [False, True], ids=["http1.1", "http2"])
def test_run_batch(svc: ServiceProcess, tmp_path: Path, http2: bool) -> None:
    """Over HTTP/1.1 the submissions are the whole request body (half duplex); HTTP/2 (h2c)
    carries the bidirectional stream as it is."""
    url = svc.http_url  # type: ignore[attr-defined]
    body = b"".join(
        envelope(m)
        for m in (
            {"spec": SPEC, "requestTag": "a"},
            {"spec": {"clientTag": "no kernel"}, "requestTag": "bad"},
            {"spec": {**SPEC, "clientTag": "b"}, "requestTag": "b"},
        )
    )
    extra = ("--http2-prior-knowledge",) if http2 else ()
    reply = curl(tmp_path, f"{url}/{KES}/RunBatch", body, "application/connect+json", extra=extra)
    messages, end = events_of(reply)
    assert end == {}, end
    finished = {m["requestTag"] for m in messages if "finished" in m.get("event", {})}
    assert finished == {"a", "b"}, messages
    (refused,) = [m for m in messages if "error" in m]
    assert refused["requestTag"] == "bad" and refused["error"]["code"] == 3  # INVALID_ARGUMENT


def test_a_client_that_goes_away_cancels_its_run(svc: ServiceProcess, tmp_path: Path) -> None:
    url = svc.http_url  # type: ignore[attr-defined]
    spec = {**SPEC, "kernel": {"type": "KERNEL_TYPE_TORCH", "sourceCode": k.HANG}}
    spec["options"] = {**SPEC["options"], "timeout": "120s"}  # a Duration is a string
    body = envelope({"spec": spec})
    reply = curl(tmp_path, f"{url}/{KES}/Run", body, "application/connect+json", max_time=3)
    job_id = reply.frames()[0][1]["event"]["jobId"]  # curl gave up: no end-of-stream
    deadline = time.monotonic() + 20
    while True:
        got = curl(tmp_path, f"{url}/{KES}/GetJob", json.dumps({"jobId": job_id}).encode())
        if got.json()["job"]["state"] == "JOB_STATE_CANCELLED" or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert got.json()["job"]["state"] == "JOB_STATE_CANCELLED", got.json()


def test_https_with_the_grpc_certificate(tmp_path: Path) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: no test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    http_port = free_port()
    service = ServiceProcess(
        tmp_path / "state",
        ["--nvml", "none", "--warm-spare", "false", "--http-port", str(http_port),
         "--tls-cert", str(cert), "--tls-key", str(key)],
    )  # fmt: skip
    service.tls_root = cert.read_bytes()
    try:
        service.start(wait_serving=False)
        url = f"https://127.0.0.1:{http_port}/{KES}/GetJob"
        reply = curl(tmp_path, url, b'{"jobId": "x"}', extra=("--cacert", str(cert)))
        assert (reply.status, reply.json()["code"]) == (404, "not_found"), reply.body
        plain = curl(tmp_path, url.replace("https:", "http:"), b'{"jobId": "x"}', max_time=5)
        assert plain.status != 404  # no plain HTTP on the TLS port
    finally:
        service.stop()
