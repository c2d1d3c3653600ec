"""The console kept in memory is bounded: the last MAX_TEXT characters and the oops lines, with offsets that
count everything printed, so a guest printing forever cannot grow qprobe without end."""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from qprobe.errors import GuestBootFailed, GuestPanicked, GuestTimeout, TargetGone
from qprobe.vmm import bootfail
from qprobe.vmm import console as console_mod
from qprobe.vmm.bootfail import BootSetup
from qprobe.vmm.console import Console


@pytest.fixture
def guest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Console, socket.socket]]:
    """A Console on a socket whose other end (returned) the test writes as the guest would."""
    monkeypatch.setattr(console_mod, "MAX_TEXT", 1000)
    monkeypatch.setattr(console_mod, "MAX_OOPS", 5)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "console.sock"))
    listener.listen()
    accepted: list[socket.socket] = []
    thread = threading.Thread(target=lambda: accepted.append(listener.accept()[0]))
    thread.start()
    console = Console(tmp_path / "console.sock")
    thread.join()
    yield console, accepted[0]
    accepted[0].close()
    console.close()
    listener.close()


def test_a_console_that_prints_forever_is_kept_bounded(guest: tuple[Console, socket.socket]) -> None:
    console, far = guest
    lines = [f"line {i:06d} of noise\n" if i % 50 else f"BUG: number {i}\n" for i in range(1000)]
    far.sendall("".join(lines).encode())
    total = sum(map(len, lines))
    console.wait_for(r"line 000999 of noise\n", 5)
    assert console.end == total and len(console.text) <= 1000
    assert console.text.endswith("line 000999 of noise\n")
    # The oops lines survive the text they were in, up to MAX_OOPS of them.
    assert console.oopses() == [f"BUG: number {i}" for i in range(0, 250, 50)]
    # Offsets count what is no longer kept: a search from an old offset finds only what follows it.
    far.sendall(b"after the flood\n")
    assert console.wait_for(r"after the flood\n", 5, start=total) == total + len("after the flood\n")


def test_a_line_split_across_reads_is_one_oops_line(guest: tuple[Console, socket.socket]) -> None:
    console, far = guest
    far.sendall(b"[ 1.0] BU")
    console.wait_for(r"BU", 5)
    far.sendall(b"G: split in two\nnext\n")
    console.wait_for(r"next\n", 5)
    assert console.oopses() == ["[ 1.0] BUG: split in two"]
    assert re.search(r"BUG: split in two", console.text)


def test_a_console_that_closes_after_a_panic_says_so(guest: tuple[Console, socket.socket]) -> None:
    console, far = guest
    far.sendall(b"[ 1.5] Oops: int3: 0000 [#1] PREEMPT SMP NOPTI\n")
    far.sendall(b"[ 1.5] Kernel panic - not syncing: Fatal exception in interrupt\n[ 3.1] Shutting down cpus\n")
    far.close()
    with pytest.raises(GuestPanicked, match=r"waited for 'QPROBE-READY': Kernel panic - not syncing: Fatal exception"):
        console.wait_for("QPROBE-READY", 5)


def test_a_console_that_closes_without_a_panic_is_gone(guest: tuple[Console, socket.socket]) -> None:
    console, far = guest
    far.sendall(b"reboot: Power down\n")
    far.close()
    with pytest.raises(TargetGone) as info:
        console.wait_for("QPROBE-READY", 5)
    assert not isinstance(info.value, GuestPanicked)


class FakeGuest:
    """Both of a booted VM's serial ports, each a socket whose far end the test writes as the guest would."""

    def __init__(self, tmp_path: Path) -> None:
        self.listeners: dict[str, socket.socket] = {}
        self.far: dict[str, socket.socket] = {}
        for name in ("console", "shell"):
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(str(tmp_path / f"{name}.sock"))
            listener.listen()
            self.listeners[name] = listener
        self.console = self._connect("console", lambda: Console(tmp_path / "console.sock"))

    def _connect(self, name: str, make):  # type: ignore[no-untyped-def]
        accepted: list[socket.socket] = []
        thread = threading.Thread(target=lambda: accepted.append(self.listeners[name].accept()[0]))
        thread.start()
        made = make()
        thread.join()
        self.far[name] = accepted[0]
        return made

    def answer(self, command_line: bytes, output: bytes, status: int) -> None:
        """Answer one GuestShell.run command as the guest's shell does: the markers around the output."""
        token = re.search(rb"printf '\\n@@qp-begin-%s@@\\n' ([0-9a-f]+);", command_line)
        assert token is not None
        t = token.group(1)
        data = b"\n@@qp-begin-" + t + b"@@\n" + output + b"\n@@qp-end-" + t + b"@@%d\n" % status
        # In two reads, split inside the output's first multi-byte character if it has one.
        cut = next((i + 1 for i, b in enumerate(data) if b >= 0x80), len(data) // 2)
        self.far["shell"].sendall(data[:cut])
        time.sleep(0.05)
        self.far["shell"].sendall(data[cut:])

    def close(self) -> None:
        for s in (*self.far.values(), *self.listeners.values()):
            s.close()
        self.console.close()


@pytest.fixture
def vm(tmp_path: Path) -> Iterator[FakeGuest]:
    guest = FakeGuest(tmp_path)
    yield guest
    guest.close()


def _run_answered(vm: FakeGuest, shell: console_mod.GuestShell, output: bytes, status: int) -> console_mod.RunResult:
    """shell.run("cmd") with the guest answering ``output`` and ``status`` while the kernel logs on the console."""
    result: list[console_mod.RunResult] = []
    thread = threading.Thread(target=lambda: result.append(shell.run("cmd", timeout=5)))
    thread.start()
    command_line = b""
    while not command_line.endswith(b"\n"):
        command_line += vm.far["shell"].recv(4096)
    vm.far["console"].sendall(b"[    1.234567] tsc: Refined TSC clocksource calibration: 2445.425 MHz\r\n")
    vm.answer(command_line, output, status)
    thread.join(5)
    return result[0]


def test_a_commands_output_is_what_it_wrote_whatever_the_kernel_logs(vm: FakeGuest, tmp_path: Path) -> None:
    shell = vm._connect("shell", lambda: console_mod.open_shell(vm.console, tmp_path / "shell.sock", None, None))
    # Bytes as the command wrote them: a carriage return kept, a character split across two reads whole.
    output = "6.12.117\r\nsplit é here".encode()
    got = _run_answered(vm, shell, output, 3)
    assert got.output == output.decode() and got.status == 3
    vm.console.wait_for("Refined TSC", 5)
    assert "Refined TSC" not in shell.port.text and "@@qp-" not in vm.console.text


def test_a_shell_that_says_ready_on_the_console_is_read_there(vm: FakeGuest, tmp_path: Path) -> None:
    """A root filesystem whose /init ignores qprobe.shell= puts its shell on the console."""
    vm.far["console"].sendall(b"[    2.0] Run /init as init process\r\nQPROBE-READY\n")
    shell = vm._connect("shell", lambda: console_mod.open_shell(vm.console, tmp_path / "shell.sock", None, 5))
    assert shell.port is vm.console


def test_a_panic_while_the_shell_waits_is_reported_from_the_console(vm: FakeGuest, tmp_path: Path) -> None:
    shell = vm._connect("shell", lambda: console_mod.open_shell(vm.console, tmp_path / "shell.sock", None, None))
    vm.far["console"].sendall(b"[ 1.5] Kernel panic - not syncing: Fatal exception\r\n")
    vm.far["console"].close()
    vm.far["shell"].close()
    with pytest.raises(GuestPanicked, match=r"waited for 'QPROBE-READY': Kernel panic - not syncing: Fatal"):
        shell.wait_ready(5)


BUILDROOT = BootSetup("buildroot", "console=ttyS0,115200 root=/dev/vda rootwait rw", "virtio")


def test_a_login_prompt_on_the_console_ends_the_wait_for_the_shell_at_once(vm: FakeGuest, tmp_path: Path) -> None:
    vm.far["console"].sendall(
        b"[    2.0] Run /sbin/init as init process\r\n\r\nWelcome to Buildroot\r\nbuildroot login: "
    )
    t0 = time.monotonic()
    with pytest.raises(GuestBootFailed, match=r"printed a login prompt on its console \('buildroot login:'\)"):
        vm._connect("shell", lambda: console_mod.open_shell(vm.console, tmp_path / "shell.sock", None, 60, BUILDROOT))
    assert time.monotonic() - t0 < 5  # LOGIN_GRACE and a poll, not the 60 s timeout


def test_a_vm_that_ends_with_a_panic_names_its_cause(vm: FakeGuest, tmp_path: Path) -> None:
    vm.far["console"].sendall(b"[    2.4] Kernel panic - not syncing: Requested init /x failed (error -2).\r\n")
    vm.far["console"].close()
    setup = BootSetup("debian-cloud", "console=ttyS0,115200 init=/x")
    with pytest.raises(GuestBootFailed, match=r"no init program could run; check init= and rdinit= \(the command "
                       r"line says init=/x\)"):  # fmt: skip
        vm._connect("shell", lambda: console_mod.open_shell(vm.console, tmp_path / "shell.sock", lambda: False, 60,
                                                            setup))  # fmt: skip


def test_a_panic_that_may_be_the_emulators_stays_a_guest_panic(vm: FakeGuest, tmp_path: Path) -> None:
    vm.far["console"].sendall(b"[    1.5] Kernel panic - not syncing: Fatal exception in interrupt\r\n")
    with pytest.raises(GuestPanicked, match=r"^the kernel of image 'buildroot' panicked before qprobe's shell "
                       r"started \('Kernel panic - not syncing: Fatal exception in interrupt'\)") as info:  # fmt: skip
        vm._connect("shell", lambda: console_mod.open_shell(vm.console, tmp_path / "shell.sock", None, 60, BUILDROOT))
    assert not isinstance(info.value, GuestBootFailed)


def test_without_a_setup_only_the_timeout_ends_the_wait(vm: FakeGuest, tmp_path: Path) -> None:
    vm.far["console"].sendall(b"buildroot login: ")
    with pytest.raises(GuestTimeout, match=r"did not print 'QPROBE-READY' within 1.5 s") as info:
        vm._connect("shell", lambda: console_mod.open_shell(vm.console, tmp_path / "shell.sock", None, 1.5))
    assert not isinstance(info.value, GuestBootFailed)


def test_the_shell_on_the_console_is_waited_for_the_same_way(vm: FakeGuest) -> None:
    vm.far["console"].sendall(b"[    2.5] Waiting for root device /dev/vda...\r\n")
    t0 = time.monotonic()
    with pytest.raises(GuestBootFailed, match=r"disk_interface='virtio'.*root=/dev/vda"):
        console_mod.open_shell(vm.console, None, None, 60, BUILDROOT)
    assert time.monotonic() - t0 < 2 + bootfail.ROOT_GRACE


def _interrupted_run(vm: FakeGuest, tmp_path: Path) -> tuple[console_mod.GuestShell, bytes, threading.Thread]:
    """A ``run("sleep 60")`` the guest has begun (its begin marker printed), on a thread; the shell, the
    command's token, the thread."""
    shell = vm._connect("shell", lambda: console_mod.open_shell(vm.console, tmp_path / "shell.sock", None, None))
    far = vm.far["shell"]

    def run() -> None:
        with contextlib.suppress(TargetGone):  # the port closes under a command the guest never ends
            shell.run("sleep 60", timeout=30)

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    command_line = b""
    while not command_line.endswith(b"\n"):
        command_line += far.recv(4096)
    token = re.search(rb"@@qp-begin-%s@@\\n' ([0-9a-f]+);", command_line)
    assert token is not None
    far.sendall(b"\n@@qp-begin-" + token[1] + b"@@\n")
    shell.port.wait_for("@@qp-begin-", 5)
    return shell, token[1], runner


def test_a_ctrl_c_the_shell_took_is_sent_again_until_the_command_ends(vm: FakeGuest, tmp_path: Path) -> None:
    """A ^C after the shell printed the begin marker but before the command's process group is the tty's
    foreground one reaches the shell, which waits on while the command runs (a ``sleep 60`` holds the shell
    for a minute).  Here the guest takes the first ^C so, reads no line meanwhile, and the second ends it."""
    shell, token, runner = _interrupted_run(vm, tmp_path)
    far = vm.far["shell"]
    ctrl_c: list[int] = []

    def guest() -> None:
        while len(ctrl_c) < 2:
            ctrl_c.extend(b for b in far.recv(4096) if b == 3)
        far.sendall(b"\n@@qp-end-" + token + b"@@130\n")  # the second ^C reached the command

    answering = threading.Thread(target=guest)
    answering.start()
    shell.interrupt()
    answering.join(10)
    runner.join(10)
    assert len(ctrl_c) == 2 and not runner.is_alive()
    far.setblocking(False)  # what interrupt() sent after the second ^C: its last line asking if the shell reads
    with contextlib.suppress(BlockingIOError):
        while far.recv(4096):
            pass
    far.setblocking(True)
    shell.interrupt()  # nothing in flight: one ^C, no wait
    assert far.recv(16) == b"\x03"


def test_a_ctrl_c_that_aborted_the_command_line_is_not_sent_again(vm: FakeGuest, tmp_path: Path) -> None:
    """A ^C before the shell forked the command aborts the rest of its line: no end marker comes, but the
    shell reads again, and says so to the line interrupt() sends it."""
    shell, _, _ = _interrupted_run(vm, tmp_path)
    far = vm.far["shell"]
    heard = b""

    def guest() -> None:
        nonlocal heard
        while not heard.endswith(b"\n"):
            heard += far.recv(4096)
        idle = re.search(rb"printf '\\n@@qp-idle-%s@@\\n' ([0-9a-f]+)\n$", heard)
        assert idle is not None, heard
        far.sendall(b"\n@@qp-idle-" + idle[1] + b"@@\n")

    answering = threading.Thread(target=guest)
    answering.start()
    shell.interrupt(settle=30)  # a bound on a hang: the answer ends it
    answering.join(10)
    assert heard.count(b"\x03") == 1 and heard.startswith(b"\x03")
