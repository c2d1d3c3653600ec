"""drgn on the live guest: Target.prog, fresh reads between hits, VMCOREINFO, `qprobe drgn` and the shell's `drgn`."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import drgn
import pytest
from drgn.helpers.linux.pid import find_task, for_each_task

import qprobe
from qprobe import Kprobe
from qprobe.kernel.program import open_program, synthetic_vmcoreinfo, vmcoreinfo

from .conftest import IMAGE, workload_result

pytestmark = pytest.mark.vm
ROOT = Path(__file__).resolve().parents[2]


def _fields(text: bytes) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.decode().splitlines() if "=" in line)


# -- the interactive sessions, as a person would use them: in a terminal (tmux) ----------------------
class Tmux:
    def __init__(self, command: list[str]) -> None:
        self.name = f"qprobe-test-{uuid.uuid4().hex[:8]}"
        env = dict(os.environ, PYTHONPATH=str(ROOT), NO_COLOR="1", TERM="xterm")
        inner = " ".join(map(_quote, command)) + '; echo "[exit status $?]"; sleep 600'
        subprocess.run(["tmux", "new-session", "-d", "-s", self.name, "-x", "200", "-y", "50", "sh", "-c", inner],
                       check=True, env=env, cwd=str(ROOT))  # fmt: skip

    def screen(self) -> str:
        return subprocess.run(["tmux", "capture-pane", "-p", "-S", "-2000", "-t", self.name],
                              capture_output=True, text=True, check=True).stdout  # fmt: skip

    def wait_for(self, pattern: str, timeout: float = 60.0, after: int = 0) -> str:
        """The screen once ``pattern`` (a regex) shows up past the first ``after`` characters."""
        deadline = time.monotonic() + timeout
        while True:
            text = self.screen()
            if re.search(pattern, text[after:], re.M):
                return text
            if time.monotonic() > deadline:
                raise AssertionError(f"{pattern!r} not on screen after {timeout} s:\n{text}")
            time.sleep(0.3)

    def type(self, line: str) -> int:
        """Type a line and Enter; returns how much of the screen was there before it."""
        mark = len(self.screen().rstrip())
        subprocess.run(["tmux", "send-keys", "-t", self.name, "-l", line], check=True)
        subprocess.run(["tmux", "send-keys", "-t", self.name, "Enter"], check=True)
        return mark

    def keys(self, *keys: str) -> None:
        subprocess.run(["tmux", "send-keys", "-t", self.name, *keys], check=True)

    def kill(self) -> None:
        subprocess.run(["tmux", "kill-session", "-t", self.name], check=False, capture_output=True)


def _quote(word: str) -> str:
    return "'" + word.replace("'", "'\\''") + "'"


@pytest.fixture
def tmux_session() -> Iterator[list[Tmux]]:
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (make installs it)")
    sessions: list[Tmux] = []
    yield sessions
    for session in sessions:
        session.kill()  # SIGHUP: qprobe removes its probes and stops its QEMU


# The terminal tests boot their own VM: they come first, before the module's `target` VM is booted.
def test_qprobe_drgn_in_a_terminal(tmux_session: list[Tmux]) -> None:
    term = Tmux([sys.executable, "-m", "qprobe.cli", "drgn", "--image", IMAGE, "p:gp __x64_sys_getppid"])
    tmux_session.append(term)
    term.wait_for(r"^>>> ", timeout=600)
    mark = term.type("prog['init_uts_ns'].name.sysname.string_()")
    term.wait_for(r"^b'Linux'$", after=mark)
    # The event stays armed while drgn runs, and drgn sees the guest as it is now.
    mark = term.type('target.run("workload getppid 3").check(); target.events["kprobes/gp"].probe.nhit')
    term.wait_for(r"^\(?3\)?$", after=mark, timeout=120)
    mark = term.type("[t.pid.value_() for t in for_each_task(prog)][:2]")
    term.wait_for(r"^\[1, 2\]$", after=mark)  # init and kthreadd, after init_task (pid 0)
    term.keys("C-d")
    term.wait_for(r"^\[exit status 0\]$", timeout=120)


def test_shell_drgn_command_in_a_terminal(tmux_session: list[Tmux]) -> None:
    term = Tmux([sys.executable, "-m", "qprobe.cli", "shell", "--image", IMAGE])
    tmux_session.append(term)
    term.wait_for(r"qprobe>", timeout=600)
    mark = term.type("p:gp __x64_sys_getppid")
    term.wait_for("added kprobes/gp", after=mark)
    mark = term.type("drgn")
    term.wait_for(r"^>>> ", after=mark, timeout=120)
    mark = term.type('target.run("workload getppid 2").check(); target.events["kprobes/gp"].probe.nhit')
    term.wait_for(r"^\(?2\)?$", after=mark, timeout=120)
    mark = term.type("cpu_curr(prog, 0).comm.string_() != b''")
    term.wait_for(r"^True$", after=mark)
    mark = len(term.screen().rstrip())
    term.keys("C-d")  # back to the qprobe shell, the probe still armed
    term.wait_for(r"qprobe>", after=mark, timeout=60)
    mark = term.type("count gp by $comm run workload getppid 3")
    term.wait_for(r"@\[workload\]: 3", after=mark, timeout=120)
    term.keys("C-d")
    term.wait_for(r"^\[exit status 0\]$", timeout=120)


def test_a_vmlinux_without_dwarf_still_probes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default image's kernel with its vmlinux stripped of DWARF: probes, return probes and events work;
    what needs the kernel's types says so in one line."""
    from qprobe.images import get_image

    img = get_image(IMAGE, fetch=False)
    stripped = tmp_path / "vmlinux-nodwarf"
    subprocess.run(["objcopy", "--strip-debug", str(img.vmlinux), str(stripped)], check=True)
    (tmp_path / "images.toml").write_text(
        f'[images.nodwarf]\nkernel = "{img.kernel}"\nvmlinux = "{stripped}"\n'
        + (f'system_map = "{img.system_map}"\n' if img.system_map else "")
    )
    monkeypatch.setenv("QPROBE_IMAGES", str(tmp_path / "images.toml"))
    with qprobe.boot("nodwarf") as t:
        offsets: list[int] = []
        errors: list[str] = []

        def pre(kp: Kprobe, regs: qprobe.PtRegs) -> None:
            offsets.append(regs.si)
            try:
                regs.stack_trace()
            except qprobe.SymbolError as exc:
                errors.append(str(exc))

        kp = Kprobe(symbol_name="ksys_lseek", pre_handler=pre)
        returns: list[tuple[int, object]] = []
        rp = qprobe.Kretprobe(symbol_name="ksys_lseek", handler=lambda ri, regs: returns.append((regs.ax, ri.task)))
        t.register_kprobe(kp)
        t.register_kretprobe(rp)
        t.run("workload lseek 3").check()
        t.unregister_kprobe(kp)
        t.unregister_kretprobe(rp)
        assert offsets == [1, 2, 3] and returns == [(1, None), (2, None), (3, None)], (kp.errors, rp.errors)
        assert len(errors) == 3 and "\n" not in errors[0] and "has no DWARF debug info" in errors[0]
        te = t.add_event("p:ls ksys_lseek off=%si")
        t.run("workload lseek 2").check()
        t.remove_event(te)
        assert [h.args["off"] for h in te.hits] == ["0x1", "0x2"] and te.hits[0].comm == "<...>"
        with pytest.raises(qprobe.SymbolError, match="vmlinux-nodwarf has no DWARF debug info"):
            _ = t.prog


def test_prog_lists_the_guest_s_tasks(target: qprobe.Target) -> None:
    out = target.run("workload spin 3 >/dev/null & echo pid=$!; sleep 1").check().output
    pid = int(re.search(r"pid=(\d+)", out).group(1))  # type: ignore[union-attr]
    try:
        tasks = {t.pid.value_(): t.comm.string_() for t in for_each_task(target.prog)}
        assert tasks.get(pid) == b"workload", sorted(tasks.items())
        assert find_task(target.prog, pid).tgid.value_() == pid
    finally:
        target.run(f"while [ -e /proc/{pid} ]; do sleep 0.2; done", timeout=30).check()
    # Gone once it exited: the task list is read from the guest each time.
    assert pid not in {t.pid.value_() for t in for_each_task(target.prog)}


def test_values_that_change_between_two_hits_are_read_fresh(target: qprobe.Target, guard: dict[int, bytes]) -> None:
    """lseek(fd, i, SEEK_SET) for i = 1, 2, 3: at each hit the file position is the previous offset."""
    seen: list[tuple[int, int, int, int, int]] = []
    first: list[drgn.Object] = []

    def pre(kp: Kprobe, regs: qprobe.PtRegs) -> None:
        current = target.current(regs)
        if current.comm.string_() != b"workload":
            return
        file = drgn.Object(target.prog, "struct file *", regs.arg("file"))
        first[:] = first or [file]  # the same object, asked again at the later hits
        seen.append((current.pid.value_(), regs.arg("offset"), regs.arg("whence"), file.f_pos.value_(),
                     first[0].f_pos.value_()))  # fmt: skip

    kp = Kprobe(symbol_name="generic_file_llseek_size", pre_handler=pre)
    target.register_kprobe(kp)
    try:
        res = workload_result(target.run("workload lseek 3").check().output)
    finally:
        target.unregister_kprobe(kp)
    pid = int(res["pid"])
    assert seen == [(pid, 1, 0, 0, 0), (pid, 2, 0, 1, 1), (pid, 3, 0, 2, 2)], kp.errors


def test_vmcoreinfo_written_from_vmlinux_agrees_with_the_guest_s(target: qprobe.Target) -> None:
    """What qprobe writes for a kernel without CONFIG_CRASH_CORE, against the lines this kernel wrote itself."""
    guest = _fields(vmcoreinfo(target.symbols, target.mem, target.arch))
    ours = _fields(synthetic_vmcoreinfo(target.symbols, target.mem, target.arch))
    assert "OSRELEASE" in guest and "KERNELOFFSET" in guest
    assert {k: guest.get(k) for k in ours} == ours
    # And drgn works from it alone.
    prog = open_program(
        target.symbols, target.mem, target.arch, synthetic_vmcoreinfo(target.symbols, target.mem, target.arch)
    )
    release = target.run("uname -r").check().output.strip()
    assert prog["init_uts_ns"].name.release.string_().decode() == release
    assert any(t.comm.string_() == b"sh" for t in for_each_task(prog))
