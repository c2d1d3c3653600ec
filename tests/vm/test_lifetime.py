"""A VM never outlives the qprobe that started it: `qprobe trace` and `qprobe shell` ended by a closed
terminal (SIGHUP) or by SIGKILL leave no QEMU, no janitor, no RAM file in /dev/shm, no run directory and
no undo journal (of no use once its VM is gone)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pexpect
import pytest

from qprobe.paths import cache_dir

from .conftest import IMAGE

pytestmark = pytest.mark.vm
ROOT = Path(__file__).resolve().parents[2]
BOOT_TIMEOUT = 600


def _qemu_of(owner: int) -> tuple[int, Path, Path]:
    """The QEMU ``owner`` started: its pid, run directory and RAM directory (from its command line)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == owner and "qemu-system" in argv[0]:
            text = " ".join(argv)
            ram = re.search(r"mem-path=(\S+)/ram", text)
            gdb = re.search(r"path=(\S+)/gdb\.sock", text)
            assert ram and gdb, text
            return int(entry.name), Path(gdb[1]), Path(ram[1])
    raise AssertionError(f"no QEMU started by {owner}")


def _mentioning(path: Path) -> list[int]:
    """Processes whose command line names a file in ``path`` (QEMU, the janitor)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if f"{path}/".encode() in (entry / "cmdline").read_bytes():
                    out.append(int(entry.name))
            except OSError:
                continue
    return out


def _wait_until(cond: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return cond()


def _journals() -> set[Path]:
    """The undo journals (and their logs) in qprobe's cache."""
    return {p for p in cache_dir("journal").iterdir() if p.suffix in (".json", ".log")}


def _assert_nothing_left(qemu: int, rundir: Path, shmdir: Path, journals: set[Path]) -> None:
    """Nothing of the VM is left; ``journals`` were there before it booted."""

    def clean() -> bool:
        return (not Path(f"/proc/{qemu}").exists() and not rundir.exists() and not shmdir.exists()
                and _journals() <= journals)  # fmt: skip

    try:
        assert _wait_until(clean, 60), (
            f"left behind: qemu {'running' if Path(f'/proc/{qemu}').exists() else 'gone'}, "
            f"run directory {rundir.exists()}, RAM directory {shmdir.exists()}, "
            f"journals {sorted(_journals() - journals)}"
        )
        assert _mentioning(rundir) == [] and _mentioning(shmdir) == []
    finally:
        for pid in [qemu, *_mentioning(rundir), *_mentioning(shmdir)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT), PROMPT_TOOLKIT_NO_CPR="1", TERM="xterm", NO_COLOR="1")


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGKILL], ids=["SIGHUP", "SIGKILL"])
def test_trace_ended_by_a_signal_leaves_nothing(sig: signal.Signals) -> None:
    journals = _journals()
    proc = subprocess.Popen(
        [sys.executable, "-m", "qprobe.cli", "trace", "--image", IMAGE, "p:gp __x64_sys_getppid"],
        cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stderr is not None
    try:
        deadline = time.monotonic() + BOOT_TIMEOUT
        while "; Ctrl-C to stop" not in proc.stderr.readline():  # "qprobe: tracing N event(s); Ctrl-C to stop"
            assert proc.poll() is None and time.monotonic() < deadline, "qprobe trace did not start tracing"
        qemu, rundir, shmdir = _qemu_of(proc.pid)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    _assert_nothing_left(qemu, rundir, shmdir, journals)
    if sig == signal.SIGHUP:
        assert proc.returncode == 128 + signal.SIGHUP
        assert "# gp: hits=" in out, out  # it unwound: the summary was printed
    else:
        assert proc.returncode == -signal.SIGKILL


def _shell_with_a_probe() -> pexpect.spawn:
    """``qprobe shell`` in a pty, booted, with one event added and its prompt back."""
    child = pexpect.spawn(sys.executable, ["-m", "qprobe.cli", "shell", "--image", IMAGE], cwd=str(ROOT),
                          env=_env(), encoding="utf-8", timeout=120, dimensions=(50, 200))  # fmt: skip
    try:
        child.expect_exact("qprobe>", timeout=BOOT_TIMEOUT)
        child.sendline("p:gp __x64_sys_getppid")
        child.expect_exact("added kprobes/gp")
        child.expect_exact("qprobe>")
    except BaseException:
        child.kill(signal.SIGKILL)
        raise
    return child


@pytest.mark.parametrize("how", ["terminal closed", "SIGKILL"])
def test_shell_ended_by_its_terminal_or_sigkill_leaves_nothing(how: str) -> None:
    journals = _journals()
    child = _shell_with_a_probe()
    try:
        qemu, rundir, shmdir = _qemu_of(child.pid)
        if how == "SIGKILL":
            child.kill(signal.SIGKILL)
        else:
            # What `tmux kill-session` or closing a terminal window does: the pty's master goes away,
            # the kernel hangs the terminal up and sends SIGHUP to the shell.
            child.ptyproc.fileobj.close()
        assert _wait_until(lambda: not child.isalive(), 120), "qprobe shell did not end"
    finally:
        if child.isalive():
            child.kill(signal.SIGKILL)
    _assert_nothing_left(qemu, rundir, shmdir, journals)


def _kill_qemu_under(child: pexpect.spawn) -> tuple[int, Path, Path]:
    """SIGKILL the QEMU under ``child`` and wait for its one error line and its exit; QEMU's pid and dirs."""
    try:
        qemu, rundir, shmdir = _qemu_of(child.pid)
        os.kill(qemu, signal.SIGKILL)
        child.expect_exact("qprobe: error: the VM is gone", timeout=60)
        child.expect(pexpect.EOF, timeout=60)
        child.close()
    finally:
        if child.isalive():
            child.kill(signal.SIGKILL)
    return qemu, rundir, shmdir


def test_the_shell_ends_when_its_vm_dies() -> None:
    """QEMU killed while the shell waits at its prompt: one error line at once, a non-zero exit, nothing left."""
    journals = _journals()
    child = _shell_with_a_probe()
    # A bound on waiting, not on speed: before, the shell sat at its prompt until the next command.
    qemu, rundir, shmdir = _kill_qemu_under(child)
    assert child.exitstatus == 2
    _assert_nothing_left(qemu, rundir, shmdir, journals)


def test_drgn_ends_when_its_vm_dies() -> None:
    """QEMU killed while `qprobe drgn` waits at its prompt: one error line at once, a non-zero exit, nothing left."""
    journals = _journals()
    child = pexpect.spawn(sys.executable, ["-m", "qprobe.cli", "drgn", "--image", IMAGE, "p:gp __x64_sys_getppid"],
                          cwd=str(ROOT), env=_env(), encoding="utf-8", timeout=120, dimensions=(50, 200))  # fmt: skip
    try:
        child.expect_exact(">>> ", timeout=BOOT_TIMEOUT)
    except BaseException:
        child.kill(signal.SIGKILL)
        raise
    # A bound on waiting, not on speed: before, drgn sat at its prompt (and the RAM file stayed) until Ctrl-D.
    qemu, rundir, shmdir = _kill_qemu_under(child)
    assert child.exitstatus == 2
    assert "Traceback" not in (child.before or ""), child.before
    _assert_nothing_left(qemu, rundir, shmdir, journals)


WAITING_TEST = """
import time

from qprobe import Kprobe


def test_waits(qprobe_target):
    qprobe_target.register_kprobe(Kprobe(symbol_name="__x64_sys_getppid"))
    print("@@armed@@", flush=True)
    time.sleep(3600)  # as a test waiting for the guest would: its VM's death must end the wait
"""


def _plugin_session_armed(tmp_path: Path, source: str, act: Callable[[subprocess.Popen[str], int], None],
                          wait: float) -> tuple[int, str, int, Path, Path]:  # fmt: skip
    """Run pytest with the plugin on ``source`` up to its test's ``@@armed@@``, then ``act(proc, qemu pid)``;
    (status, output, QEMU's pid, run directory, RAM directory) once the session ended, within ``wait`` s."""
    (tmp_path / "test_session.py").write_text(source)
    argv = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "test_session.py",
            "--qprobe-image", IMAGE]  # fmt: skip
    proc = subprocess.Popen(argv, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    try:
        deadline = time.monotonic() + BOOT_TIMEOUT
        before = ""
        while "@@armed@@" not in (line := proc.stdout.readline()):
            before += line
            assert proc.poll() is None and time.monotonic() < deadline, f"the test did not start:\n{before}"
        qemu, rundir, shmdir = _qemu_of(proc.pid)
        act(proc, qemu)
        # A bound on waiting, not on speed: before each fix, the session went on (here sleeping an hour).
        out, _ = proc.communicate(timeout=wait)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, out, qemu, rundir, shmdir


def test_a_plugin_test_ends_when_its_vm_dies(tmp_path: Path) -> None:
    """QEMU killed under a test using qprobe_target: the test fails at once with one line, nothing is left."""
    journals = _journals()
    status, out, qemu, rundir, shmdir = _plugin_session_armed(
        tmp_path, WAITING_TEST, lambda proc, qemu: os.kill(qemu, signal.SIGKILL), wait=120
    )
    assert status == 1, out
    assert re.search(r"^1 failed in ", out, re.M), out  # the test's failure, and no teardown error
    failure = [line for line in out.splitlines() if line.startswith("qprobe: error:")]
    assert len(failure) == 1 and failure[0].startswith("qprobe: error: the VM is gone"), out
    assert "Traceback" not in out and "During handling" not in out, out
    _assert_nothing_left(qemu, rundir, shmdir, journals)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
def test_a_plugin_session_ended_by_a_signal_stops_its_vm(tmp_path: Path, sig: signal.Signals) -> None:
    """A signal to pytest in the middle of a test ends the session (SIGTERM and SIGHUP as Ctrl-C does), its VM
    stopped and nothing left; before, SIGTERM only failed the test it landed in and the session went on."""
    journals = _journals()
    source = WAITING_TEST + "\n\ndef test_after(qprobe_target):\n    pass\n"
    status, out, qemu, rundir, shmdir = _plugin_session_armed(
        tmp_path, source, lambda proc, qemu: proc.send_signal(sig), wait=60
    )
    assert status == 2, out  # pytest's "interrupted"
    assert "test_after" not in out and " passed" not in out, out
    _assert_nothing_left(qemu, rundir, shmdir, journals)
