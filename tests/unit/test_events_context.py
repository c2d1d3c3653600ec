"""What a kprobe event's fetch arguments read at a hit: pt_regs' system call number is the layout's field."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

from qprobe.arch.x86_64.arch import X86_64
from qprobe.events.context import HostContext
from qprobe.fetch.context import U64_MASK


def _context(syscall_nr: str | None) -> HostContext:
    layout = replace(X86_64.registers, syscall_nr=syscall_nr)
    host = SimpleNamespace(arch=SimpleNamespace(registers=layout),
                           mem=SimpleNamespace(paging=SimpleNamespace(task_size_max=lambda: 1 << 47)))  # fmt: skip
    regs = SimpleNamespace(di=7)
    return HostContext(host, regs, None)  # type: ignore[arg-type]


def test_the_system_call_number_reads_as_the_kinds_handler_holds_it() -> None:
    ctx = _context("orig_ax")
    assert ctx.reg("orig_ax") == U64_MASK  # -1, as x86's int3 entry leaves it
    ctx.syscall_nr = 0  # an ftrace-based probe's
    assert ctx.reg("orig_ax") == 0
    assert ctx.reg("di") == 7


def test_another_architectures_field_is_its_layouts() -> None:
    ctx = _context("syscallno")  # arm64's pt_regs
    assert ctx.reg("syscallno") == U64_MASK
