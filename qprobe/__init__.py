"""qprobe: Linux kprobes rebuilt outside the guest."""

from qprobe.api import Target
from qprobe.core.kprobe import Kprobe, Kretprobe, KretprobeInstance
from qprobe.core.regs import PtRegs, regs_get_kernel_argument, regs_return_value
from qprobe.core.uprobe import Uprobe, Uretprobe
from qprobe.core.watchpoint import Watchpoint
from qprobe.errors import (
    Blacklisted,
    CannotProbe,
    GuestBootFailed,
    InvalidProbe,
    NotInstructionBoundary,
    NotKernelText,
    ProbeError,
    QprobeError,
    SymbolError,
    TargetError,
    TargetGone,
    VmlinuxMismatch,
)
from qprobe.kernel.program import Stack, Task
from qprobe.session import attach, boot

__version__ = "0.1.0"

__all__ = [
    "Blacklisted",
    "CannotProbe",
    "GuestBootFailed",
    "InvalidProbe",
    "Kprobe",
    "Kretprobe",
    "KretprobeInstance",
    "NotInstructionBoundary",
    "NotKernelText",
    "ProbeError",
    "PtRegs",
    "QprobeError",
    "Stack",
    "SymbolError",
    "Target",
    "TargetError",
    "TargetGone",
    "Task",
    "Uprobe",
    "Uretprobe",
    "VmlinuxMismatch",
    "Watchpoint",
    "__version__",
    "attach",
    "boot",
    "regs_get_kernel_argument",
    "regs_return_value",
]
