"""The sandbox's launcher: sets up isolation in a fresh process, then execs the program.

Run by path with ``python -I -S`` (stdlib only, nothing from streamrl is imported), so the
parent never needs ``preexec_fn``, which is unsafe in a process with threads. Argument 1 is a
JSON config from ``sandbox.py``; the launcher writes one JSON line of what it applied to the
status fd, which closes on a successful exec. If setup or exec fails it writes
``{"error": ...}`` there and exits 125, so the parent can tell a broken sandbox from a program
that failed.

Order matters: namespaces and mounts need root, so they come first; rlimits next; dropping to
the sandbox uid last, after which the process has no capabilities left.
"""

import ctypes
import json
import os
import resource
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_BIND = 0x1000

_libc = ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def isolate_network(as_root: bool) -> str:
    """A new, empty network namespace: only a loopback that is down, so nothing is reachable.

    Root (with CAP_SYS_ADMIN) can unshare it directly; anyone else needs a user namespace
    around it, which some kernels and container seccomp profiles forbid."""
    if as_root:
        try:
            _check(_libc.unshare(CLONE_NEWNET), "unshare(CLONE_NEWNET)")
            return "netns"
        except OSError:
            pass  # e.g. root in a container without CAP_SYS_ADMIN: try a user namespace
    uid, gid = os.getuid(), os.getgid()
    _check(_libc.unshare(CLONE_NEWUSER | CLONE_NEWNET), "unshare(CLONE_NEWUSER|CLONE_NEWNET)")
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"{uid} {uid} 1")
    _write("/proc/self/gid_map", f"{gid} {gid} 1")
    return "userns+netns"


def private_tmp(workdir: str, dirs: list[str], size_mb: int) -> list[str]:
    """Give the program empty, size-capped tmpfs mounts over the world-writable directories,
    in its own mount namespace: what it writes there vanishes with it.

    The working directory lives under /tmp on the host, so once /tmp is covered we bind it
    back at the same path, from a descriptor opened inside the new namespace. If the
    namespace cannot be made we raise before touching anything; a failure after that is fatal
    to the run (the caller's ``main`` turns it into a setup error)."""
    _check(_libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    try:
        _check(_libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "make / private")
        workdir_fd = os.open(workdir, os.O_RDONLY | os.O_DIRECTORY)
        done = []
        opts = f"size={size_mb}m,nr_inodes=4096,mode=1777".encode()
        for d in dirs:
            if os.path.isdir(d) and not os.path.islink(d):
                flags = MS_NOSUID | MS_NODEV
                _check(_libc.mount(b"tmpfs", d.encode(), b"tmpfs", flags, opts), f"tmpfs {d}")
                done.append(d)
        os.makedirs(workdir, exist_ok=True)
        fd_path = f"/proc/self/fd/{workdir_fd}".encode()
        _check(_libc.mount(fd_path, workdir.encode(), None, MS_BIND, None), "bind workdir")
        os.close(workdir_fd)
        os.chdir(workdir)
        return done
    except OSError as e:
        raise RuntimeError(f"private /tmp half made: {e}") from e


def main() -> None:
    cfg = json.loads(sys.argv[1])
    status_fd = cfg["status_fd"]
    report: dict = {"network": None, "private_tmp": [], "uid": os.getuid()}
    try:
        as_root = os.geteuid() == 0
        if cfg["isolate_network"]:
            try:
                report["network"] = isolate_network(as_root)
            except OSError as e:  # not allowed here: run without, and say so
                report["notes"] = [f"no network isolation: {e}"]
        if as_root and cfg["private_tmp"]:
            try:
                report["private_tmp"] = private_tmp(
                    cfg["workdir"], cfg["private_tmp"], cfg["tmp_mb"]
                )
            except OSError as e:
                report.setdefault("notes", []).append(f"no private /tmp: {e}")
        os.chdir(cfg["workdir"])
        for name, (soft, hard) in cfg["rlimits"].items():
            resource.setrlimit(getattr(resource, name), (soft, hard))
        if as_root and cfg["uid"] is not None:
            os.setgroups([])
            os.setgid(cfg["gid"])
            os.setuid(cfg["uid"])
            report["uid"] = os.getuid()
        os.write(status_fd, (json.dumps(report) + "\n").encode())
        os.set_inheritable(status_fd, False)  # closes on exec: EOF tells the parent we got there
        os.execve(cfg["argv"][0], cfg["argv"], cfg["env"])
    except BaseException as e:
        os.write(status_fd, (json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n").encode())
        os._exit(125)


if __name__ == "__main__":
    main()
