"""arch/arm64/kernel/probes/decode-insn.c on the host: which instructions a probe may sit on, and how each runs.

:func:`arm_probe_decode_insn` is the decoder kprobes and uprobes share;
:func:`arm_kprobe_decode_insn` adds what only kprobes do (LDR literal
simulation, the atomic-sequence scan); :func:`arch_uprobe_analyze_insn` is
arch/arm64/kernel/probes/uprobes.c's.  Each answers with a
:class:`Decoded`: INSN_REJECTED with the reason to show the user,
INSN_GOOD_NO_SLOT with the simulate-insn.c handler that runs it on the
host, or INSN_GOOD (a copy runs out of line).

The kernel's behaviour changed between the two versions qprobe is tested
on, so every function takes the guest's ``version`` as a tuple compared
in order: (6, 1), (6, 12), or with the stable patch level, (6, 1, 158),
which the stable backports below need (Debian's kernels are stable ones):

- "arm64: probes: Remove broken LDR (literal) uprobe support" (v6.12-rc4;
  stable 6.1.113): LDR/LDRSW (literal) are simulated for kprobes only, so
  uprobes refuse them; before, uprobes simulated them too.  With it came
  "Fix simulate_ldr*_literal()" (simulate.py).
- "arm64: probes: Disable kprobes/uprobes on MOPS instructions"
  (c56c599d9002, merged for v6.13, so v6.12 itself steps them; stable
  6.11.11 and, in the same batch of backports, 6.12.2): FEAT_MOPS's
  CPY*/SET* are refused.  6.1 has no MOPS support and never took it.

The steppable hints, the exclusive-access masks and the rest agree in 6.1
and 6.12 (the hint list changed in 2020; the load_ex/store_ex masks and
NOP simulation only after 6.12, and are not followed here).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from qprobe.arch.arm64.insn import (
    AARCH64_INSN_SIZE,
    AARCH64_INSN_SPCLREG_DAIF,
    BRK64_OPCODE_UPROBES,
    aarch64_insn_extract_system_reg,
    aarch64_insn_is_adr_adrp,
    aarch64_insn_is_b,
    aarch64_insn_is_bcond,
    aarch64_insn_is_bl,
    aarch64_insn_is_blr,
    aarch64_insn_is_br,
    aarch64_insn_is_branch,
    aarch64_insn_is_cbnz,
    aarch64_insn_is_cbz,
    aarch64_insn_is_class_branch_sys,
    aarch64_insn_is_eret,
    aarch64_insn_is_eret_auth,
    aarch64_insn_is_exception,
    aarch64_insn_is_exclusive,
    aarch64_insn_is_hint,
    aarch64_insn_is_ldr_lit,
    aarch64_insn_is_ldr_lit_simd,
    aarch64_insn_is_ldrsw_lit,
    aarch64_insn_is_load_ex,
    aarch64_insn_is_mops,
    aarch64_insn_is_mrs,
    aarch64_insn_is_msr_imm,
    aarch64_insn_is_msr_reg,
    aarch64_insn_is_ret,
    aarch64_insn_is_steppable_hint,
    aarch64_insn_is_store_ex,
    aarch64_insn_is_tbnz,
    aarch64_insn_is_tbz,
    aarch64_insn_uses_literal,
    le32,
)

KernelVersion = tuple[int, ...]
NEWEST: KernelVersion = (6, 12)

# decode-insn.h: how far back is_probed_address_atomic() looks for an exclusive load.
MAX_ATOMIC_CONTEXT_SIZE = 32


def _since(version: KernelVersion, mainline: KernelVersion, stable: dict[tuple[int, int], int]) -> bool:
    """Whether ``version`` has a change merged in ``mainline``, or backported to a stable series
    (``stable``: (major, minor) -> the first patch level that has it)."""
    if version >= mainline:
        return True
    first = stable.get((version[0], version[1]) if len(version) >= 2 else (version[0], 0))
    return first is not None and len(version) > 2 and version[2] >= first


def mops_refused(version: KernelVersion) -> bool:
    """ "Disable kprobes/uprobes on MOPS instructions": v6.13, 6.12.2 (see above)."""
    return _since(version, (6, 13), {(6, 12): 2, (6, 11): 11})


def ldr_literal_fixed(version: KernelVersion) -> bool:
    """v6.12-rc4's LDR (literal) fixes (6.1.113): a 32-bit load for a W register, no LDR (literal) uprobes."""
    return _since(version, (6, 12), {(6, 1): 113})


class ProbeInsn(enum.Enum):
    """``enum probe_insn`` (asm/probes.h)."""

    INSN_REJECTED = "rejected"
    INSN_GOOD_NO_SLOT = "simulated"
    INSN_GOOD = "out of line"


@dataclass(frozen=True)
class Decoded:
    """A decoder's answer: ``handler`` names the simulate-insn.c function (INSN_GOOD_NO_SLOT);
    ``reason`` says why an INSN_REJECTED instruction is refused."""

    kind: ProbeInsn
    handler: str | None = None
    reason: str | None = None


GOOD = Decoded(ProbeInsn.INSN_GOOD)


def _rejected(reason: str) -> Decoded:
    return Decoded(ProbeInsn.INSN_REJECTED, reason=reason)


def _unsteppable(insn: int, version: KernelVersion) -> str | None:
    """Why ``aarch64_insn_is_steppable()`` says no (it writes the pc, traps, or needs its neighbours), or None."""
    if aarch64_insn_is_class_branch_sys(insn):
        if aarch64_insn_is_branch(insn):
            return "is a branch (it writes the pc, so it cannot run out of line)"
        if aarch64_insn_is_msr_imm(insn) or aarch64_insn_is_msr_reg(insn):
            return "is an MSR, which may change the state single-stepping relies on"
        if aarch64_insn_is_exception(insn):
            return "generates an exception (svc/hvc/smc/brk/hlt/dcps)"
        if aarch64_insn_is_eret(insn) or aarch64_insn_is_eret_auth(insn):
            return "is an exception return"
        # "The MRS instruction may not return a correct value when executing in the
        # single-stepping environment. We do make one exception, for reading the DAIF bits."
        if aarch64_insn_is_mrs(insn):
            if aarch64_insn_extract_system_reg(insn) != AARCH64_INSN_SPCLREG_DAIF:
                return "is an MRS of a register other than DAIF, which may read wrong out of line"
            return None
        if aarch64_insn_is_hint(insn) and not aarch64_insn_is_steppable_hint(insn):
            return "is a hint the kernel does not step (only NOP and the PAC-signing and BTI hints)"
        return None
    if aarch64_insn_uses_literal(insn):
        return "uses a PC-relative literal"
    if aarch64_insn_is_exclusive(insn):
        return "is an exclusive load/store, which an exception between it and its pair makes fail for ever"
    if mops_refused(version) and aarch64_insn_is_mops(insn):
        return "is a memory copy/set (MOPS) instruction, whose three parts must run consecutively"
    return None


# arm_probe_decode_insn()'s simulated classes, in its order: (tests, simulate-insn.c handler).
_SIMULATED = (
    ((aarch64_insn_is_bcond,), "simulate_b_cond"),
    ((aarch64_insn_is_cbz, aarch64_insn_is_cbnz), "simulate_cbz_cbnz"),
    ((aarch64_insn_is_tbz, aarch64_insn_is_tbnz), "simulate_tbz_tbnz"),
    ((aarch64_insn_is_adr_adrp,), "simulate_adr_adrp"),
    ((aarch64_insn_is_b, aarch64_insn_is_bl), "simulate_b_bl"),
    ((aarch64_insn_is_br, aarch64_insn_is_blr, aarch64_insn_is_ret), "simulate_br_blr_ret"),
)
_LITERAL_LOADS = (
    ((aarch64_insn_is_ldr_lit,), "simulate_ldr_literal"),
    ((aarch64_insn_is_ldrsw_lit,), "simulate_ldrsw_literal"),
)


def arm_probe_decode_insn(insn: int, version: KernelVersion = NEWEST) -> Decoded:
    """``arm_probe_decode_insn()``: step it out of line, simulate it, or refuse it.

    The pointer-authenticated branches (retaa, braa, blraaz, ...) are
    branches the kernel does not simulate: refused, in 6.1 and 6.12 alike.
    Before the LDR (literal) fixes (see above) this decoder, uprobes', simulated
    LDR/LDRSW (literal) too.
    """
    why = _unsteppable(insn, version)
    if why is None:
        return GOOD
    simulated = _SIMULATED if ldr_literal_fixed(version) else _SIMULATED + _LITERAL_LOADS
    for tests, handler in simulated:
        if any(test(insn) for test in tests):
            return Decoded(ProbeInsn.INSN_GOOD_NO_SLOT, handler)
    return _rejected(why)


def is_probed_address_atomic(preceding: bytes) -> int | None:
    """``is_probed_address_atomic()`` over the instructions before the probe, nearest first.

    ``preceding`` holds the bytes before the probed address, back to the
    function's start at most (the kernel's ``scan_end`` is the symbol's
    start, or MAX_ATOMIC_CONTEXT_SIZE instructions back, whichever is
    nearer).  Returns the byte offset in ``preceding`` of the exclusive load
    that opens an atomic sequence the probe is inside, or None (an exclusive
    store ends the search: the sequence before it is closed).
    """
    end = len(preceding) - len(preceding) % AARCH64_INSN_SIZE
    start = max(0, end - MAX_ATOMIC_CONTEXT_SIZE * AARCH64_INSN_SIZE)
    for off in range(end - AARCH64_INSN_SIZE, start - 1, -AARCH64_INSN_SIZE):
        word = le32(preceding, off)
        if aarch64_insn_is_store_ex(word):
            return None
        if aarch64_insn_is_load_ex(word):
            return off
    return None


def atomic_reason(preceding: bytes) -> str | None:
    """Why the probe is refused for sitting in an atomic sequence (see :func:`is_probed_address_atomic`)."""
    at = is_probed_address_atomic(preceding)
    if at is None:
        return None
    back = (len(preceding) - at) // AARCH64_INSN_SIZE
    return (f"is inside an atomic sequence: the exclusive load {back} instruction(s) before it has no "
            "exclusive store before the probe, so a breakpoint there would make it fail for ever")  # fmt: skip


def arm_kprobe_decode_insn(insn: int, preceding: bytes = b"", version: KernelVersion = NEWEST) -> Decoded:
    """``arm_kprobe_decode_insn()``: :func:`arm_probe_decode_insn` plus LDR (literal) and the atomic scan.

    ``preceding``: the function's bytes before the probed address (empty
    when unknown: the kernel also skips the scan without a symbol).

    One deliberate difference: the kernel's aarch64_insn_uses_literal()
    misses LDR (literal, SIMD&FP), which 6.1 and 6.12 therefore step out of
    line, loading from the slot's neighbourhood instead of the literal.
    qprobe refuses it.
    """
    literal = next((handler for tests, handler in _LITERAL_LOADS if any(t(insn) for t in tests)), None)
    if literal is not None:
        decoded = Decoded(ProbeInsn.INSN_GOOD_NO_SLOT, literal)
    elif aarch64_insn_is_ldr_lit_simd(insn):
        return _rejected("loads a SIMD&FP register from a PC-relative literal, which no copy out of "
                         "line reaches (the kernel steps it anyway)")  # fmt: skip
    else:
        decoded = arm_probe_decode_insn(insn, version)
    if decoded.kind is not ProbeInsn.INSN_REJECTED:
        why = atomic_reason(preceding)
        if why is not None:
            return _rejected(why)
    return decoded


def arch_uprobe_analyze_insn(code: bytes, version: KernelVersion = NEWEST) -> str | None:
    """Why arm64's uprobes refuse the user instruction ``code`` starts with, or None.

    prepare_uprobe()'s ``is_trap_insn`` (the uprobe BRK itself: ENOTSUPP),
    then arch_uprobe_analyze_insn()'s decode (INSN_REJECTED: EINVAL).  The
    task's AArch32 mode (EOPNOTSUPP) and the address's alignment (EINVAL)
    are the caller's to check.
    """
    insn = le32(code)
    if insn == BRK64_OPCODE_UPROBES:
        return "the uprobe breakpoint instruction is there already (ENOTSUPP)"
    decoded = arm_probe_decode_insn(insn, version)
    if decoded.kind is ProbeInsn.INSN_REJECTED:
        return f"the instruction {decoded.reason} (EINVAL)"
    return None
