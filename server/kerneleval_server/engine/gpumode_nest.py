"""A GPU MODE case's data and a kernel's output as nests of values, walked both ways: copied
for the kernel (clone), flattened into the record's values and nest and rebuilt from them in
the judge (flatten, rebuild: RecordedTrial.structure), and laid out as the leaves and nest the
judge's timed calls share with the kernel's process (share_layout, share_rebuild), or found
unfit for them (unshared_reason). What a kernel's process sends is read as hostile: a nest
that is not one is StructureError or Unshared.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import torch

from . import timed_calls


def clone(data: Any) -> Any:
    """A deep copy of the data: the tensors in a nest of tuples, lists and dicts cloned, any
    other object copied whole (copy.deepcopy: amd/mla-decode's KVCache module, which a call
    writes into, and its Config of weights), shared only where it cannot be copied."""
    if isinstance(data, torch.Tensor):
        return data.clone()
    if isinstance(data, (tuple, list)):
        return type(data)(clone(x) for x in data)
    if isinstance(data, dict):
        return {k: clone(v) for k, v in data.items()}
    if data is None or isinstance(data, (bool, int, float, complex, str, bytes)):
        return data
    try:
        return copy.deepcopy(data)
    except Exception:  # noqa: BLE001 - not copyable (a lock, a handle): shared, as before
        return data


def tensors_of(data: Any) -> list[torch.Tensor]:
    if isinstance(data, torch.Tensor):
        return [data]
    if isinstance(data, (tuple, list)):
        return [t for x in data for t in tensors_of(x)]
    if isinstance(data, dict):
        return [t for x in data.values() for t in tensors_of(x)]
    return []


MAX_STRUCTURE = 1 << 16  # characters of a recorded output's nest (RecordedTrial.structure)
MAX_DEPTH = 32


def flatten(output: Any) -> tuple[list[Any], str]:
    """A submission's output as the record holds it: its values in order and the nest of
    tuples and lists around them ("t" a value: "t", "(t,t)", "[t,(t,t)]"). Anything else (a
    dict, ...) is one value, which the record keeps as a stand-in that no check passes."""
    leaves: list[Any] = []
    return leaves, _flatten_into(output, 0, leaves)


# The walks over a nest below are module functions, not nested ones: a nested function that
# calls itself is a reference cycle (it holds its own cell) and keeps what it closes over,
# the nest's tensors, alive until the cyclic collector runs. A judge timing a GPU MODE task
# whose data is gigabytes held 65 GB of them after ~15 calls and ran out of GPU memory.
def _flatten_into(x: Any, depth: int, leaves: list[Any]) -> str:
    if isinstance(x, (tuple, list)) and depth < MAX_DEPTH:
        inner = ",".join(_flatten_into(v, depth + 1, leaves) for v in x)
        return f"({inner})" if isinstance(x, tuple) else f"[{inner}]"
    leaves.append(x)
    return "t"


class StructureError(ValueError):
    """A recorded nest that flatten never writes (a hostile kernel's process)."""


def rebuild(leaves: list[Any], structure: str) -> Any:
    """flatten's inverse; StructureError for a nest that is not one, or not of these values."""
    if not structure or len(structure) > MAX_STRUCTURE:
        raise StructureError(f"an output nest of {len(structure)} characters")
    parser = _NestParser(leaves, structure)
    out = parser.parse(0)
    if parser.pos != len(structure) or parser.used != len(leaves):
        raise StructureError("an output nest that does not hold exactly the values recorded")
    return out


class _NestParser:
    """rebuild's walk over a nest (a class, not a nested function: see _flatten_into)."""

    def __init__(self, leaves: list[Any], structure: str) -> None:
        self.leaves, self.structure = leaves, structure
        self.pos = self.used = 0

    def parse(self, depth: int) -> Any:
        structure = self.structure
        if depth > MAX_DEPTH or self.pos >= len(structure):
            raise StructureError("an output nest too deep or cut short")
        c = structure[self.pos]
        if c == "t":
            self.pos += 1
            if self.used >= len(self.leaves):
                raise StructureError("an output nest with more values than were recorded")
            self.used += 1
            return self.leaves[self.used - 1]
        close = {"(": ")", "[": "]"}.get(c)
        if close is None:
            raise StructureError(f"an output nest with {c!r} at {self.pos}")
        self.pos += 1
        items: list[Any] = []
        while self.pos < len(structure) and structure[self.pos] != close:
            if items:
                if structure[self.pos] != ",":
                    raise StructureError(f"an output nest without a comma at {self.pos}")
                self.pos += 1
            items.append(self.parse(depth + 1))
        if self.pos >= len(structure):
            raise StructureError("an output nest left open")
        self.pos += 1
        return tuple(items) if c == "(" else items


# -- a case's data shared with the kernel's process (timed from outside, issue 40) ---------


class Unshared(ValueError):
    """A case's data or output holds what the timed calls cannot share (the message says)."""


def share_layout(data: Any) -> tuple[list[Any], Any]:
    """The data's leaves (tensors, shared by the driver; scalars, sent as they are) and its
    nest as JSON ("t" a leaf; {"tuple"|"list": [...]}; {"dict": [[key, ...], ...]}).
    Unshared for anything else: an object, a dict with other than string keys, a tensor
    that is not dense and contiguous (its strides would not survive), of a dtype the calls
    do not carry, on another device than the job's or the host, or that shares memory with
    another (the kernel would see them apart)."""
    leaves: list[Any] = []
    tree = _layout_into(data, 0, leaves)
    seen: set[int] = set()
    for t in leaves:
        if isinstance(t, torch.Tensor) and t.numel():
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen:
                raise Unshared("tensors of its data share memory")
            seen.add(ptr)
    return leaves, tree


def _layout_into(x: Any, depth: int, leaves: list[Any]) -> Any:
    """share_layout's walk (a module function: see _flatten_into)."""
    if depth > MAX_DEPTH:
        raise Unshared("its data is nested too deep")
    if isinstance(x, torch.Tensor):
        if x.layout != torch.strided or not x.is_contiguous():
            raise Unshared("a tensor of its data is not dense and contiguous")
        if not timed_calls.shareable_dtype(x.dtype):
            raise Unshared(f"a tensor of its data is of {x.dtype}")
        leaves.append(x)
        return "t"
    if x is None or type(x) in (bool, int, float, str):
        leaves.append(x)
        return "t"
    if type(x) in (tuple, list):
        return {type(x).__name__: [_layout_into(v, depth + 1, leaves) for v in x]}
    if type(x) is dict and all(type(k) is str for k in x):
        return {"dict": [[k, _layout_into(v, depth + 1, leaves)] for k, v in x.items()]}
    raise Unshared(f"its data holds a {type(x).__name__}")


def share_rebuild(values: list[Any], tree: Any) -> Any:
    """share_layout's inverse: the data from its leaves, in the nest `tree` describes."""
    it = iter(values)
    out = _build(tree, it)
    if next(it, it) is not it:
        raise Unshared("more values than the nest holds")
    return out


def _build(node: Any, it: Iterator[Any]) -> Any:
    """share_rebuild's walk (a module function: see _flatten_into)."""
    if node == "t":
        return next(it)
    ((kind, items),) = node.items()
    if kind == "dict":
        return {k: _build(v, it) for k, v in items}
    built = [_build(v, it) for v in items]
    return tuple(built) if kind == "tuple" else built


def unshared_reason(data: Any, output_leaves: list[Any], device: torch.device) -> str:
    """Why a benchmark case cannot be timed from outside ("" when it can): its data (as
    share_layout) or its output's leaves (the kernel's, as recorded: tensors only)."""
    try:
        leaves, _ = share_layout(data)
    except Unshared as e:
        return str(e)
    for v in leaves:
        if isinstance(v, torch.Tensor) and v.device.type not in ("cpu", device.type):
            return f"a tensor of its data is on {v.device.type}"
    for v in output_leaves:
        if not isinstance(v, torch.Tensor):
            return f"its output holds a {type(v).__name__}"
        if not timed_calls.shareable_dtype(v.dtype):
            return f"its output holds a tensor of {v.dtype}"
    if not output_leaves:
        return "its output holds no tensor"
    return ""
