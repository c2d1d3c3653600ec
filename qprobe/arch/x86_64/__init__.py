"""x86_64 instruction layer: decode, prepare, emulate and relocate probed instructions.

Pure functions over bytes and register objects; nothing here talks to QEMU.
Names follow Linux 6.1's arch/x86/kernel/kprobes/{core,opt}.c.
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
