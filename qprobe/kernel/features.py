"""Facts about the running Linux that the kprobes engine needs, found by feature detection.

Each one is read from the kernel at hand (its symbols or its debug info),
never assumed from one build; the comments cite the kernel change that makes
the detection necessary, as drgn's helpers do.
"""

from __future__ import annotations

import drgn

from qprobe.arch import Arch
from qprobe.errors import QprobeError, SymbolError
from qprobe.kernel.program import KernelData
from qprobe.kernel.symbols import Symbols

# The init task's stack in the linker script (include/asm-generic/vmlinux.lds.h), 6.10's names first.
_INIT_STACK_SPANS = (("__start_init_stack", "__end_init_stack"), ("__start_init_task", "__end_init_task"))


def trap_entry(symbols: Symbols, arch: Arch) -> int:
    """Where a breakpoint trap from kernel mode enters the kernel (the first of the arch's entries it has)."""
    for name in arch.traps.trap_entries:
        if name in symbols:
            return symbols.address(name)
    raise SymbolError(f"this kernel has no breakpoint entry qprobe knows ({' or '.join(arch.traps.trap_entries)})")


def trap_path(symbols: Symbols, arch: Arch) -> list[tuple[int, int]]:
    """[start, end) of each function a trap passes through before the watchpoint hook hears of it."""
    return [(f.addr, f.addr + f.size) for f in map(symbols.lookup, (n for n in arch.traps.trap_path if n in symbols))]


def find_watch_site(kernel: KernelData, arch: Arch) -> tuple[int, frozenset[int]] | None:
    """(address of the watched word, where a vCPU is when QEMU reports the handler's read of it), or None.

    The word is the arch's ``trap_watch`` (x86: text_poke_bp's ``bp_desc.refs``).
    None (the breakpoint hook is used) if the arch has none, or this kernel has no
    such read in the shape the watch's ``site`` expects.
    """
    watch, symbols = arch.trap_watch, kernel.symbols
    if watch is None or watch.variable not in symbols or watch.handler not in symbols:
        return None
    try:
        word = symbols.address(watch.variable) + kernel.type_offset(watch.type_name, watch.member)
        fn = symbols.lookup(watch.handler)
        code = kernel.mem.read(fn.addr, min(fn.size, 128))
    except QprobeError:
        return None
    safe = watch.site(code, fn.addr, word)
    return None if safe is None else (word, safe)


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
        return drgn.sizeof(kernel.prog.variable("init_stack"))  # type: ignore[no-any-return]  # drgn: untyped to mypy
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


__all__ = ["find_watch_site", "fully_preemptible", "init_stack_span", "preemptible", "thread_size", "trap_entry",
           "trap_path"]  # fmt: skip
