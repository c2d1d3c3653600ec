"""Why a guest will not start qprobe's shell, read from its console while qprobe waits for QPROBE-READY.

A guest whose init never starts qprobe's shell would otherwise keep qprobe waiting for the whole boot
timeout and then say only that the marker did not come.  Its console usually says why long before:
a getty's login prompt, a kernel looking for a root device it has no driver for, a panic, or nothing
at all from a kernel without a serial console.  ``diagnose`` names the cause from the console's text
(a pure function); ``BootWatch`` adds the time a verdict must hold before it is final.

The console is the guest's to write: every line quoted in a message is bounded and stripped of
control characters, and only the console's last ``TAIL`` characters are read.
"""

from __future__ import annotations

import re
import time
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass

from qprobe.errors import GuestBootFailed, GuestPanicked, GuestStalled, TargetError

# How much of the console's end is read: a panic's line is followed by its stack trace and registers
# (a few KiB), and a login prompt or a root device wait is at the very end.
TAIL = 16 << 10
# The longest console line quoted in a message.
MAX_SEEN = 160
# A kernel prints its banner within a second or two of starting, even under TCG on a loaded host.
SILENT_AFTER = 15.0
# Between its banner and running init a kernel prints a line every second or two under TCG (no gap over
# 2 s in the boots kept by the test runs); this long a silence there is a boot that has stopped (QEMU
# 7.2's TCG has been seen to leave a kernel silent after "clocksource: Switched to clocksource hpet").
STALL_AFTER = 30.0
# A root device that shows up late (its driver probing asynchronously) ends the wait within this.
ROOT_GRACE = 2.0
# An init that starts a getty and qprobe's shell has the prompt on the console just before the marker.
LOGIN_GRACE = 1.0
# qprobe's pre-init (qprobe.images.preinit), and the console line it prints once it has started qprobe's shell
# beside the image's own init: a login prompt after it is that init's getty, and the shell is on its way.
PREINIT = "/qprobe/preinit"
PREINIT_STARTED = "qprobe-preinit: qprobe's shell started"
PREINIT_OWN = "starts qprobe's shell itself"  # the pre-init found qprobe's own init as the image's
_RAN_INIT = re.compile(r"Run (\S+) as init process")
# rootdelay=: the kernel sleeps that long, silent, before it mounts its root (init/do_mounts.c).
_ROOT_DELAY = re.compile(r"Waiting (\d{1,9}) sec before mounting root device")
# The first line of an oops that kills the task it hit (a WARNING lets it go on; a panic is judged above).
_OOPSED = re.compile(r"(?:BUG: |Oops: |general protection fault|kernel BUG at|double fault)[^\n]*")
# What the kernel prints once it has left its own boot for init (init/main.c, kernel_init).
_KERNEL_DONE = re.compile(r"Run \S+ as init process|Freeing unused kernel|Write protecting the kernel")

GUIDE = 'docs/user-guide.md, "Use your own kernel"'
_TIMESTAMP = re.compile(r"\[\s*\d+\.\d+\]")  # CONFIG_PRINTK_TIME's prefix of a kernel line
_PANIC = re.compile(r"Kernel panic - not syncing: ?([^\n]*)")
_PANIC_END = re.compile(r"\s*\]---\s*$")  # "---[ end Kernel panic - not syncing: ... ]---"
_ROOT_FAILED = re.compile(r"(VFS: Cannot open root device[^\n]*|VFS: Unable to mount root fs[^\n]*)")
_ROOT_WAIT = re.compile(r"Waiting for root device[^\n]*")
# What follows a root device wait once the device has come.
_ROOT_CAME = re.compile(r"VFS: Mounted root|Freeing unused kernel|Run /\S+ as init process|mounted filesystem")
# A prompt line's end (a prompt is short; a huge line's last part stands for it), possibly with a kernel
# message the console printed after it before any newline.
_LOGIN = re.compile(r"(?P<prompt>[^\n]{0,200}?login:)[ \t]*(?:\[\s*\d+\.\d+\][^\n]*)?$")
# Init panics the kernel raises when no init program could be executed (init/main.c).
_NO_INIT = ("Requested init", "No working init found")
# ESC sequences a terminal would act on (CSI, OSC and two-byte ones), removed whole.
_ESCAPES = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]?|\][^\x07\x1b]*(?:\x07|\x1b\\)?|[@-_]?)|\x9b[0-?]*[ -/]*[@-~]?")


@dataclass(frozen=True)
class BootSetup:
    """What the messages name: the image, the kernel's command line and how its disk is attached."""

    image: str
    cmdline: str = ""
    disk_interface: str | None = None  # "nvme" or "virtio"; None: no disk (an initramfs root)
    # Whether a kernel silent in its own boot is a verdict: not while probes armed at boot may hold its
    # vCPUs in a handler on the host for as long as the handler takes.
    stall: bool = False


@dataclass(frozen=True)
class BootFailure:
    """One verdict: its cause, the console line it rests on (quoted), and the one-line message."""

    cause: str  # "login", "root", "init", "panic", "silent", "stalled" or "oops"
    seen: str  # the console line, made safe to print ("" for silence)
    message: str
    settle: float = 0.0  # seconds the verdict must hold before qprobe acts on it

    def error(self) -> TargetError:
        """The exception to raise: a panic or a stall that may be the emulator's stays a GuestPanicked or a
        GuestStalled (boot() tries once more on either); every other cause is the image's and would fail
        again."""
        if self.cause == "panic":
            return GuestPanicked(self.message)
        if self.cause == "stalled":
            return GuestStalled(self.message)
        return GuestBootFailed(self.message)


def printable(text: str, limit: int = MAX_SEEN) -> str:
    """``text`` (guest output) as one safe line: escape sequences and control characters gone, runs of
    blanks one space, at most ``limit`` characters."""
    text = _ESCAPES.sub("", text[: limit * 8])
    kept = "".join(" " if c.isspace() else c for c in text if c.isspace() or unicodedata.category(c)[0] != "C")
    line = " ".join(kept.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def cmdline_value(cmdline: str, key: str) -> str | None:
    """The value of ``key=`` on a kernel command line (the last one counts, as for the kernel)."""
    found = None
    for arg in cmdline.split():
        if arg.startswith(key + "="):
            found = arg[len(key) + 1 :]
    return found


def _lines(text: str) -> list[str]:
    """The tail's lines, the last possibly incomplete; the first dropped if the tail cut it."""
    tail = text[-TAIL:]
    lines = tail.split("\n")
    if len(text) > TAIL and len(lines) > 1:
        lines = lines[1:]
    return lines


def _panic(lines: list[str], setup: BootSetup) -> BootFailure | None:
    for line in reversed(lines):
        m = _PANIC.search(line)
        if m is None:
            continue
        reason = _PANIC_END.sub("", m.group(1))
        seen = printable(f"Kernel panic - not syncing: {reason}")
        # Not the whole text: a console line can lose or repeat a character when QEMU exits under it.
        if "mount root fs" in reason:
            return _root(seen, setup)
        if reason.startswith(_NO_INIT):
            return BootFailure("init", seen, f"the kernel of image {setup.image!r} panicked before qprobe's shell "
                               f"started ({seen!r}): no init program could run; {_init_advice(setup)}")  # fmt: skip
        return BootFailure("panic", seen, f"the kernel of image {setup.image!r} panicked before qprobe's shell "
                           f"started ({seen!r}): the console lines before it say why")  # fmt: skip
    return None


def _init_advice(setup: BootSetup) -> str:
    given = [f"{key}={value}" for key in ("init", "rdinit") if (value := cmdline_value(setup.cmdline, key)) is not None]
    named = f" (the command line says {' '.join(given)})" if given else ""
    return f"check init= and rdinit={named} and that the root filesystem holds that program ({GUIDE})"


def _root(seen: str, setup: BootSetup) -> BootFailure:
    root = cmdline_value(setup.cmdline, "root")
    says = f"root={root}" if root is not None else "no root="
    if setup.disk_interface is None:
        why = (f"the image has no disk, its root is an initramfs, and the command line says {says}: the kernel "
               f"looks for a root device when the initramfs has no init to run; check rdinit= (default /init), "
               f"and that the kernel has CONFIG_BLK_DEV_INITRD")  # fmt: skip
    else:
        device = "/dev/vda" if setup.disk_interface == "virtio" else "/dev/nvme0n1"
        driver = "CONFIG_VIRTIO_BLK and CONFIG_VIRTIO_PCI" if setup.disk_interface == "virtio" else (
            "CONFIG_BLK_DEV_NVME")  # fmt: skip
        why = (f"its disk is attached as disk_interface={setup.disk_interface!r} (the kernel calls it {device}) "
               f"and the command line says {says}: make root= name that disk, or set the image's disk_interface "
               f"to the interface the kernel has a driver for ({driver} built in, as is the root "
               f"filesystem's type)")  # fmt: skip
    return BootFailure("root", seen, f"the kernel of image {setup.image!r} cannot mount its root filesystem "
                       f"({seen!r}): {why}")  # fmt: skip


def _login(text: str, lines: list[str], setup: BootSetup) -> BootFailure | None:
    """A getty's prompt: the last line that is not a kernel message ends with "login:"."""
    if PREINIT_STARTED in text:
        return None  # the image's getty, beside qprobe's shell
    for line in reversed(lines[-64:]):
        stripped = line.strip()
        if not stripped or _TIMESTAMP.match(stripped):
            continue
        m = _LOGIN.search(stripped[-400:])
        if m is None:
            return None
        seen = printable(m.group("prompt"))
        return BootFailure("login", seen, f"the guest of image {setup.image!r} printed a login prompt on its console "
                           f"({seen!r}) and never started qprobe's shell: {_no_preinit(text, lines, setup)} "
                           f"({GUIDE})", LOGIN_GRACE)  # fmt: skip
    return None


def _no_preinit(text: str, lines: list[str], setup: BootSetup) -> str:
    """Why qprobe's pre-init did not start the shell before the image's init ran a getty."""
    rdinit = cmdline_value(setup.cmdline, "rdinit")
    if PREINIT_OWN in text:
        return ("qprobe's pre-init took the image's init for qprobe's own (it names QPROBE-READY) and ran it "
                "without starting the shell, but that init ran a getty")  # fmt: skip
    if rdinit == PREINIT:
        ran = next((m.group(1) for line in reversed(lines) if (m := _RAN_INIT.search(line))), None)
        said = f"the kernel ran {printable(ran)!r} as init instead" if ran else "the kernel did not run it"
        return (f"qprobe's pre-init, which starts the shell before the image's init, did not run ({said}): the "
                f"kernel needs CONFIG_BLK_DEV_INITRD to run it from qprobe's initramfs archive")  # fmt: skip
    if rdinit is not None:
        return (f"the command line's rdinit={printable(rdinit)} replaced qprobe's pre-init, which starts the shell "
                f"before the image's init: leave rdinit= out")  # fmt: skip
    return (
        "qprobe booted it without its pre-init, as its root filesystem is qprobe's own, whose /init starts "
        "the shell, yet an init that runs a getty ran instead: check init= on its command line"
    )


def _quiet(cmdline: str) -> bool:
    """Whether the command line keeps the kernel's own lines off the console (quiet, a low loglevel=)."""
    if "quiet" in cmdline.split():
        return True
    level = cmdline_value(cmdline, "loglevel")
    return level is not None and not (level.isdigit() and int(level) > 5)  # the banner is KERN_NOTICE (5)


def diagnose(text: str, setup: BootSetup, *, elapsed: float = 0.0, ended: bool = False,
             quiet_for: float = 0.0) -> BootFailure | None:  # fmt: skip
    """Why the guest will not start qprobe's shell, if its console ``text`` says; None while it may still.

    ``elapsed``: seconds qprobe has waited; ``ended``: the VM is gone (its console closed); ``quiet_for``:
    seconds since the console last printed.
    """
    lines = _lines(text)
    # A panic's line still being printed is judged once it is whole: its reason, cut short, may not
    # yet name the cause ("VFS: Unable to mount" before "root fs on ...").
    found = _panic(lines if ended or text.endswith("\n") else lines[:-1], setup)
    if found is not None:
        return found
    for line in reversed(lines):
        m = _ROOT_FAILED.search(line)
        if m is not None:
            return _root(printable(m.group(0)), setup)
    for i in range(len(lines) - 1, -1, -1):
        m = _ROOT_WAIT.search(lines[i])
        if m is not None:
            if any(_ROOT_CAME.search(later) for later in lines[i + 1 :]):
                break
            failure = _root(printable(m.group(0)), setup)
            return BootFailure(failure.cause, failure.seen, failure.message, ROOT_GRACE)
    found = _login(text, lines, setup)
    if found is not None:
        return found
    if elapsed >= SILENT_AFTER and not ended and not text.strip() and not _quiet(setup.cmdline):
        consoles = " ".join(arg for arg in setup.cmdline.split() if arg.startswith("console="))
        return BootFailure("silent", "", f"the kernel of image {setup.image!r} printed nothing on its console in "
                           f"{elapsed:.0f} s: it has no serial console, or its command line does not send the log "
                           f"there ({consoles or 'no console='}); build it with CONFIG_SERIAL_8250 and "
                           f"CONFIG_SERIAL_8250_CONSOLE")  # fmt: skip
    if quiet_for >= STALL_AFTER and not ended:
        found = _stalled(text, lines, setup, quiet_for) if setup.stall and not _quiet(setup.cmdline) else None
        return found if found is not None else _oopsed(lines, setup, quiet_for)
    return None


def _oopsed(lines: list[str], setup: BootSetup, quiet_for: float) -> BootFailure | None:
    """An oops on the console, then silence: the task it killed was the boot's (init, or a worker init waits
    for), whatever held the vCPUs meanwhile; its first line quoted."""
    first = next((m for line in lines if (m := _OOPSED.search(line)) is not None), None)
    if first is None:
        return None
    seen = printable(first.group(0))
    return BootFailure("oops", seen, f"the kernel of image {setup.image!r} oopsed before qprobe's shell started "
                       f"({seen!r}) and has printed nothing since for {quiet_for:.0f} s: the console lines "
                       f"around it say where")  # fmt: skip


def _stalled(text: str, lines: list[str], setup: BootSetup, quiet_for: float) -> BootFailure | None:
    """A kernel gone silent in its own boot, after its banner and before init: its last line quoted."""
    if _KERNEL_DONE.search(text[-TAIL:]) is not None:
        return None  # init's own silence (a user's init may take its time) is no verdict
    last = next((line for line in reversed(lines) if _TIMESTAMP.match(line.strip())), None)
    if last is None:
        return None
    delay = _ROOT_DELAY.search(last)
    if delay is not None and quiet_for < STALL_AFTER + int(delay.group(1)):
        return None
    seen = printable(last)
    return BootFailure("stalled", seen, f"the kernel of image {setup.image!r} stopped printing in its own boot, "
                       f"before it ran init: nothing on its console for {quiet_for:.0f} s after {seen!r}")  # fmt: skip


class BootWatch:
    """``diagnose`` over time: a verdict counts once it has held for its ``settle`` seconds."""

    def __init__(self, setup: BootSetup, clock: Callable[[], float] = time.monotonic) -> None:
        self.setup = setup
        self._clock = clock
        self._start = clock()
        self._pending: tuple[str, str, float] | None = None  # (cause, seen, first seen at)
        self._last = (0, "")  # the console's length and end when last checked, and when they last changed
        self._grew = self._start

    def check(self, text: str, ended: bool = False) -> BootFailure | None:
        """The failure once the console has shown it long enough (at once when the VM is gone)."""
        now = self._clock()
        if (len(text), text[-64:]) != self._last:
            self._last, self._grew = (len(text), text[-64:]), now
        found = diagnose(text, self.setup, elapsed=now - self._start, ended=ended, quiet_for=now - self._grew)
        if found is None:
            self._pending = None
            return None
        if ended or found.settle <= 0:
            return found
        if self._pending is None or self._pending[:2] != (found.cause, found.seen):
            self._pending = (found.cause, found.seen, now)
        return found if now - self._pending[2] >= found.settle else None
