"""A guest that will never start qprobe's shell ends the boot as soon as its console says why, with one
line naming the image, the console line and the cause, long before the boot timeout."""

from __future__ import annotations

import logging
import re
import threading
import time
from pathlib import Path

import pytest

import qprobe
from qprobe import session
from qprobe.errors import GuestBootFailed
from qprobe.vmm.qemu import QemuProcess

from .conftest import IMAGE

pytestmark = pytest.mark.vm
# The initramfs has no /nonexistent, so the kernel has no init to run from it and looks for a root device
# instead; the image has none (its root is the initramfs) and no root= names one.
CMDLINE = "init=/nonexistent rdinit=/nonexistent"
TIMEOUT = 600.0  # the wait must end on the console's cause, never on this


def test_a_guest_without_an_init_fails_at_once_with_its_cause(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="qprobe"), pytest.raises(GuestBootFailed) as info:
        qprobe.boot(IMAGE, cmdline=CMDLINE, boot_timeout=TIMEOUT)
    message = str(info.value)
    assert message.startswith(f"the kernel of image {IMAGE!r} cannot mount its root filesystem "
                              "('Kernel panic - not syncing: VFS: Unable to mount root fs on "), message  # fmt: skip
    assert "the image has no disk" in message and "no root=" in message and "rdinit=" in message, message
    assert "\n" not in message
    assert "booting" not in caplog.text  # the image's fault: not booted a second time as a panic may be


def test_a_login_prompt_fails_the_boot_only_when_the_pre_init_did_not_run_and_says_why() -> None:
    # A user's rdinit= after qprobe's replaces the pre-init: the kernel finds no such program in the initramfs,
    # mounts the disk itself and runs its /sbin/init, whose inittab puts a getty on the console.  (Booted
    # as qprobe boots it, the same image's getty runs beside qprobe's shell: tests/vm/test_buildroot_style.py.)
    with pytest.raises(GuestBootFailed) as info:  # not GuestTimeout: the wait ended on the prompt
        qprobe.boot("buildroot-ext2", cmdline="rdinit=/nonexistent", boot_timeout=TIMEOUT)
    message = str(info.value)
    assert message.startswith("the guest of image 'buildroot-ext2' printed a login prompt on its console "
                              "('buildroot login:') and never started qprobe's shell: the command line's "
                              "rdinit=/nonexistent replaced qprobe's pre-init"), message  # fmt: skip
    assert "\n" not in message


def test_a_kernel_silent_in_its_boot_is_named_with_where_its_vcpus_are_and_booted_again(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The first VM is stopped (QMP ``stop``) once its kernel has printed: its console goes silent in the
    boot, as a stalled guest's does.  qprobe names the stall, with each vCPU's place, and boots again."""
    stopped: list[str] = []

    class StoppedOnce(QemuProcess):
        def wait_for_sockets(self, timeout: float = 10.0) -> None:
            super().wait_for_sockets(timeout)
            if not stopped:
                stopped.append(str(self.rundir))
                threading.Thread(target=self._stop_in_boot, daemon=True).start()

        def _stop_in_boot(self) -> None:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and self.alive():
                if self.console_log.exists() and b"Linux version" in self.console_log.read_bytes():
                    self.qmp("stop")
                    return
                time.sleep(0.05)

    monkeypatch.setattr(session, "QemuProcess", StoppedOnce)
    with caplog.at_level(logging.WARNING, logger="qprobe"), qprobe.boot(IMAGE, boot_timeout=TIMEOUT) as target:
        assert target.run("echo up").check().output.strip() == "up"
        warning = next(r.getMessage() for r in caplog.records if "again" in r.getMessage())
        assert warning.startswith(f"booting {IMAGE} again: the kernel of image {IMAGE!r} stopped printing"), warning
        # vCPU 0 in a function of this vmlinux, with its offset; vCPU 1 there too, or still in the firmware
        # if the kernel had not brought it up yet.
        stalled = (
            r"when it stalled: vCPU 0 at ([\w.]+)\+0x[0-9a-f]+, "
            r"vCPU 1 at ([\w.]+\+0x[0-9a-f]+|0x[0-9a-f]+, not in the kernel yet)\)"
        )
        places = re.search(stalled, warning)
        assert places is not None and places[1] in target.symbols, warning
        second = places[2].partition("+")[0]
        assert second in target.symbols or second.endswith("not in the kernel yet"), warning
        # The console kept for the user ends with the same words, where no later warning hides them.
        kept = re.search(r"guest console kept in (\S+?)\)", warning)
        assert kept is not None, warning
        last = Path(kept[1]).read_text().rstrip("\n").rpartition("\n")[2]
        assert last.startswith("[qprobe: the kernel of image") and places[0].removesuffix(")") in last, last
    assert len(stopped) == 1
