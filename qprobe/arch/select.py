"""Which :class:`qprobe.arch.Arch` a target gets: chosen by the architecture it reports.

The one place that names the architectures qprobe implements, so that
everything above (wiring.py is the composition root) asks for an ``Arch`` by
the name the gdbstub's target description gives it (``<architecture>`` in
``target.xml``: ``i386:x86-64`` under QEMU's x86_64 system emulator) or by a
vmlinux's ELF ``e_machine``.  A new architecture is one more entry in ARCHES.
"""

from __future__ import annotations

from collections.abc import Callable

from qprobe.arch import Arch
from qprobe.arch.arm64.arch import Arm64
from qprobe.arch.x86_64.arch import X86_64
from qprobe.errors import TargetError

# Every implementation of Arch, by the name gdb gives the architecture, with its ELF e_machine (EM_*).
# The type check (make lint) proves each one implements Arch here: through a lambda, so that mypy
# names the member that does not match.
ARCHES: dict[str, tuple[int, Callable[[], Arch]]] = {
    X86_64.gdb_architecture: (62, lambda: X86_64()),  # EM_X86_64
    Arm64.gdb_architecture: (183, lambda: Arm64()),  # EM_AARCH64
}


def arch_named(gdb_architecture: str) -> Arch:
    """The Arch of a target whose gdbstub names its architecture ``gdb_architecture``."""
    if gdb_architecture not in ARCHES:
        raise TargetError(f"qprobe does not support the target's architecture {gdb_architecture[:40]!r} "
                          f"(supported: {', '.join(ARCHES)})")  # fmt: skip
    return ARCHES[gdb_architecture][1]()


def arch_of_machine(e_machine: int) -> Arch:
    """The Arch of a vmlinux whose ELF header says ``e_machine``."""
    for machine, make in ARCHES.values():
        if machine == e_machine:
            return make()
    raise TargetError(f"qprobe does not support ELF machine {e_machine} (supported: {', '.join(ARCHES)})")


__all__ = ["ARCHES", "arch_named", "arch_of_machine"]
