"""How a Target comes to be: ``boot()`` starts QEMU on an image and attaches, ``attach()`` joins a running one.

A QEMU qprobe starts writes a session file beside its gdbstub socket (``qprobe boot --detach``
leaves it running), so a later ``attach`` to that socket finds the vmlinux, the shared RAM file,
the console and the guest shell without being told; the file is checked before anything in it
is used, since it names a file that is then mapped writable.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, cast

from qprobe.api import SESSION_FILE, BootPlan, Target
from qprobe.core.kprobe import Kprobe, Kretprobe
from qprobe.errors import BootPanic, GuestStalled, TargetError
from qprobe.paths import read_private
from qprobe.vmm.connection import parse_address
from qprobe.vmm.peer import LOCAL_HOSTS, listener_pid, qemu_kernel_args
from qprobe.vmm.qemu import SHM_PREFIX, SHM_ROOT, QemuConfig, QemuProcess, parse_memory

if TYPE_CHECKING:
    from qprobe.images import Image

log = logging.getLogger("qprobe")


def boot(image: str = "debian-cloud", smp: int = 2, memory: str | int = "512M",
         files: Mapping[str, str | Path] | None = None, accel: str = "auto", cmdline: str = "",
         boot_timeout: float = 60.0, transport: str = "rsp", keepable: bool = False,
         tcg_thread: str = "", probes: Iterable[Kprobe | Kretprobe | str] = (),
         at_boot: Callable[[Target], None] | None = None) -> Target:  # fmt: skip
    """Boot an image (fetched and built on first use) and attach to it.

    ``probes`` (Kprobe, Kretprobe or kprobe_events definitions) are armed before the kernel's first
    instruction, as stub breakpoints (the guest cannot take an int3 that early), and see every hit from
    ``start_kernel`` on; ``at_boot(target)`` runs at the same moment, for probes that need the target
    (``target.add_event(...)`` with a callback).  The boot then waits for the guest's shell as usual; once
    it is up, the kprobes not asked ``anywhere=True`` that the int3 path accepts move to it, their counts
    going on (kretprobes stay on stub breakpoints).

    ``transport``: "rsp" (qprobe's own client) or "gdb" (a real gdb through GDB/MI).
    ``tcg_thread``: TCG's ``thread=`` mode, "single" (every vCPU on one host thread) or "multi";
    "" leaves QEMU's default (one thread per vCPU).
    The VM dies with this process; ``keepable=True`` lets ``target.qemu.keep()``
    leave it running afterwards (the pytest plugin's ``--qprobe-keep``).
    """
    from qprobe.images import get_image, with_files
    from qprobe.images.preinit import with_preinit

    img = get_image(image)
    if files:
        img = with_files(img, files)
    # A root filesystem that is not qprobe's gets qprobe's shell from the pre-init, its own init then running.
    img = with_preinit(img)
    config = QemuConfig(
        kernel=img.kernel, initrd=img.initrd, disk=img.disk, disk_interface=img.disk_interface,
        cmdline=" ".join(x for x in (img.cmdline, cmdline) if x), smp=smp, memory=parse_memory(memory), accel=accel,
        tcg_thread=tcg_thread, extra_args=["-S"] if probes or at_boot else [], name=img.name, arch=img.arch,
    )  # fmt: skip
    wanted = list(probes)
    if wanted or at_boot is not None:
        # No second boot on a panic: the probes are this boot's (registered once) and their hits are its.
        return _boot_once(img, config, boot_timeout, transport, keepable, _arming(wanted, at_boot))
    try:
        return _boot_once(img, config, boot_timeout, transport, keepable)
    except (BootPanic, GuestStalled) as exc:
        # QEMU 7.2's multi-threaded TCG can run a stale translation of an int3 the kernel's own
        # text_poke_bp() already replaced, and the kernel oopses on it, or leave a kernel silent in
        # its boot (docs/reliability.md): a panic or a stall before qprobe attached is the emulator's,
        # and a second boot is what a user would do.
        # It reads as the progress line it is ("booting ..."), then why.
        kept = "".join(f" ({note})" for note in getattr(exc, "__notes__", []))
        log.warning("booting %s again: %s%s", img.name, exc, kept)
    return _boot_once(img, config, boot_timeout, transport, keepable)


def _arming(
    probes: list[Kprobe | Kretprobe | str], at_boot: Callable[[Target], None] | None
) -> Callable[[Target], None]:
    for p in probes:
        if not isinstance(p, Kprobe | Kretprobe | str):
            raise TypeError(f"probes are Kprobe, Kretprobe or kprobe_events definitions, not {type(p).__name__}")

    def arm(target: Target) -> None:
        # The target is booting: these go on stub breakpoints, and those not asked anywhere=True (nor
        # kretprobes) to the int3 path once the kernel has booted (KprobeManager.switch_from_boot).
        for p in probes:
            if isinstance(p, str):
                target.add_event(p)
            elif isinstance(p, Kretprobe):
                target.register_kretprobe(p)
            else:
                target.register_kprobe(p)
        if at_boot is not None:
            at_boot(target)

    return arm


def _boot_once(img: Image, config: QemuConfig, boot_timeout: float, transport: str, keepable: bool,
               arm: Callable[[Target], None] | None = None) -> Target:  # fmt: skip
    qemu = QemuProcess(config, keepable=keepable)
    try:
        qemu.wait_for_sockets()
        session = {"gdb": str(qemu.gdb_path), "console": str(qemu.console_path),
                   "shell": str(qemu.shell_path) if qemu.shell_path else None, "ram": str(qemu.ram_path),
                   "ram_size": config.memory, "vmlinux": str(img.vmlinux), "image": img.name,
                   "console_log": str(qemu.console_log), "pid": qemu.proc.pid,
                   "doorbell": str(qemu.doorbell_path) if qemu.doorbell_path else None}  # fmt: skip
        path = qemu.rundir / SESSION_FILE
        path.write_text(json.dumps(session))
        os.chmod(path, 0o600)
    except BaseException:
        qemu.terminate()
        raise
    target = Target(f"unix:{qemu.gdb_path}", img.vmlinux, ram=qemu.ram_path, ram_size=config.memory,
                    console=qemu.console_path, shell=qemu.shell_path, qemu=qemu,
                    boot_timeout=boot_timeout, doorbell=qemu.doorbell_path, system_map=img.system_map,
                    transport=transport,
                    boot=None if arm is None else BootPlan(arm, img.kernel, qemu.kernel_cmdline))  # fmt: skip
    target.image = img
    return target


def attach(
    address: str,
    vmlinux: str | Path | None = None,
    *,
    ram: str | Path | None = None,
    ram_size: int | str = 0,
    console: str | Path | None = None,
    shell: str | Path | None = None,
    allow_remote: bool = False,
    system_map: str | Path | None = None,
    transport: str = "rsp",
    probes: Iterable[Kprobe | Kretprobe | str] = (),
    at_boot: Callable[[Target], None] | None = None,
    kernel_image: str | Path | None = None,
    kernel_cmdline: str | None = None,
    boot_timeout: float = 60.0,
) -> Target:
    """Attach to a running QEMU's gdbstub (``unix:PATH`` or ``HOST:PORT``).

    ``transport``: "rsp" (qprobe's own client) or "gdb" (a real gdb through GDB/MI).

    With ``probes`` or ``at_boot``, the QEMU must be halted before its first instruction (started with
    ``-S``): they are armed before the kernel runs, as ``boot(probes=...)`` arms them, and the call returns
    once the kernel execs init (``boot_timeout``), or, with ``shell``, once qprobe's /init says its shell is
    ready.  The kernel image QEMU boots (its KASLR alignment) and the command line it gives the kernel are
    read from a local QEMU's own command line (``-kernel``, ``-append``); ``kernel_image`` and
    ``kernel_cmdline`` (the whole line) override them, and are needed where they cannot be read.

    ``console`` is the socket of the guest's console (the kernel's log), ``shell`` that of the serial
    port the guest's shell runs on when it has one of its own (qprobe's /init puts it on ttyS1 given
    ``qprobe.shell=ttyS1``); without ``shell``, commands go to the shell on the console, where kernel
    messages can land in their output.  For a QEMU started by ``qprobe boot``, the run directory's
    session file supplies vmlinux, the shared RAM file, the console and the shell.
    """
    addr = address
    doorbell: str | None = None
    where = parse_address(addr)
    if isinstance(where, tuple):
        host = where[0]
        if host not in LOCAL_HOSTS and not allow_remote:
            raise TargetError(f"refusing to attach to non-local {host}: the gdbstub is unauthenticated "
                              "(pass allow_remote=True / --allow-remote if you mean it)")  # fmt: skip
        log.warning("attaching over TCP to %s: anyone who can reach that port controls the guest", addr)
    else:
        sock = Path(where)
        if not sock.exists():
            raise TargetError(f"no such socket {sock}: is the VM running? (`qprobe boot` prints its address)")
        if not stat.S_ISSOCK(sock.stat().st_mode):
            raise TargetError(f"{sock} is not a socket: give the gdbstub's socket (unix:PATH) or HOST:PORT")
        session = read_session(sock)
        if session is not None:
            vmlinux = vmlinux or str(session["vmlinux"])
            ram = ram or str(session["ram"])
            ram_size = ram_size or int(session["ram_size"])  # type: ignore[call-overload]
            console = console or str(session["console"])
            # read_session checked both are strings or None.
            shell = shell or cast("str | None", session.get("shell"))
            doorbell = cast("str | None", session.get("doorbell"))
    if vmlinux is None:
        raise TargetError("attach needs the running kernel's vmlinux (vmlinux=PATH / --vmlinux PATH)")
    ram_path = Path(ram) if ram else None
    size = parse_memory(ram_size) if ram_size else (ram_path.stat().st_size if ram_path else 0)
    wanted = list(probes)
    plan = None
    if wanted or at_boot is not None:
        plan = _attach_plan(where, _arming(wanted, at_boot), kernel_image, kernel_cmdline)
    return Target(addr, vmlinux, ram=ram_path, ram_size=size, console=Path(console) if console else None,
                  shell=Path(shell) if shell else None, doorbell=Path(doorbell) if doorbell else None,
                  system_map=Path(system_map) if system_map else None, transport=transport,
                  boot=plan, boot_timeout=boot_timeout)  # fmt: skip


def _attach_plan(where: str | tuple[str, int], arm: Callable[[Target], None], kernel_image: str | Path | None,
                 kernel_cmdline: str | None) -> BootPlan:  # fmt: skip
    """What a boot qprobe did not start takes from the QEMU's command line, unless given."""
    image = Path(kernel_image) if kernel_image is not None else None
    if image is not None and not image.is_file():
        raise TargetError(f"kernel image {image} is not a file")
    if image is not None and kernel_cmdline is not None:
        return BootPlan(arm, image, kernel_cmdline)
    pid = listener_pid(where)
    if pid is None:
        return BootPlan(arm, image, kernel_cmdline, "no local QEMU of yours listens there to read it from")
    qemu_image, append = qemu_kernel_args(pid)
    if qemu_image is None:
        # Without -kernel, firmware and a boot loader pick the kernel and its command line.
        return BootPlan(arm, image, kernel_cmdline, f"QEMU (pid {pid}) was started without -kernel")
    cmdline = kernel_cmdline if kernel_cmdline is not None else append or ""
    if image is None and not qemu_image.is_file():
        return BootPlan(arm, None, cmdline, f"QEMU's -kernel {qemu_image} is not a file here")
    return BootPlan(arm, image or qemu_image, cmdline)


def read_session(sock: Path) -> dict[str, object] | None:
    """The session file `qprobe boot` wrote beside ``sock``, or None if there is none.

    Checked before anything in it is used, since it names the RAM file that is
    then mapped writable: a private file of this user's, in a private directory,
    naming sockets beside ``sock`` and a RAM file of the size it says in a
    private directory of this user's under /dev/shm.
    """
    path = sock.parent / SESSION_FILE

    def bad(why: str) -> TargetError:
        return TargetError(f"{path} is not a session file qprobe wrote ({why}): attach with --vmlinux instead")

    raw = read_private(path)
    if raw is None:
        return None
    # The directory as the user named it may be a link (their choice); what it leads to must be private.
    if not _private(path, 0o600) or not _private(sock.parent.resolve(), 0o700):
        raise bad("it or its directory is not private to you")
    try:
        data = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        raise bad("not JSON") from None
    if not isinstance(data, dict):
        raise bad("not a JSON object")
    text = ("gdb", "console", "ram", "vmlinux", "console_log")
    optional = ("shell", "doorbell")  # null where the board has no such port
    if (
        not all(isinstance(data.get(k), str) for k in text)
        or not all(data.get(k) is None or isinstance(data[k], str) for k in optional)
        or type(data.get("ram_size")) is not int
    ):
        raise bad(f"it needs strings {', '.join(text)}, {' and '.join(optional)} (or null), and a number ram_size")
    for key in ("gdb", "console", *optional, "console_log"):
        if data.get(key) is None:
            continue
        try:
            beside = os.path.samefile(Path(data[key]).parent, sock.parent)
        except OSError:
            beside = False
        if not beside:
            raise bad(f"its {key} is not beside {sock.name}")
    ram = Path(data["ram"])
    if not (ram.is_absolute() and ram.parent.parent == SHM_ROOT and ram.parent.name.startswith(SHM_PREFIX)):
        raise bad(f"its RAM file {ram} is not one qprobe makes")
    if not _private(ram, 0o777, size=data["ram_size"]) or not _private(ram.parent, 0o700):
        raise bad(f"its RAM file {ram} is not yours, not private or not {data['ram_size']} bytes")
    return data


def _private(path: Path, mode: int, size: int | None = None) -> bool:
    """``path`` is a file or directory of this user's (not a link), with no permission beyond ``mode``."""
    try:
        st = path.lstat()
    except OSError:
        return False
    kind_ok = stat.S_ISDIR(st.st_mode) if mode == 0o700 else stat.S_ISREG(st.st_mode)
    # A RAM file may be readable by others (QEMU creates it 0644): its directory is what keeps them out.
    perm_ok = mode == 0o777 or not stat.S_IMODE(st.st_mode) & ~mode
    return kind_ok and perm_ok and st.st_uid == os.getuid() and (size is None or st.st_size == size)


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} in a session file")


__all__ = ["attach", "boot", "read_session"]
