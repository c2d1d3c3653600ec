"""Which process a VM is: the pid (and start time) of the QEMU behind a gdbstub address.

An undo journal is only of use while its VM runs, so it records its QEMU as (pid, start time): a pid
alone may be reused by another process once QEMU is gone, the pair never is.  For a QEMU qprobe did
not start, the process listening on the gdbstub's Unix socket or TCP port is found through
/proc/net/{unix,tcp,tcp6} (the socket's inode) and the processes' descriptors.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["LOCAL_HOSTS", "kernel_args", "listener_pid", "process_identity", "qemu_kernel_args", "still_running"]

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")  # a TCP gdbstub on this machine

_LISTEN_UNIX = 0x10000  # __SO_ACCEPTCON in /proc/net/unix's Flags column
_LISTEN_TCP = "0A"  # TCP_LISTEN in /proc/net/tcp's st column


def process_identity(pid: int) -> tuple[int, int] | None:
    """``(pid, start time in clock ticks since boot)``, or None if there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return pid, int(stat.rsplit(")", 1)[1].split()[19])  # field 22, starttime
    except (OSError, ValueError, IndexError):
        return None


def still_running(identity: tuple[int, int]) -> bool:
    return process_identity(identity[0]) == identity


def _socket_inodes(where: str | tuple[str, int]) -> set[int]:
    """The inodes of listening sockets at ``where`` (a Unix socket's path, or a TCP (host, port))."""
    inodes: set[int] = set()
    if isinstance(where, str):
        path = os.path.abspath(where)
        try:
            lines = Path("/proc/net/unix").read_text().splitlines()[1:]
        except OSError:
            return inodes
        for line in lines:
            cols = line.split()
            if len(cols) >= 8 and cols[7] == path and int(cols[3], 16) & _LISTEN_UNIX:
                inodes.add(int(cols[6]))
        return inodes
    port = f"{where[1]:04X}"
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) >= 10 and cols[1].rsplit(":", 1)[1] == port and cols[3] == _LISTEN_TCP:
                inodes.add(int(cols[9]))
    return inodes


def listener_pid(where: str | tuple[str, int]) -> int | None:
    """The pid of the process (of this user's, whose descriptors are readable) listening at ``where``; None
    for another machine's TCP port (its number may be a local process's)."""
    if isinstance(where, tuple) and where[0] not in LOCAL_HOSTS:
        return None
    inodes = _socket_inodes(where)
    if not inodes:
        return None
    links = {f"socket:[{inode}]" for inode in inodes}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for fd in (proc / "fd").iterdir():
                if os.readlink(fd) in links:
                    return int(proc.name)
        except OSError:
            continue
    return None


def kernel_args(argv: list[str], cwd: Path) -> tuple[Path | None, str | None]:
    """A QEMU command line's ``-kernel`` image (relative to ``cwd``, QEMU's working directory) and
    ``-append`` text, None for an option it lacks; as QEMU reads them, either with one dash or two,
    the last one given counting."""
    found: dict[str, str] = {}
    i = 0
    while i < len(argv) - 1:
        opt = argv[i]
        name = opt[1:].removeprefix("-") if opt.startswith("-") else ""
        if name in ("kernel", "append"):
            found[name] = argv[i + 1]
            i += 1  # its value, whatever it looks like ("-append -kernel" is an append of "-kernel")
        i += 1
    kernel = cwd / found["kernel"] if "kernel" in found else None
    return kernel, found.get("append")


def qemu_kernel_args(pid: int) -> tuple[Path | None, str | None]:
    """What ``kernel_args`` finds in the command line of the process ``pid``; (None, None) if it is unreadable."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="surrogateescape").split("\0")
        cwd = Path(os.readlink(f"/proc/{pid}/cwd"))
    except OSError:
        return None, None
    return kernel_args(argv, cwd)
