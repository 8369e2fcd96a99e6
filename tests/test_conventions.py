"""Packaging and conventions (issue 17): one version, declared imports, the README's defaults
in `serve --help`, metric and reason names as docs/OPERATIONS.md has them, the children's
stderr lines as JSON records. No service (tests/test_conventions_e2e.py asks a running one)."""

from __future__ import annotations

import ast
import asyncio
import functools
import json
import logging
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import fields
from importlib import metadata
from pathlib import Path

import kerneleval
import pytest
import tomllib
from kerneleval.v1 import job_pb2
from kerneleval_server import logs
from kerneleval_server import metrics as metrics_mod
from kerneleval_server.config import Config, add_arguments, default_text
from kerneleval_server.jobs.admission import QUOTAS
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from setuptools.config.pyprojecttoml import read_configuration

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
OPERATIONS = (REPO / "docs" / "OPERATIONS.md").read_text()
CLIENT = REPO / "clients" / "python"
CLIENT_SRC = CLIENT / "src" / "kerneleval"
GENERATED = ("v1", "internal")  # made by protoc; their imports are the server's business


def project(folder: Path) -> dict:
    cwd = os.getcwd()
    os.chdir(folder)  # setuptools resolves package-dir against the working directory
    try:
        return read_configuration(folder / "pyproject.toml", expand=True)["project"]
    finally:
        os.chdir(cwd)


# ---- one version --------------------------------------------------------------------------


def test_client_and_server_metadata_read_the_one_version() -> None:
    server, client = project(REPO), project(CLIENT)
    assert server["version"] == client["version"] == kerneleval.__version__
    for folder in (REPO, CLIENT):
        raw = tomllib.loads((folder / "pyproject.toml").read_text())
        assert "version" not in raw["project"] and raw["project"]["dynamic"] == ["version"]
    # The literal lives in one file only.
    literal = f'"{kerneleval.__version__}"'
    holders = [
        p
        for p in (*REPO.joinpath("server").rglob("*.py"), *CLIENT_SRC.rglob("*.py"))
        if literal in p.read_text()
    ]
    assert holders == [CLIENT_SRC / "__init__.py"]


def test_server_reports_the_version() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kerneleval_server", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.stdout.strip() == f"kerneleval {kerneleval.__version__}", out


# ---- declared imports ---------------------------------------------------------------------


def imports(root: Path, top_level_only: bool = False) -> Iterator[tuple[str, Path]]:
    """(distribution-level module, file) of each absolute import: `google.rpc`, not `google`."""
    for path in root.rglob("*.py"):
        if any(part in GENERATED for part in path.relative_to(root).parts[:-1]):
            continue
        tree = ast.parse(path.read_text())
        nodes = tree.body if top_level_only else list(ast.walk(tree))
        for node in nodes:
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                parts = name.split(".")
                yield ".".join(parts[:2]) if parts[0] == "google" else parts[0], path


@functools.cache
def providers(module: str) -> frozenset[str]:
    """Distributions that install `module` (google.X: the ones with a google/X folder)."""
    top, _, sub = module.partition(".")
    found = set()
    for dist in metadata.packages_distributions().get(top, []):
        files = metadata.distribution(dist).files or []
        if not sub or any(f.parts[:2] == (top, sub) for f in files):
            found.add(canonicalize_name(dist))
    return frozenset(found)


# Import name's distribution -> the one a project declares for it.
DECLARED_AS = {"protobuf-py-pure": "protobuf-py"}  # protobuf-py picks its pure or native half


def declared(requirements: list[str]) -> set[str]:
    return {canonicalize_name(Requirement(r).name) for r in requirements}


def undeclared(found: Iterator[tuple[str, Path]], names: set[str], own: set[str]) -> list[str]:
    missing = set()
    for module, path in found:
        if module in own or module in sys.stdlib_module_names:
            continue
        dists = {DECLARED_AS.get(d, d) for d in providers(module)}
        if not dists & names:
            missing.add(f"{module} ({path.relative_to(REPO)}; from {sorted(dists)})")
    return sorted(missing)


def test_server_declares_every_package_it_imports() -> None:
    deps = declared(project(REPO)["dependencies"])
    found = imports(REPO / "server" / "kerneleval_server")
    assert undeclared(found, deps, {"kerneleval_server"}) == []
    assert "kerneleval-client" in deps  # kerneleval.v1: the generated code


def test_client_declares_what_it_imports() -> None:
    client = project(CLIENT)
    deps = declared(client["dependencies"])
    extra_names = declared([r for rs in client["optional-dependencies"].values() for r in rs])
    # Module level (what importing the package and its CLI needs): dependencies only, but for
    # the module of an extra (`kerneleval mcp` imports it when it runs).
    extra_modules = {CLIENT_SRC / "mcp_server.py"}
    top = ((m, p) for m, p in imports(CLIENT_SRC, top_level_only=True) if p not in extra_modules)
    assert undeclared(top, deps, {"kerneleval"}) == []
    # Anywhere: a dependency, an extra, or one of these, imported only where they are used.
    optional = {"torch", "nvidia-ml-py", "kerneleval-server"}  # contracts, doctor, `serve`
    left = undeclared(imports(CLIENT_SRC), deps | extra_names | optional, {"kerneleval"})
    assert left == []
    assert {"rich", "mcp"} <= extra_names


# ---- serve --help and the README ----------------------------------------------------------


def readme_defaults() -> dict[str, str]:
    """Setting -> the README configuration table's default cell, without backticks."""
    table = README.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`--"):
            for flag in re.findall(r"`--([a-z0-9-]+)`", cells[0]):
                rows[flag.replace("-", "_")] = cells[2].replace("`", "")
    return rows


def test_readme_defaults_are_the_real_ones() -> None:
    rows = readme_defaults()
    wrong = {}
    for f in fields(Config):
        shown, cell = default_text(f), rows.get(f.name)
        # The cell is the default, maybe followed by a note in parentheses.
        if cell is None or not (cell == shown or (shown and cell.startswith(shown + " ("))):
            wrong[f.name] = (shown, cell)
    assert wrong == {}


def test_serve_help_shows_the_defaults() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    helps = {a.dest: a.help or "" for a in parser._actions}
    for f in fields(Config):
        shown = default_text(f)
        if shown:
            assert helps[f.name].endswith(f"; default: {shown})"), helps[f.name]
        else:
            assert "default" not in helps[f.name], helps[f.name]
    # The ones issue 17 found wrong, as the watchdog applies them.
    by_name = {f.name: default_text(f) for f in fields(Config)}
    assert by_name["max_restarts"] == "5" and by_name["restart_window_s"] == "30"
    assert by_name["kmsg_path"] == "/dev/kmsg"


def test_serve_help_is_headed_by_the_real_command() -> None:
    cli = Path(sys.executable).with_name("kerneleval")
    if not cli.exists():
        pytest.skip("no kerneleval command in this environment")
    env = {**os.environ, "COLUMNS": "200"}
    out = subprocess.run(
        [str(cli), "serve", "--help"], capture_output=True, text=True, timeout=60, env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: kerneleval serve "), out.stdout[:200]
    assert "kerneleval_server" not in out.stdout.splitlines()[0]
    entry = re.search(r"\n  --max-restarts .*?(?=\n  -)", out.stdout, flags=re.S)
    assert entry is not None and "default: 5)" in " ".join(entry.group().split()), out.stdout


# ---- metrics and reasons as docs/OPERATIONS.md says ------------------------------------------


def exported() -> dict[str, tuple[str, ...]]:
    """Every family the service registers: name -> its labels."""
    out = {}
    for c in metrics_mod.Metrics().registry._collector_to_names:
        kind, name = c._type, c._name  # type: ignore[attr-defined]
        out[f"{name}_total" if kind == "counter" else name] = tuple(c._labelnames)  # type: ignore[attr-defined]
    return out


def family(series: str, families: dict[str, tuple[str, ...]]) -> str | None:
    """The family of a series name (`x_bucket` is of histogram `x`)."""
    for suffix in ("", "_bucket", "_count", "_sum", "_created"):
        base = series.removesuffix(suffix) if suffix else series
        if base in families and (not suffix or series.endswith(suffix)):
            return base
    return None


def enum_names(enum: object, prefix: str) -> set[str]:
    return {n.removeprefix(prefix) for n in enum.keys()}  # type: ignore[attr-defined]


# A label's values where the code names them (others are free: device indices and the like).
LABEL_VALUES: dict[str, set[str]] = {
    "reason": set(metrics_mod.WORKER_EXIT_REASONS) | {metrics_mod.OTHER_REASON},
    "state": enum_names(job_pb2.JobState, "JOB_STATE_"),
    "verdict": enum_names(job_pb2.Verdict, "VERDICT_"),
    "success": {"true", "false"},
    "quota": set(QUOTAS),
}
NUMERIC_LABELS = {"xid", "device"}
SELECTOR = re.compile(r"\b((?:kerneleval|grpc_server)_[a-z_]+)(\{[^}]*\})?")
MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"')


def documented_expressions() -> list[str]:
    """The PromQL blocks and the inline code spans that name a metric."""
    blocks = re.findall(r"```promql\n(.*?)```", OPERATIONS, flags=re.S)
    spans = [s for s in re.findall(r"`([^`\n]+)`", OPERATIONS) if SELECTOR.search(s)]
    lines = [ln for b in blocks for ln in b.splitlines() if ln and not ln.startswith("#")]
    return lines + spans


def test_documented_alerts_name_real_series_and_label_values() -> None:
    families = exported()
    expressions = documented_expressions()
    assert any('reason="crashed"' in e for e in expressions)  # the alert issue 17 found dead
    problems = []
    for expr in expressions:
        for name, matchers in SELECTOR.findall(expr):
            fam = family(name, families)
            if fam is None:
                problems.append(f"{expr}: no series {name}")
                continue
            for label, op, value in MATCHER.findall(matchers):
                if label not in families[fam]:
                    problems.append(f"{expr}: {fam} has no label {label}")
                    continue
                values = value.split("|") if op in ("=~", "!~") else [value]
                for v in values:
                    known = LABEL_VALUES.get(label)
                    if known is not None and v not in known:
                        problems.append(f"{expr}: {label}={v!r} is never emitted")
                    if label in NUMERIC_LABELS and not v.isdigit():
                        problems.append(f"{expr}: {label}={v!r} is not a number")
    assert problems == []


def test_metrics_table_is_what_the_service_registers() -> None:
    section = OPERATIONS.split("## Metrics", 1)[1].split("\n## ", 1)[0]
    table = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            labels = tuple(x.strip() for x in cells[1].split(",") if x.strip())
            table[cells[0].strip("`")] = labels
    assert table == exported()


def test_reason_table_is_every_reason() -> None:
    section = OPERATIONS.split("## Watching events", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `([a-z_:]+)` \|", section, flags=re.M))
    assert documented == set(metrics_mod.WORKER_EXIT_REASONS)
    assert "`other`" in section


def test_reasons_the_code_emits_are_known() -> None:
    """The watchdog's exit reasons (C++ literals) and the front end's kill reasons."""
    reasons = metrics_mod.WORKER_EXIT_REASONS
    cc = "\n".join(p.read_text() for p in (REPO / "watchdog" / "src").glob("*.cc"))
    literals = set()
    for call in re.findall(r"(?:terminate|stop_workers)\([^;]*?\);", cc, flags=re.S):
        literals |= set(re.findall(r'"([a-z_:]+)"', call))
    # The exit of a job process nobody asked to stop: on_worker_exit's reason.
    literals |= set(re.findall(r'"(\w+)"', cc.split("const std::string reason =", 1)[1][:200]))
    assert {"crashed", "exited", "oom", "xid", "reset", "shutdown"} <= literals
    literals.remove("killed:")  # + the front end's KillWorker reason, checked below
    assert literals - reasons == set()
    assert {f"killed:{k}" for k in metrics_mod.KILL_REASONS} <= reasons

    server = REPO / "server" / "kerneleval_server"
    # The job manager's kills (a job's process killed: exits.py), its job processes'
    # keeping's, and the watchdog events' (a job process without its channel).
    killers = [
        server / "jobs" / "manager.py",
        server / "jobs" / "exits.py",
        server / "jobs" / "processes.py",
        server / "fleet" / "watchdog_events.py",
    ]
    kills = []
    for node in (n for p in killers for n in ast.walk(ast.parse(p.read_text()))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in ("kill_worker", "kill") and len(node.args) == 2:
                kills.append(node.args[1])
            for kw in node.keywords:
                if kw.arg == "reason" and isinstance(kw.value, ast.Constant):
                    assert kw.value.value in reasons, ast.unparse(node)
    assert len(kills) >= 6
    for arg in kills:  # a named constant, so the list above stays complete
        if isinstance(arg, ast.Name) and arg.id == "reason":
            continue  # Exits.kill passes its own argument on
        assert isinstance(arg, ast.Attribute) and arg.attr.startswith("KILL_"), ast.unparse(arg)
        assert getattr(metrics_mod, arg.attr) in metrics_mod.KILL_REASONS


def test_unknown_reasons_keep_the_label_set_bounded() -> None:
    m = metrics_mod.Metrics()
    m.worker_restarted(0, "crashed")
    m.worker_restarted(0, "something new")
    samples = {
        (s.labels["reason"], s.value)
        for fam in m.registry.collect()
        if fam.name == "kerneleval_worker_restarts"
        for s in fam.samples
        if s.name.endswith("_total")
    }
    assert samples == {("crashed", 1.0), ("other", 1.0)}


# ---- the children's stderr in the service's log ---------------------------------------------


def test_child_stderr_lines_become_json_records(caplog: pytest.LogCaptureFixture) -> None:
    long_line = b"y" * (logs.MAX_CHILD_LINE + 10)
    written = (
        b"kerneleval-watchdog: zygote of device 0 started: pid 7\n"
        b"kerneleval zygote: config refused: bad\n"
        b"kerneleval job process d0-w1: setgroups: EPERM\n"
        b"Traceback (most recent call last):\n" + long_line + b"\nlast words"
    )

    async def forward() -> None:
        fd = await logs.child_stderr()

        def write() -> None:  # more than a pipe holds: the reader must keep up
            with os.fdopen(fd, "wb") as pipe:
                pipe.write(written)

        await asyncio.to_thread(write)
        await asyncio.wait_for(asyncio.gather(*logs._forwarders), 10)

    with caplog.at_level(logging.INFO):
        asyncio.run(forward())
    as_json = [json.loads(logs.JsonFormatter().format(r)) for r in caplog.records]
    got = [(r["logger"], r["level"], r["message"][:40]) for r in as_json]
    assert got[:4] == [
        ("kerneleval.watchdog", "INFO", "zygote of device 0 started: pid 7"),
        ("kerneleval.zygote", "INFO", "config refused: bad"),
        ("kerneleval.jobproc", "INFO", "kerneleval job process d0-w1: setgroups:"),
        ("kerneleval.watchdog", "WARNING", "Traceback (most recent call last):"),
    ]
    rest = [r["message"] for r in as_json[4:]]
    assert rest[-1] == "last words"  # the end without a newline, then EOF
    # The long line: its first MAX_CHILD_LINE characters, marked; what follows of it, if
    # anything, as more records (never one longer).
    assert rest[0] == "y" * logs.MAX_CHILD_LINE + " [cut]"
    assert all(set(m.removesuffix(" [cut]")) == {"y"} for m in rest[1:-1])
