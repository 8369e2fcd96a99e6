"""A GPU MODE task's cases as its reference's generate_input gets them: each case's keyword
arguments (task.yml's values, lists as tuples), its seed (mixed with EvalOptions.seed when that
is set) and the seed of the global generators, the same on every side that makes its data (the
kernel's process, its judge, the judge's variants for the timed calls: gpumode_judge_timing.py).
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
from kerneleval.v1 import kernel_pb2

from .inputs import mix_seed, seed_all


@dataclass(frozen=True)
class Case:
    """One test or benchmark case: its label and generate_input's keyword arguments."""

    label: str  # "test 2" or "benchmark 0"
    spec: str  # "size: 127; seed: 4242", the seed as used
    kwargs: dict[str, Any]
    # What the global generators (torch's, numpy's, Python's) are seeded with right before
    # generate_input, on every side that makes the case's data (seed_globals).
    global_seed: int = 0


GLOBAL_SEED = 0x474C4F42  # mixed into a case's global_seed

# A variant of a case's seed: in 31 bits, as tasks seed numpy's and Python's generators too.
VARIANT_SEED_MASK = (1 << 31) - 1


def cases(label: str, given: Iterable[kernel_pb2.TaskCase], seed: int | None) -> list[Case]:
    out = []
    for i, c in enumerate(given):
        kwargs: dict[str, Any] = {}
        for a in c.args:
            value = task_value(a)
            if a.name == "seed" and seed is not None and type(value) is int:
                value = mix_seed(value, seed)
            kwargs[a.name] = value
        spec = "; ".join(f"{k}: {spec_text(v)}" for k, v in kwargs.items())
        own = kwargs.get("seed")
        parts = [GLOBAL_SEED, label == "benchmark", i, seed or 0]
        parts += [own] if type(own) is int else []
        glob = mix_seed(*parts) & VARIANT_SEED_MASK
        out.append(Case(f"{label} {i}", spec, kwargs, glob))
    return out


def seed_globals(seed: int) -> None:
    """The generators a generate_input may draw from without seeding them (bioml/trimul's
    torch.distributions draws from torch's): seeded alike wherever the case's data is made,
    the kernel's process and its judge, which makes it again."""
    seed_all(seed)
    random.seed(seed)
    np.random.seed(seed)


def task_value(v: kernel_pb2.TaskArg | kernel_pb2.TaskValue) -> Any:
    """A case's value as generate_input gets it: a list as a tuple (GPU MODE's harness parses
    `m: [96, 128]` into one), a mapping as a dict in the task's order, a scalar as itself."""
    which = v.WhichOneof("value")
    if which == "list_value":
        return tuple(task_value(x) for x in v.list_value.values)
    if which == "map_value":
        return {e.key: task_value(e.value) for e in v.map_value.entries}
    return getattr(v, which or "int_value")


def spec_text(value: Any) -> str:
    """A value as GPU MODE's test files write it: `[96, 128]` for a list."""
    if isinstance(value, tuple):
        return "[" + ", ".join(spec_text(x) for x in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {spec_text(x)}" for k, x in value.items()) + "}"
    return str(value)
