"""Fixtures for tests that boot a real image under real QEMU (TCG).

They are the qprobe pytest plugin's (``qprobe/pytest_plugin.py``), the one
users get: ``target`` is ``qprobe_target`` (one VM per module and image,
``--qprobe-image`` repeatable), reset and checked after every test by the
plugin's ``qprobe_reset``.
"""

from __future__ import annotations

import contextlib
import io
import os
import time
from collections.abc import Callable, Iterator

import pytest

import qprobe
from qprobe.images import get_image
from qprobe.pytest_plugin import QprobeReset, qprobe_scope, register_if_missing, selected_images
from qprobe.shell import Shell
from qprobe.vmm.console import READY, Console
from qprobe.vmm.qemu import QemuConfig, QemuProcess

# The image of tests that boot through the CLI or by hand: the first --qprobe-image.
IMAGE = os.environ.get("QPROBE_TEST_IMAGE", "debian-cloud")


def pytest_addoption(parser: pytest.Parser, pluginmanager: pytest.PytestPluginManager) -> None:
    # A source checkout that is not pip-installed has no pytest11 entry point.
    register_if_missing(pluginmanager)


def pytest_configure(config: pytest.Config) -> None:
    global IMAGE
    IMAGE = selected_images(config)[0]


@contextlib.contextmanager
def bare_qemu(image: str | None = None, timeout: float = 180.0) -> Iterator[QemuProcess]:
    """Our QEMU without qprobe attached, booted to the guest shell, stopped afterwards."""
    img = get_image(image or IMAGE, fetch=False)
    q = QemuProcess(QemuConfig(kernel=img.kernel, initrd=img.initrd, cmdline=img.cmdline))
    try:
        q.wait_for_sockets()
        console = Console(q.console_path, alive=q.alive)
        try:
            console.wait_for(READY, timeout)
        finally:
            console.close()
        yield q
    finally:
        q.terminate()


def fake_return(value: int) -> Callable[[qprobe.Kprobe, qprobe.PtRegs], int]:
    """A pre_handler that makes the probed function return ``value`` without running it."""

    def handler(kp: qprobe.Kprobe, regs: qprobe.PtRegs) -> int:
        regs.ax = value
        regs.ip = regs.read_u64(regs.sp)  # the return address
        regs.sp += 8
        return 1  # skip the probed instruction: we changed ip

    return handler


def workload_result(output: str) -> dict[str, str]:
    """The ``key=value`` summary line the guest workload prints."""
    line = next(x for x in output.splitlines() if x.startswith("workload "))
    return dict(part.split("=", 1) for part in line.split()[1:] if "=" in part)


@pytest.fixture(scope=qprobe_scope)
def target(qprobe_target: qprobe.Target) -> qprobe.Target:
    """One booted guest per test module and image (KASLR on, smp 2)."""
    return qprobe_target


@pytest.fixture
def guard(target: qprobe.Target, qprobe_reset: QprobeReset) -> dict[int, bytes]:
    """Snapshot of kernel text; after the test no probe is left and the text is byte-identical.

    The plugin checks every function the test probed, the console and qprobe's
    journal anyway; the guard also fails a test that leaves a probe registered
    and watches these functions whether probed or not.
    """
    qprobe_reset.strict = True
    return qprobe_reset.watch("ksys_lseek", "__x64_sys_getppid", "__x64_sys_lseek", "vfs_read", "ksys_read",
                              "vfs_write")  # fmt: skip


def wait_for_optimizer(target: qprobe.Target, timeout: float = 60.0) -> None:
    """Wait while points are still queued for their jump (the ftrace selftests' wait_for_kprobe_optimizer).

    A point a vCPU was passing through stays an int3 after register returns; the optimizer's thread
    places its jump later, as the kernel's kprobe_optimizer kicks itself again.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(
        p.opt is None and p.optimizing for p in list(target.kprobes.points.values())
    ):
        time.sleep(0.1)


def shell_do(sh: Shell, out: io.StringIO, line: str) -> str:
    """What one shell line prints (``out`` is the shell's output, emptied first)."""
    out.seek(0)
    out.truncate()
    sh.execute(line)
    return out.getvalue()
