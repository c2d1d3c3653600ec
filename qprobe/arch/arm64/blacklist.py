"""What arm64 adds to the kprobe blacklist, and the sizes of the sites its kernel rewrites.

``arch_populate_kprobe_blacklist`` in arch/arm64/kernel/probes/kprobes.c adds
the entry text, the IRQ entry text, the idmap text (6.1; 6.12 moved it out of
the kernel's text into ``.rodata.text``, never run through the kernel
mapping, and dropped it from the list), the hypervisor text, and the
hypervisor's idmap text unless the kernel runs at EL2 (``is_kernel_in_hyp_mode``:
under QEMU's ``virt`` machine without ``virtualization=on`` it runs at EL1).
The trap entry itself, ``el1h_64_sync``, is in ``.entry.text``.

arm64 has no kretprobe blacklist of its own (``kretprobe_blacklist_size`` is 0
in arch/arm64/include/asm/kprobes.h); qprobe refuses functions that never
return to their caller, whose instances would never be reclaimed.

Every jump-label site is one instruction, a ``nop`` or a ``b``
(arch/arm64/include/asm/jump_label.h, ``AARCH64_INSN_SIZE``); arm64 selects
no HAVE_STATIC_CALL in 6.1 or 6.12, so vmlinux has no static-call sites, and
one would be a single ``b``/``bl`` too.
"""

from __future__ import annotations

from qprobe.arch import ArchBlacklist

AARCH64_INSN_SIZE = 4

# (start symbol, end symbol, section) as kprobes.c passes them to kprobe_add_area_blacklist; the
# linker script (arch/arm64/kernel/vmlinux.lds.S, include/asm-generic/vmlinux.lds.h) defines the
# symbols.  .irqentry.text is in kernel/kprobes.c's list for every architecture (core/blacklist.py),
# so it is not repeated here.  In 6.12 __idmap_text_* bound code outside the kernel's text, which no
# probe can be placed in either way.
SECTIONS = (
    ("__entry_text_start", "__entry_text_end", ".entry.text"),
    ("__idmap_text_start", "__idmap_text_end", ".idmap.text"),
    ("__hyp_text_start", "__hyp_text_end", ".hyp.text"),
    ("__hyp_idmap_text_start", "__hyp_idmap_text_end", ".hyp.idmap.text"),
)

# Functions that do not return to their caller: the arch-independent ones, arm64's system-call
# wrappers of exit and exit_group (__arm64_sys_*), and arm64's own __noreturn functions
# (arch/arm64/kernel/{smp.c,process.c,traps.c,entry-common.c}).  __switch_to is not one: arm64's returns to
# its caller on its own task's stack (cpu_switch_to, which switches stacks, is entry.S's and NOKPROBE).
KRETPROBE_BLACKLIST = frozenset({
    "do_exit", "do_group_exit", "make_task_dead", "panic", "kthread_exit", "__arm64_sys_exit",
    "__arm64_sys_exit_group", "__do_sys_exit", "__do_sys_exit_group", "machine_restart", "emergency_restart",
    "__stack_chk_fail", "__ubsan_handle_builtin_unreachable", "start_kernel", "cpu_startup_entry",
    "do_task_dead", "usercopy_abort", "secondary_start_kernel", "cpu_die", "cpu_die_early",
    "arch_cpu_idle_dead", "panic_smp_self_stop", "panic_bad_stack", "handle_bad_stack", "arm64_serror_panic",
})  # fmt: skip

# Jump labels and static calls: every site is one instruction.
JUMP_LABEL_PROBE = AARCH64_INSN_SIZE
JUMP_LABEL_MAX = AARCH64_INSN_SIZE
STATIC_CALL_SIZE = AARCH64_INSN_SIZE


def jump_label_size(code: bytes) -> int:
    """A jump-label site's size, whatever it holds now (``nop`` or ``b``): one instruction."""
    return AARCH64_INSN_SIZE


def arch_populate_kprobe_blacklist() -> ArchBlacklist:
    """The sections kprobes.c's arch_populate_kprobe_blacklist adds; arm64 has no return or branch thunks."""
    return ArchBlacklist(SECTIONS)


def arch_kretprobe_blacklist() -> frozenset[str]:
    return KRETPROBE_BLACKLIST


__all__ = [
    "AARCH64_INSN_SIZE",
    "JUMP_LABEL_MAX",
    "JUMP_LABEL_PROBE",
    "KRETPROBE_BLACKLIST",
    "SECTIONS",
    "STATIC_CALL_SIZE",
    "arch_kretprobe_blacklist",
    "arch_populate_kprobe_blacklist",
    "jump_label_size",
]
