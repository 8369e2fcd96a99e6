"""The per-job sandbox steps, as the zygote's children take them (stdlib and ctypes only).

Each step raises SandboxError (an OSError with the errno and the step's name) when the kernel
refuses it. Linux only; x86_64 and aarch64 for the raw syscalls (seccomp).
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import resource
import stat
from collections.abc import Callable, Iterable, Mapping

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18

PR_SET_DUMPABLE = 4
PR_SET_NO_NEW_PRIVS = 38
PR_GET_NO_NEW_PRIVS = 39
PR_SET_SECCOMP = 22
PR_SET_CHILD_SUBREAPER = 36
SECCOMP_MODE_FILTER = 2
SECCOMP_SET_MODE_FILTER = 1
SECCOMP_FILTER_FLAG_TSYNC = 1
BPF_MAXINSNS = 4096

_SYS_SECCOMP = {"x86_64": 317, "aarch64": 277}

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.prctl.argtypes = [
    ctypes.c_int,
    ctypes.c_ulong,
    ctypes.c_ulong,
    ctypes.c_ulong,
    ctypes.c_ulong,
]
_libc.mount.argtypes = [
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_ulong,
    ctypes.c_void_p,
]
_libc.unshare.argtypes = [ctypes.c_int]


class SandboxError(OSError):
    """A sandbox step the kernel refused: errno, the step's name and what was asked."""

    def __init__(self, err: int, step: str, detail: str = "") -> None:
        message = f"{step}: {os.strerror(err)}" + (f" ({detail})" if detail else "")
        super().__init__(err, message)
        self.step = step

    def __str__(self) -> str:
        return str(self.args[1])


def _check(result: int, step: str, detail: str = "") -> int:
    if result < 0:
        raise SandboxError(ctypes.get_errno() or errno.EIO, step, detail)
    return result


class _SockFilter(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_ushort),
        ("jt", ctypes.c_ubyte),
        ("jf", ctypes.c_ubyte),
        ("k", ctypes.c_uint32),
    ]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


# ---- namespaces and mounts --------------------------------------------------------------------


def unshare(flags: int) -> None:
    _check(_libc.unshare(flags), "unshare", f"flags {flags:#x}")


def setns(fd: int, nstype: int = 0) -> None:
    """Joins the namespace that `fd` (an open /proc/<pid>/ns/* file) names."""
    _check(_libc.setns(fd, nstype), "setns", f"nstype {nstype:#x}")


def mount(
    source: str | None, target: str, fstype: str | None, flags: int = 0, data: str | None = None
) -> None:
    _check(
        _libc.mount(
            source.encode() if source is not None else None,
            target.encode(),
            fstype.encode() if fstype is not None else None,
            flags,
            ctypes.c_char_p(data.encode()) if data is not None else None,
        ),
        "mount",
        f"{fstype or 'bind'} on {target}",
    )


def make_mounts_private() -> None:
    """After unshare(CLONE_NEWNS): nothing mounted here propagates back to the parent."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)


def mount_tmpfs(target: str, size_bytes: int, mode: int = 0o1777) -> None:
    """A fresh tmpfs on `target` (nosuid, nodev), `size_bytes` at most (0: the kernel's default)."""
    options = f"mode={mode:o}"
    if size_bytes > 0:
        options += f",size={size_bytes}"
    mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, options)


def mounts_under(folder: str) -> list[str]:
    """Mount points strictly below `folder` (from /proc/self/mountinfo), outermost only."""
    prefix = folder.rstrip("/") + "/"
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].replace("\\040", " ")
            if point.startswith(prefix):
                points.append(point)
    return [p for p in points if not any(p != q and p.startswith(q + "/") for q in points)]


def mount_private_tmpfs(target: str, size_bytes: int) -> None:
    """A fresh tmpfs on `target` that keeps what is mounted below it (the read-only code
    paths of a checkout under /tmp): each is bound again, read-only, inside the new tmpfs."""
    kept = [(p, os.open(p, os.O_PATH | os.O_CLOEXEC)) for p in mounts_under(target)]
    mount_tmpfs(target, size_bytes)
    for point, fd in kept:
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            os.makedirs(point, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(point), exist_ok=True)
            open(point, "a").close()
        mount(f"/proc/self/fd/{fd}", point, None, MS_BIND | MS_REC)
        mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
        os.close(fd)


def mount_proc(target: str = "/proc") -> None:
    """A proc of the caller's PID namespace on `target` (only its own processes show)."""
    mount("proc", target, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)


# ---- cgroups ----------------------------------------------------------------------------------


def join_cgroups(procs_fds: Iterable[int]) -> None:
    """Moves the caller into each cgroup whose `cgroup.procs` (open for writing) is given; closes
    the descriptors."""
    fds = list(procs_fds)
    try:
        for fd in fds:
            try:
                os.write(fd, b"0")
            except OSError as exc:
                raise SandboxError(exc.errno or errno.EIO, "join cgroup", f"fd {fd}") from exc
    finally:
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass


# ---- credentials and limits -------------------------------------------------------------------


def setgroups_denied() -> bool:
    """In a user namespace made by an unprivileged service, setgroups(2) is denied for good
    (/proc/self/setgroups "deny"): the groups are the service's, mapped to the overflow group,
    and nobody inside can use or change them."""
    try:
        with open("/proc/self/setgroups") as f:
            return f.read().strip() == "deny"
    except OSError:
        return False


def drop_privileges(uid: int, gid: int) -> None:
    """setgroups([gid]), setresgid(gid), setresuid(uid): for every thread (glibc broadcasts)."""
    steps: tuple[tuple[str, Callable[[], None]], ...] = (
        ("setgroups", lambda: None if setgroups_denied() else os.setgroups([gid])),
        ("setresgid", lambda: os.setresgid(gid, gid, gid)),
        ("setresuid", lambda: os.setresuid(uid, uid, uid)),
    )
    for name, step in steps:
        try:
            step()
        except OSError as exc:
            raise SandboxError(exc.errno or errno.EPERM, name, f"uid {uid} gid {gid}") from exc
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid):
        raise SandboxError(errno.EPERM, "drop privileges", f"still {os.getresuid()}")
    if uid != 0:
        try:
            os.setresuid(0, 0, 0)
        except PermissionError:
            pass
        else:
            raise SandboxError(errno.EPERM, "drop privileges", "root could be regained")


def set_no_new_privs() -> None:
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "PR_SET_NO_NEW_PRIVS")


def set_dumpable(on: bool) -> None:
    """After a uid change the kernel marks the process not dumpable, which leaves /proc/self to
    root; the job's own tools (and torch) read /proc/self, so it is set back after the drop."""
    _check(_libc.prctl(PR_SET_DUMPABLE, 1 if on else 0, 0, 0, 0), "PR_SET_DUMPABLE")


def set_child_subreaper(on: bool) -> None:
    _check(_libc.prctl(PR_SET_CHILD_SUBREAPER, 1 if on else 0, 0, 0, 0), "PR_SET_CHILD_SUBREAPER")


def set_rlimits(limits: Mapping[int, int]) -> None:
    """resource.RLIMIT_* -> value, as both the soft and the hard limit."""
    for which, value in limits.items():
        try:
            resource.setrlimit(which, (value, value))
        except (OSError, ValueError) as exc:
            err = exc.errno if isinstance(exc, OSError) and exc.errno else errno.EINVAL
            raise SandboxError(err, "setrlimit", f"resource {which} = {value}") from exc


# ---- seccomp ----------------------------------------------------------------------------------


def install_seccomp(program: bytes) -> None:
    """Installs a classic BPF program (struct sock_filter[], 8 bytes each, host byte order) with
    SECCOMP_MODE_FILTER on every thread (SECCOMP_FILTER_FLAG_TSYNC, which also sets
    no_new_privs on every thread); needs no_new_privs (or CAP_SYS_ADMIN) on the caller."""
    if not program or len(program) % 8:
        raise SandboxError(errno.EINVAL, "seccomp", f"a filter of {len(program)} bytes")
    count = len(program) // 8
    if count > BPF_MAXINSNS:
        raise SandboxError(errno.EINVAL, "seccomp", f"{count} instructions")
    filters = (_SockFilter * count).from_buffer_copy(program)
    prog = _SockFprog(count, ctypes.cast(filters, ctypes.POINTER(_SockFilter)))
    nr = _SYS_SECCOMP.get(platform.machine())
    if nr is not None:
        result = _libc.syscall(
            ctypes.c_long(nr),
            ctypes.c_long(SECCOMP_SET_MODE_FILTER),
            ctypes.c_long(SECCOMP_FILTER_FLAG_TSYNC),
            ctypes.byref(prog),
        )
        if result == 0:
            return
        err = ctypes.get_errno()
        if result > 0:  # TSYNC: the id of a thread that could not be synchronised
            raise SandboxError(errno.EBUSY, "seccomp", f"thread {result} has another filter")
        if err != errno.ENOSYS:
            raise SandboxError(err or errno.EIO, "seccomp", f"{count} instructions")
    _check(
        _libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(prog), 0, 0),
        "seccomp",
        f"{count} instructions",
    )


# ---- descriptors ------------------------------------------------------------------------------


def keep_only_fd(
    fd: int, target: int = 3, keep_stderr: bool = False, also_keep: Iterable[int] = ()
) -> int:
    """Moves `fd` to `target` (inheritable), points 0 and 1 (and 2 unless `keep_stderr`) at
    /dev/null, and closes every other descriptor but `also_keep` (which must be above `target`
    and 2). Returns `target`."""
    extra = set(also_keep)
    if any(x <= max(2, target) for x in extra):
        raise SandboxError(errno.EINVAL, "descriptors", f"cannot keep {sorted(extra)}")
    try:
        if fd != target:
            os.dup2(fd, target, inheritable=True)
            os.close(fd)
        else:
            os.set_inheritable(fd, True)
        null = os.open(os.devnull, os.O_RDWR)
        for std in (0, 1) if keep_stderr else (0, 1, 2):
            if std != target:
                os.dup2(null, std)
        keep = {0, 1, 2, target, *extra}
        if null not in keep:
            os.close(null)
    except OSError as exc:
        raise SandboxError(exc.errno or errno.EBADF, "descriptors", f"fd {fd} -> {target}") from exc
    for other in _open_fds():
        if other not in keep:
            try:
                os.close(other)
            except OSError:
                pass
    return target


def _open_fds() -> list[int]:
    try:
        return [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        return list(range(min(soft, 65536)))


def chown_tree(root: str, uid: int, gid: int) -> None:
    """Hands a folder the job process's warm-up filled (its private /tmp) to the job user; does
    not follow symlinks and stays on one file system."""
    try:
        top = os.lstat(root)
    except FileNotFoundError:
        return
    os.lchown(root, uid, gid)
    if not stat.S_ISDIR(top.st_mode):
        return
    # The folders on the way to read-only paths mounted below (mount_private_tmpfs) stay root's:
    # the job could otherwise add files beside a checkout's code.
    way = {os.path.dirname(p) for p in mounts_under(root)}
    while any(os.path.dirname(w) not in way and w != root for w in way):
        way |= {os.path.dirname(w) for w in way if w != root}
    for base, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(base, name)
            st = os.lstat(path)
            if st.st_dev != top.st_dev or path in way:
                dirs[:] = [d for d in dirs if d != name]
                continue
            os.lchown(path, uid, gid)
