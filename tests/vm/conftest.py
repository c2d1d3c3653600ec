"""Fixtures for tests that boot a real image under real QEMU (TCG).

They are the qprobe pytest plugin's (``qprobe/pytest_plugin.py``), the one
users get: ``target`` is ``qprobe_target`` (one VM per module and image,
``--qprobe-image`` repeatable), reset and checked after every test by the
plugin's ``qprobe_reset``.
"""

from __future__ import annotations

import contextlib
import functools
import io
import itertools
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, KeysView, Sequence
from pathlib import Path

import pytest

import qprobe
from qprobe.images import Image, get_image
from qprobe.pytest_plugin import QprobeReset, qprobe_scope, register_if_missing, selected_images
from qprobe.shell import Shell
from qprobe.vmm.console import Console, open_shell
from qprobe.vmm.qemu import QemuConfig, QemuProcess

# The image of tests that boot through the CLI or by hand: the first --qprobe-image.
IMAGE = os.environ.get("QPROBE_TEST_IMAGE", "debian-cloud")


def pytest_addoption(parser: pytest.Parser, pluginmanager: pytest.PytestPluginManager) -> None:
    # A source checkout that is not pip-installed has no pytest11 entry point.
    register_if_missing(pluginmanager)


def pytest_configure(config: pytest.Config) -> None:
    global IMAGE
    IMAGE = selected_images(config)[0]


# Every process this test run starts inherits this variable, a detached boot's VM and a janitor that
# outlive their parent included: what carries it is this run's, wherever it was re-parented.
RUN_MARK = "QPROBE_TEST_RUN"


def _ours() -> dict[int, str]:
    """Every live process this test run started: pid -> its command line (a zombie has nothing to read)."""
    mark = f"{RUN_MARK}={os.environ[RUN_MARK]}".encode()
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if mark not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            argv = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        found[int(entry.name)] = argv.replace(b"\0", b" ").decode(errors="replace").strip()[:160]
    return found


@pytest.fixture(scope="module", autouse=True)
def nothing_outlives_its_module(request: pytest.FixtureRequest) -> Iterator[None]:
    """A QEMU, janitor or qprobe process a module started and did not stop fails that module, and is killed:
    left running it would take the CPU, memory and sockets of every later module's tests."""
    if qprobe_scope("", request.config) != "module":  # a VM shared by modules outlives each of them
        yield
        return
    os.environ.setdefault(RUN_MARK, str(os.getpid()))
    before = set(_ours())
    yield
    deadline = time.monotonic() + 10  # a janitor ends within milliseconds of its owner; a slow one gets this
    left = {pid: cmd for pid, cmd in _ours().items() if pid not in before}
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = {pid: cmd for pid, cmd in _ours().items() if pid not in before}
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)
    if left:
        pytest.fail("processes this module started outlived it (killed now):\n  "
                    + "\n  ".join(f"{pid}: {cmd}" for pid, cmd in sorted(left.items())), pytrace=False)  # fmt: skip


@contextlib.contextmanager
def bare_qemu(image: str | None = None, timeout: float = 180.0) -> Iterator[QemuProcess]:
    """Our QEMU without qprobe attached, booted to the guest shell, stopped afterwards."""
    img = get_image(image or IMAGE, fetch=False)
    q = QemuProcess(QemuConfig(kernel=img.kernel, initrd=img.initrd, cmdline=img.cmdline))
    try:
        q.wait_for_sockets()
        console = Console(q.console_path, alive=q.alive)
        try:
            open_shell(console, q.shell_path, q.alive, timeout).close()
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


def readline_matching(proc: subprocess.Popen[str], pattern: str) -> re.Match[str]:
    """The first line of ``proc``'s output that matches ``pattern`` (its stderr in the failure if none does)."""
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        m = re.search(pattern, line)
        if m:
            return m
    err = proc.stderr.read() if proc.stderr else ""
    raise AssertionError(f"{pattern!r} never printed; output: {''.join(seen)}; stderr: {err}")


def workload_result(output: str) -> dict[str, str]:
    """The ``key=value`` summary line the guest workload prints."""
    line = next((x for x in output.splitlines() if x.startswith("workload ")), None)
    if line is None:
        pytest.fail(f"the guest workload printed no summary line; its output was {output!r}")
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


@functools.cache
def _elf_symbols(vmlinux: Path) -> dict[str, list[tuple[int, int]]]:
    """name -> [(link-time address, size)] of a vmlinux file's text symbols, as binutils' nm reads them."""
    out = subprocess.run(["nm", "-S", "--defined-only", str(vmlinux)], capture_output=True, text=True, check=True)
    syms: dict[str, list[tuple[int, int]]] = {}
    for line in out.stdout.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[2] in "tT":
            syms.setdefault(parts[3], []).append((int(parts[0], 16), int(parts[1], 16)))
    return syms


def _elf_function(vmlinux: Path, name: str) -> tuple[int, int]:
    rows = _elf_symbols(vmlinux).get(name, [])
    if len(rows) != 1:
        pytest.fail(f"{vmlinux.name}: {len(rows)} symbols named {name}, need exactly one")
    return rows[0]


_INSN = re.compile(r"^\s*([0-9a-f]+):\t(\S+)\s*(.*)$")


@functools.cache
def branches_to(vmlinux: Path, caller: str, callee: str) -> tuple[list[int], list[int]]:
    """Offsets in ``caller`` after each direct call of ``callee``, and of each jump (a tail call) to it."""
    start, size = _elf_function(vmlinux, caller)
    target = _elf_function(vmlinux, callee)[0]
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", f"--start-address={start:#x}",
                          f"--stop-address={start + size:#x}", str(vmlinux)],
                         capture_output=True, text=True, check=True)  # fmt: skip
    insns = [(int(m[1], 16), m[2], m[3]) for m in map(_INSN.match, out.stdout.splitlines()) if m]
    calls, jumps = [], []
    for i, (_, mnemonic, operands) in enumerate(insns):
        if operands.split(" ")[0] != f"{target:x}":
            continue
        after = insns[i + 1][0] if i + 1 < len(insns) else start + size
        if mnemonic.startswith("call"):
            calls.append(after - start)
        elif mnemonic.startswith("j"):
            jumps.append(after - start)
    return calls, jumps


@functools.cache
def disassemble(vmlinux: Path, name: str) -> list[tuple[int, str, str]]:
    """(offset, mnemonic, operands) of each instruction of a vmlinux file's function, as binutils' objdump reads it."""
    start, size = _elf_function(vmlinux, name)
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", f"--start-address={start:#x}",
                          f"--stop-address={start + size:#x}", str(vmlinux)],
                         capture_output=True, text=True, check=True)  # fmt: skip
    return [(int(m[1], 16) - start, m[2], m[3]) for m in map(_INSN.match, out.stdout.splitlines()) if m]


def vmlinux_of(target: qprobe.Target) -> Path:
    """The vmlinux file of the image a target booted (the first --qprobe-image when it has none)."""
    return (target.image or get_image(IMAGE, fetch=False)).vmlinux


def text_symbols(vmlinux: Path) -> KeysView[str]:
    """Names of a vmlinux file's text symbols, as binutils' nm reads them."""
    return _elf_symbols(vmlinux).keys()


def entry_offset(vmlinux: Path, name: str) -> int:
    """Where the kernel puts a probe on a function's entry: past an ``endbr64`` on a kernel built with IBT
    (arch_adjust_kprobe_addr, Linux 5.18's "x86/ibt,kprobes: Cure sym+0 equals fentry woes"), else at +0."""
    insns = disassemble(vmlinux, name)
    return insns[1][0] if insns[0][1] == "endbr64" else 0


def has_fentry_call(vmlinux: Path, name: str) -> bool:
    """Whether a function calls ``__fentry__``, the site ftrace manages; a kernel built with
    CONFIG_KPROBE_EVENTS_ON_NOTRACE=n refuses kprobe events on a function without one."""
    return any(mnemonic.startswith("call") and operands.endswith("<__fentry__>")
               for _, mnemonic, operands in disassemble(vmlinux, name))  # fmt: skip


def frames_above(image: Image, path: Sequence[str]) -> list[tuple[str, frozenset[str]]]:
    """The frames above the last function of a call path while it runs, innermost first.

    ``path`` names functions from the outermost down, each calling the next
    directly. What the compiler made of each call is read from the image's
    vmlinux with binutils, not with qprobe: a call leaves the caller on the stack
    with its return site ``caller+0xoff`` (the instruction after the call); a
    jump to the callee (a tail call, which a kernel built with frame pointers
    has none of: -fno-optimize-sibling-calls) leaves nothing, and the callee
    returns into the caller's caller. Each frame is ``(function, return sites)``.
    """
    frames = []
    for caller, callee in itertools.pairwise(path):
        calls, jumps = branches_to(image.vmlinux, caller, callee)
        if bool(calls) == bool(jumps):
            pytest.fail(f"{image.name}: {caller} has {len(calls)} direct calls and {len(jumps)} jumps to {callee}; "
                        "its call path cannot be told from its text")  # fmt: skip
        if calls:
            frames.append((caller, frozenset(f"{caller}+{off:#x}" for off in calls)))
    return frames[::-1]


@pytest.fixture
def booted() -> Iterator[str]:
    """``qprobe boot`` in the background, started with SIGINT ignored as `qprobe boot &` from a script (or
    from a pytest run so started) starts it; yields the attach address.  SIGINT still stops it."""
    proc = subprocess.Popen([sys.executable, "-m", "qprobe.cli", "boot", "--image", IMAGE],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))  # fmt: skip
    try:
        yield readline_matching(proc, r"attach with:\s+qprobe attach (\S+)").group(1)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            assert proc.wait(30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()


def sigkill_when(code: str, args: Sequence[str], line: str) -> None:
    """Run ``python -c code args...`` (a qprobe that arms probes) until it prints ``line``, then SIGKILL it: what
    it wrote into the guest stays, for the next attach to undo."""
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        readline_matching(proc, line)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
