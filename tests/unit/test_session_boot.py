"""boot() boots once more when the guest kernel panicked before qprobe attached, and only then."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from qprobe import session
from qprobe.errors import BootPanic, GuestPanicked
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


def test_a_second_panic_is_reported(image: None, monkeypatch: pytest.MonkeyPatch) -> None:
    attempts = _Attempts(BootPanic("first"), BootPanic("second"))
    monkeypatch.setattr(session, "_boot_once", attempts)
    with pytest.raises(BootPanic, match="second"):
        session.boot("fake")
    assert attempts.calls == 2


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
