"""Conventions a running service keeps (issue 17): reflection under v1 and v1alpha, a log of
JSON lines only (the watchdog's lines included), the metric families docs/OPERATIONS.md lists.
One shared service (tests/conftest.py)."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import grpc
import kerneleval
import pytest
from google.protobuf import descriptor_pool
from grpc_reflection.v1alpha import reflection_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from ke_service import ServiceProcess
from prometheus_client.parser import text_string_to_metric_families
from test_conventions import exported

SERVICES = ("kerneleval.v1.KernelEvalService", "kerneleval.v1.OperationsService")
REFLECTION = {
    "v1": "grpc.reflection.v1.ServerReflection",
    "v1alpha": "grpc.reflection.v1alpha.ServerReflection",
}


class _Stub:
    """ServerReflectionInfo of one protocol version (v1's messages are v1alpha's bytes)."""

    def __init__(self, channel: grpc.Channel, service: str) -> None:
        self.ServerReflectionInfo = channel.stream_stream(
            f"/{service}/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )


@pytest.mark.parametrize("version", sorted(REFLECTION))
def test_reflection_answers_v1_and_v1alpha(
    kerneleval_service: ServiceProcess, version: str
) -> None:
    with kerneleval_service.channel() as channel:
        # grpcio-reflection's client (what tools built on it do), on the chosen protocol.
        db = ProtoReflectionDescriptorDatabase(channel)
        db._stub = _Stub(channel, REFLECTION[version])  # type: ignore[assignment]
        names = set(db.get_services())
        assert {*SERVICES, *REFLECTION.values(), "grpc.health.v1.Health"} <= names
        pool = descriptor_pool.DescriptorPool(db)
        evaluate = pool.FindServiceByName(SERVICES[0]).FindMethodByName("Evaluate")
        assert evaluate.input_type.full_name == "kerneleval.v1.EvaluateRequest"
        assert "spec" in evaluate.input_type.fields_by_name  # its file and dependencies came
        # The reflection service describes itself under its own name.
        reflect = pool.FindServiceByName(REFLECTION[version])
        assert reflect.FindMethodByName("ServerReflectionInfo").client_streaming


def test_a_name_the_service_lacks_is_unimplemented(kerneleval_service: ServiceProcess) -> None:
    with kerneleval_service.channel() as channel:
        call = _Stub(channel, "grpc.reflection.v2.ServerReflection").ServerReflectionInfo
        with pytest.raises(grpc.RpcError) as err:
            list(call(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_service_log_is_json_lines_with_the_watchdogs(kerneleval_service: ServiceProcess) -> None:
    records: list[dict[str, Any]] = []
    for line in kerneleval_service.log_path.read_text(errors="replace").splitlines():
        if line.strip():
            record = json.loads(line)  # fails on a plain-text line
            assert {"time", "level", "logger", "message"} <= record.keys(), line
            records.append(record)
    watchdog = [r["message"] for r in records if r["logger"] == "kerneleval.watchdog"]
    assert any(m.startswith("zygote of device 0 started") for m in watchdog), watchdog[:20]
    assert not any(m.startswith("kerneleval-watchdog") for m in watchdog)  # prefix taken off
    serving = [r["message"] for r in records if " serving on " in r["message"]]
    assert serving and serving[0].startswith(f"kerneleval {kerneleval.__version__} serving on ")


def test_metrics_endpoint_exports_the_documented_families(
    kerneleval_service: ServiceProcess,
) -> None:
    port = kerneleval_service.metrics_port  # type: ignore[attr-defined]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    served = {
        f"{f.name}_total" if f.type == "counter" else f.name
        for f in text_string_to_metric_families(text)
    }
    assert set(exported()) <= served
