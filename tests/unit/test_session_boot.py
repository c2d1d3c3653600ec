"""boot() boots once more when the guest kernel panicked before qprobe attached, and only then; what an
attached boot takes from its QEMU's command line."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from qprobe import session
from qprobe.errors import BootPanic, GuestBootFailed, GuestPanicked, GuestStalled, TargetError
from qprobe.images import Image


class _Attempts:
    def __init__(self, *outcomes: object) -> None:
        self.outcomes = list(outcomes)
        self.calls = 0

    def __call__(self, *args: object) -> object:
        self.calls += 1
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


@pytest.fixture
def image(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    img = Image(name="fake", kernel=tmp_path / "bzImage", vmlinux=tmp_path / "vmlinux", initrd=tmp_path / "initrd",
                disk=None, system_map=None, config=None, cmdline="", disk_interface="", preempt="none",
                kernel_version="6.1.0")  # fmt: skip
    monkeypatch.setattr("qprobe.images.get_image", lambda name: img)


def test_a_panic_before_attach_boots_again_once(image: None, monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    panic = BootPanic("the guest kernel panicked while qprobe waited for 'QPROBE-READY': Kernel panic - x")
    attempts = _Attempts(panic, "the target")
    monkeypatch.setattr(session, "_boot_once", attempts)
    with caplog.at_level(logging.WARNING, logger="qprobe"):
        assert session.boot("fake") == "the target"
    assert attempts.calls == 2
    assert "Kernel panic - x" in caplog.text and "booting fake again" in caplog.text


def test_a_kernel_stalled_in_its_boot_before_attach_boots_again_once(
    image: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    stall = GuestStalled("the kernel of image 'fake' stopped printing in its own boot, before it ran init")
    attempts = _Attempts(stall, "the target")
    monkeypatch.setattr(session, "_boot_once", attempts)
    with caplog.at_level(logging.WARNING, logger="qprobe"):
        assert session.boot("fake") == "the target"
    assert attempts.calls == 2
    # A progress line first, as the front ends print and their users skip them, then the cause.
    assert caplog.records[-1].getMessage().startswith("booting fake again: the kernel of image 'fake' stopped")
    attempts = _Attempts(stall, stall)
    monkeypatch.setattr(session, "_boot_once", attempts)
    with pytest.raises(GuestStalled):
        session.boot("fake")
    assert attempts.calls == 2


def test_a_second_panic_is_reported(image: None, monkeypatch: pytest.MonkeyPatch) -> None:
    attempts = _Attempts(BootPanic("first"), BootPanic("second"))
    monkeypatch.setattr(session, "_boot_once", attempts)
    with pytest.raises(BootPanic, match="second"):
        session.boot("fake")
    assert attempts.calls == 2


def test_a_guest_that_will_not_boot_is_not_retried(image: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # Its console named a cause of the image's own (a getty, no root device, no init): a second boot
    # would fail the same way.
    attempts = _Attempts(GuestBootFailed("the kernel of image 'fake' panicked ... no init program could run"), "x")
    monkeypatch.setattr(session, "_boot_once", attempts)
    with pytest.raises(GuestBootFailed, match="no init program"):
        session.boot("fake")
    assert attempts.calls == 1


def test_a_panic_after_attach_is_not_retried(image: None, monkeypatch: pytest.MonkeyPatch) -> None:
    attempts = _Attempts(GuestPanicked("panicked with probes in it"), "unused")
    monkeypatch.setattr(session, "_boot_once", attempts)
    with pytest.raises(GuestPanicked):
        session.boot("fake")
    assert attempts.calls == 1


def test_the_tcg_thread_mode_reaches_qemus_config(image: None, monkeypatch: pytest.MonkeyPatch) -> None:
    configs = []
    monkeypatch.setattr(session, "_boot_once", lambda img, config, *rest: configs.append(config) or "the target")
    assert session.boot("fake", tcg_thread="single") == "the target"
    assert session.boot("fake") == "the target"
    assert [c.tcg_thread for c in configs] == ["single", ""]


def _arm(target: object) -> None:
    pass


@pytest.fixture
def listening_qemu(tmp_path: Path) -> Iterator[Callable[..., Path]]:
    """Starts a process listening on a Unix socket with the given QEMU-like arguments; its socket's path."""
    children: list[subprocess.Popen[bytes]] = []
    code = ("import socket, sys; s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(); "
            "print(flush=True); input()")  # fmt: skip

    def start(*args: str) -> Path:
        sock = tmp_path / f"gdb{len(children)}.sock"
        child = subprocess.Popen([sys.executable, "-c", code, str(sock), *args], cwd=tmp_path,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # fmt: skip
        children.append(child)
        assert child.stdout is not None and child.stdout.readline() == b"\n"
        return sock

    yield start
    for child in children:
        child.communicate(b"\n")


def test_an_attached_boot_reads_qemu_s_kernel_and_append(tmp_path: Path, listening_qemu: Callable[..., Path]) -> None:
    (tmp_path / "bz").write_bytes(b"")
    sock = listening_qemu("-S", "-kernel", "bz", "-append", "quiet memmap=2M$0x1e000000")
    plan = session._attach_plan(str(sock), _arm, None, None)
    assert (plan.image, plan.cmdline) == (tmp_path / "bz", "quiet memmap=2M$0x1e000000")
    plan = session._attach_plan(str(sock), _arm, None, "nokaslr")  # the whole line, given
    assert (plan.image, plan.cmdline) == (tmp_path / "bz", "nokaslr")
    plan = session._attach_plan(str(listening_qemu("-kernel", "bz")), _arm, None, None)
    assert (plan.image, plan.cmdline) == (tmp_path / "bz", "")  # no -append: the kernel gets an empty line


def test_what_an_attached_boot_cannot_find_says_why(tmp_path: Path, listening_qemu: Callable[..., Path]) -> None:
    plan = session._attach_plan(("10.0.0.1", 1234), _arm, None, None)
    assert plan.image is plan.cmdline is None and "no local QEMU" in plan.unknown
    plan = session._attach_plan(str(listening_qemu("-S", "-hda", "disk.img")), _arm, None, None)
    assert plan.image is plan.cmdline is None and "without -kernel" in plan.unknown
    plan = session._attach_plan(str(listening_qemu("-kernel", "gone", "-append", "x")), _arm, None, None)
    assert plan.image is None and "not a file here" in plan.unknown
    assert plan.cmdline == "x"  # what could be read is kept: with nokaslr the image is not needed
    (tmp_path / "bz").write_bytes(b"")
    plan = session._attach_plan(("10.0.0.1", 1234), _arm, tmp_path / "bz", "nokaslr")  # given: nothing looked up
    assert (plan.image, plan.cmdline, plan.unknown) == (tmp_path / "bz", "nokaslr", "")
    with pytest.raises(TargetError, match="is not a file"):
        session._attach_plan(("10.0.0.1", 1234), _arm, tmp_path / "missing", "nokaslr")
