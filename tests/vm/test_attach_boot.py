"""Boot-time probes on a QEMU qprobe did not start: ``qprobe trace --boot --attach`` to one started with ``-S``.

The QEMU here is a plain one, started by the test as a user would: no shared RAM (qprobe reads
memory through the stub), its kernel image named relative to its working directory; qprobe
finds the image and the kernel's command line in QEMU's own command line.  The kernel is the
oracle as in test_boot_probes: its ``initcall_debug`` lines against the probes on
``do_one_initcall``, ``start_kernel`` once on the boot CPU, ``start_secondary`` once on each other.
Before the kernel runs, an attach without probes is refused and leaves the VM halted; once it
runs, boot-time probes are refused.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import qprobe
from qprobe.images import get_image
from qprobe.vmm.boards import board_for
from qprobe.vmm.qemu import SCRATCH_SIZE, TCG_CPU, storage_args

from .conftest import IMAGE
from .test_boot_frontends import MARK, _sections
from .test_boot_probes import GUEST, TCG, _kernel_initcalls, check_boot_trace

pytestmark = pytest.mark.vm
ROOT = Path(__file__).resolve().parents[2]
SMP = 2
MEMORY = 512 << 20


def _append() -> str:
    """The kernel's command line: qprobe's scratch reservation, its guest shell on ttyS1, the kernel's oracles."""
    pc = board_for("x86_64")
    scratch = pc.reserve(pc.scratch_phys(MEMORY), SCRATCH_SIZE)  # as qprobe's own QEMU reserves it
    return " ".join(["console=ttyS0,115200", f"qprobe.shell={pc.shell_tty}", scratch, "panic=-1",
                     get_image(IMAGE, fetch=False).cmdline,
                     "initcall_debug log_buf_len=8M kprobe_event=p:kic,do_one_initcall"])  # fmt: skip


def _start_halted(rundir: Path) -> subprocess.Popen[bytes]:
    """A plain QEMU, halted before its first instruction (-S), its gdbstub and two serial ports on sockets."""
    img = get_image(IMAGE, fetch=False)
    append = _append()
    argv = ["qemu-system-x86_64", "-S", "-accel", f"tcg,thread={TCG}", "-machine", "pc", "-m", f"{MEMORY >> 20}M",
            "-smp", str(SMP), "-cpu", TCG_CPU, "-display", "none", "-vga", "none", "-nodefaults", "-no-reboot",
            "-gdb", f"unix:{rundir}/gdb.sock,server=on,wait=off",
            "-chardev", f"socket,id=con0,path={rundir}/console.sock,server=on,wait=off", "-serial", "chardev:con0",
            "-chardev", f"socket,id=sh0,path={rundir}/shell.sock,server=on,wait=off", "-serial", "chardev:sh0",
            "-kernel", img.kernel.name, "-append", append]  # fmt: skip
    argv += storage_args(img.initrd, img.disk, img.disk_interface)
    # Its working directory the kernel's: -kernel is relative, as a user's often is.
    return subprocess.Popen(argv, cwd=img.kernel.parent, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)


@pytest.fixture
def halted(tmp_path: Path, qemu: subprocess.Popen[bytes]) -> Path:
    """The directory of the halted QEMU's sockets."""
    return tmp_path


@pytest.fixture
def qemu(tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A QEMU started with -S, its sockets in tmp_path; killed at the end."""
    proc = _start_halted(tmp_path)
    try:
        deadline = time.monotonic() + 10
        while not all((tmp_path / f"{s}.sock").exists() for s in ("gdb", "console", "shell")):
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "QEMU did not open its sockets"
            time.sleep(0.05)
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_trace_boot_attach_lists_the_kernel_s_initcalls_and_its_cpus_bring_up(halted: Path) -> None:
    vmlinux = get_image(IMAGE, fetch=False).vmlinux
    gdb = f"unix:{halted}/gdb.sock"
    with pytest.raises(qprobe.TargetError) as refused:
        qprobe.attach(gdb, vmlinux)
    assert "has not started" in str(refused.value) and "left halted" in str(refused.value)
    assert "\n" not in str(refused.value)

    out = subprocess.run(
        [sys.executable, "-m", "qprobe.cli", "trace", "--boot", "--attach", gdb, "--vmlinux", str(vmlinux),
         "--console", f"{halted}/console.sock", "--shell", f"{halted}/shell.sock", "--json", "--run", GUEST,
         "p:ic do_one_initcall fn=%di:symbol", "r:icr do_one_initcall ret=$retval",
         "p:sk start_kernel", "p:ss start_secondary"],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )  # fmt: skip
    check_boot_trace(out)

    # The kernel runs now (qprobe detached): probes from its boot are refused, in one line.
    with pytest.raises(qprobe.TargetError) as running:
        qprobe.attach(gdb, vmlinux, probes=[qprobe.Kprobe("start_kernel")])
    assert "has not run yet" in str(running.value) and "\n" not in str(running.value)


def test_attach_with_probes_returns_once_init_runs_without_a_console(halted: Path,
                                                                    qemu: subprocess.Popen[bytes]) -> None:  # fmt: skip
    """The API, no serial port given, the kernel image and command line given rather than read from QEMU."""
    img = get_image(IMAGE, fetch=False)
    sk, ss, kif = qprobe.Kprobe("start_kernel"), qprobe.Kprobe("start_secondary"), qprobe.Kprobe("kernel_init_freeable")
    with qprobe.attach(f"unix:{halted}/gdb.sock", img.vmlinux, probes=[sk, ss, kif], kernel_image=img.kernel,
                       kernel_cmdline=_append()) as target:  # fmt: skip
        assert target.cmdline == _append()  # the kernel's own saved_command_line, read once it booted
        assert target.vcpus == SMP  # QEMU's count, from its gdbstub
        assert (sk.nhit, ss.nhit, kif.nhit) == (1, SMP - 1, 1), target.list_probes()
        assert sk.gone and kif.gone and not ss.gone  # __init text, freed before init runs; start_secondary is not
        assert target.journal.qemu is not None and target.journal.qemu[0] == qemu.pid  # its undo journal's VM
    assert qemu.poll() is None  # a QEMU qprobe did not start runs on


def test_shell_boot_attach_counts_what_the_kernel_did(halted: Path) -> None:
    """The shell's --boot on the halted QEMU: its events at the prompt hold the boot's hits."""
    script = "".join(f"run echo {MARK}{name}\n{command}\n" for name, command in
                     [("dmesg", "run dmesg"), ("stats", "stats"), ("list", "list")])  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "qprobe.cli", "shell", "--boot", "--attach", f"unix:{halted}/gdb.sock",
         "--vmlinux", str(get_image(IMAGE, fetch=False).vmlinux), "--console", f"{halted}/console.sock",
         "--shell", f"{halted}/shell.sock", "p:ic do_one_initcall", "p:sk start_kernel", "p:ss start_secondary"],
        input=script + "quit\n", capture_output=True, text=True, timeout=900, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    got = _sections(out.stdout)
    kernel = _kernel_initcalls(got["dmesg"])
    assert len(kernel) > 100, got["dmesg"][-3000:]
    stats = {row.split()[0]: row.split()[1:4] for row in got["stats"].splitlines()[1:]}
    assert stats["kprobes/ic"] == [str(len(kernel)), "0", "0"], got["stats"]
    assert stats["kprobes/sk"] == ["1", "0", "0"], got["stats"]
    assert stats["kprobes/ss"] == [str(SMP - 1), "0", "0"], got["stats"]
    assert "start_kernel" in got["list"] and "[GONE]" in got["list"], got["list"]
