"""Launch and tear down our own QEMU.

Everything QEMU listens on is a Unix socket in a private (0700) run
directory: the gdbstub gives whoever connects full control of the guest, so
it is never put on a network port.  Guest RAM is a shared file in /dev/shm so
the host reads it without stopping the VM.

A VM never outlives the process that started it, however that process ends:
QEMU gets SIGKILL from the kernel when its owner dies (PR_SET_PDEATHSIG), a
janitor process removes the run directory and the RAM file once the owner
is gone, and every start sweeps what a host crash may still have left.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from qprobe.errors import TargetError, TargetGone
from qprobe.vmm.boards import SCRATCH_SIZE, Board, board_for

log = logging.getLogger(__name__)

# The isa-debugcon port whose writes are the optimized probes' doorbell: qprobe.core.optimizer
# hands it to the architecture's mailbox stub, which rings it with an ``out``.
DOORBELL_PORT = 0x5E0
# The x86 CPU under TCG (qprobe.vmm.boards says why); under KVM the host's CPU runs the guest.
TCG_CPU = board_for("x86_64").tcg_cpu
RUN_PREFIX = "qprobe-run-"
SHM_ROOT = Path("/dev/shm")
SHM_PREFIX = "qprobe-"
# A directory younger than this may belong to a QEMU that is still starting (not yet in any
# process's command line): the sweep leaves it alone.
SWEEP_GRACE = 60.0
PR_SET_PDEATHSIG = 1
# Stopping a VM takes at most about this long, QEMU answering or not (terminate).
STOP_TIMEOUT = 3.0
QMP_TIMEOUT = 5.0
JANITOR_WAIT = 1.0


def parse_memory(memory: str | int) -> int:
    """``512M``/``1G``/bytes -> bytes."""
    if isinstance(memory, int):
        return memory
    text = memory.strip().upper()
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    try:
        if text[-1:] in units:
            return int(text[:-1]) * units[text[-1]]
        return int(text) << 20  # QEMU's -m default unit is MiB
    except ValueError:
        raise TargetError(f"bad memory size {memory!r}: expected e.g. 512M or 1G") from None


def scratch_phys(ram: int, arch: str = "x86_64") -> int:
    """Physical base of the scratch area in ``ram`` bytes of an ``arch`` guest's memory (its board's choice)."""
    return board_for(arch).scratch_phys(ram)


def kvm_usable() -> bool:
    # /dev/kvm can exist (and even create VMs) on a CPU without VMX/SVM, where
    # guests then hang: require the CPU flag as well.
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    if not re.search(r"\b(vmx|svm)\b", flags):
        return False
    try:
        fd = os.open("/dev/kvm", os.O_RDWR)
    except OSError:
        return False
    try:
        import fcntl

        # /dev/kvm can exist on a CPU without VMX/SVM; only creating a VM proves it works.
        kvm_create_vm = 0xAE01
        vm = fcntl.ioctl(fd, kvm_create_vm, 0)
        os.close(vm)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _command_lines() -> str:
    """Every process's command line, NUL-separated, one per line (what the sweep looks for paths in)."""
    lines = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                lines.append((entry / "cmdline").read_bytes().decode(errors="replace"))
            except OSError:
                continue  # exited meanwhile
    return "\n".join(lines)


def sweep_stale(grace: float = SWEEP_GRACE) -> list[Path]:
    """Remove this user's QEMU run directories and /dev/shm RAM directories whose QEMU is gone.

    A directory is in use while its owner holds a lock on it (``flock``) or
    while a process (its QEMU) names a path inside it on its command line.
    Returns what was removed.
    """
    candidates = [*Path(tempfile.gettempdir()).glob(RUN_PREFIX + "*"), *SHM_ROOT.glob(SHM_PREFIX + "*")]
    now = time.time()
    mine = []
    for path in candidates:
        try:
            st = path.lstat()
        except OSError:
            continue
        if path.is_dir() and not path.is_symlink() and st.st_uid == os.getuid() and now - st.st_mtime > grace:
            mine.append(path)
    if not mine:
        return []
    in_use = _command_lines()
    removed = []
    for path in mine:
        if f"{path}/" in in_use:
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # its owner is alive
        finally:
            os.close(fd)  # also releases the lock just taken
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _private_dir(root: str | None, prefix: str) -> tuple[Path, int]:
    """A fresh 0700 directory and an fd holding an exclusive ``flock`` on it (so the sweep sees it in use)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=root))
    os.chmod(path, 0o700)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return path, fd


def _die_with_owner() -> Callable[[], None]:
    """A ``preexec_fn``: the child gets SIGKILL when the thread that forked it dies."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here: the child only calls it
    owner = os.getpid()

    def in_child() -> None:
        prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGKILL))
        if os.getppid() != owner:  # the owner died before prctl took effect: no signal will come
            os._exit(1)

    return in_child


@dataclass
class QemuConfig:
    kernel: Path
    initrd: Path | None = None
    disk: Path | None = None
    disk_interface: str = "nvme"
    cmdline: str = ""
    smp: int = 2
    memory: int = 512 << 20
    accel: str = "auto"  # "tcg", "kvm" or "auto" (kvm:tcg when /dev/kvm works)
    # TCG's thread= option: "single" runs every vCPU on one host thread (no concurrent translated code), "" the default
    tcg_thread: str = ""
    extra_args: list[str] = field(default_factory=list)
    name: str = ""  # the image's name, for messages ("": the kernel file's)
    arch: str = "x86_64"  # the guest's architecture (its vmlinux's), which picks the board (qprobe.vmm.boards)


class QemuProcess:
    """A running QEMU with its private run directory.

    QEMU dies with this process unless ``keepable``: then the kernel does not
    kill it with its owner, so that ``keep()`` can hand it over to the user;
    until then the janitor still stops it if its owner dies.
    """

    def __init__(self, config: QemuConfig, qemu_binary: str | None = None, keepable: bool = False) -> None:
        if config.smp < 1:
            raise TargetError(f"bad -smp {config.smp}: at least one vCPU")
        if config.disk_interface not in ("nvme", "virtio"):
            raise TargetError(f"unknown disk interface {config.disk_interface!r}: nvme or virtio")
        if config.tcg_thread not in ("", "single", "multi"):
            raise TargetError(f"unknown TCG thread mode {config.tcg_thread!r}: single or multi")
        for what, path in (("kernel", config.kernel), ("initrd", config.initrd), ("disk", config.disk)):
            if path is not None and not Path(path).is_file():
                raise TargetError(f"{what} file {path} does not exist")
        self.board: Board = board_for(config.arch)
        wanted = qemu_binary or self.board.binary
        binary = shutil.which(wanted)
        if binary is None:
            raise TargetError(f"{wanted} not found: install Debian's {self.board.package} (make setup)")
        self.config = config
        self.scratch_phys = self.board.scratch_phys(config.memory)
        sweep_stale()
        self._locks: list[int] = []
        self._janitor: subprocess.Popen[bytes] | None = None
        self._janitor_pipe: int | None = None
        self.rundir, lock = _private_dir(None, RUN_PREFIX)
        self._locks.append(lock)
        try:
            self.shmdir, lock = _private_dir(str(SHM_ROOT), SHM_PREFIX)
            self._locks.append(lock)
            self.ram_path = self.shmdir / "ram"
            self.gdb_path = self.rundir / "gdb.sock"
            self.qmp_path = self.rundir / "qmp.sock"
            self.console_path = self.rundir / "console.sock"
            self.console_log = self.rundir / "console.log"
            # The guest's shell's own port, and the doorbell, where the board has them (None: it has not).
            self.shell_path: Path | None = self.rundir / "shell.sock" if self.board.shell_tty else None
            self.shell_log = self.rundir / "shell.log"
            self.doorbell_path: Path | None = self.rundir / "doorbell.sock" if self.board.doorbell else None
            self.argv = [binary, *self._args()]
            # PR_SET_PDEATHSIG fires when the forking *thread* ends: only the main thread lives as long
            # as the process.  A VM started from another thread is stopped by the janitor alone.
            tie = not keepable and threading.current_thread() is threading.main_thread()
            preexec = _die_with_owner() if tie else None
            with open(self.rundir / "qemu.stderr", "wb") as stderr:
                self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=stderr, stderr=stderr,
                                             start_new_session=True, preexec_fn=preexec)  # fmt: skip
            self._start_janitor()
        except BaseException:
            self.terminate()
            raise

    def _start_janitor(self) -> None:
        """The process that cleans up after us if we die (see qprobe.vmm.janitor)."""
        read_end, self._janitor_pipe = os.pipe()
        script = Path(__file__).with_name("janitor.py")
        try:
            self._janitor = subprocess.Popen(
                [sys.executable, "-I", "-S", str(script), str(self.proc.pid), str(self.rundir), str(self.shmdir)],
                stdin=read_end, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        finally:
            os.close(read_end)
        assert self._janitor.stdout is not None
        # Until it holds a pidfd of QEMU, reaping QEMU here could let its pid be reused under it.
        ready = self._janitor.stdout.readline()
        self._janitor.stdout.close()
        if ready != b"ready\n":
            raise TargetError("the janitor process that stops QEMU if qprobe dies did not start")

    def _stop_janitor(self, message: bytes = b"") -> None:
        if self._janitor_pipe is not None:
            try:
                if message:
                    os.write(self._janitor_pipe, message)
            finally:
                os.close(self._janitor_pipe)
                self._janitor_pipe = None
        if self._janitor is not None:
            try:
                # It exits at once on end-of-file when QEMU is gone; only a QEMU it must kill takes longer.
                self._janitor.wait(JANITOR_WAIT)
            except subprocess.TimeoutExpired:
                self._janitor.kill()
                self._janitor.wait()
            self._janitor = None

    def remove_with_vm(self, files: list[Path]) -> None:
        """Files the janitor removes with the run directory, should this process die first."""
        if self._janitor_pipe is not None:
            os.write(self._janitor_pipe, b"".join(b"rm:" + os.fsencode(f) + b"\0" for f in files))

    def keep(self) -> None:
        """Hand the VM over: it runs on after this process ends (``keepable`` VMs only)."""
        self._stop_janitor(b"keep\0")
        for fd in self._locks:
            os.close(fd)
        self._locks.clear()

    @property
    def accel(self) -> str:
        if self.config.accel == "auto":
            return "kvm" if kvm_usable() else "tcg"
        return self.config.accel

    @property
    def kernel_cmdline(self) -> str:
        """The command line QEMU gives the kernel (-append)."""
        c = self.config
        board = self.board
        return " ".join(
            [
                f"console={board.console},115200",
                # The guest's shell on a serial port of its own, so that a command's output never holds a
                # kernel message (scripts/guest/init reads this).
                *([f"qprobe.shell={board.shell_tty}"] if board.shell_tty else []),
                # Keep the scratch area away from the kernel (KASLR honours memmap= too).
                board.reserve(self.scratch_phys, SCRATCH_SIZE),
                "panic=-1",
                c.cmdline,
            ]
        ).strip()

    def _args(self) -> list[str]:
        c = self.config
        mem = c.memory
        append = self.kernel_cmdline
        board = self.board
        tcg = f"tcg,thread={c.tcg_thread}" if c.tcg_thread else "tcg"
        args = [
            *(["-accel", "kvm", "-accel", tcg] if self.accel == "kvm" else ["-accel", tcg]),
            "-machine", f"{board.machine},memory-backend=guest.ram",
            "-object", f"memory-backend-file,id=guest.ram,size={mem},mem-path={self.ram_path},share=on",
            "-m", f"{mem >> 20}M",
            "-smp", str(c.smp),
            "-cpu", board.tcg_cpu if self.accel == "tcg" else "host",
            "-display", "none", *board.extra, "-nodefaults", "-no-reboot",
            "-chardev", f"socket,id=gdb0,path={self.gdb_path},server=on,wait=off",
            "-gdb", "chardev:gdb0",
            "-chardev", f"socket,id=qmp0,path={self.qmp_path},server=on,wait=off",
            "-mon", "chardev=qmp0,mode=control",
            "-chardev", f"socket,id=con0,path={self.console_path},server=on,wait=off,logfile={self.console_log}",
            "-serial", "chardev:con0",
        ]  # fmt: skip
        if board.shell_tty:
            args += ["-chardev", f"socket,id=sh0,path={self.shell_path},server=on,wait=off,logfile={self.shell_log}",
                     *board.shell_device]  # fmt: skip
        if board.doorbell:
            # The optimized probes' doorbell: an `out` to this port arrives on the socket.
            args += ["-chardev", f"socket,id=bell0,path={self.doorbell_path},server=on,wait=off",
                     "-device", f"isa-debugcon,iobase={DOORBELL_PORT:#x},chardev=bell0"]  # fmt: skip
        args += ["-kernel", str(c.kernel), "-append", append]
        return args + storage_args(c.initrd, c.disk, c.disk_interface) + c.extra_args

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stderr_tail(self) -> str:
        try:
            return (self.rundir / "qemu.stderr").read_text(errors="replace").strip()[-500:]
        except OSError:
            return ""

    def wait_for_sockets(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        paths = (self.gdb_path, self.console_path, self.shell_path, self.qmp_path, self.ram_path, self.doorbell_path)
        while not all(p.exists() for p in paths if p is not None):
            if not self.alive():
                raise TargetGone(f"QEMU exited at start-up: {self.stderr_tail() or 'no message'}")
            if time.monotonic() > deadline:
                raise TargetError(f"QEMU did not open its sockets within {timeout:g} s")
            time.sleep(0.02)

    def qmp(self, command: str, timeout: float = QMP_TIMEOUT, **arguments: object) -> object:
        """One QMP command through QEMU's own client library (qemu.qmp), answered within ``timeout`` seconds.

        The whole exchange is bounded, the greeting included: QEMU answers QMP from its main loop, and a
        main loop spinning in a blocking write (the gdbstub writes whole packets to a client that no longer
        reads) never greets, so an unbounded connect would wait for ever.
        """
        import asyncio

        from qemu.qmp import QMPClient

        async def exchange() -> object:
            client = QMPClient(self.rundir.name)
            try:
                await client.connect(str(self.qmp_path))
                return await client.execute(command, arguments or None)
            finally:
                await client.disconnect()

        async def bounded() -> object:
            return await asyncio.wait_for(exchange(), timeout)

        try:
            return asyncio.run(bounded())
        except TimeoutError:
            raise TargetError(f"QEMU's monitor did not answer {command!r} within {timeout:g} s") from None

    def terminate(self, timeout: float = STOP_TIMEOUT) -> None:
        """Stop QEMU (QMP ``quit``, then SIGTERM, then SIGKILL) and remove the run directory and RAM file.

        Bounded whatever state QEMU is in: each step gets a share of ``timeout``, and SIGKILL of QEMU's
        process group, which needs nothing from QEMU, is the last one.
        """
        if hasattr(self, "proc"):
            self._stop_qemu(timeout)
        for d in (getattr(self, "shmdir", None), self.rundir):
            if d is not None:
                shutil.rmtree(d, ignore_errors=True)
        self._stop_janitor()
        for fd in self._locks:
            os.close(fd)
        self._locks.clear()

    def _stop_qemu(self, timeout: float) -> None:
        step = timeout / 3
        if self.alive():
            try:
                self.qmp("quit", timeout=step)
                self.proc.wait(step)
            except Exception:  # any QMP failure or a slow exit falls through to the signals below
                pass
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if not self.alive():
                return
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(step)
            except subprocess.TimeoutExpired:
                pass
        if self.alive():  # SIGKILL delivered but not yet acted on (a process in uninterruptible sleep)
            log.warning("QEMU (pid %d) has not exited %g s after SIGKILL", self.proc.pid, step)


def storage_args(initrd: Path | None, disk: Path | None, disk_interface: str) -> list[str]:
    """QEMU's arguments for an image's initramfs and root disk (a snapshot: the guest never writes the file)."""
    args = [] if initrd is None else ["-initrd", str(initrd)]
    if disk is not None:
        if disk_interface == "nvme":
            args += ["-drive", f"file={disk},if=none,id=d0,format=raw,snapshot=on",
                     "-device", "nvme,drive=d0,serial=qprobe0"]  # fmt: skip
        else:
            args += ["-drive", f"file={disk},if=virtio,format=raw,snapshot=on"]
    return args
