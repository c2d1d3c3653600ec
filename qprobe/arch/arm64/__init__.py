"""arm64: the :class:`qprobe.arch.Arch` the core is given (``arch.py``) and the modules behind it.

Instructions are decoded as arch/arm64/kernel/probes/decode-insn.c does
(``insn``, ``decode``), simulated on the host (``simulate``) or copied into a
slot with a BRK after them (``kprobes``); ``ptregs`` defines ``struct
pt_regs`` once; ``paging`` walks the kernel half's tables as TCR_EL1 shapes
them; ``traps`` reads a stop on the EL1 synchronous vector; ``returns``,
``bootentry`` and ``blacklist`` answer the rest.  All of it works on bytes
and register values: the host's I/O with QEMU is qprobe.vmm's.
"""

from qprobe.arch.arm64.arch import Arm64

__all__ = ["Arm64"]
