"""qprobe's glue around drgn, without a VM: VMCOREINFO lines, per-CPU feature detection, trampoline splicing."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from pathlib import Path

import drgn
import pytest

from qprobe.arch.x86_64.arch import X86_64
from qprobe.errors import SymbolError
from qprobe.kernel.program import KernelData, Stack, describe, synthetic_vmcoreinfo
from qprobe.kernel.symbols import Symbol

TEXT = 0xFFFF_FFFF_A500_0000  # _text after a 0x24000000 slide
SLIDE = 0x2400_0000


class FakeSymbols:
    path = Path("/images/vmlinux-6.12")
    build_id = "ab" * 20
    slide = SLIDE

    def __init__(self, percpu: dict[str, int] | None = None) -> None:
        self.percpu = percpu or {}
        self.banner = b"Linux version 6.12.111+deb12-cloud-amd64 (debian-kernel@lists.debian.org) #1 SMP\n\0"

    def lookup(self, name: str) -> Symbol:
        return Symbol(name, {"linux_banner": TEXT + 0x1000}[name], len(self.banner), "object")

    def address(self, name: str) -> int:
        return {"init_top_pgt": TEXT + 0x1A0_0000, "_text": TEXT}[name]

    def file_bytes(self, addr: int, size: int) -> bytes:
        assert addr == TEXT + 0x1000
        return self.banner[:size]


@dataclass
class FakePaging:
    levels: int = 5


class FakeMem:
    paging = FakePaging()

    def read_u64(self, vaddr: int) -> int:
        raise AssertionError("x86's lines read no kernel memory")

    def virt_to_phys(self, vaddr: int) -> int:
        assert vaddr == TEXT
        return 0x2A00_0000  # loaded 0x28000000 above where vmlinux was linked to load (16 MiB)


def test_synthetic_vmcoreinfo_has_the_lines_drgn_reads() -> None:
    text = synthetic_vmcoreinfo(FakeSymbols(), FakeMem(), X86_64()).decode()  # type: ignore[arg-type]
    assert text.endswith("\n")
    assert text.splitlines() == [
        "OSRELEASE=6.12.111+deb12-cloud-amd64",
        f"BUILD-ID={'ab' * 20}",
        "PAGESIZE=4096",
        f"SYMBOL(swapper_pg_dir)={TEXT + 0x1A0_0000:x}",
        # __pa_symbol(_text) = _text - __START_KERNEL_map + phys_base
        f"NUMBER(phys_base)={0x2A00_0000 - (TEXT - 0xFFFF_FFFF_8000_0000)}",
        "NUMBER(pgtable_l5_enabled)=1",
        "KERNELOFFSET=24000000",
    ]
    # drgn accepts it as a Linux kernel description.
    prog = drgn.Program(drgn.Platform(drgn.Architecture.X86_64, drgn.PlatformFlags.IS_64_BIT
                                      | drgn.PlatformFlags.IS_LITTLE_ENDIAN))  # fmt: skip
    prog.set_linux_kernel_custom(text, True)
    assert prog.flags & drgn.ProgramFlags.IS_LINUX_KERNEL and prog.flags & drgn.ProgramFlags.IS_LIVE


def test_a_banner_without_a_release_is_one_line_error() -> None:
    symbols = FakeSymbols()
    symbols.banner = b"not a banner\0"
    with pytest.raises(SymbolError, match="linux_banner does not name a release"):
        synthetic_vmcoreinfo(symbols, FakeMem(), X86_64())  # type: ignore[arg-type]


# -- per-CPU variables: feature detection over drgn objects ------------------------------------------
def _kernel_with(objects: dict[str, tuple[str, int]], percpu: dict[str, int] | None = None) -> KernelData:
    """A KernelData whose Program knows ``objects`` (name -> (layout, address)), for 6.1- or 6.2-style kernels."""
    prog = drgn.Program(drgn.Platform(drgn.Architecture.X86_64, drgn.PlatformFlags.IS_64_BIT
                                      | drgn.PlatformFlags.IS_LITTLE_ENDIAN))  # fmt: skip
    task_ptr = prog.pointer_type(prog.struct_type("task_struct"))
    hot = prog.struct_type("pcpu_hot", 64, [
        drgn.TypeMember(task_ptr, "current_task", 0), drgn.TypeMember(prog.int_type("int", 4, True), "cpu_number", 64),
    ])  # fmt: skip
    layouts = {"pointer": task_ptr, "int": prog.int_type("int", 4, True), "pcpu_hot": hot}

    def find(prog: drgn.Program, name: str | None, flags: drgn.FindObjectFlags, filename: str | None) -> drgn.Object:
        if name not in objects:
            return None  # type: ignore[return-value]
        layout, address = objects[name]
        return drgn.Object(prog, layouts[layout], address=address)

    prog.register_object_finder("fake", find, enable_index=0)
    kernel = KernelData(FakeSymbols(percpu), None, X86_64())  # type: ignore[arg-type]
    kernel._prog = prog
    return kernel


def test_per_cpu_variables_of_their_own_up_to_6_1() -> None:
    kernel = _kernel_with({"current_task": ("pointer", 0x1FB80), "cpu_number": ("int", 0x1FB90)})
    assert kernel.current_task_offset == 0x1FB80 and kernel.percpu_offset("cpu_number") == 0x1FB90


def test_pcpu_hot_members_from_6_2() -> None:
    kernel = _kernel_with({"pcpu_hot": ("pcpu_hot", 0x2_1A40)})
    assert kernel.current_task_offset == 0x2_1A40 and kernel.percpu_offset("cpu_number") == 0x2_1A48
    with pytest.raises(SymbolError, match=r"neither a per-CPU this_cpu_off nor pcpu_hot\.this_cpu_off"):
        kernel.percpu_offset("this_cpu_off")


def test_current_is_the_per_cpu_current_task_on_x86() -> None:
    kernel = _kernel_with({"current_task": ("pointer", 0x1FB80)})
    gs, task = 0xFFFF_8880_1F00_0000, 0xFFFF_8880_0123_4000
    memory = {gs + 0x1FB80: task}
    assert kernel.current_address({"gs_base": gs}, memory.__getitem__) == task
    # Before swapgs GS is still the user's: the kernel's per-CPU base waits in KERNEL_GS_BASE.
    assert kernel.current_address({"gs_base": 0x7F00_0000_0000, "k_gs_base": gs}, memory.__getitem__) == task


def test_without_debug_info_the_symbol_table_s_per_cpu_variables_are_used() -> None:
    kernel = KernelData(FakeSymbols({"cpu_number": 0x1FB90}), None, X86_64())  # type: ignore[arg-type]
    kernel._unusable = "vmlinux has no DWARF debug info that drgn can use"
    assert kernel.percpu_offset("cpu_number") == 0x1FB90
    for _ in range(2):  # the same one line each time, found once
        with pytest.raises(SymbolError, match=r"^vmlinux has no DWARF debug info that drgn can use$"):
            kernel.percpu_offset("current_task")


# -- stack traces through kretprobe trampolines ------------------------------------------------------
@dataclass
class FakeFrame:
    pc: int
    sp: int
    regs: dict[str, int] = field(default_factory=dict)
    is_inline: bool = False

    def registers(self) -> dict[str, int]:
        return {"rip": self.pc, "rsp": self.sp, **self.regs}


TRAMPOLINE = 0xFFFF_FFFF_C000_0100
USER = 0x0000_7F00_0000_1234


class Unwinder:
    """prog.stack_trace(pt_regs) over a fake stack: each frame's return address at the next frame's sp - 8."""

    def __init__(self, stack: list[FakeFrame]) -> None:
        self.stack = stack
        self.starts: list[dict[str, int]] = []

    def __call__(self, regs: dict[str, int]) -> list[FakeFrame]:
        self.starts.append(regs)
        # drgn reads the trampoline as the return address and has no unwind data for it: it stops there.
        frames = [FakeFrame(regs["ip"], regs["sp"], {"rbx": regs.get("bx", 0)})]
        for frame in self.stack:
            if frame.sp <= regs["sp"]:
                continue
            frames.append(frame)
            if frame.pc == TRAMPOLINE:
                break
        return frames


def _kernel_over(unwind: Unwinder) -> KernelData:
    kernel = KernelData(FakeSymbols(), None, X86_64())  # type: ignore[arg-type]
    kernel._prog = type("FakeProg", (), {"stack_trace": staticmethod(unwind)})()  # type: ignore[assignment]
    kernel.pt_regs = lambda values: values  # type: ignore[method-assign,assignment,return-value]
    return kernel


def test_a_trampoline_is_replaced_by_the_real_return_address_and_the_walk_goes_on() -> None:
    stack = [FakeFrame(0xFFFF_FFFF_8100_0010, 0x1010), FakeFrame(TRAMPOLINE, 0x1020, {"rbx": 7}),
             FakeFrame(0xFFFF_FFFF_8100_0030, 0x1030), FakeFrame(USER, 0x1040)]  # fmt: skip
    unwind = Unwinder(stack)
    slots: list[tuple[int, int]] = []

    def fix_return(slot: int, value: int) -> int:
        slots.append((slot, value))
        return 0xFFFF_FFFF_8100_0020 if value == TRAMPOLINE else value

    trace = _kernel_over(unwind).stack_trace({"ip": 0xFFFF_FFFF_8100_0000, "sp": 0x1000, "bx": 5}, fix_return)
    assert [f.pc for f in trace] == [0xFFFF_FFFF_8100_0000, 0xFFFF_FFFF_8100_0010, 0xFFFF_FFFF_8100_0020,
                                     0xFFFF_FFFF_8100_0030]  # fmt: skip
    # The trampoline is told by the stack pointer the frame returned to (the arch knows where the slot was).
    assert (0x1020, TRAMPOLINE) in slots
    # The walk went on from that frame's registers, with the real return address.
    assert unwind.starts[1] == {"ip": 0xFFFF_FFFF_8100_0020, "sp": 0x1020, "bx": 7}
    # It ends where the task entered the kernel: the user-mode frame is not a kernel frame.
    assert USER not in [f.pc for f in trace]


def test_without_fix_return_the_trace_is_drgn_s_as_it_is() -> None:
    stack = [FakeFrame(TRAMPOLINE, 0x1020), FakeFrame(0xFFFF_FFFF_8100_0030, 0x1030)]
    trace = _kernel_over(Unwinder(stack)).stack_trace({"ip": 0xFFFF_FFFF_8100_0000, "sp": 0x1000}, None, 64)
    assert [f.pc for f in trace] == [0xFFFF_FFFF_8100_0000, TRAMPOLINE]
    limited = _kernel_over(Unwinder(stack)).stack_trace({"ip": 0xFFFF_FFFF_8100_0000, "sp": 0x1000}, None, 1)
    assert len(limited) == 1


# -- printing -------------------------------------------------------------------------------------
class Printable:
    def __init__(self, function: str | None, source: tuple[str, int, int] | None, symbol: tuple[str, int, int] | None,
                 pc: int = 0xFFFF_FFFF_8100_105B) -> None:  # fmt: skip
        self.function_name, self._source, self._symbol, self.pc = function, source, symbol, pc

    def source(self) -> tuple[str, int, int]:
        if self._source is None:
            raise LookupError("no source")
        return self._source

    def symbol(self) -> drgn.Symbol:
        if self._symbol is None:
            raise LookupError("no symbol")
        name, address, size = self._symbol
        return drgn.Symbol(name, address, size, drgn.SymbolBinding.GLOBAL, drgn.SymbolKind.FUNC)


def test_frames_print_as_drgn_prints_a_trace() -> None:
    frames = [
        Printable("ksys_lseek", ("fs/read_write.c", 380, 9), None),
        Printable(None, ("arch/x86/entry/entry_64.S", 121, 0), ("entry_SYSCALL_64", 0xFFFF_FFFF_8100_1000, 0x1AB)),
        Printable(None, None, None, pc=0xFFFF_FFFF_C000_1234),
    ]
    assert describe(frames[1]) == "entry_SYSCALL_64+0x5b/0x1ab (arch/x86/entry/entry_64.S:121)"  # type: ignore[arg-type]
    assert str(Stack(frames)).splitlines() == [  # type: ignore[arg-type]
        "#0  ksys_lseek (fs/read_write.c:380:9)",
        "#1  entry_SYSCALL_64+0x5b/0x1ab (arch/x86/entry/entry_64.S:121)",
        "#2  0xffffffffc0001234",
    ]


def test_a_closed_targets_program_is_let_go_at_once_and_not_made_again() -> None:
    # A closed Target's parts can sit in a reference cycle until Python's full collection: the Program, the
    # biggest of them, must not wait with it (a 6.12 test process grew 300 MB per attach and close).
    class Program:  # drgn's own takes no weak reference
        pass

    kernel = KernelData(FakeSymbols(), None, X86_64())  # type: ignore[arg-type]
    prog = Program()
    kernel._prog = prog  # type: ignore[assignment]
    ref = weakref.ref(prog)
    del prog
    kernel.close()
    assert ref() is None
    with pytest.raises(SymbolError, match="the target is closed"):
        _ = kernel.prog
