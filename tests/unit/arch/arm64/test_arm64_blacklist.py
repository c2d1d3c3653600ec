"""arm64's additions to the kprobe blacklist, through the core's Blacklist, and the sites its kernel rewrites."""

from __future__ import annotations

from pathlib import Path

from qprobe.arch.arm64.blacklist import (
    JUMP_LABEL_MAX,
    JUMP_LABEL_PROBE,
    STATIC_CALL_SIZE,
    arch_kretprobe_blacklist,
    arch_populate_kprobe_blacklist,
    jump_label_size,
)
from qprobe.core.blacklist import Blacklist
from qprobe.kernel.symbols import Symbols
from qprobe.kernel.vmlinux import Section

K = 0xFFFF_8000_0800_0000  # 6.1's KIMAGE_VADDR (VA_BITS 48)
SLIDE = 0x2A_0000_0000  # a multiple of 2 MiB, as arm64's KASLR picks
# Link addresses of the linker script's bounds, laid out as arch/arm64/kernel/vmlinux.lds.S does in 6.1:
# .text holds the irq/softirq entry, the entry, the hypervisor and the idmap text.
BOUNDS = {
    "__irqentry_text_start": K + 0x1_0000, "__irqentry_text_end": K + 0x1_1000,
    "__softirqentry_text_start": K + 0x1_1000, "__softirqentry_text_end": K + 0x1_2000,
    "__entry_text_start": K + 0x1_2000, "__entry_text_end": K + 0x1_5000,
    "__noinstr_text_start": K + 0x2_0000, "__noinstr_text_end": K + 0x2_4000,
    "__kprobes_text_start": K + 0x2_4000, "__kprobes_text_end": K + 0x2_4000,
    "__hyp_idmap_text_start": K + 0x3_0000, "__hyp_idmap_text_end": K + 0x3_0800,
    "__hyp_text_start": K + 0x3_0800, "__hyp_text_end": K + 0x3_8000,
    "__idmap_text_start": K + 0x4_0000, "__idmap_text_end": K + 0x4_0C00,
}  # fmt: skip
FUNCS = {
    "el1h_64_sync": (K + 0x1_2800, 0x80),  # the trap entry: .entry.text
    "__enable_mmu": (K + 0x4_0100, 0x40),  # .idmap.text
    "__kvm_hyp_vector": (K + 0x3_0800, 0x800),  # .hyp.text
    "vfs_read": (K + 0x10_0000, 0x100),
}


def _symbols(tmp_path: Path) -> Symbols:
    rows = [(n, a, 0, "other") for n, a in BOUNDS.items()] + [(n, a, s, "func") for n, (a, s) in FUNCS.items()]
    (tmp_path / "vmlinux").write_bytes(b"\0" * 0x1000)
    syms = Symbols(tmp_path / "vmlinux", "00" * 20, rows, [Section(".text", K, 0x100_0000, 0x1000, True)])
    syms.slide = SLIDE
    return syms


def test_the_entry_idmap_and_hypervisor_text_are_refused(tmp_path: Path) -> None:
    bl = Blacklist(_symbols(tmp_path), arch_populate_kprobe_blacklist())
    # kprobes.c's list, then kernel/kprobes.c's for every architecture (.irqentry.text once: it is there).
    assert [e.name for e in bl.sections] == [
        ".entry.text", ".idmap.text", ".hyp.text", ".hyp.idmap.text",
        ".noinstr.text", ".irqentry.text", ".softirqentry.text",
    ]  # fmt: skip
    for name, section, start in (("el1h_64_sync", ".entry.text", "__entry_text_start"),
                                 ("__enable_mmu", ".idmap.text", "__idmap_text_start"),
                                 ("__kvm_hyp_vector", ".hyp.text", "__hyp_text_start")):  # fmt: skip
        addr, size = FUNCS[name]
        hit = bl.lookup(addr + SLIDE + size - 4)
        assert hit is not None and (hit.name, hit.start) == (section, BOUNDS[start] + SLIDE)
    assert bl.lookup(FUNCS["vfs_read"][0] + SLIDE) is None
    assert bl.functions == []  # no _kprobe_blacklist here, and arm64 names no thunks


def test_kretprobe_blacklist_names_functions_that_never_return() -> None:
    refused = arch_kretprobe_blacklist()
    assert {"do_exit", "make_task_dead", "panic", "__arm64_sys_exit", "cpu_die", "secondary_start_kernel"} <= refused
    # arm64's __switch_to returns to its caller, on its own stack; no x86 name is in the list.
    assert "__switch_to" not in refused
    assert not any(name.startswith("__x64_") for name in refused)


def test_every_jump_label_and_static_call_site_is_one_instruction() -> None:
    assert JUMP_LABEL_PROBE == JUMP_LABEL_MAX == STATIC_CALL_SIZE == 4
    assert jump_label_size(bytes.fromhex("1f2003d5")) == 4  # nop
    assert jump_label_size(bytes.fromhex("02000014")) == 4  # b .+8
