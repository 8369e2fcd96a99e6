"""deploy/kubernetes: every kustomization renders (kustomize_lite.py), every resource is valid
against the Kubernetes schemas (kubernetes-validate, offline, strict: no unknown field), and the
manifests agree with the code: settings the service has, ports, probes, selectors, secrets."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
from kerneleval_server import config as config_mod
from kerneleval_server import host_memory
from kerneleval_server.main import build_parser
from kustomize_lite import pod_specs, render

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
BASE = KUBE / "base"
OVERLAYS = sorted(p.parent for p in (KUBE / "overlays").glob("*/kustomization.yaml"))
# gRPC probes are GA from 1.27: the oldest Kubernetes DEPLOY.md supports, and the newest schemas.
VERSIONS = ("1.27.0", kubernetes_validate.utils.latest_version())
SECRET = "kerneleval"
SECRET_KEYS = {"admin-token", "store-url", "postgres-password"}
# Values the Secret would give, for parsing the service's settings.
SECRET_VALUES = {"store-url": "postgresql://u:p@db:5432/kerneleval", "admin-token": "ket_x"}

# The Prometheus Operator's PodMonitor is not in the Kubernetes schemas: the fields used here,
# from its CRD (monitoring.coreos.com/v1), strictly.
PODMONITOR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PodMonitor"},
        "metadata": {"type": "object"},
        "spec": {
            "type": "object",
            "required": ["selector", "podMetricsEndpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "matchLabels": {"type": "object"},
                        "matchExpressions": {"type": "array"},
                    },
                },
                "podMetricsEndpoints": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                        },
                    },
                },
            },
        },
    },
}


def kustomizations() -> list[Path]:
    return [BASE, *OVERLAYS]


@pytest.fixture(scope="module", params=kustomizations(), ids=lambda p: p.name)
def rendered(request: pytest.FixtureRequest) -> tuple[Path, list[dict[str, Any]]]:
    return request.param, render(request.param)


def find(resources: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (hit,) = [r for r in resources if r["kind"] == kind and r["metadata"]["name"] == name]
    return hit


def test_the_overlays_are_there() -> None:
    assert {p.name for p in OVERLAYS} >= {
        "example-postgres", "gpu-reset", "prometheus-operator", "builder-autoscaling",
    }  # fmt: skip


def test_valid_against_the_kubernetes_schemas(rendered: tuple[Path, list]) -> None:
    _, resources = rendered
    assert resources
    for res in resources:
        if res["kind"] == "PodMonitor":
            jsonschema.validate(res, PODMONITOR_SCHEMA)
            continue
        for version in VERSIONS:
            try:
                kubernetes_validate.validate(res, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                where = "/".join(str(p) for p in exc.path)
                pytest.fail(
                    f"{res['kind']}/{res['metadata']['name']} ({version}): {where}: {exc.message}"
                )


def test_namespaced_in_kerneleval(rendered: tuple[Path, list]) -> None:
    _, resources = rendered
    for res in resources:
        if res["kind"] != "Namespace":
            assert res["metadata"].get("namespace") == "kerneleval", res["metadata"]["name"]


def kerneleval_containers(resources: list[dict[str, Any]]) -> list[tuple[dict, dict, dict]]:
    out = []
    for res in resources:
        for pod in pod_specs(res):
            for c in pod["containers"]:
                if c["image"].split(":")[0].endswith("kerneleval"):
                    out.append((res, pod, c))
    return out


def service_config(container: dict[str, Any]) -> config_mod.Config:
    """The service's settings as this container would start it (args, then env)."""
    env: dict[str, str] = {"POD_IP": "10.0.0.7"}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], var["value"])
        else:
            ref = var["valueFrom"]
            if "secretKeyRef" in ref:
                assert ref["secretKeyRef"]["name"] == SECRET
                assert ref["secretKeyRef"]["key"] in SECRET_KEYS
                env[var["name"]] = SECRET_VALUES[ref["secretKeyRef"]["key"]]
            else:
                assert ref["fieldRef"]["fieldPath"] == "status.podIP"
    names = {"KERNELEVAL_" + f.upper() for f in config_mod.Config.__dataclass_fields__}
    unknown = [k for k in env if k.startswith("KERNELEVAL_") and k not in names]
    assert unknown == [], "not settings of the service"
    assert container["args"][0] == "serve"
    ns = build_parser().parse_args(container["args"])
    cfg = config_mod.from_args(ns, environ=env)
    assert cfg.problems() == []
    return cfg


def test_containers_start_the_service_as_configured(rendered: tuple[Path, list]) -> None:
    _, resources = rendered
    roles = {}
    for res, pod, c in kerneleval_containers(resources):
        cfg = service_config(c)
        roles[cfg.role] = res
        assert cfg.host == "0.0.0.0" and cfg.metrics_host == "0.0.0.0"
        assert cfg.store  # from the Secret
        # The admin token from the Secret, never generated per pod; a builder serves no
        # OperationsService and is not given it.
        assert bool(cfg.admin_token) == (cfg.role != "builder")
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports == {"grpc": cfg.port, "metrics": cfg.metrics_port}
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            if probe in c:
                assert c[probe]["grpc"] == {"port": cfg.port}  # grpc.health.v1, overall
        notes = res["spec"]["template"]["metadata"]["annotations"]
        assert notes["prometheus.io/port"] == str(cfg.metrics_port)
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        assert cfg.state_dir in mounts
        if cfg.role == "gateway":
            assert res["kind"] == "Deployment"
            assert pod["securityContext"]["runAsNonRoot"] is True
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert "nvidia.com/gpu" not in c["resources"].get("limits", {})
        elif cfg.role == "builder":
            assert res["kind"] == "Deployment"
            assert cfg.advertise_address == f"10.0.0.7:{cfg.port}"  # ListBuilders' address
            # Its build processes' sandboxes, as a node's job processes': DEPLOY.md.
            assert c["securityContext"]["privileged"] is True and cfg.job_user == "kerneleval-job"
            for kind in ("requests", "limits"):
                assert not any("nvidia.com" in r for r in c["resources"].get(kind, {}))
            assert "nvidia.com/gpu.present" not in pod.get("nodeSelector", {})
            assert not any(t.get("key") == "nvidia.com/gpu" for t in pod.get("tolerations", []))
            # Build processes said (auto counts the machine's CPUs), fewer than its CPUs, and
            # each one's cgroup inside the pod's memory limit (else the pod's OOM killer, not
            # the build's cgroup, ends a build that runs away).
            cpus = float(c["resources"]["requests"]["cpu"])
            assert 0 < cfg.build_processes < cpus
            limit = quantity_bytes(c["resources"]["limits"]["memory"])
            # --job-memory-mib by default: worked out from the pod's limit (host_memory.py).
            job_mib = cfg.job_memory_mib or host_memory.auto_job_memory_mib(
                limit, cfg.job_slots(), host_memory.BUILD_FLOOR_MIB
            )
            assert cfg.job_slots() == cfg.build_processes
            assert limit > cfg.build_processes * job_mib * 2**20
            assert "startupProbe" in c and "livenessProbe" in c and "readinessProbe" in c
        else:
            assert cfg.role == "node" and res["kind"] == "DaemonSet"
            assert cfg.advertise_address == f"10.0.0.7:{cfg.port}"
            assert c["securityContext"]["privileged"] is True  # its sandboxes: DEPLOY.md
            gpus = c["resources"]["limits"]["nvidia.com/gpu"]
            assert str(gpus) == pod["nodeSelector"]["nvidia.com/gpu.count"]
            assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
            assert cfg.build_processes >= 0  # auto would count the machine's CPUs
            assert cfg.auto_reset is False
    assert set(roles) == {"gateway", "node", "builder"}


def quantity_bytes(text: str) -> int:
    """A Kubernetes memory quantity with a binary suffix ("56Gi"), in bytes."""
    number, unit = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)", text).groups()  # type: ignore[union-attr]
    return int(number) * 1024 ** (("Ki", "Mi", "Gi", "Ti").index(unit) + 1)


def test_builders_are_reached_by_no_service(rendered: tuple[Path, list]) -> None:
    """Builders take their work from the store; a Service that selected them would send
    clients to pods that serve health only."""
    _, resources = rendered
    builder = find(resources, "Deployment", "kerneleval-builder")
    labels = builder["spec"]["template"]["metadata"]["labels"]
    assert builder["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for svc in (r for r in resources if r["kind"] == "Service"):
        assert not svc["spec"].get("selector", {}).items() <= labels.items(), svc["metadata"]


def test_the_builders_autoscaler_owns_their_replicas() -> None:
    resources = render(KUBE / "overlays" / "builder-autoscaling")
    hpa = find(resources, "HorizontalPodAutoscaler", "kerneleval-builder")
    target = hpa["spec"]["scaleTargetRef"]
    builder = find(resources, target["kind"], target["name"])
    assert target["apiVersion"] == builder["apiVersion"] == "apps/v1"
    assert "replicas" not in builder["spec"]  # the autoscaler's, not `kubectl apply`'s
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    # Utilization is of the CPU request: a request there is what it scales on.
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu"
    assert builder["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"]
    assert "replicas" in find(render(BASE), "Deployment", "kerneleval-builder")["spec"]


def test_gpu_reset_is_off_but_in_its_overlay(rendered: tuple[Path, list]) -> None:
    folder, resources = rendered
    node = find(resources, "DaemonSet", "kerneleval-node")
    cfg = service_config(node["spec"]["template"]["spec"]["containers"][0])
    if folder.name == "gpu-reset":
        assert cfg.reset_command == config_mod.Config().reset_command  # nvidia-smi --gpu-reset
    else:
        assert "nvidia-smi" not in cfg.reset_command and cfg.reset_command.endswith("exit 1")


def test_services_select_the_gateways(rendered: tuple[Path, list]) -> None:
    _, resources = rendered
    gateway = find(resources, "Deployment", "kerneleval-gateway")
    labels = gateway["spec"]["template"]["metadata"]["labels"]
    assert gateway["spec"]["selector"]["matchLabels"].items() <= labels.items()
    port_names = {p["name"] for p in gateway["spec"]["template"]["spec"]["containers"][0]["ports"]}
    for name, headless in (("kerneleval", False), ("kerneleval-headless", True)):
        svc = find(resources, "Service", name)
        assert svc["spec"]["selector"].items() <= labels.items()
        assert (svc["spec"].get("clusterIP") == "None") is headless
        assert [p["targetPort"] for p in svc["spec"]["ports"]] == ["grpc"]
        assert "grpc" in port_names
    pdb = find(resources, "PodDisruptionBudget", "kerneleval-gateway")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_example_postgres_matches_the_store_url() -> None:
    resources = render(KUBE / "overlays" / "example-postgres")
    svc = find(resources, "Service", "kerneleval-postgres")
    pg = find(resources, "StatefulSet", "kerneleval-postgres")
    c = pg["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in c["env"]}
    assert env["POSTGRES_PASSWORD"]["valueFrom"]["secretKeyRef"]["key"] == "postgres-password"
    assert svc["spec"]["selector"].items() <= pg["spec"]["template"]["metadata"]["labels"].items()
    # The URL the overlay's comment and DEPLOY.md tell you to put in store-url.
    url = (
        f"postgresql://{env['POSTGRES_USER']['value']}:PASSWORD@{svc['metadata']['name']}:"
        f"{svc['spec']['ports'][0]['port']}/{env['POSTGRES_DB']['value']}"
    )
    assert url == "postgresql://kerneleval:PASSWORD@kerneleval-postgres:5432/kerneleval"
    kustomization = (KUBE / "overlays" / "example-postgres" / "kustomization.yaml").read_text()
    deploy_md = (ROOT / "docs" / "DEPLOY.md").read_text()
    for text in (kustomization, deploy_md):
        assert "postgresql://kerneleval:" in text and "@kerneleval-postgres:5432/kerneleval" in text


def test_podmonitor_scrapes_the_metrics_port() -> None:
    resources = render(KUBE / "overlays" / "prometheus-operator")
    monitor = find(resources, "PodMonitor", "kerneleval")
    (components,) = monitor["spec"]["selector"]["matchExpressions"]
    assert components["key"] == "app.kubernetes.io/component" and components["operator"] == "In"
    for res, _, c in kerneleval_containers(resources):
        labels = res["spec"]["template"]["metadata"]["labels"]
        assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert labels["app.kubernetes.io/component"] in components["values"]
        assert any(p["name"] == "metrics" for p in c["ports"])
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["metrics"]


def test_no_secret_values_in_the_manifests() -> None:
    for path in KUBE.rglob("*.yaml"):
        text = path.read_text()
        assert "kind: Secret" not in text, path
        assert not re.search(r"postgresql://\w+:(?!<|PASSWORD)[^@\s]+@", text), path
    assert os.path.isfile(BASE / "kustomization.yaml")
