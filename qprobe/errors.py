"""One exception tree for everything qprobe reports to a user.

Every message is one line a user can act on; the CLI prints ``str(exc)``
without a traceback for any ``QprobeError``.
"""

from __future__ import annotations


class QprobeError(Exception):
    """Base of every error qprobe raises on purpose."""


class TargetError(QprobeError):
    """QEMU, the gdbstub or the guest did not do what was asked."""


class MemoryFault(TargetError):
    """A guest virtual address is not mapped."""

    def __init__(self, addr: int, why: str = "not mapped") -> None:
        self.addr = addr
        super().__init__(f"guest address {addr:#x} is {why}")


class TargetGone(TargetError):
    """QEMU exited or the connection to it closed."""


class GoneInterrupt(SystemExit):
    """The VM died while the main thread waited elsewhere (a prompt, a sleep, a test's loop).

    Raised in the main thread at once, as Ctrl-C raises KeyboardInterrupt, by ``Target.interrupt_when_gone``;
    a SystemExit, so that a REPL's or a test's own ``except Exception`` lets it through.  ``gone`` says why.
    """

    def __init__(self, gone: TargetGone) -> None:
        super().__init__(str(gone))
        self.gone = gone


class GuestPanicked(TargetGone):
    """The VM ended and its console shows the guest kernel's panic."""


class BootPanic(GuestPanicked):
    """The guest kernel panicked while booting, before qprobe attached: nothing of qprobe's was in it."""


class ProtocolError(TargetError):
    """The GDB remote protocol peer sent something malformed or unexpected."""


class GuestTimeout(TargetError):
    """The guest did not answer in time."""


class GuestStalled(GuestTimeout):
    """The guest kernel stopped printing in its own boot, before init: a hang qprobe did not cause (nothing
    of qprobe's is in a kernel booted without probes), so boot() tries once more, as for a panic."""


class GuestBootFailed(GuestTimeout):
    """The guest will not start qprobe's shell, and its console says why: raised as soon as that shows,
    rather than when the boot timeout ends."""


class ImageError(QprobeError):
    """A kernel image is unknown, incomplete or could not be built."""


class SymbolError(QprobeError):
    """A symbol is unknown or vmlinux does not match the running kernel."""


class VmlinuxMismatch(SymbolError):
    """The vmlinux file is not the kernel that is running."""


class ProbeError(QprobeError):
    """A probe cannot be registered, armed or removed."""


class InvalidProbe(ProbeError):
    """The probe definition itself is wrong (EINVAL in the kernel)."""


class NotInstructionBoundary(ProbeError):
    """The address is inside an instruction (the kernel's BAD_INSN_BNDRY)."""


class Blacklisted(ProbeError):
    """The address is in code that must not be probed."""


class NotKernelText(ProbeError):
    """The address is not in the kernel's executable text."""


class CannotProbe(ProbeError):
    """The instruction at the address cannot be executed out of line."""


class DisplacementOverflow(CannotProbe):
    """A relocated displacement does not fit in 32 bits."""


class ScratchFull(ProbeError):
    """No room is left in the scratch area injected into the guest."""


class ProbeBusy(ProbeError):
    """Something other than qprobe already patched this address (EBUSY)."""


class FetchArgError(QprobeError):
    """A kprobe_events definition or fetch argument is malformed.

    ``column`` is the 0-based position of the offending character in the
    definition, as the kernel's error_log caret points at it.
    ``logged`` is False for a refusal the kernel makes without an error_log
    entry; ``detail`` says more than the kernel's text (why registration failed).
    """

    def __init__(self, message: str, text: str = "", column: int = 0, *, logged: bool = True,
                 detail: str = "") -> None:  # fmt: skip
        self.reason = message
        self.text = text
        self.column = column
        self.logged = logged
        self.detail = detail
        where = f" (at column {column}: {text!r})" if text else ""
        super().__init__(f"{message}{where}" + (f": {detail}" if detail else ""))

    @property
    def explained(self) -> str:
        """The kernel's text, and qprobe's reason after it when there is one."""
        return f"{self.reason}: {self.detail}" if self.detail else self.reason

    def caret(self) -> str:
        """Two lines: the definition and a caret under the offending column."""
        return f"{self.text}\n{' ' * self.column}^"
