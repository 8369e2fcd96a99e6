"""The test renderer of kustomizations (kustomize_lite.py) does what kustomize does, or refuses."""

from __future__ import annotations

from pathlib import Path

import pytest
from kustomize_lite import KustomizeError, image_name, json_patch, render

DEPLOYMENT = """\
apiVersion: apps/v1
kind: Deployment
metadata: {name: web}
spec:
  template:
    spec:
      containers:
        - {name: a, image: app}
        - {name: b, image: "registry:5000/other:1@sha256:abc"}
      initContainers:
        - {name: i, image: "app:old"}
"""


def write(folder: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return folder


def test_json_patch_operations() -> None:
    doc = {"a": {"b": [1, 2]}, "c~d/e": 1}
    out = json_patch(
        doc,
        [
            {"op": "test", "path": "/a/b/0", "value": 1},
            {"op": "add", "path": "/a/b/1", "value": 9},
            {"op": "add", "path": "/a/b/-", "value": 3},
            {"op": "replace", "path": "/c~0d~1e", "value": 2},
            {"op": "remove", "path": "/a/b/0"},
            {"op": "add", "path": "/x", "value": {"y": 1}},
        ],
    )
    assert out == {"a": {"b": [9, 2, 3]}, "c~d/e": 2, "x": {"y": 1}}
    assert doc == {"a": {"b": [1, 2]}, "c~d/e": 1}  # a copy is patched


@pytest.mark.parametrize(
    "op",
    [
        {"op": "test", "path": "/a", "value": 2},
        {"op": "replace", "path": "/missing", "value": 1},
        {"op": "remove", "path": "/l/5"},
        {"op": "add", "path": "/l/7", "value": 1},
        {"op": "move", "from": "/a", "path": "/b"},
        {"op": "add", "path": "a", "value": 1},
    ],
)
def test_json_patch_refuses(op: dict) -> None:
    with pytest.raises(KustomizeError):
        json_patch({"a": 1, "l": [0]}, [op])


def test_image_name() -> None:
    assert image_name("app") == "app"
    assert image_name("app:1") == "app"
    assert image_name("registry:5000/ns/app:1") == "registry:5000/ns/app"
    assert image_name("registry:5000/app@sha256:abc") == "registry:5000/app"


def test_overlay_over_base(tmp_path: Path) -> None:
    write(
        tmp_path,
        {
            "base/kustomization.yaml": "resources: [ns.yaml, web.yaml]\nnamespace: prod\n"
            "images: [{name: app, newTag: '2'}]\n",
            "base/ns.yaml": "apiVersion: v1\nkind: Namespace\nmetadata: {name: prod}\n",
            "base/web.yaml": DEPLOYMENT,
            "overlay/kustomization.yaml": "resources: [../base, svc.yaml]\n"
            "images: [{name: app, newName: reg.example/app}]\n"
            "patches:\n- target: {kind: Deployment, name: web}\n  patch: |-\n"
            "    - {op: add, path: /spec/replicas, value: 3}\n",
            "overlay/svc.yaml": "apiVersion: v1\nkind: Service\nmetadata: {name: web}\n---\n",
        },
    )
    ns, web, svc = render(tmp_path / "overlay")
    assert "namespace" not in ns["metadata"]
    assert web["metadata"]["namespace"] == "prod"
    assert "namespace" not in svc["metadata"]  # the overlay sets none
    assert web["spec"]["replicas"] == 3
    pod = web["spec"]["template"]["spec"]
    assert [c["image"] for c in pod["containers"]] == [
        "reg.example/app:2",
        "registry:5000/other:1@sha256:abc",
    ]
    assert pod["initContainers"][0]["image"] == "reg.example/app:2"


@pytest.mark.parametrize(
    "kustomization",
    [
        "resources: [web.yaml]\ncommonLabels: {a: b}\n",  # a field it does not know
        "resources: [missing.yaml]\n",
        "resources: [web.yaml, web.yaml]\n",  # the same resource twice
        "resources: [web.yaml]\npatches:\n- target: {kind: Service}\n  patch: '[]'\n",
        "resources: [web.yaml]\npatches:\n- target: {kind: Deployment}\n"
        "  patch: 'metadata: {labels: {a: b}}'\n",  # strategic merge
        "resources: [web.yaml]\npatches:\n- target: {labelSelector: a=b}\n  patch: '[]'\n",
        "resources: [web.yaml]\nimages: [{name: app, newTagg: '1'}]\n",
        "kind: Component\nresources: [web.yaml]\n",
    ],
)
def test_refuses_what_it_does_not_do(tmp_path: Path, kustomization: str) -> None:
    write(tmp_path, {"kustomization.yaml": kustomization, "web.yaml": DEPLOYMENT})
    with pytest.raises(KustomizeError):
        render(tmp_path)


def test_patch_from_a_file(tmp_path: Path) -> None:
    write(
        tmp_path,
        {
            "kustomization.yaml": "resources: [web.yaml]\npatches:\n"
            "- target: {group: apps, version: v1, kind: Deployment, name: web}\n"
            "  path: p.yaml\n",
            "p.yaml": "- {op: replace, path: /spec/template/spec/containers/0/name, value: z}\n",
            "web.yaml": DEPLOYMENT,
        },
    )
    (web,) = render(tmp_path)
    assert web["spec"]["template"]["spec"]["containers"][0]["name"] == "z"
