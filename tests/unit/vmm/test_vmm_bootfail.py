"""Why a guest will not start qprobe's shell, from its console: each cause, what is not one, and a console
that is hostile input (escape sequences, huge lines, floods)."""

from __future__ import annotations

import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from qprobe.errors import GuestBootFailed, GuestPanicked, GuestStalled
from qprobe.vmm import bootfail
from qprobe.vmm.bootfail import BootSetup, BootWatch, diagnose, printable

INITRD = BootSetup("debian-cloud", "console=ttyS0,115200 qprobe.shell=ttyS1 memmap=8M$0x1f000000 panic=-1")
DISK = BootSetup("buildroot", "console=ttyS0,115200 panic=-1 root=/dev/vda rootwait rw", "nvme")

BOOTING = """\
[    0.000000] Linux version 6.1.0-57-cloud-amd64 (debian-kernel@lists.debian.org)
[    0.000000] Command line: console=ttyS0,115200 qprobe.shell=ttyS1 panic=-1
[    2.387180] Run /init as init process
"""


def _panic(reason: str) -> str:
    return (
        f"{BOOTING}[    2.4] Kernel panic - not syncing: {reason}\n[    2.4] CPU: 0 PID: 1 Comm: swapper/0\n"
        f"[    2.4] Call Trace:\n[    2.4]  <TASK>\n[    2.4] ---[ end Kernel panic - not syncing: {reason} ]---\n"
    )


@pytest.mark.parametrize(
    ("text", "setup", "cause", "seen"),
    [
        # A getty on the console, with and without the issue banner, a kernel line after it, a prompt's space.
        (f"{BOOTING}\nWelcome to Buildroot\nbuildroot login: ", DISK, "login", "buildroot login:"),
        (f"{BOOTING}buildroot login:", DISK, "login", "buildroot login:"),
        (f"{BOOTING}\nqemu login: [    9.1] random: crng init done\n", DISK, "login", "qemu login:"),
        (f"{BOOTING}\ndebian login: \n[   12.5] clocksource: Switched to clocksource tsc\n", DISK, "login",
         "debian login:"),
        # The root device: waited for, not found, not mountable.
        (f"{BOOTING}[    2.5] Waiting for root device /dev/vda...\n", DISK, "root",
         "Waiting for root device /dev/vda..."),
        (f"{BOOTING}[    2.5] Waiting for root device /dev/vda...\n[  3.1] random: crng init done\n", DISK, "root",
         "Waiting for root device /dev/vda..."),
        (f'{BOOTING}[    2.5] VFS: Cannot open root device "vda" or unknown-block(0,0): error -6\n', DISK, "root",
         'VFS: Cannot open root device "vda" or unknown-block(0,0): error -6'),
        (_panic("VFS: Unable to mount root fs on unknown-block(0,0)"), INITRD, "root",
         "Kernel panic - not syncing: VFS: Unable to mount root fs on unknown-block(0,0)"),
        (_panic("VFS: Unnable to mount root fs on unknown-block(0,0)"), INITRD, "root",
         "Kernel panic - not syncing: VFS: Unnable to mount root fs on unknown-block(0,0)"),
        # Panics: no init, and any other (quoted).
        (_panic("Requested init /nonexistent failed (error -2)."), INITRD, "init",
         "Kernel panic - not syncing: Requested init /nonexistent failed (error -2)."),
        (_panic("No working init found.  Try passing init= option to kernel."), INITRD, "init",
         "Kernel panic - not syncing: No working init found. Try passing init= option to kernel."),
        (_panic("Fatal exception in interrupt"), INITRD, "panic",
         "Kernel panic - not syncing: Fatal exception in interrupt"),
        (_panic("Attempted to kill init! exitcode=0x00000100"), DISK, "panic",
         "Kernel panic - not syncing: Attempted to kill init! exitcode=0x00000100"),
    ],
)  # fmt: skip
def test_each_cause_is_named_with_the_line_it_rests_on(text: str, setup: BootSetup, cause: str, seen: str) -> None:
    found = diagnose(text, setup, elapsed=3.0)
    assert found is not None
    assert (found.cause, found.seen) == (cause, seen)
    assert repr(seen) in found.message and repr(setup.image) in found.message
    assert "\n" not in found.message


@pytest.mark.parametrize(
    "text",
    [
        "",  # nothing yet, but not for long
        BOOTING,
        f"{BOOTING}[    2.5] Waiting for root device /dev/vda...\n[  2.9] VFS: Mounted root (ext2 filesystem)\n",
        f"{BOOTING}[    2.5] Waiting for root device /dev/nvme0n1...\n[  2.9] EXT4-fs (nvme0n1): mounted filesystem\n",
        # The word alone, in a kernel line or inside a line, is no prompt.
        f"{BOOTING}[    2.6] systemd-logind: login: new session\n",
        f"{BOOTING}the login: prompt comes later\n",
        f"{BOOTING}[    2.6] traps: init[1] trap int3 ip:4011 sp:7ffd error:0 in login:\n",
        # An oops alone is the plugin's to report; only a panic ends the boot.
        f"{BOOTING}[    2.6] BUG: kernel NULL pointer dereference, address: 0000000000000000\n",
    ],
)  # fmt: skip
def test_a_console_that_may_still_boot_is_no_verdict(text: str) -> None:
    assert diagnose(text, DISK, elapsed=5.0) is None


def test_the_root_message_names_the_disk_interface_and_root() -> None:
    found = diagnose(f"{BOOTING}[    2.5] Waiting for root device /dev/vda...\n", DISK)
    assert found is not None
    assert "disk_interface='nvme'" in found.message and "/dev/nvme0n1" in found.message
    assert "root=/dev/vda" in found.message and "CONFIG_BLK_DEV_NVME" in found.message
    virtio = diagnose('VFS: Cannot open root device "nvme0n1"\n', BootSetup("br", "root=/dev/nvme0n1", "virtio"))
    assert virtio is not None and "disk_interface='virtio'" in virtio.message and "/dev/vda" in virtio.message
    assert "CONFIG_VIRTIO_BLK" in virtio.message
    # An initramfs root: no disk, so the kernel looked for one because the initramfs had no init to run.
    none = diagnose(_panic("VFS: Unable to mount root fs on unknown-block(0,0)"), INITRD)
    assert none is not None and "no disk" in none.message and "no root=" in none.message
    assert "rdinit=" in none.message


def test_the_init_message_names_init_and_rdinit_from_the_command_line() -> None:
    setup = BootSetup("debian-cloud", f"{INITRD.cmdline} init=/nonexistent rdinit=/sbin/x")
    found = diagnose(_panic("Requested init /nonexistent failed (error -2)."), setup)
    assert found is not None and "init=/nonexistent rdinit=/sbin/x" in found.message


def test_the_last_panic_counts_and_the_end_marker_is_not_quoted() -> None:
    text = _panic("first") + "[    3.0] Kernel panic - not syncing: second ]---\n"
    found = diagnose(text, INITRD)
    assert found is not None and found.seen == "Kernel panic - not syncing: second"


def test_a_silent_console_is_a_verdict_after_a_while_unless_the_log_is_kept_off_it() -> None:
    assert diagnose("", INITRD, elapsed=bootfail.SILENT_AFTER - 1) is None
    found = diagnose("", INITRD, elapsed=bootfail.SILENT_AFTER)
    assert found is not None and found.cause == "silent" and found.seen == ""
    assert "console=ttyS0,115200" in found.message and "CONFIG_SERIAL_8250_CONSOLE" in found.message
    assert diagnose("\n\n", INITRD, elapsed=60.0) is not None  # blank lines are nothing printed
    assert diagnose("[    0.0] Linux version 6.1\n", INITRD, elapsed=60.0) is None
    for quiet in ("quiet", "loglevel=3", "loglevel=5", "loglevel=x"):
        assert diagnose("", BootSetup("x", f"root=/dev/vda {quiet}"), elapsed=60.0) is None, quiet
    assert diagnose("", BootSetup("x", "loglevel=7"), elapsed=60.0) is not None
    # A VM that ended with nothing on its console: QEMU's own failure says more than a guess.
    assert diagnose("", INITRD, elapsed=60.0, ended=True) is None


def test_errors_keep_a_panic_that_may_be_the_emulators_apart() -> None:
    panic = diagnose(_panic("Fatal exception"), INITRD)
    init = diagnose(_panic("Requested init /x failed (error -2)."), INITRD)
    login = diagnose("buildroot login: ", DISK)
    assert panic is not None and init is not None and login is not None
    # boot() boots again after a GuestPanicked before attach (a stale TCG translation); the image's own
    # causes would only fail again.
    assert type(panic.error()) is GuestPanicked
    assert type(init.error()) is GuestBootFailed and type(login.error()) is GuestBootFailed
    assert str(login.error()) == login.message


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("\x1b[2J\x1b[Hroot login:", "root login:"),  # clear screen, cursor home
        ("\x1b]0;pwned\x07host login:", "host login:"),  # a window title (OSC ... BEL)
        ("\x1b]8;;http://x\x1b\\link\x1b]8;;\x1b\\ login:", "link login:"),  # OSC 8 hyperlink
        ("a\x00b\x7fc\x08d\x9b31me", "abcde"),  # NUL, DEL, backspace, an 8-bit CSI
        ("tab\there\u2028there\u202eevil", "tab here thereevil"),  # a line separator, a bidi override
        ("  many    blanks  ", "many blanks"),
        ("é 中文 ok", "é 中文 ok"),
    ],
)
def test_console_text_is_made_safe_before_it_is_quoted(raw: str, shown: str) -> None:
    assert printable(raw) == shown


def test_a_huge_line_is_bounded_and_read_in_bounded_time() -> None:
    huge = "A" * 5_000_000 + " login: "
    t0 = time.monotonic()
    found = diagnose(huge, DISK)
    assert time.monotonic() - t0 < 1.0
    assert found is not None and found.cause == "login" and len(found.seen) <= bootfail.MAX_SEEN
    assert found.seen.endswith("...") and len(found.message) < 1000
    panic = diagnose("Kernel panic - not syncing: " + "\x1b[31m" * 1_000 + "B" * 10_000 + "\n", INITRD)
    assert panic is not None and len(panic.seen) <= bootfail.MAX_SEEN and "\x1b" not in panic.message


def test_only_the_tail_is_read() -> None:
    # A panic line that scrolled out of the tail long ago is not this boot's verdict (and is not read).
    text = _panic("old") + "x" * 80 + "\n" + "[    5.0] noise\n" * 10_000
    assert diagnose(text, INITRD) is None
    # A cut line at the tail's start is not taken for a prompt.
    cut = "buildroot login:" + "y" * (bootfail.TAIL - 10)
    assert diagnose(cut[-(bootfail.TAIL + 5) :] + "\n[ 1.0] kernel\n", DISK) is None


@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=2000))
def test_any_console_text_gives_a_safe_one_line_message_or_none(text: str) -> None:
    for setup in (INITRD, DISK):
        found = diagnose(text, setup, elapsed=60.0)
        if found is not None:
            assert found.seen == printable(found.seen)
            assert len(found.seen) <= bootfail.MAX_SEEN
            assert all(c == " " or c.isprintable() for c in found.message), found.message


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_watch_acts_on_a_verdict_once_it_has_held_its_settle_time() -> None:
    clock = Clock()
    watch = BootWatch(DISK, clock)
    waiting = f"{BOOTING}[    2.5] Waiting for root device /dev/vda...\n"
    assert watch.check(waiting) is None  # a late device still has ROOT_GRACE to come
    clock.now += bootfail.ROOT_GRACE / 2
    assert watch.check(waiting + "[  3.0] random: crng init done\n") is None
    clock.now += bootfail.ROOT_GRACE / 2
    found = watch.check(waiting + "[  3.0] random: crng init done\n")
    assert found is not None and found.cause == "root"
    # The device came: the verdict is gone and its clock starts again on the next one.
    came = waiting + "[    3.1] VFS: Mounted root (ext2 filesystem)\n"
    assert watch.check(came) is None
    assert watch.check(came + "buildroot login: ") is None
    clock.now += bootfail.LOGIN_GRACE
    assert watch.check(came + "buildroot login: ") is not None


def test_a_panic_line_read_before_its_end_is_judged_once_it_is_whole() -> None:
    whole = _panic("VFS: Unable to mount root fs on unknown-block(0,0)")
    cut = whole[: whole.index("root fs")]
    assert diagnose(cut, DISK) is None
    found = diagnose(whole, DISK)
    assert found is not None and found.cause == "root", found
    ended = diagnose(cut, DISK, ended=True)
    assert ended is not None and ended.cause == "panic", ended


def test_a_watch_acts_at_once_on_a_panic_and_on_a_vm_that_ended() -> None:
    clock = Clock()
    watch = BootWatch(DISK, clock)
    assert watch.check(_panic("Fatal exception")) is not None
    assert watch.check("buildroot login: ", ended=True) is not None
    clock.now += bootfail.SILENT_AFTER
    silent = watch.check("")
    assert silent is not None and silent.cause == "silent" and f"in {bootfail.SILENT_AFTER:.0f} s" in silent.message


# A kernel in its own boot, its last line printed: what the hung boot of a CI run showed for 180 s.
STALLING = """\
[    0.000000] Linux version 6.1.0-57-cloud-amd64 (debian-kernel@lists.debian.org)
[    1.067060] hpet0: 3 comparators, 64-bit 100.000000 MHz counter
[    1.071452] clocksource: Switched to clocksource hpet
"""
PLAIN = BootSetup(INITRD.image, INITRD.cmdline, stall=True)


def test_a_kernel_silent_in_its_own_boot_is_a_stall_naming_its_last_line() -> None:
    assert diagnose(STALLING, PLAIN, elapsed=60, quiet_for=bootfail.STALL_AFTER - 1) is None
    found = diagnose(STALLING, PLAIN, elapsed=60, quiet_for=bootfail.STALL_AFTER)
    assert found is not None and found.cause == "stalled", found
    assert "Switched to clocksource hpet" in found.seen and "before it ran init" in found.message
    assert isinstance(found.error(), GuestStalled)


def test_a_silence_is_no_stall_with_probes_armed_at_boot_after_init_ran_when_asked_or_once_the_vm_ended() -> None:
    quiet = bootfail.STALL_AFTER * 10
    # A boot handler on the host holds the vCPUs as long as it takes.
    assert diagnose(STALLING, INITRD, elapsed=quiet, quiet_for=quiet) is None
    # Init may take its time (a user's init, a root filesystem's fsck).
    assert diagnose(BOOTING, PLAIN, elapsed=quiet, quiet_for=quiet) is None
    assert diagnose(STALLING, PLAIN, elapsed=quiet, quiet_for=quiet, ended=True) is None
    # rootdelay= asks for a silent wait before the root is mounted.
    delayed = STALLING + "[    1.2] Waiting 100 sec before mounting root device...\n"
    assert diagnose(delayed, PLAIN, elapsed=quiet, quiet_for=100) is None
    assert diagnose(delayed, PLAIN, elapsed=quiet, quiet_for=100 + bootfail.STALL_AFTER) is not None
    # A kernel told to keep its lines off the console is quiet by choice.
    hushed = BootSetup(PLAIN.image, f"{PLAIN.cmdline} quiet", stall=True)
    assert diagnose(STALLING, hushed, elapsed=quiet, quiet_for=quiet) is None


def test_a_watch_counts_the_quiet_time_from_the_consoles_last_line() -> None:
    clock = Clock()
    watch = BootWatch(PLAIN, clock)
    first = STALLING.splitlines(keepends=True)[0]
    assert watch.check(first) is None
    clock.now += bootfail.STALL_AFTER - 1
    assert watch.check(STALLING) is None  # it printed: the quiet time starts again
    clock.now += bootfail.STALL_AFTER - 1
    assert watch.check(STALLING) is None
    clock.now += 1
    found = watch.check(STALLING)
    assert found is not None and found.cause == "stalled" and f"for {bootfail.STALL_AFTER:.0f} s" in found.message


def test_an_oops_then_silence_is_named_even_with_probes_armed_at_boot() -> None:
    oopsed = (f"{STALLING}[    1.9] BUG: unable to handle page fault for address: fffff000e38148fb\n"
              "[    1.9] Oops: 0010 [#1] PREEMPT SMP NOPTI\n[    1.9] RIP: 0010:0xfffff000e38148fb\n")  # fmt: skip
    assert diagnose(oopsed, INITRD, elapsed=60, quiet_for=bootfail.STALL_AFTER - 1) is None
    found = diagnose(oopsed, INITRD, elapsed=60, quiet_for=bootfail.STALL_AFTER)
    assert found is not None and found.cause == "oops", found
    assert found.seen.startswith("BUG: unable to handle page fault") and isinstance(found.error(), GuestBootFailed)
    # A WARNING lets the kernel go on: no verdict of its own.
    warned = f"{STALLING}[    1.9] WARNING: CPU: 0 PID: 1 at kernel/foo.c:1 foo+0x1/0x2\n"
    assert diagnose(warned, INITRD, elapsed=60, quiet_for=bootfail.STALL_AFTER * 10) is None


# What qprobe boots a buildroot disk with: its pre-init (qprobe.images.preinit) as rdinit=.
PREINIT = BootSetup("buildroot", f"{DISK.cmdline} rdinit={bootfail.PREINIT} qprobe.devtmpfs=1", "nvme")
STARTED = f"{bootfail.PREINIT_STARTED} on ttyS1; running the image's init /sbin/init\n"


def test_a_login_prompt_after_the_pre_init_started_the_shell_is_the_images_getty_not_a_failure() -> None:
    # The getty's prompt may come before the shell's marker: the shell is on its way on its own port.
    text = f"{BOOTING}{STARTED}Starting syslogd: OK\nWelcome to Buildroot\nbuildroot login: "
    assert diagnose(text, PREINIT) is None
    # However much the image prints after it.
    assert diagnose(f"{BOOTING}{STARTED}" + "x" * (2 * bootfail.TAIL) + "\nbuildroot login: ", PREINIT) is None


@pytest.mark.parametrize(
    ("text", "setup", "why"),
    [
        # The kernel ran the disk's init itself: the pre-init archive never ran.
        (
            f"{BOOTING.replace('/init', '/sbin/init')}buildroot login: ",
            PREINIT,
            "qprobe's pre-init, which starts the shell before the image's init, did not run (the kernel ran "
            "'/sbin/init' as init instead): the kernel needs CONFIG_BLK_DEV_INITRD",
        ),
        (
            f"{BOOTING}qprobe-preinit: /init {bootfail.PREINIT_OWN}: running it\nbuildroot login: ",
            PREINIT,
            "qprobe's pre-init took the image's init for qprobe's own (it names QPROBE-READY)",
        ),
        (
            f"{BOOTING}buildroot login: ",
            BootSetup("br", f"{PREINIT.cmdline} rdinit=/sbin/init", "nvme"),
            "the command line's rdinit=/sbin/init replaced qprobe's pre-init",
        ),
        (
            f"{BOOTING}buildroot login: ",
            INITRD,
            "qprobe booted it without its pre-init, as its root filesystem is qprobe's own",
        ),
    ],
)
def test_a_login_prompt_without_the_pre_init_says_why_it_did_not_run(text: str, setup: BootSetup, why: str) -> None:
    found = diagnose(text, setup)
    assert found is not None and found.cause == "login", found
    assert found.message.startswith(
        f"the guest of image {setup.image!r} printed a login prompt on its console "
        "('buildroot login:') and never started qprobe's shell: "
    ), found.message
    assert why in found.message and "\n" not in found.message, found.message
