"""Shared helpers of the bench/ scripts: a service process, machine facts, statistics, output.

Every benchmark starts its own `python -m kerneleval_server serve` on a free port in a fresh
state folder (`Service`), states the machine and versions (`machine_info`), and writes
<out>/<name>.json and <out>/<name>.md (`write_results`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
for _p in (REPO / "server", REPO / "clients" / "python" / "src"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import grpc  # noqa: E402
from kerneleval.client import Client  # noqa: E402

DEFAULT_OUT = REPO / "bench" / "results"
WATCHDOG = REPO / "build" / "watchdog" / "kerneleval-watchdog"


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for Python children: the repo's server and client on PYTHONPATH."""
    env = dict(os.environ)
    paths = [str(REPO / "server"), str(REPO / "clients" / "python" / "src")]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.pop("KERNELEVAL_ADMIN_TOKEN", None)
    env.update(extra or {})
    return env


def _die_with_parent() -> None:
    """In the service's child: SIGTERM when the benchmark dies (even by SIGKILL), so that no
    service outlives its benchmark and holds the GPU into the next one."""
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


class Service:
    """One `kerneleval_server serve` on a free port; `client()` gives a Client with the token."""

    def __init__(
        self,
        flags: Sequence[str],
        *,
        root: Path | None = None,
        nvml: str = "none",
        result_cache: bool = False,
    ):
        """`result_cache`: keep the service's result cache on. Off, as benchmarks measure
        runs: the same job sent again runs again (jobs need no bypass_cache, which would also
        keep their references' times from being reused: --reference-time-reuse-s)."""
        self.root = root or Path(tempfile.mkdtemp(prefix="kerneleval-bench-"))
        self.root.mkdir(parents=True, exist_ok=True)
        self.resets = self.root / "resets.log"
        # Never reset a lent GPU: the reset command only records that it was called.
        script = self.root / "record_reset.sh"
        script.write_text(f'#!/bin/sh\necho "reset $*" >> {self.resets}\n')
        script.chmod(0o755)
        self.port_file = self.root / "port"
        self.state = self.root / "state"
        self.log = self.root / "service.log"
        self.cmd = [
            sys.executable, "-m", "kerneleval_server", "serve",
            "--port", "0", "--port-file", str(self.port_file),
            "--state-dir", str(self.state),
            "--watchdog", str(WATCHDOG),
            "--reset-command", f"{script} {{index}}",
            "--nvml", nvml,
            "--log-file", str(self.log),
            *([] if result_cache else ["--result-cache-hours", "0"]),
            *flags,
        ]  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None
        self.address = ""
        self.token = ""

    def start(self, timeout: float = 180.0) -> Service:
        if not WATCHDOG.exists():
            raise SystemExit(f"the watchdog is not built ({WATCHDOG}): run `make watchdog`")
        # A start again on the same folder (a restart): the last start's port is not this one's.
        self.port_file.unlink(missing_ok=True)
        stderr = open(self.root / "service.stderr", "wb")  # noqa: SIM115 - the child keeps it
        self.proc = subprocess.Popen(
            self.cmd, cwd=REPO, env=child_env(), stdout=subprocess.DEVNULL, stderr=stderr,
            preexec_fn=_die_with_parent,
        )  # fmt: skip
        stderr.close()
        deadline = time.monotonic() + timeout
        while not (self.port_file.exists() and self.port_file.read_text().strip()):
            self._check(deadline)
            time.sleep(0.05)
        self.address = f"127.0.0.1:{self.port_file.read_text().strip()}"
        self.token = (self.state / "admin_token").read_text().strip()
        with self.client() as c:
            while True:
                try:
                    if c.health() == "SERVING":
                        break
                except Exception:  # noqa: BLE001 - not up yet
                    pass
                self._check(deadline)
                time.sleep(0.1)
        return self

    def wait_workers(self, count: int, timeout: float = 180.0) -> None:
        """Wait until `count` job-taking workers (not spares) are up: they import torch."""
        deadline = time.monotonic() + timeout
        with self.client() as c:
            while True:
                devices = c.list_devices()
                up = sum(1 for d in devices for w in d.workers if not w.spare and w.pid)
                if up >= count:
                    return
                self._check(deadline)
                time.sleep(0.2)

    def _check(self, deadline: float) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise SystemExit(f"the service exited ({self.proc.returncode}):\n{self.tail()}")
        if time.monotonic() > deadline:
            raise SystemExit(f"the service did not become ready:\n{self.tail()}")

    def tail(self, lines: int = 30) -> str:
        text = ""
        for name in ("service.stderr", "service.log"):
            p = self.root / name
            if p.exists():
                text += "\n".join(p.read_text(errors="replace").splitlines()[-lines:]) + "\n"
        return text

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def client(self, timeout: float | None = None) -> Client:
        return Client(self.address, admin_token=self.token, timeout=timeout)

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.address)

    def warnings(self) -> list[str]:
        """The watchdog's warnings (e.g. a sandbox feature the host refused), from the log."""
        out: list[str] = []
        if self.log.exists():
            for line in self.log.read_text(errors="replace").splitlines():
                try:
                    msg = str(json.loads(line).get("message", ""))
                except ValueError:
                    continue
                if msg.startswith("watchdog:") and msg not in out:
                    out.append(msg)
        return out

    def resets_recorded(self) -> int:
        return len(self.resets.read_text().splitlines()) if self.resets.exists() else 0

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def rss_kib(pid: int) -> int:
    """Resident memory of one process, from /proc (0 if it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def child_pids(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(x) for x in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"


def gpus() -> list[dict[str, str]]:
    """GPU name, driver and memory per GPU from nvidia-smi; [] without one."""
    if not shutil.which("nvidia-smi"):
        return _gpus_from_proc()
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,name,driver_version,memory.total",
             "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return []
    rows = []
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 4:
            rows.append(
                {"index": parts[0], "name": parts[1], "driver": parts[2], "memory": parts[3]}
            )
    return rows


def _gpus_from_proc() -> list[dict[str, str]]:
    """The same facts from the driver's /proc files, where nvidia-smi is missing."""
    try:
        version = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return []
    m = re.search(r"Kernel Module\s+(?:for \S+\s+)?([\d.]+)", version)
    driver = m.group(1) if m else "unknown"
    rows = []
    for i, info in enumerate(sorted(Path("/proc/driver/nvidia/gpus").glob("*/information"))):
        name = "unknown"
        for line in info.read_text(errors="replace").splitlines():
            if line.startswith("Model:"):
                name = line.split(":", 1)[1].strip()
        rows.append({"index": str(i), "name": name, "driver": driver, "memory": ""})
    return rows


def machine_info() -> dict[str, Any]:
    """Machine, versions and date, stated in every result."""
    g = gpus()
    return {
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "mem_total_gib": round(mem_total_bytes() / 2**30, 1),
        "gpus": g,
        "gpu": f"{g[0]['name']} (driver {g[0]['driver']})" if g else "none",
        "gpu_count": len(g),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "triton": _version("triton"),
        "grpcio": _version("grpcio"),
        "protobuf": _version("protobuf"),
        "platform": platform.platform(),
    }


def mem_total_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return 0


def machine_line(info: dict[str, Any]) -> str:
    return (
        f"{info['date_utc']}; GPU: {info['gpu']} x{info['gpu_count']}; "
        f"{info['cpu_count']} CPUs, {info['mem_total_gib']} GiB; Python {info['python']}, "
        f"torch {info['torch']}, triton {info['triton']}, grpcio {info['grpcio']}, "
        f"protobuf {info['protobuf']}"
    )


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def summary(values: Sequence[float]) -> dict[str, float]:
    """n, median, p99, mean, min, max of a sample (same unit as the input)."""
    if not values:
        return {"n": 0, "median": 0.0, "p99": 0.0, "mean": 0.0, "min": 0.0, "max": 0.0}
    return {
        "n": len(values),
        "median": statistics.median(values),
        "p99": percentile(values, 99),
        "mean": statistics.fmean(values),
        "min": min(values),
        "max": max(values),
    }


def ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def fmt(value: Any) -> str:
    """Floats with 4 significant digits below 1, 2 decimals below 100, 1 decimal above."""
    if isinstance(value, float):
        if value == 0 or abs(value) >= 100:
            return f"{value:.1f}"
        if abs(value) >= 1:
            return f"{value:.2f}"
        return f"{value:.4g}"
    return str(value)


def text_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def md_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    out = ["| " + " | ".join(str(h) for h in headers) + " |"]
    out.append("|" + "|".join(" --- " for _ in headers) + "|")
    out += ["| " + " | ".join(fmt(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def write_results(
    out: str | Path,
    name: str,
    title: str,
    info: dict[str, Any],
    data: dict[str, Any],
    tables: Sequence[tuple[str, Sequence[str], Sequence[Sequence[Any]]]],
    notes: Sequence[str] = (),
) -> None:
    """Print the tables, write <out>/<name>.json (info + data) and <out>/<name>.md."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    md = [f"# {title}", "", f"Machine: {machine_line(info)}", ""]
    print(f"\n== {title} ==\n{machine_line(info)}")
    for caption, headers, rows in tables:
        print(f"\n{caption}\n{text_table(headers, rows)}")
        md += [f"## {caption}", "", md_table(headers, rows), ""]
    if notes:
        print("\n" + "\n".join(f"- {n}" for n in notes))
        md += ["Notes:", "", *[f"- {n}" for n in notes], ""]
    (folder / f"{name}.json").write_text(
        json.dumps({"machine": info, **data}, indent=2, default=str) + "\n"
    )
    (folder / f"{name}.md").write_text("\n".join(md))
    print(f"\nwrote {folder / name}.json and .md", flush=True)


def ts(t: Any) -> float:
    """A protobuf Timestamp as seconds since the epoch."""
    return float(t.seconds) + float(t.nanos) / 1e9


def add_common_args(ap: Any, *, smoke: bool = True) -> None:
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="results folder")
    if smoke:
        ap.add_argument(
            "--cpu-smoke", action="store_true", help="no GPU: small, CPU + Triton interpreter"
        )


# ---- PostgreSQL for the shared-store benchmarks (issue 18) -----------------------------------


def _version_key(path: str) -> tuple[int, ...]:
    """/usr/lib/postgresql/<N>/bin/initdb -> (N,): the newest major version sorts last."""
    parts = Path(path).parts
    try:
        return tuple(int(x) for x in parts[-3].split("."))
    except (IndexError, ValueError):
        return (0,)


def pgserver_bin() -> Path | None:
    """The PostgreSQL binaries inside the `pgserver` wheel (pgserver/pginstall/bin), found
    without importing pgserver (its Python dependencies need not be installed)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("pgserver")
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec else []:
        bindir = Path(location) / "pginstall" / "bin"
        if (bindir / "initdb").exists():
            return bindir
    return None


def postgres_bin(which: str = "auto") -> tuple[Path, str] | None:
    """(bin folder, where from) of PostgreSQL server binaries: `system` (Debian's
    /usr/lib/postgresql/<N>/bin, else initdb on PATH), `pgserver` (the wheel's), or `auto`
    (system, else pgserver); None where there are none. Any other value is a bin folder."""
    if which not in ("auto", "system", "pgserver"):
        path = Path(which)
        return (path, "given") if (path / "initdb").exists() else None
    if which in ("auto", "system"):
        import glob

        found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=_version_key)
        if found:
            return Path(found[-1]).parent, "system"
        initdb = shutil.which("initdb")
        if initdb:
            return Path(initdb).resolve().parent, "system"
    if which in ("auto", "pgserver"):
        bindir = pgserver_bin()
        if bindir is not None:
            return bindir, "pgserver"
    return None


def _unprivileged_user() -> str:
    """A user to run PostgreSQL as when this runs as root (initdb and postgres refuse root):
    `postgres`, made if missing (useradd), else the job user `kerneleval-job`, else nobody."""
    import pwd

    for attempt in range(2):
        try:
            pwd.getpwnam("postgres")
            return "postgres"
        except KeyError:
            if attempt == 0 and shutil.which("useradd"):
                subprocess.run(
                    ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                     "postgres"],
                    capture_output=True, timeout=60,
                )  # fmt: skip
    for name in ("kerneleval-job", "nobody"):
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            continue
    raise SystemExit("running as root and no unprivileged user to run PostgreSQL as")


class Postgres:
    """A throw-away PostgreSQL server: a temporary folder, unix socket only (no TCP), trust
    authentication, no fsync; the binaries of `postgres_bin(which)`. As root, initdb, pg_ctl
    and the server run as an unprivileged user (`_unprivileged_user`) that owns the folder.
    The wheel's binaries find their libraries through LD_LIBRARY_PATH (its pginstall/lib and
    the wheel's bundled pgserver.libs)."""

    def __init__(self, which: str = "auto") -> None:
        found = postgres_bin(which)
        if found is None:
            raise SystemExit(
                f"no PostgreSQL server binaries ({which}): Debian's postgresql (`make` installs "
                "it) or the pgserver wheel (bench/run_gpu.sh installs .whl/pgserver-*.whl)"
            )
        self.bindir, self.source = found
        root = Path(tempfile.mkdtemp(prefix="kerneleval-pg-"))
        if len(str(root)) > 80:  # a unix socket's path has room for about 107 bytes
            shutil.rmtree(root, ignore_errors=True)
            root = Path(tempfile.mkdtemp(prefix="kerneleval-pg-", dir="/tmp"))
        self.root = root
        self.port = 5432 + (os.getpid() % 1000) + 1
        self.user = ""
        self.run_as: dict[str, Any] = {}
        if os.geteuid() == 0:
            import pwd

            self.user = _unprivileged_user()
            pw = pwd.getpwnam(self.user)
            os.chown(self.root, pw.pw_uid, pw.pw_gid)
            self.run_as = {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}
        os.chmod(self.root, 0o700)
        self.env = self._env()
        self.started = False

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        env.update({"LC_ALL": "C", "LANG": "C", "HOME": str(self.root)})
        libs = [self.bindir.parent / "lib", self.bindir.parents[2] / "pgserver.libs"]
        extra = [str(p) for p in libs if p.is_dir()]
        if self.source != "system" and extra:
            old = env.get("LD_LIBRARY_PATH", "")
            env["LD_LIBRARY_PATH"] = os.pathsep.join(extra + ([old] if old else []))
        return env

    def _run(self, *args: str, timeout: float = 120) -> None:
        try:
            subprocess.run(
                list(args), check=True, capture_output=True, text=True, timeout=timeout,
                env=self.env, cwd=self.root, **self.run_as,
            )  # fmt: skip
        except OSError as e:  # not executable by the user it runs as
            raise SystemExit(f"{args[0]}: {e} (as {self.user or 'this user'})") from e
        except subprocess.CalledProcessError as e:
            log = self.root / "log"
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise SystemExit(
                f"{Path(args[0]).name} failed ({e.returncode}; {self.source} binaries in "
                f"{self.bindir}, as {self.user or 'this user'}):\n{e.stdout[-2000:]}\n"
                f"{e.stderr[-2000:]}\n{tail}"
            ) from e

    def _own_copy(self) -> None:
        """The wheel's binaries copied into the server's folder, owned by the user that runs
        them (for an installation that user cannot read, e.g. made under umask 077)."""
        top = self.root / "pg"
        shutil.copytree(self.bindir.parent, top / "pgserver" / "pginstall",
                        ignore=shutil.ignore_patterns("include"))  # fmt: skip
        libs = self.bindir.parents[2] / "pgserver.libs"
        if libs.is_dir():
            shutil.copytree(libs, top / "pgserver.libs")
        for path in [top, *top.rglob("*")]:
            os.chown(path, self.run_as["user"], self.run_as["group"], follow_symlinks=False)
            if not path.is_symlink():
                path.chmod(0o755 if path.is_dir() or path.parent.name == "bin" else 0o644)
        self.bindir = top / "pgserver" / "pginstall" / "bin"
        self.env = self._env()

    def _initdb(self, data: Path) -> None:
        for exe in self.bindir.iterdir():
            if exe.is_file() and not os.access(exe, os.X_OK):
                exe.chmod(0o755)  # a wheel unpacked without its modes
        self._run(str(self.bindir / "initdb"), "-D", str(data), "-A", "trust", "-U",
                  "kerneleval", "--no-sync", "-E", "UTF8", "--locale=C")  # fmt: skip

    def start(self) -> Postgres:
        data = self.root / "data"
        try:
            self._initdb(data)
        except SystemExit as failed:
            if not self.run_as or self.source == "system":
                raise
            print(f"initdb as {self.user} failed; again with a copy of the binaries it "
                  f"owns: {str(failed)[-300:]}", flush=True)  # fmt: skip
            shutil.rmtree(data, ignore_errors=True)
            self._own_copy()
            self._initdb(data)
        options = (f"-k {self.root} -p {self.port} -c listen_addresses='' -c fsync=off "
                   "-c max_connections=300")  # fmt: skip
        self._run(str(self.bindir / "pg_ctl"), "-D", str(data), "-l", str(self.root / "log"),
                  "-o", options, "-w", "-t", "60", "start")  # fmt: skip
        self.started = True
        import atexit

        atexit.register(self.stop)
        return self

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://kerneleval@/{database}?host={self.root}&port={self.port}"

    def new_database(self) -> str:
        """A fresh, empty database; its URL."""
        import uuid

        import psycopg

        name = "t_" + uuid.uuid4().hex[:12]
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def version(self) -> str:
        try:
            out = subprocess.run([str(self.bindir / "postgres"), "--version"], env=self.env,
                                 capture_output=True, text=True, timeout=30)  # fmt: skip
            return out.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return "unknown"

    def stop(self) -> None:
        if not self.started:
            shutil.rmtree(self.root, ignore_errors=True)
            return
        self.started = False
        try:
            self._run(str(self.bindir / "pg_ctl"), "-D", str(self.root / "data"), "-m",
                      "immediate", "-w", "stop", timeout=60)  # fmt: skip
        except (SystemExit, subprocess.SubprocessError):
            pass
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


def log_records(path: Path, offset: int = 0) -> list[dict[str, Any]]:
    """The JSON records of a service's log (from byte `offset`), lines that are none left out."""
    if not path.exists():
        return []
    with path.open("rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace")
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def add_service_flags(ap: argparse.ArgumentParser) -> None:
    """The service's choices a benchmark compares arms of: a kernel compared with an eager
    reference, and any other flag (service_flags gives the service's flags)."""
    ap.add_argument(
        "--reference-time-reuse-s", type=float, default=None,
        help="the service's --reference-time-reuse-s (60; 0 times every job's reference)",
    )  # fmt: skip
    ap.add_argument(
        "--run-whole", action="store_true",
        help="the service's --judge-launches false: a kernel against an eager reference runs "
        "whole in a job process of its own (the default launches it alone and judges it)",
    )  # fmt: skip
    ap.add_argument(
        "--service-arg", action="append", default=[], metavar="FLAG=VALUE",
        help="one more flag of the service (repeatable), e.g. --service-arg=--build-nice=0",
    )  # fmt: skip


def service_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--judge-launches", "false"] if args.run_whole else []
    if args.reference_time_reuse_s is not None:
        flags += ["--reference-time-reuse-s", str(args.reference_time_reuse_s)]
    return flags + list(args.service_arg)
