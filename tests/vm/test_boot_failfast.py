"""A guest that will never start qprobe's shell ends the boot as soon as its console says why, with one
line naming the image, the console line and the cause, long before the boot timeout."""

from __future__ import annotations

import logging

import pytest

import qprobe
from qprobe.errors import GuestBootFailed

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
