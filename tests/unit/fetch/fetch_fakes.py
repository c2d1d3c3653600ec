"""A tiny in-memory guest for the fetch tests: registers, memory, symbols."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from qprobe.arch.x86_64.arch import X86_64
from qprobe.arch.x86_64.paging import X86PageTables
from qprobe.fetch import MemoryFault, SymbolInfo, sprint_symbol
from qprobe.fetch.dialect import BASE

# The language of an x86_64 kernel, whose %REG names are its architecture's (the selftests' registers).
X86 = replace(BASE, registers=frozenset(X86_64.registers.pt_regs))
# x86_64 argument registers, in order (regs_get_kernel_argument).
ARG_REGS = ("di", "si", "dx", "cx", "r8", "r9")

# Symbols the selftests use, with made-up addresses: name -> (addr, size, module).
KALLSYMS: dict[str, tuple[int, int, str | None]] = {
    "_stext": (0xFFFF_FFFF_8100_0000, 0x10, None),
    "vfs_read": (0xFFFF_FFFF_8130_0000, 0x1A0, None),
    "kernel_clone": (0xFFFF_FFFF_8108_0000, 0x400, None),
    "do_exit": (0xFFFF_FFFF_8109_0000, 0xB00, None),
    "do_sys_open": (0xFFFF_FFFF_8131_0000, 0xD6, None),
    "do_sys_openat2": (0xFFFF_FFFF_8131_1000, 0x120, None),
    "vfs_symlink": (0xFFFF_FFFF_8132_0000, 0x200, None),
    "tracefs_create_dir": (0xFFFF_FFFF_8150_0000, 0x40, None),
    "tracefs_create_file": (0xFFFF_FFFF_8150_0040, 0x80, None),
    "tracefs_remove": (0xFFFF_FFFF_814F_FFC0, 0x40, None),
    "inet_csk_accept": (0xFFFF_FFFF_8170_0000, 0x300, None),
    "ksys_read": (0xFFFF_FFFF_8130_1000, 0xD0, None),
    "cleanup_module.isra.0": (0xFFFF_FFFF_8160_0000, 0x20, None),
    "__kretprobe_trampoline": (0xFFFF_FFFF_8105_0000, 0x30, None),
    "_sdata": (0xFFFF_FFFF_8200_0000, 0x0, None),
    "linux_proc_banner": (0xFFFF_FFFF_8200_1000, 0x40, None),
    "trace_printk:trace_printk_irq_work": (0xFFFF_FFFF_C000_0000, 0x60, "trace_printk"),
}


def symbol_exists(name: str) -> bool:
    """kallsyms_lookup_name() != 0."""
    return name in KALLSYMS


def lookup(addr: int) -> SymbolInfo | None:
    """kallsyms_lookup_size_offset(): the symbol whose [start, start+size) holds addr."""
    for name, (start, size, module) in KALLSYMS.items():
        if start <= addr < start + max(size, 1):
            short = name.split(":", 1)[-1]
            return SymbolInfo(short, addr - start, size, module)
    return None


@dataclass
class FakeContext:
    """Implements qprobe.fetch.FetchContext over dicts and byte strings."""

    regs: dict[str, int] = field(default_factory=dict)
    memory: dict[int, bytes] = field(default_factory=dict)  # kernel: base -> bytes
    user_memory: dict[int, bytes] = field(default_factory=dict)
    task_comm: str = "bash"
    ret: int | None = None
    reads: list[tuple[int, int]] = field(default_factory=list)
    task_size_max: int = X86PageTables(4).task_size_max()

    @staticmethod
    def _read(regions: dict[int, bytes], addr: int, size: int) -> bytes:
        for base, data in regions.items():
            if base <= addr and addr + size <= base + len(data):
                return data[addr - base : addr - base + size]
        raise MemoryFault(addr, size)

    def reg(self, name: str) -> int:
        return self.regs.get(name, 0)

    def read(self, addr: int, size: int) -> bytes:
        self.reads.append((addr, size))
        return self._read(self.memory, addr, size)

    def read_user(self, addr: int, size: int) -> bytes:
        return self._read(self.user_memory, addr, size)

    def stack(self, n: int) -> int:
        try:
            return int.from_bytes(self.read(self.stack_pointer() + 8 * n, 8), "little")
        except MemoryFault:
            return 0  # regs_get_kernel_stack_nth: 0 outside the stack

    def stack_pointer(self) -> int:
        return self.regs.get("sp", 0)

    def retval(self) -> int:
        assert self.ret is not None, "retval asked for outside a return probe"
        return self.ret

    def comm(self) -> str:
        return self.task_comm

    def arg(self, n: int) -> int:
        if n <= len(ARG_REGS):
            return self.reg(ARG_REGS[n - 1])
        return self.stack(n - len(ARG_REGS))  # skip the return address

    def symbol_address(self, name: str) -> int:
        return KALLSYMS[name][0]

    def symbolize(self, addr: int) -> str:
        return sprint_symbol(addr, lookup)


def u64(value: int) -> bytes:
    return (value & (1 << 64) - 1).to_bytes(8, "little")
