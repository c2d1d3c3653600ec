"""x86's time stamp counter as the kernel's sched_clock reads it (arch/x86/kernel/tsc.c).

With a usable TSC, ``sched_clock()`` is ``native_sched_clock()``:
``cycles_2_ns(rdtsc())`` with the per-CPU ``cyc2ns`` scale, a latch-protected
pair of scales since Linux 4.16's "x86/tsc: Use seqcount_latch() for
cyc2ns".  The host finds the ``rdtsc`` it calibrates against
(:func:`after_rdtsc`) and computes the same scale (:class:`Cyc2ns`).
"""

from __future__ import annotations

from collections.abc import Sequence

import drgn
from drgn.helpers.linux.percpu import per_cpu
from iced_x86 import Decoder, Mnemonic

from qprobe.arch.cycles import GuestKernel
from qprobe.errors import SymbolError

U64 = (1 << 64) - 1


def after_rdtsc(code: bytes, address: int) -> int | None:
    """The address of the instruction right after the first plain ``rdtsc`` in ``code`` (at ``address``).

    There ``edx:eax`` hold the counter just read.  None if ``code`` has no ``rdtsc``
    (an ``rdtscp`` also writes ``ecx`` and is not taken: one shape, one reader).
    """
    decoder = Decoder(64, code, ip=address)
    for insn in decoder:
        if insn.mnemonic == Mnemonic.RDTSC:
            return insn.next_ip
    return None


def tsc_hz(kernel: GuestKernel) -> int:
    """The TSC's rate by the kernel's own calibration (``tsc_khz``), 0 where it has none."""
    at = kernel.address("tsc_khz")
    return 0 if at is None else int.from_bytes(kernel.read(at, 4), "little") * 1000


def native_sched_clock(kernel: GuestKernel) -> Cyc2ns | str:
    """The TSC's sched_clock of this kernel, or why its sched_clock is another."""
    prog = kernel.prog
    try:
        prog["cyc2ns"]
    except KeyError:
        return "this kernel has no per-CPU cyc2ns (its sched_clock is not the TSC's)"
    # Without a usable TSC native_sched_clock() counts jiffies instead (__use_tsc off).
    try:
        if not prog["__use_tsc"].key.enabled.counter.value_():
            return "this kernel's sched_clock does not read the TSC (__use_tsc is off)"
    except (KeyError, LookupError):
        pass
    # A paravirtual sched_clock (kvm-clock under KVM, Xen, Hyper-V) replaces the TSC's:
    # since Linux 5.19 through the pv_sched_clock static call, before through pv_ops.
    native = kernel.address("native_sched_clock") or 0
    try:
        target = prog["__SCK__pv_sched_clock"].func.value_()
    except (KeyError, LookupError):
        try:
            target = prog["pv_ops"].time.sched_clock.value_()
        except (KeyError, LookupError):
            target = native
    if native and target != native:
        return f"this kernel's sched_clock is {kernel.symbolize(target)}, not the TSC's native_sched_clock"
    return Cyc2ns(kernel)


class Cyc2ns:
    """``cycles_2_ns()``: each CPU's scale, read again whenever its latch's sequence moved.

    The kernel rescales after it refines its first, rough TSC calibration (a second
    or so into boot, set_cyc2ns_scale keeps the clock continuous by a new offset).
    """

    def __init__(self, kernel: GuestKernel) -> None:
        self.kernel = kernel
        self._seq_addrs: dict[int, tuple[int, int, int, drgn.Type]] = {}  # cpu -> (&seq, its size, &data[0], its type)
        self._scales: dict[int, tuple[int, tuple[int, int, int]]] = {}  # cpu -> (seq, (mul, shift, offset))

    def ns(self, cycles: int, cpu: int) -> int:
        """sched_clock() on ``cpu`` for the TSC value ``cycles``: offset + mul_u64_u32_shr(cycles, mul, shift)."""
        mul, shift, offset = self.scale(cpu)
        return (offset + ((cycles * mul) >> shift)) & U64

    def ns_many(self, points: Sequence[tuple[int, int]]) -> list[int]:
        """``ns`` of each (cycles, CPU), each CPU's scale read once for them all."""
        scales: dict[int, tuple[int, int, int]] = {}
        out = []
        for cycles, cpu in points:
            scale = scales.get(cpu)
            if scale is None:
                scale = scales[cpu] = self.scale(cpu)
            mul, shift, offset = scale
            out.append((offset + ((cycles * mul) >> shift)) & U64)
        return out

    def scale(self, cpu: int) -> tuple[int, int, int]:
        """(mul, shift, offset) of ``cpu``'s scale now."""
        where = self._seq_addrs.get(cpu)
        if where is None:
            try:
                c = per_cpu(self.kernel.prog["cyc2ns"], cpu)
                try:
                    seq = c.seq.seqcount.sequence
                except (AttributeError, LookupError):
                    seq = c.seq.sequence  # a plain seqcount before seqcount_latch_t (Linux 5.10)
                where = (seq.address_, seq.type_.size, c.data[0].address_, c.data.type_.type)
            except (drgn.FaultError, LookupError, AttributeError) as exc:
                raise SymbolError(f"cannot find the guest's cyc2ns scale of CPU {cpu}: {exc}") from None
            self._seq_addrs[cpu] = where
        seq_addr, seq_size, data, data_type = where
        seq = int.from_bytes(self.kernel.read(seq_addr, seq_size), "little")
        cached = self._scales.get(cpu)
        if cached is not None and cached[0] == seq:
            return cached[1]
        # A rescale is rare: the scale is read through its type, the layout the kernel at hand has.
        try:
            d = drgn.Object(self.kernel.prog, data_type, address=data + (seq & 1) * data_type.size)
            scale = (d.cyc2ns_mul.value_(), d.cyc2ns_shift.value_(), d.cyc2ns_offset.value_())
        except (drgn.FaultError, LookupError, AttributeError) as exc:
            raise SymbolError(f"cannot read the guest's cyc2ns scale of CPU {cpu}: {exc}") from None
        self._scales[cpu] = (seq, scale)
        return scale


__all__ = ["Cyc2ns", "after_rdtsc", "native_sched_clock", "tsc_hz"]
