"""Static pre-checks: rules over a candidate's source, before it runs, that raise integrity flags.

The front end runs `check` on every submitted job (never in the job process, which runs the
candidate). The flags go into the job's result; they are advisory unless the job asked for
`reject_flagged`, in which case a flagged candidate is not run at all (VERDICT_REJECTED).

The rules are one walk over the candidate's syntax tree (plus a look into its string constants
for inline CUDA), written for this service's kernel formats (KernelBench's `ModelNew`, Triton,
inline CUDA). They read names through the source's imports, so `import time as t;
t.perf_counter = f` is seen as a write to `time.perf_counter`. They are not a sandbox: code
built at run time (`exec`, `getattr` with computed names, native code) is out of their reach;
the sealed job process and the runtime checks are what hold against that. Each rule must stay
silent on honest kernels: tests/security/test_static_flags.py runs them over KernelBench.

Never raises: a source that does not parse gets no flags (the engine reports the syntax error).
"""

from __future__ import annotations

import ast
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kerneleval.v1 import job_pb2, kernel_pb2

log = logging.getLogger("kerneleval.static_checks")

# Rule ids: stable, part of the API (clients match on them).
TIMER_PATCH = "timer_patch"
HARNESS_PATCH = "harness_patch"
THREAD_OR_PROCESS = "thread_or_process"
CUDA_STREAM = "cuda_stream"
SYS_MODULES = "sys_modules"
GC_WALK = "gc_walk"
CTYPES = "ctypes"
FRAME_WALK = "frame_walk"
SWALLOWED_EXCEPTION = "swallowed_exception"
DECOY_KERNEL = "decoy_kernel"
UNCHECKABLE = "uncheckable"

RULES: dict[str, str] = {
    TIMER_PATCH: "patches a clock or CUDA timing (time.*, torch.cuda.Event, synchronize)",
    HARNESS_PATCH: "imports or patches the service's modules, or patches torch functions",
    THREAD_OR_PROCESS: "starts threads or processes",
    CUDA_STREAM: "creates or switches CUDA streams (work the timing events may not cover)",
    SYS_MODULES: "reads or changes sys.modules",
    GC_WALK: "walks the garbage collector's objects",
    CTYPES: "loads native code through ctypes or cffi",
    FRAME_WALK: "walks the call stack or traces frames (inspect.stack, sys._getframe)",
    SWALLOWED_EXCEPTION: "a broad except whose body does nothing (errors silently swallowed)",
    DECOY_KERNEL: "defines a kernel that its code never launches",
    UNCHECKABLE: "the static checks could not read the source",
}

_THREAD_MODULES = (
    "threading",
    "_thread",
    "multiprocessing",
    "subprocess",
    "concurrent",
    "torch.multiprocessing",
)
_OS_PROCESS_CALLS = re.compile(
    r"os\.(fork|forkpty|system|popen|spawn\w*|posix_spawn\w*|exec\w*|startfile)$"
)
_STREAM_CALLS = frozenset(
    {
        "torch.cuda.Stream",
        "torch.cuda.stream",
        "torch.cuda.ExternalStream",
        "torch.cuda.set_stream",
        "torch.cuda.streams.Stream",
        "torch.cuda.streams.ExternalStream",
        "torch.Stream",
        "torch.cuda.graph",
        "torch.cuda.CUDAGraph",
    }
)
_CUDA_STREAM_TEXT = re.compile(r"\b(cudaStreamCreate\w*|cuStreamCreate\w*|getStreamFromPool)\b")
_GC_WALK = frozenset(
    {"gc.get_objects", "gc.get_referrers", "gc.get_referents", "gc.callbacks", "gc.garbage"}
)
_FRAME_CALLS = frozenset(
    {
        "sys._getframe",
        "sys._current_frames",
        "sys.settrace",
        "sys.setprofile",
        "threading.settrace",
        "threading.setprofile",
        "inspect.stack",
        "inspect.currentframe",
        "inspect.getouterframes",
        "inspect.getinnerframes",
        "inspect.trace",
        "inspect.getframeinfo",
        "traceback.walk_stack",
        "traceback.extract_stack",
    }
)
_FRAME_ATTRS = frozenset(
    {"f_back", "f_locals", "f_globals", "f_builtins", "tb_frame", "gi_frame", "cr_frame"}
)
# Writes under these are honest configuration, not patches.
_TORCH_CONFIG = ("torch.backends.", "torch._dynamo.config.", "torch._inductor.config.")
_HARNESS_ROOTS = frozenset({"kerneleval_server", "kerneleval", "engine", "__main__", "builtins"})
_BROAD_EXCEPTIONS = frozenset({"Exception", "BaseException", "builtins.Exception"})


@dataclass
class _Hits:
    found: dict[str, list[str]] = field(default_factory=dict)

    def add(self, rule: str, node: ast.AST | None, what: str) -> None:
        line = getattr(node, "lineno", 0)
        hit = f"line {line}: {what}" if line else what
        listed = self.found.setdefault(rule, [])
        if hit not in listed:
            listed.append(hit)

    def flags(self) -> list[job_pb2.IntegrityFlag]:
        out = []
        for rule, hits in self.found.items():
            more = f" (and {len(hits) - 1} more)" if len(hits) > 1 else ""
            out.append(
                job_pb2.IntegrityFlag(
                    rule_id=rule,
                    message=f"{RULES[rule]}: {hits[0]}{more}",
                    source=job_pb2.FLAG_SOURCE_STATIC,
                )
            )
        return out


def check(spec: kernel_pb2.JobSpec) -> list[job_pb2.IntegrityFlag]:
    """The flags of the candidate's source (spec.kernel; the reference is trusted)."""
    try:
        return _check(spec.kernel)
    except Exception:  # noqa: BLE001 - a check never fails a job
        log.exception("static checks failed; the job goes on unflagged")
        return []


def _check(kernel: kernel_pb2.KernelSource) -> list[job_pb2.IntegrityFlag]:
    try:
        tree = ast.parse(kernel.source_code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    hits = _Hits()
    try:
        # Every rule reads the same nodes: the tree is walked once (a walk costs far more than
        # going over its list again).
        nodes = list(ast.walk(tree))
        aliases = _aliases(nodes)
        _Walker(aliases, hits).visit(nodes)
        # A kernel launched from the IOContract is launched by the service: never a decoy.
        if not kernel.io.args:
            _decoys(nodes, aliases, hits)
    except RecursionError:
        # Parsed, but nested too deeply for a rule: honest code never is. Flagged rather
        # than passed, so that nesting cannot hide what the rules would have seen.
        hits.add(UNCHECKABLE, None, "nested too deeply for the static checks")
    return hits.flags()


def rule_names(flags: Iterable[job_pb2.IntegrityFlag]) -> str:
    """ "timer_patch, cuda_stream": for state_reason and logs."""
    return ", ".join(dict.fromkeys(f.rule_id for f in flags))


# ---- names -------------------------------------------------------------------------------


def _aliases(nodes: Iterable[ast.AST]) -> dict[str, str]:
    """Local name -> the dotted module path it stands for, from every import in the source
    (`nodes`: all of its syntax tree's nodes)."""
    names: dict[str, str] = {}
    for node in nodes:
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    names[a.asname] = a.name
                else:
                    root = a.name.split(".")[0]
                    names[root] = root
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                if a.name != "*":
                    names[a.asname or a.name] = f"{node.module}.{a.name}"
    return names


def _dotted(expr: ast.AST, aliases: dict[str, str]) -> str | None:
    parts: list[str] = []
    while isinstance(expr, ast.Attribute):
        parts.append(expr.attr)
        expr = expr.value
    if not isinstance(expr, ast.Name):
        return None
    parts.append(aliases.get(expr.id, expr.id))
    return ".".join(reversed(parts))


def _literal(expr: ast.AST) -> str | None:
    return expr.value if isinstance(expr, ast.Constant) and isinstance(expr.value, str) else None


class _Walker:
    """Looks at every node once, without recursion (ast.walk is iterative: a deeply nested
    source cannot make the walk fail and so go unflagged)."""

    def __init__(self, aliases: dict[str, str], hits: _Hits) -> None:
        self.aliases = aliases
        self.hits = hits

    def visit(self, nodes: Iterable[ast.AST]) -> None:
        """Each of `nodes` (a tree's, from ast.walk) once."""
        methods: dict[type, Any] = {}
        for node in nodes:
            kind = type(node)
            method = methods.get(kind, methods)
            if method is methods:
                method = methods[kind] = getattr(self, "visit_" + kind.__name__, None)
            if method is not None:
                method(node)

    def dotted(self, expr: ast.AST) -> str | None:
        return _dotted(expr, self.aliases)

    # -- imports

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            self._imported(a.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module and not node.level:
            self._imported(node.module, node)
            for a in node.names:
                self._imported(f"{node.module}.{a.name}", node, names_only=True)

    def _imported(self, module: str, node: ast.AST, names_only: bool = False) -> None:
        root = module.split(".")[0]
        if not names_only:
            if any(module == m or module.startswith(m + ".") for m in _THREAD_MODULES):
                self.hits.add(THREAD_OR_PROCESS, node, f"imports {module}")
            if root in ("kerneleval_server", "kerneleval", "engine"):
                self.hits.add(HARNESS_PATCH, node, f"imports {module}")
            if root in ("ctypes", "cffi"):
                self.hits.add(CTYPES, node, f"imports {module}")
        self._used(module, node)

    # -- writes

    def visit_Assign(self, node: ast.Assign) -> None:
        for t in node.targets:
            self._write(t, node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._write(node.target, node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self._write(node.target, node)

    def visit_Delete(self, node: ast.Delete) -> None:
        for t in node.targets:
            self._write(t, node)

    def _write(self, target: ast.AST, node: ast.AST) -> None:
        if isinstance(target, (ast.Tuple, ast.List)):
            for t in target.elts:
                self._write(t, node)
            return
        if isinstance(target, ast.Starred):
            self._write(target.value, node)
            return
        if isinstance(target, ast.Subscript):
            # mod.__dict__["x"] = ..., vars(mod)["x"] = ...
            owner = target.value
            if isinstance(owner, ast.Attribute) and owner.attr == "__dict__":
                path = self.dotted(owner.value)
                if path:
                    self._patched(f"{path}.{_literal(target.slice) or '*'}", node)
            elif (
                isinstance(owner, ast.Call)
                and isinstance(owner.func, ast.Name)
                and owner.func.id == "vars"
                and owner.args
            ):
                path = self.dotted(owner.args[0])
                if path:
                    self._patched(f"{path}.{_literal(target.slice) or '*'}", node)
            return
        if isinstance(target, ast.Attribute):
            path = self.dotted(target)
            if path:
                self._patched(path, node)

    def _patched(self, path: str, node: ast.AST) -> None:
        root = path.split(".")[0]
        if path.startswith(_TORCH_CONFIG):
            return
        if (
            root == "time"
            or path.startswith(("torch.cuda.", "triton.testing."))
            or path == "torch.cuda"
        ):
            self.hits.add(TIMER_PATCH, node, f"replaces {path}")
        elif root in _HARNESS_ROOTS or (root == "torch" and "." in path):
            self.hits.add(HARNESS_PATCH, node, f"replaces {path}")
        elif path.startswith("sys.modules"):
            self.hits.add(SYS_MODULES, node, f"writes {path}")

    # -- calls and reads

    def visit_Call(self, node: ast.Call) -> None:
        name = self.dotted(node.func)
        if isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
            if node.args:
                path = self.dotted(node.args[0])
                attr = _literal(node.args[1]) if len(node.args) > 1 else None
                if path:
                    self._patched(f"{path}.{attr or '*'}", node)
        elif isinstance(node.func, ast.Name) and node.func.id == "__import__" and node.args:
            mod = _literal(node.args[0])
            if mod:
                self._imported(mod, node)
        elif name in ("importlib.import_module", "importlib.__import__") and node.args:
            mod = _literal(node.args[0])
            if mod:
                self._imported(mod, node)
        if name:
            self._called(name, node)

    def _called(self, name: str, node: ast.Call) -> None:
        if _OS_PROCESS_CALLS.match(name) or name == "pty.spawn":
            self.hits.add(THREAD_OR_PROCESS, node, f"calls {name}")
        if name in _STREAM_CALLS:
            self.hits.add(CUDA_STREAM, node, f"calls {name}")
        if name in _FRAME_CALLS:
            self.hits.add(FRAME_WALK, node, f"calls {name}")

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr in _FRAME_ATTRS:
            self.hits.add(FRAME_WALK, node, f"reads .{node.attr}")
        path = self.dotted(node)
        if path:
            self._used(path, node)

    def visit_Name(self, node: ast.Name) -> None:
        full = self.aliases.get(node.id)
        if full and full != node.id:
            self._used(full, node)  # `from sys import modules`; `from gc import get_objects`

    def _used(self, path: str, node: ast.AST) -> None:
        if path == "sys.modules" or path.startswith("sys.modules."):
            self.hits.add(SYS_MODULES, node, "uses sys.modules")
        elif path in _GC_WALK:
            self.hits.add(GC_WALK, node, f"uses {path}")

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str):
            m = _CUDA_STREAM_TEXT.search(node.value)
            if m:
                self.hits.add(CUDA_STREAM, node, f"its CUDA source calls {m.group(1)}")

    # -- control flow

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        if _broad(node.type, self.aliases) and all(_does_nothing(s) for s in node.body):
            caught = (_dotted(node.type, self.aliases) or "a tuple") if node.type else "everything"
            self.hits.add(SWALLOWED_EXCEPTION, node, f"catches {caught} and does nothing")


def _broad(expr: ast.expr | None, aliases: dict[str, str]) -> bool:
    if expr is None:
        return True
    if isinstance(expr, ast.Tuple):
        return any(_broad(e, aliases) for e in expr.elts)
    return _dotted(expr, aliases) in _BROAD_EXCEPTIONS


def _does_nothing(stmt: ast.stmt) -> bool:
    if isinstance(stmt, (ast.Pass, ast.Continue)):
        return True
    return isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)


# ---- decoys -------------------------------------------------------------------------------


def _is_triton_jit(dec: ast.expr, aliases: dict[str, str]) -> bool:
    target = dec.func if isinstance(dec, ast.Call) else dec
    name = _dotted(target, aliases) or ""
    return name in ("triton.jit", "triton.autotune", "triton.heuristics", "triton.runtime.jit")


def _decoys(nodes: list[ast.AST], aliases: dict[str, str], hits: _Hits) -> None:
    """A Triton kernel never referenced from host code, or inline CUDA whose `__global__`
    kernels are never launched (no `<<<` and no launch API) or whose loaded module is never
    used. Textual: a reference is not a launch, so a decoy that names its kernel somewhere
    passes; the runtime check of launched kernels (later work) is what closes that."""
    jit: dict[str, ast.FunctionDef] = {}
    for node in nodes:
        if isinstance(node, ast.FunctionDef) and any(
            _is_triton_jit(d, aliases) for d in node.decorator_list
        ):
            jit[node.name] = node
    if jit:
        inside_jit = {id(n) for f in jit.values() for n in ast.walk(f)}
        referenced = {
            n.id if isinstance(n, ast.Name) else n.attr
            for n in nodes
            if id(n) not in inside_jit
            and (
                (isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load))
                or isinstance(n, ast.Attribute)
            )
        }
        if not referenced & set(jit):
            first = min(jit.values(), key=lambda f: f.lineno)
            hits.add(
                DECOY_KERNEL,
                first,
                f"@triton.jit {', '.join(sorted(jit))} never launched or referenced outside "
                "Triton code",
            )
    texts = [n.value for n in nodes if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    cuda = "\n".join(t for t in texts if "__global__" in t)
    if cuda and "<<<" not in cuda and not re.search(r"cudaLaunch\w*|cuLaunchKernel", cuda):
        hits.add(
            DECOY_KERNEL,
            None,
            "its CUDA source defines __global__ kernels and never "
            "launches one (no <<<...>>> and no launch API)",
        )
    used = {n.id for n in nodes if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    for node in nodes:
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call)
            and (_dotted(node.value.func, aliases) or "").endswith("cpp_extension.load_inline")
        ):
            names = {t.id for t in node.targets if isinstance(t, ast.Name)}
            if names and not names & used:
                hits.add(
                    DECOY_KERNEL,
                    node,
                    f"the load_inline module {', '.join(sorted(names))} is never used",
                )
