"""x86_64: the :class:`qprobe.arch.Arch` the core is given (``arch.py``) and the modules behind it.

Instructions are decoded, prepared, emulated and relocated (decode, insn,
emulate, boost, opt); ``ptregs`` defines ``struct pt_regs`` once; detour,
retdetour, guestagg and guestfilter generate the code optimized probes run in
the guest (the mailbox stub rings QEMU's isa-debugcon port); int3hook finds
where the host hears of a guest int3.  Each optional facet of the Arch is a
class: ``arch.X86TrapStep``, ``opt.X86OptProbes``, ``guestram.X86GuestRam``
(the layouts in guest RAM) and ``uprobes.X86Uprobes``.  All of it works on bytes and register
values: the host's I/O with QEMU is qprobe.vmm's.  Names follow
arch/x86/kernel/kprobes/{core,opt}.c.
"""

from qprobe.arch.x86_64.boost import can_boost, synthesize_relcall, synthesize_reljump
from qprobe.arch.x86_64.decode import Insn, check_boundary, decode_all, decode_one
from qprobe.arch.x86_64.emulate import emulate
from qprobe.arch.x86_64.insn import PreparedInsn, prepare_kprobe, resume_singlestep
from qprobe.arch.x86_64.opt import OptCheck, can_optimize

__all__ = [
    "Insn",
    "OptCheck",
    "PreparedInsn",
    "can_boost",
    "can_optimize",
    "check_boundary",
    "decode_all",
    "decode_one",
    "emulate",
    "prepare_kprobe",
    "resume_singlestep",
    "synthesize_relcall",
    "synthesize_reljump",
]
