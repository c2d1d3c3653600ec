"""THREAD_SIZE by feature detection: the debug info's init_stack, else the linker script's init stack span."""

from __future__ import annotations

import drgn
import pytest

from qprobe.arch.x86_64.arch import X86_64
from qprobe.errors import SymbolError
from qprobe.kernel.features import thread_size
from qprobe.kernel.program import KernelData

INIT_STACK = 0xFFFF_FFFF_82C0_0000


class SpanSymbols:
    """The ELF symbol table's part that matters: linker-script symbols and their addresses."""

    def __init__(self, symbols: dict[str, int]) -> None:
        self.symbols = symbols

    def __contains__(self, name: str) -> bool:
        return name in self.symbols

    def address(self, name: str) -> int:
        return self.symbols[name]


def _without_debug_info(symbols: dict[str, int]) -> KernelData:
    kernel = KernelData(SpanSymbols(symbols), None, X86_64())  # type: ignore[arg-type]
    kernel._unusable = "vmlinux has no DWARF debug info that drgn can use"
    return kernel


def test_init_stack_from_the_debug_info() -> None:
    """6.12's DWARF has no union thread_union; init_stack is unsigned long[THREAD_SIZE / 8] (Linux 4.16 on)."""
    prog = drgn.Program(drgn.Platform(drgn.Architecture.X86_64, drgn.PlatformFlags.IS_64_BIT
                                      | drgn.PlatformFlags.IS_LITTLE_ENDIAN))  # fmt: skip
    stack = prog.array_type(prog.int_type("unsigned long", 8, False), 4096)  # a KASAN kernel's 32 KiB

    def find(prog: drgn.Program, name: str | None, flags: drgn.FindObjectFlags, filename: str | None) -> drgn.Object:
        return drgn.Object(prog, stack, address=INIT_STACK) if name == "init_stack" else None  # type: ignore[return-value]

    prog.register_object_finder("fake", find, enable_index=0)
    kernel = KernelData(SpanSymbols({}), None, X86_64())  # type: ignore[arg-type]
    kernel._prog = prog
    assert thread_size(kernel) == 32 << 10


@pytest.mark.parametrize(
    ("start", "end"),
    [("__start_init_stack", "__end_init_stack"), ("__start_init_task", "__end_init_task")],  # 6.10 on; before
)
def test_the_init_stack_span_without_debug_info(start: str, end: str) -> None:
    assert thread_size(_without_debug_info({start: INIT_STACK, end: INIT_STACK + 0x4000})) == 16 << 10


def test_no_way_to_tell_is_one_line_naming_what_is_missing() -> None:
    with pytest.raises(SymbolError, match=r"^the size of a kernel stack is unknown: .*__start_init_stack"):
        thread_size(_without_debug_info({"init_stack": INIT_STACK}))
