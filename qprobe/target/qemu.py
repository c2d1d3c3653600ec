"""Launch and tear down our own QEMU.

Everything QEMU listens on is a Unix socket in a private (0700) run
directory: the gdbstub gives whoever connects full control of the guest, so
it is never put on a network port.  Guest RAM is a shared file in /dev/shm so
the host reads it without stopping the VM.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from qprobe.errors import TargetError, TargetGone

# Reserved with memmap= so the kernel never uses it; qprobe maps it as the
# scratch area (see qprobe.target.scratch).  2 MiB: one PMD.
SCRATCH_SIZE = 2 << 20
DOORBELL_PORT = 0x5E0  # must match qprobe.core.optimizer.DOORBELL_PORT


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


def scratch_phys(ram: int) -> int:
    """Physical base of the scratch area: 2 MiB-aligned, 32 MiB below the top of low RAM.

    Below 3 GiB so that it is in the first RAM block of the ``pc`` machine.
    """
    top = min(ram, 3 << 30)
    if top < (128 << 20):
        raise TargetError(f"guest memory {ram >> 20} MiB is too small: qprobe needs at least 128M")
    return (top - (32 << 20)) & ~(SCRATCH_SIZE - 1)


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
    extra_args: list[str] = field(default_factory=list)


class QemuProcess:
    """A running QEMU with its private run directory."""

    def __init__(self, config: QemuConfig, qemu_binary: str = "qemu-system-x86_64") -> None:
        if config.smp < 1:
            raise TargetError(f"bad -smp {config.smp}: at least one vCPU")
        for what, path in (("kernel", config.kernel), ("initrd", config.initrd), ("disk", config.disk)):
            if path is not None and not Path(path).is_file():
                raise TargetError(f"{what} file {path} does not exist")
        binary = shutil.which(qemu_binary)
        if binary is None:
            raise TargetError(f"{qemu_binary} not found: install Debian's qemu-system-x86 (make setup)")
        self.config = config
        self.rundir = Path(tempfile.mkdtemp(prefix="qprobe-run-"))
        os.chmod(self.rundir, 0o700)
        self.shmdir = Path(tempfile.mkdtemp(prefix="qprobe-", dir="/dev/shm"))
        os.chmod(self.shmdir, 0o700)
        self.ram_path = self.shmdir / "ram"
        self.gdb_path = self.rundir / "gdb.sock"
        self.qmp_path = self.rundir / "qmp.sock"
        self.console_path = self.rundir / "console.sock"
        self.console_log = self.rundir / "console.log"
        self.doorbell_path = self.rundir / "doorbell.sock"
        self.scratch_phys = scratch_phys(config.memory)
        self.argv = [binary, *self._args()]
        stderr = open(self.rundir / "qemu.stderr", "wb")  # noqa: SIM115 - lives as long as QEMU
        self.proc = subprocess.Popen(
            self.argv, stdin=subprocess.DEVNULL, stdout=stderr, stderr=stderr, start_new_session=True
        )
        stderr.close()

    @property
    def accel(self) -> str:
        if self.config.accel == "auto":
            return "kvm" if kvm_usable() else "tcg"
        return self.config.accel

    def _args(self) -> list[str]:
        c = self.config
        mem = c.memory
        append = " ".join(
            [
                "console=ttyS0,115200",
                # Keep the scratch area away from the kernel (KASLR honours memmap= too).
                f"memmap={SCRATCH_SIZE >> 20}M${self.scratch_phys:#x}",
                "panic=-1",
                c.cmdline,
            ]
        ).strip()
        args = [
            *(["-accel", "kvm", "-accel", "tcg"] if self.accel == "kvm" else ["-accel", "tcg"]),
            "-machine", "pc,memory-backend=pc.ram",
            "-object", f"memory-backend-file,id=pc.ram,size={mem},mem-path={self.ram_path},share=on",
            "-m", f"{mem >> 20}M",
            "-smp", str(c.smp),
            "-cpu", "max" if self.accel == "tcg" else "host",
            "-display", "none", "-vga", "none", "-nodefaults", "-no-reboot",
            "-chardev", f"socket,id=gdb0,path={self.gdb_path},server=on,wait=off",
            "-gdb", "chardev:gdb0",
            "-chardev", f"socket,id=qmp0,path={self.qmp_path},server=on,wait=off",
            "-mon", "chardev=qmp0,mode=control",
            "-chardev", f"socket,id=con0,path={self.console_path},server=on,wait=off,logfile={self.console_log}",
            "-serial", "chardev:con0",
            # The optimized probes' doorbell: an `out` to this port arrives on the socket.
            "-chardev", f"socket,id=bell0,path={self.doorbell_path},server=on,wait=off",
            "-device", f"isa-debugcon,iobase={DOORBELL_PORT:#x},chardev=bell0",
            "-kernel", str(c.kernel),
            "-append", append,
        ]  # fmt: skip
        if c.initrd is not None:
            args += ["-initrd", str(c.initrd)]
        if c.disk is not None:
            if c.disk_interface == "nvme":
                args += ["-drive", f"file={c.disk},if=none,id=d0,format=raw,snapshot=on",
                         "-device", "nvme,drive=d0,serial=qprobe0"]  # fmt: skip
            elif c.disk_interface == "virtio":
                args += ["-drive", f"file={c.disk},if=virtio,format=raw,snapshot=on"]
            else:
                raise TargetError(f"unknown disk interface {c.disk_interface!r}: nvme or virtio")
        return args + c.extra_args

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stderr_tail(self) -> str:
        try:
            return (self.rundir / "qemu.stderr").read_text(errors="replace").strip()[-500:]
        except OSError:
            return ""

    def wait_for_sockets(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        paths = (self.gdb_path, self.console_path, self.qmp_path, self.ram_path, self.doorbell_path)
        while not all(p.exists() for p in paths):
            if not self.alive():
                raise TargetGone(f"QEMU exited at start-up: {self.stderr_tail() or 'no message'}")
            if time.monotonic() > deadline:
                raise TargetError(f"QEMU did not open its sockets within {timeout:g} s")
            time.sleep(0.02)

    def qmp(self, command: str, **arguments: object) -> object:
        """One QMP command through QEMU's own client library (qemu.qmp)."""
        from qemu.qmp.legacy import QEMUMonitorProtocol

        mon = QEMUMonitorProtocol(str(self.qmp_path))
        try:
            mon.settimeout(5.0)
            mon.connect()
            return mon.cmd(command, **arguments)  # type: ignore[arg-type]
        finally:
            mon.close()

    def terminate(self, timeout: float = 5.0) -> None:
        """Stop QEMU (QMP ``quit``, then SIGTERM, then SIGKILL) and remove the run directory and RAM file."""
        if self.alive():
            try:
                self.qmp("quit")
                self.proc.wait(timeout)
            except Exception:  # any QMP failure falls through to the signals below
                pass
        if self.alive():
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout)
        shutil.rmtree(self.shmdir, ignore_errors=True)
        shutil.rmtree(self.rundir, ignore_errors=True)
