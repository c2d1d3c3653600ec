"""``current`` on the toy architecture, which keeps it in a register in kernel mode only, as arm64 does.

The kernel layer's KernelData.current_address reads the register (arm64's SP_EL0) at a kernel-mode stop, and
at a user-mode stop, where that register is the user's stack pointer, the per-CPU variable the layout names
(arm64's ``__entry_task``).
"""

from __future__ import annotations

from pathlib import Path

from fakearch import USER, Toy

from qprobe.kernel.program import KernelData

BASE, TASK = 0xFFFF_8000_0100_0000, 0xFFFF_0000_0123_4000  # the CPU's per-CPU base, its current task
ENTRY_TASK = 0x40  # the per-CPU offset of the toy's entry_task


class _Symbols:
    """vmlinux without debug info: the ELF symbol table's per-CPU variables."""

    path = Path("/images/vmlinux-toy")
    percpu = {"entry_task": ENTRY_TASK}


def _kernel() -> KernelData:
    kernel = KernelData(_Symbols(), None, Toy())  # type: ignore[arg-type]
    kernel._unusable = "the toy kernel has no debug info"
    return kernel


def test_current_is_the_register_that_holds_it_at_a_kernel_mode_stop() -> None:
    nothing: dict[int, int] = {}  # no memory is read
    assert _kernel().current_address({"psr": 0, "cur": TASK, "tpidr": BASE}, nothing.__getitem__) == TASK


def test_current_is_the_per_cpu_variable_at_a_user_mode_stop_where_the_register_is_the_users() -> None:
    memory = {BASE + ENTRY_TASK: TASK}
    regs = {"psr": USER, "cur": 0x0000_FFFF_F7FF_E000, "tpidr": BASE}  # as SP_EL0: the user's stack pointer
    assert _kernel().current_address(regs, memory.__getitem__) == TASK


def test_every_cpus_current_pointer_is_the_layouts_per_cpu_variable() -> None:
    assert _kernel().current_task_offset == ENTRY_TASK
