"""Facts about the running Linux that the kprobes engine needs, found by feature detection.

Each one is read from the kernel at hand (its symbols or its debug info),
never assumed from one build; the comments cite the kernel change that makes
the detection necessary, as drgn's helpers do.
"""

from __future__ import annotations

import drgn

from qprobe.arch.x86_64.int3hook import watch_site
from qprobe.errors import QprobeError, SymbolError
from qprobe.kernel.program import KernelData
from qprobe.kernel.symbols import Symbols

# The #BP entry: asm_exc_int3 since Linux 5.8's IDTENTRY rework of the x86 entry code
# ("x86/entry: Convert INT3 exception to IDTENTRY_RAW"); plain int3 before.
_INT3_ENTRIES = ("asm_exc_int3", "int3")
# What a vCPU runs from the #BP entry up to the read poke_int3_handler makes of the text_poke_bp
# descriptor (the watchpoint hook's site); the names of 5.8 and later.
_INT3_PATH = ("asm_exc_int3", "error_entry", "exc_int3", "poke_int3_handler")
# The init task's stack in the linker script (include/asm-generic/vmlinux.lds.h), 6.10's names first.
_INIT_STACK_SPANS = (("__start_init_stack", "__end_init_stack"), ("__start_init_task", "__end_init_task"))


def int3_entry(symbols: Symbols) -> int:
    """Where a breakpoint trap from kernel mode enters the kernel (the IDT's #BP handler)."""
    for name in _INT3_ENTRIES:
        if name in symbols:
            return symbols.address(name)
    raise SymbolError(f"this kernel has no #BP entry qprobe knows ({' or '.join(_INT3_ENTRIES)})")


def int3_path(symbols: Symbols) -> list[tuple[int, int]]:
    """[start, end) of each function a trap passes through before the watchpoint hook hears of it."""
    return [(f.addr, f.addr + f.size) for f in map(symbols.lookup, (n for n in _INT3_PATH if n in symbols))]


def find_watch_site(kernel: KernelData) -> tuple[int, frozenset[int]] | None:
    """(address of bp_desc.refs, where a vCPU is when QEMU reports poke_int3_handler's read of it), or None.

    ``bp_desc`` is text_poke_bp's descriptor with a ``refs`` count in the 6.1 and 6.12
    kernels qprobe is tested on (arch/x86/kernel/alternative.c; older kernels reached it
    through a pointer).  None (the breakpoint hook is used) if this kernel has no such read
    in the shape qprobe.arch.x86_64.int3hook expects.
    """
    symbols = kernel.symbols
    if "bp_desc" not in symbols or "poke_int3_handler" not in symbols:
        return None
    try:
        refs = symbols.address("bp_desc") + kernel.type_offset("struct bp_patching_desc", "refs")
        fn = symbols.lookup("poke_int3_handler")
        code = kernel.mem.read(fn.addr, min(fn.size, 128))
    except QprobeError:
        return None
    safe = watch_site(code, fn.addr, refs)
    return None if safe is None else (refs, safe)


def thread_size(kernel: KernelData) -> int:
    """THREAD_SIZE: the size of a task's kernel stack (and of an IRQ stack), which KASAN doubles.

    From the debug info, ``init_stack``: ``unsigned long init_stack[THREAD_SIZE / sizeof(long)]``
    in include/linux/sched/task.h since Linux 4.16 (``union thread_union`` is no answer: 6.12's
    DWARF has no such type, nothing that is compiled uses it).  Without debug info, the span of
    the linker script's init stack: ``__start_init_stack``/``__end_init_stack`` since Linux 6.10
    ("x86: Rename __{start,end}_init_task to __{start,end}_init_stack"), ``__start_init_task``/
    ``__end_init_task`` before.  Raises SymbolError if none of them is there.
    """
    try:
        return drgn.sizeof(kernel.prog.variable("init_stack"))
    except (QprobeError, LookupError, ValueError):
        pass
    size = init_stack_span(kernel.symbols)
    if size is not None:
        return size
    raise SymbolError("the size of a kernel stack is unknown: no debug info for init_stack and no "
                      "__start_init_stack or __start_init_task")  # fmt: skip


def init_stack_span(symbols: Symbols) -> int | None:
    """THREAD_SIZE from the linker script's init stack alone (no debug info needed), or None."""
    for start, end in _INIT_STACK_SPANS:
        if start in symbols and end in symbols:
            return symbols.address(end) - symbols.address(start)
    return None


def preemptible(symbols: Symbols) -> bool:
    """CONFIG_PREEMPTION (PREEMPT, PREEMPT_RT or PREEMPT_DYNAMIC): the kernel has preempt_schedule()."""
    return "preempt_schedule" in symbols


def fully_preemptible(symbols: Symbols, cmdline: str) -> bool:
    """PREEMPT_RT, CONFIG_PREEMPT, or a PREEMPT_DYNAMIC kernel booted with preempt=full.

    PREEMPT_RT has rt_spin_lock; PREEMPT_DYNAMIC (Linux 5.12) has sched_dynamic_update and
    takes the model from the boot command line; otherwise __cond_resched is built only
    without CONFIG_PREEMPTION (as of Linux 6.1).
    """
    if "rt_spin_lock" in symbols:
        return True
    if "sched_dynamic_update" in symbols:
        return "preempt=full" in cmdline.split()
    return preemptible(symbols) and "__cond_resched" not in symbols


__all__ = ["find_watch_site", "fully_preemptible", "init_stack_span", "int3_entry", "int3_path", "preemptible",
           "thread_size"]  # fmt: skip


def has_pti(symbols: Symbols) -> bool:
    """Whether the kernel has page-table isolation compiled in, so its PGDs are 8 KiB pairs.

    arch/x86/mm/pti.c (``pti_init``) is built only with CONFIG_MITIGATION_PAGE_TABLE_ISOLATION
    (CONFIG_PAGE_TABLE_ISOLATION before Linux 6.9); with it ``PGD_ALLOCATION_ORDER`` is 1
    (arch/x86/include/asm/pgalloc.h) even when PTI is off at run time, and CR3 bit 12 selects
    the user copy. A small config without it (minimal-6.12) allocates single-page PGDs, and a
    CR3 with bit 12 set is then just a PGD at an odd page.
    """
    return "pti_init" in symbols
