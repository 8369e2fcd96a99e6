"""Helpers for RL loops: a reward from a result, and a job from an LLM completion.

    from kerneleval import Client, rl

    with Client() as c:
        try:
            spec = rl.spec_from_completion(completion, kernel_type="triton",
                                           reference=problem_source)
        except rl.NoCodeFound:
            r = rl.reward(None)                  # nothing to run: scored as a compile error
        else:
            r = rl.reward(c.compare(spec))       # 0.0 / 0.1 / 0.3 + speedup, by default

`reward` maps a result to a float with the usual shapings as parameters (bind your choice once
with functools.partial). `kernel_from_completion` and `spec_from_completion` take the code out
of a completion's Markdown fences and build the KernelSource (or JobSpec) for it.

Pure Python on the generated messages: no torch, no I/O.
"""

from __future__ import annotations

import math
import re
import textwrap
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Literal

from kerneleval import kernelbench
from kerneleval.v1 import job_pb2, kernel_pb2

__all__ = [
    "NoCodeFound",
    "NoReward",
    "extract_code",
    "kernel_from_completion",
    "reward",
    "spec_from_completion",
]

SpeedupShaping = Literal["linear", "log", "none"]
ResultLike = job_pb2.Job | job_pb2.EvalResult | job_pb2.JobEvent

# --- reward ------------------------------------------------------------------------------

# Verdicts that say the kernel did not work, not that the service failed to run it.
_FAILED_VERDICTS = frozenset(
    {
        job_pb2.VERDICT_COMPILE_ERROR,
        job_pb2.VERDICT_INCORRECT,
        job_pb2.VERDICT_RUNTIME_ERROR,
        job_pb2.VERDICT_DEVICE_FAULT,
        job_pb2.VERDICT_CRASHED,
        job_pb2.VERDICT_TIMEOUT,
        job_pb2.VERDICT_OUT_OF_MEMORY,
        job_pb2.VERDICT_RESOURCE_LIMIT,
    }
)


class NoReward(ValueError):
    """The job has no result that scores the kernel: it has not finished, was cancelled, or
    the service failed to run it (JOB_STATE_FAILED: not the kernel's fault). Drop the sample,
    or give `reward(..., unscored_reward=...)` a value for it."""


def reward(
    job_or_result: ResultLike | None,
    *,
    compile_error_reward: float = 0.0,
    compile_reward: float = 0.1,
    correct_reward: float = 0.3,
    speedup_shaping: SpeedupShaping = "linear",
    speedup_weight: float = 1.0,
    speedup_clip: tuple[float, float] = (0.1, 10.0),
    flagged_reward: float = 0.0,
    ignore_flags: Collection[str] = (),
    unscored_reward: float | None = None,
) -> float:
    """The reward of a finished job (a Job, its EvalResult, or its `finished` JobEvent).

    - No code (`None`, e.g. after `NoCodeFound`), or it did not compile
      (VERDICT_COMPILE_ERROR, or any failure with `compiled` false): `compile_error_reward`.
    - Compiled but failed (incorrect, an exception, a fault, a crash, the timeout, out of
      memory, over a launch limit): `compile_reward`.
    - Correct (VERDICT_OK): `correct_reward` plus the speedup term, when the job was timed
      against a reference (EvalResult.speedup > 0; 0 otherwise):
        - "linear": speedup_weight * s (as Kevin-32B's 0.3 + speedup),
        - "log":    speedup_weight * log2(s): 0 at parity, +w per doubling, negative when
                    slower (use speedup_clip=(1.0, ...) not to punish slowdowns),
        - "none":   no term (a correctness-only reward),
      where s is the speedup clipped to `speedup_clip` (the upper bound 10 matches the
      service's "suspicious" threshold: a bigger speedup earns no more, a common timing hack
      gains nothing past it).
    - Flagged by the service's integrity checks (EvalResult.flags, whose rule_id is not in
      `ignore_flags`) or rejected for them (VERDICT_REJECTED): `flagged_reward`, whatever the
      verdict; make it negative for a penalty.
    - Not scored (unfinished, cancelled, JOB_STATE_FAILED, no verdict, VERDICT_SERVICE_ERROR;
      a kernel that could not run on the service's host, VERDICT_CANNOT_RUN_HERE; a failure
      of the reference,
      EvalResult.failed_side SIDE_REFERENCE, where the kernel was not judged):
      `unscored_reward` when given, else `NoReward` is raised.

    The defaults give 0.0 / 0.1 / 0.3 + speedup; bind other shapings once with
    functools.partial(reward, speedup_shaping="log", flagged_reward=-1.0)."""
    lo, hi = speedup_clip
    if not 0 < lo <= hi:
        raise ValueError(f"speedup_clip must be (low, high) with 0 < low <= high, got {lo, hi}")
    if speedup_shaping not in ("linear", "log", "none"):
        raise ValueError(f"speedup_shaping must be linear, log or none, got {speedup_shaping!r}")
    if job_or_result is None:
        return compile_error_reward
    result = _result(job_or_result, unscored_reward is not None)
    if result is None:
        assert unscored_reward is not None
        return unscored_reward
    ignored = set(ignore_flags)
    if result.verdict == job_pb2.VERDICT_REJECTED or any(
        f.rule_id not in ignored for f in result.flags
    ):
        return flagged_reward
    if (why := _not_judged(result)) is not None:
        if unscored_reward is not None:
            return unscored_reward
        raise NoReward(why)
    if result.verdict == job_pb2.VERDICT_OK:
        return correct_reward + _speedup_term(
            result.speedup, speedup_shaping, speedup_weight, lo, hi
        )
    if result.verdict in _FAILED_VERDICTS:
        if result.verdict == job_pb2.VERDICT_COMPILE_ERROR or not result.compiled:
            return compile_error_reward
        return compile_reward
    if unscored_reward is not None:
        return unscored_reward
    raise NoReward(f"no reward for verdict {result.verdict} (unknown to this client)")


def _not_judged(result: job_pb2.EvalResult) -> str | None:
    """Why the result says nothing about the kernel, or None when it does."""
    if result.verdict == job_pb2.VERDICT_SERVICE_ERROR:
        return f"the service could not finish the job: {result.error.message}"
    if result.verdict == job_pb2.VERDICT_CANNOT_RUN_HERE:
        return (
            "the kernel could not run on the service's host (VERDICT_CANNOT_RUN_HERE): "
            "neither a crash nor correct; run it where there is a GPU"
        )
    if result.failed_side == job_pb2.SIDE_REFERENCE:
        verdict = job_pb2.Verdict.Name(result.verdict).removeprefix("VERDICT_")
        return f"the reference failed ({verdict}): the kernel was not judged"
    return None


def _result(item: ResultLike, lenient: bool) -> job_pb2.EvalResult | None:
    """The EvalResult that scores the kernel; None (lenient) or NoReward when there is none."""
    if isinstance(item, job_pb2.JobEvent):
        if not item.HasField("finished"):
            if lenient:
                return None
            raise NoReward(f"event {item.sequence} of job {item.job_id} is not its last")
        item = item.finished
    if isinstance(item, job_pb2.EvalResult):
        why = "" if item.verdict else "the result has no verdict"
        result = item
    elif isinstance(item, job_pb2.Job):
        state = job_pb2.JobState.Name(item.state).removeprefix("JOB_STATE_")
        why = ""
        if item.state != job_pb2.JOB_STATE_DONE:
            why = f"job {item.job_id} is {state}"
            if item.state_reason:
                why += f" ({item.state_reason})"
        elif not item.result.verdict:
            why = f"job {item.job_id} has no verdict"
        result = item.result
    else:
        raise TypeError(
            f"reward() takes a Job, an EvalResult or a finished JobEvent, not {type(item)!r}"
        )
    if why:
        if lenient:
            return None
        raise NoReward(why)
    return result


def _speedup_term(
    speedup: float, shaping: SpeedupShaping, weight: float, lo: float, hi: float
) -> float:
    if shaping == "none" or not speedup > 0:  # not timed against a reference (or NaN)
        return 0.0
    s = min(max(speedup, lo), hi)
    return weight * (math.log2(s) if shaping == "log" else s)


# --- code from a completion ----------------------------------------------------------------


class NoCodeFound(ValueError):
    """No code for the kernel asked for in the completion: no fenced block, or none that
    defines the entry point (e.g. `class ModelNew`) or holds the kernel. The message says what
    was looked for and which blocks there were."""


@dataclass(frozen=True)
class _Block:
    lang: str  # the fence's info string, lower-case, first word ("python", "cuda", "")
    code: str

    @property
    def filename(self) -> str:
        """A name that tells detect_kernel_type what the fence's language said."""
        if self.lang in _CUDA_LANGS:
            return "kernel.cu"
        return "kernel.py" if self.lang in _PY_LANGS else ""


_PY_LANGS = frozenset({"python", "py", "python3", "triton", "torch", "pytorch"})
_CUDA_LANGS = frozenset({"cuda", "cu", "cpp", "c++", "cxx", "cc", "c", "hip"})
_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^\n]*)$")
_THINK_END = re.compile(r"</think(?:ing)?>", re.IGNORECASE)
_KERNEL_MARKERS = re.compile(
    r"__global__|@\s*triton\s*\.\s*(?:jit|autotune|heuristics)\b|\bload_inline\s*\("
)
_PYTHON_CODE = re.compile(r"^\s*(?:import\s+\w|from\s+[\w.]+\s+import\b|def\s+\w|class\s+\w)", re.M)


def _fenced_blocks(text: str) -> list[_Block]:
    """The fenced code blocks (``` or ~~~) in order; an unclosed last fence (a completion cut
    at its token limit) runs to the end of the text."""
    blocks: list[_Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None or "`" in m.group("info"):
            i += 1
            continue
        fence, info = m.group("fence"), m.group("info").strip()
        body: list[str] = []
        i += 1
        while i < len(lines):
            close = lines[i].strip()
            if close and close[0] == fence[0] and set(close) == {fence[0]}:
                if len(close) >= len(fence):
                    break
            body.append(lines[i])
            i += 1
        i += 1
        code = textwrap.dedent("\n".join(body)).strip("\n")
        if code.strip():
            lang = info.split()[0].lower().lstrip("{.").rstrip("}") if info else ""
            blocks.append(_Block(lang, code + "\n"))
    return blocks


def _defines(code: str, name: str) -> bool:
    """Whether the code defines `name`: a class, a function, an assignment, a CUDA kernel."""
    n = re.escape(name)
    return bool(
        re.search(rf"^\s*(?:class|def|async\s+def)\s+{n}\b", code, re.M)
        or re.search(rf"^\s*{n}\s*=", code, re.M)
        or re.search(rf"__global__[^;{{]*?\b{n}\s*\(", code)
    )


def _wants(type_value: int | None, io: kernel_pb2.IOContract | None, entry_point: str) -> str:
    """What the chosen block must hold: "entry:<name>" or "kernel"."""
    if entry_point:
        return f"entry:{entry_point}"
    if type_value == kernel_pb2.KERNEL_TYPE_CUDA:
        return "kernel"
    if type_value == kernel_pb2.KERNEL_TYPE_TRITON and io is not None and len(io.args):
        return "kernel"  # launched from its IOContract: no wrapper class
    return "entry:ModelNew"


def _describe(blocks: list[_Block]) -> str:
    if not blocks:
        return "the completion has no fenced code block"
    langs = ", ".join(b.lang or "no language" for b in blocks)
    return f"{len(blocks)} fenced block(s): {langs}"


def extract_code(
    text: str,
    *,
    kernel_type: str | int | None = None,
    entry_point: str = "",
    io: kernel_pb2.IOContract | None = None,
) -> str:
    """The code of the kernel in an LLM completion; raises NoCodeFound.

    The completion's Markdown fences (```python, ```cuda, ```, ~~~) are stripped; text up to
    a closing </think> tag (a reasoning model's drafts) is skipped when code follows it. Of
    several blocks, the one that defines the entry point is taken: `entry_point`, else
    `class ModelNew` (KernelBench's candidate format, for torch, torch_cuda and triton), or,
    for a kernel launched from its IOContract (cuda, or triton with `io` args), the block
    with the kernel (`__global__`, `@triton.jit`). When several qualify, a block whose
    language matches kernel_type wins, then the last (the model's final answer). With
    kernel_type None, a ModelNew block is taken, else the block with a kernel. A completion
    without fences counts as one block when it is code (starts with code lines)."""
    return _extract(text, kernel_type, entry_point, io).code


def _extract(
    text: str,
    kernel_type: str | int | None,
    entry_point: str,
    io: kernel_pb2.IOContract | None,
) -> _Block:
    type_value = None
    if kernel_type not in (None, "", "auto"):
        type_value = kernelbench.kernel_type(kernel_type, "")
    parts = _THINK_END.split(text)
    answer = parts[-1]
    blocks = _fenced_blocks(answer)
    if not blocks and len(parts) > 1:
        blocks = _fenced_blocks(text)  # the code sits inside the reasoning only
    if not blocks:
        stripped = answer.strip()
        if _PYTHON_CODE.match(stripped) or stripped.startswith(("#include", "__global__")):
            blocks = [_Block("", stripped + "\n")]
    wants = [_wants(type_value, io, entry_point)]
    if type_value is None and not entry_point:
        wants.append("kernel")  # auto: ModelNew first, else whichever block has a kernel
    for want in wants:
        if want == "kernel":
            found = [b for b in blocks if _KERNEL_MARKERS.search(b.code)]
        else:
            found = [b for b in blocks if _defines(b.code, want.removeprefix("entry:"))]
        if found:
            if type_value is not None:
                typed = [
                    b
                    for b in found
                    if kernelbench.detect_kernel_type(b.code, b.filename) == type_value
                ]
                found = typed or found
            return found[-1]
    looked = " or ".join(
        "a kernel (__global__, @triton.jit)"
        if w == "kernel"
        else f"a definition of {w.removeprefix('entry:')}"
        for w in wants
    )
    raise NoCodeFound(f"no code block with {looked}: {_describe(blocks)}")


def kernel_from_completion(
    text: str,
    *,
    kernel_type: str | int | None = None,
    io: kernel_pb2.IOContract | None = None,
    entry_point: str = "",
) -> kernel_pb2.KernelSource:
    """A KernelSource for the code in an LLM completion (see `extract_code`); raises
    NoCodeFound.

    `kernel_type`: "torch", "torch_cuda", "triton", "cuda", a KERNEL_TYPE_* value, or None
    to detect it from the code (load_inline: torch_cuda, @triton.jit: triton, `__global__`
    without Python: cuda). `io` and `entry_point` go into the KernelSource as they are."""
    block = _extract(text, kernel_type, entry_point, io)
    return kernelbench.kernel_source(
        block.code, filename=block.filename, type=kernel_type, io=io, entry_point=entry_point
    )


def spec_from_completion(
    text: str,
    *,
    kernel_type: str | int | None = None,
    reference: kernel_pb2.KernelSource | str | None = None,
    io: kernel_pb2.IOContract | None = None,
    entry_point: str = "",
    options: kernel_pb2.EvalOptions | None = None,
    labels: Mapping[str, str] | None = None,
    client_tag: str = "",
) -> kernel_pb2.JobSpec:
    """A JobSpec for the code in an LLM completion, compared with `reference` when given (a
    KernelSource, or the source text of a KernelBench problem: a `Model` with get_inputs(),
    type detected); raises NoCodeFound. `labels` (e.g. {"problem": "19", "step": "420"}),
    `options` and `client_tag` go into the spec."""
    spec = kernel_pb2.JobSpec(client_tag=client_tag)
    spec.kernel.CopyFrom(
        kernel_from_completion(text, kernel_type=kernel_type, io=io, entry_point=entry_point)
    )
    if isinstance(reference, str):
        if not reference.strip():
            raise ValueError("reference is an empty source")
        spec.reference.CopyFrom(kernelbench.kernel_source(reference))
    elif reference is not None:
        spec.reference.CopyFrom(reference)
    if options is not None:
        spec.options.CopyFrom(options)
    if labels:
        spec.labels.update(labels)
    return spec
