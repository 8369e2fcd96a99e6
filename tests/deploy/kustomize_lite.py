"""A small renderer of the kustomizations in deploy/kubernetes, for tests on machines without
kustomize (it is on none of the registries `make` reaches: PyPI, Debian, npm).

It does what `kustomize build DIR` (`kubectl kustomize DIR`) does for the subset of Kustomize
those files use, and refuses everything else, so that a kustomization never means one thing
here and another to kustomize:
- `resources`: YAML files (several documents each) and folders with a kustomization of their
  own, rendered first (a base);
- `patches`: JSON 6902 patches (`patch:` inline or `path:`) with a `target` of `group`,
  `version`, `kind`, `name`; ops add, remove, replace and test (RFC 6902). A strategic-merge
  patch (a mapping) is refused;
- `namespace`: set on every namespaced resource;
- `images`: `name` with `newName`, `newTag` or `digest`, in the containers and init containers
  of pod templates;
- two resources with the same group, kind, namespace and name are an error, as in kustomize.
tests/deploy/test_kustomize_lite.py tests the renderer itself.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
SUPPORTED = {"apiVersion", "kind", "namespace", "resources", "patches", "images"}
TARGET_KEYS = {"group", "version", "kind", "name"}
IMAGE_KEYS = {"name", "newName", "newTag", "digest"}
# Kinds with no namespace (kustomize leaves them as they are).
CLUSTER_SCOPED = {
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "CustomResourceDefinition",
    "PersistentVolume",
    "StorageClass",
    "PriorityClass",
    "RuntimeClass",
    "IngressClass",
    "ValidatingWebhookConfiguration",
    "MutatingWebhookConfiguration",
    "APIService",
}

Resource = dict[str, Any]


class KustomizeError(Exception):
    pass


def render(folder: Path | str) -> list[Resource]:
    """The resources `kustomize build folder` prints, in the order they were listed."""
    folder = Path(folder)
    found = [folder / n for n in KUSTOMIZATION_FILES if (folder / n).is_file()]
    if len(found) != 1:
        raise KustomizeError(f"{folder}: expected one kustomization file, found {len(found)}")
    spec = yaml.safe_load(found[0].read_text()) or {}
    unknown = set(spec) - SUPPORTED
    if unknown:
        raise KustomizeError(f"{found[0]}: not supported by this renderer: {sorted(unknown)}")
    if spec.get("kind", "Kustomization") != "Kustomization":
        raise KustomizeError(f"{found[0]}: kind {spec.get('kind')!r}")
    resources: list[Resource] = []
    for entry in spec.get("resources") or []:
        path = folder / entry
        if path.is_dir():
            resources += render(path)
        elif path.is_file():
            resources += [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        else:
            raise KustomizeError(f"{found[0]}: resource {entry!r} does not exist")
    for patch in spec.get("patches") or []:
        _apply_patch(folder, patch, resources)
    if "namespace" in spec:
        for res in resources:
            if res.get("kind") not in CLUSTER_SCOPED:
                res.setdefault("metadata", {})["namespace"] = spec["namespace"]
    for image in spec.get("images") or []:
        _set_image(image, resources)
    _check_unique(resources)
    return resources


def group_version(res: Resource) -> tuple[str, str]:
    api = str(res.get("apiVersion", ""))
    group, _, version = api.rpartition("/")
    return group, version


def resource_id(res: Resource) -> tuple[str, str, str, str]:
    meta = res.get("metadata") or {}
    return (group_version(res)[0], res.get("kind", ""), meta.get("namespace", ""), meta["name"])


def _check_unique(resources: list[Resource]) -> None:
    seen: set[tuple[str, str, str, str]] = set()
    for res in resources:
        rid = resource_id(res)
        if rid in seen:
            raise KustomizeError(f"two resources with the id {rid}")
        seen.add(rid)


def _matches(target: dict[str, str], res: Resource) -> bool:
    group, version = group_version(res)
    have = {
        "group": group,
        "version": version,
        "kind": res.get("kind"),
        "name": (res.get("metadata") or {}).get("name"),
    }
    return all(have[k] == v for k, v in target.items())


def _apply_patch(folder: Path, entry: dict[str, Any], resources: list[Resource]) -> None:
    if set(entry) - {"patch", "path", "target"} or ("patch" in entry) == ("path" in entry):
        raise KustomizeError(f"patch entry {entry!r}: one of patch or path, and a target")
    target = entry.get("target") or {}
    if not target or set(target) - TARGET_KEYS:
        raise KustomizeError(f"patch target {target!r}: only {sorted(TARGET_KEYS)}")
    text = entry["patch"] if "patch" in entry else (folder / entry["path"]).read_text()
    ops = yaml.safe_load(text)
    if not isinstance(ops, list):
        raise KustomizeError("only JSON 6902 patches (a list of operations) are supported")
    hits = [i for i, res in enumerate(resources) if _matches(target, res)]
    if not hits:
        raise KustomizeError(f"patch target {target!r} matches no resource")
    for i in hits:
        resources[i] = json_patch(resources[i], ops)


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise KustomizeError(f"JSON pointer {path!r} must start with /")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _child(node: Any, key: str, path: str) -> Any:
    if isinstance(node, list):
        if not key.isdigit() or int(key) >= len(node):
            raise KustomizeError(f"{path}: no index {key}")
        return node[int(key)]
    if isinstance(node, dict):
        if key not in node:
            raise KustomizeError(f"{path}: no member {key!r}")
        return node[key]
    raise KustomizeError(f"{path}: {key!r} inside a scalar")


def json_patch(doc: Resource, ops: list[dict[str, Any]]) -> Resource:
    """RFC 6902 add, remove, replace and test on a copy of doc."""
    doc = copy.deepcopy(doc)
    for op in ops:
        kind, path = op.get("op"), op.get("path")
        if kind not in ("add", "remove", "replace", "test") or not isinstance(path, str):
            raise KustomizeError(f"JSON patch operation {op!r} is not supported")
        keys = _pointer(path)
        if not keys:
            raise KustomizeError("a patch of the whole document is not supported")
        parent: Any = doc
        for key in keys[:-1]:
            parent = _child(parent, key, path)
        last = keys[-1]
        if kind == "test":
            if _child(parent, last, path) != op.get("value"):
                raise KustomizeError(f"test failed at {path}: {_child(parent, last, path)!r}")
        elif kind == "remove":
            _child(parent, last, path)
            del parent[int(last) if isinstance(parent, list) else last]
        elif kind == "replace":
            _child(parent, last, path)
            parent[int(last) if isinstance(parent, list) else last] = copy.deepcopy(op["value"])
        elif isinstance(parent, list):  # add
            if last == "-":
                parent.append(copy.deepcopy(op["value"]))
            elif last.isdigit() and int(last) <= len(parent):
                parent.insert(int(last), copy.deepcopy(op["value"]))
            else:
                raise KustomizeError(f"{path}: no index {last} to add at")
        elif isinstance(parent, dict):
            parent[last] = copy.deepcopy(op["value"])
        else:
            raise KustomizeError(f"{path}: cannot add inside a scalar")
    return doc


def pod_specs(res: Resource) -> list[dict[str, Any]]:
    """The pod specs of a workload (its template's, a CronJob's job template's)."""
    spec = res.get("spec") or {}
    if res.get("kind") == "Pod":
        return [spec]
    if res.get("kind") == "CronJob":
        spec = (spec.get("jobTemplate") or {}).get("spec") or {}
    template = spec.get("template") or {}
    return [template["spec"]] if "spec" in template else []


def image_name(image: str) -> str:
    """The image without its tag or digest (a registry's port is kept)."""
    name = image.split("@", 1)[0]
    slash = name.rfind("/")
    colon = name.rfind(":")
    return name[:colon] if colon > slash else name


def _set_image(entry: dict[str, str], resources: list[Resource]) -> None:
    if "name" not in entry or set(entry) - IMAGE_KEYS:
        raise KustomizeError(f"images entry {entry!r}: name with newName, newTag or digest")
    for res in resources:
        for pod in pod_specs(res):
            for c in (pod.get("containers") or []) + (pod.get("initContainers") or []):
                if image_name(c.get("image", "")) != entry["name"]:
                    continue
                old = c["image"]
                name = entry.get("newName", entry["name"])
                if "digest" in entry:
                    c["image"] = f"{name}@{entry['digest']}"
                elif "newTag" in entry:
                    c["image"] = f"{name}:{entry['newTag']}"
                else:  # the old tag or digest kept
                    c["image"] = name + old[len(image_name(old)) :]
