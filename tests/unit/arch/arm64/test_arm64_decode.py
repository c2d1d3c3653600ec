"""arm64's probe decoder (decode-insn.c) over every class, with encodings from aarch64-linux-gnu-as.

Each word below was assembled (``-march=armv9-a+mops+pauth``) and checked
with aarch64-linux-gnu-objdump; the mnemonic is objdump's.
"""

from __future__ import annotations

import pytest

from qprobe.arch.arm64.decode import (
    MAX_ATOMIC_CONTEXT_SIZE,
    ProbeInsn,
    arch_uprobe_analyze_insn,
    arm_kprobe_decode_insn,
    arm_probe_decode_insn,
    is_probed_address_atomic,
)
from qprobe.arch.arm64.insn import aarch32_opcode_cond_checks

GOOD, SIM, REJ = ProbeInsn.INSN_GOOD, ProbeInsn.INSN_GOOD_NO_SLOT, ProbeInsn.INSN_REJECTED

SIMULATED = {
    0x54000200: ("b.eq", "simulate_b_cond"),
    0x54FFFE01: ("b.ne", "simulate_b_cond"),
    0xB4000803: ("cbz x3", "simulate_cbz_cbnz"),
    0x35FFFFC4: ("cbnz w4", "simulate_cbz_cbnz"),
    0xB6080105: ("tbz x5, #33", "simulate_tbz_tbnz"),
    0x371FFF06: ("tbnz w6, #3", "simulate_tbz_tbnz"),
    0x100091A7: ("adr x7", "simulate_adr_adrp"),
    0x90000008: ("adrp x8", "simulate_adr_adrp"),
    0x14000100: ("b", "simulate_b_bl"),
    0x97FFFF00: ("bl", "simulate_b_bl"),
    0xD61F0120: ("br x9", "simulate_br_blr_ret"),
    0xD63F0140: ("blr x10", "simulate_br_blr_ret"),
    0xD65F03C0: ("ret", "simulate_br_blr_ret"),
    0xD65F0160: ("ret x11", "simulate_br_blr_ret"),
    0xD63F03C0: ("blr x30", "simulate_br_blr_ret"),
}
LITERAL_LOADS = {
    0x5800040C: ("ldr x12, lit", "simulate_ldr_literal"),
    0x18FFFC0D: ("ldr w13, lit", "simulate_ldr_literal"),
    0x9800020E: ("ldrsw x14, lit", "simulate_ldrsw_literal"),
}
STEPPED = {
    0xD53B4220: "mrs x0, daif",
    0xD503201F: "nop",
    0xD50320FF: "xpaclri",
    0xD503211F: "pacia1716",
    0xD503215F: "pacib1716",
    0xD503231F: "paciaz",
    0xD503233F: "paciasp",
    0xD503235F: "pacibz",
    0xD503237F: "pacibsp",
    0xD503241F: "bti",
    0xD503245F: "bti c",
    0xD503249F: "bti j",
    0xD50324DF: "bti jc",
    0xC8DFFC20: "ldar x0, [x1]",
    0xC89FFC20: "stlr x0, [x1]",
    0xC8A07C41: "cas x0, x1, [x2]",
    0xF8200041: "ldadd x0, x1, [x2]",
    0xD5033F5F: "clrex",
    0xD5033BBF: "dmb ish",
    0xD5033F9F: "dsb sy",
    0xD5033FDF: "isb",
    0x8B020020: "add x0, x1, x2",
    0xF9400420: "ldr x0, [x1, #8]",
    0xA9BF7BFD: "stp x29, x30, [sp, #-16]!",
    0x910003FD: "mov x29, sp",
}
REJECTED = {
    0xD8000200: ("prfm pldl1keep, lit", "PC-relative literal"),
    0xD65F0BFF: ("retaa", "branch"),
    0xD65F0FFF: ("retab", "branch"),
    0xD71F0822: ("braa x1, x2", "branch"),
    0xD73F0822: ("blraa x1, x2", "branch"),
    0xD61F087F: ("braaz x3", "branch"),
    0xD63F0C9F: ("blrabz x4", "branch"),
    0xD69F0BFF: ("eretaa", "exception return"),
    0xD69F03E0: ("eret", "exception return"),
    0xD4000001: ("svc #0", "generates an exception"),
    0xD4000002: ("hvc #0", "generates an exception"),
    0xD4000003: ("smc #0", "generates an exception"),
    0xD4200080: ("brk #0x4", "generates an exception"),
    0xD42000C0: ("brk #0x6", "generates an exception"),
    0xD4210000: ("brk #0x800", "generates an exception"),
    0xD4400000: ("hlt #0", "generates an exception"),
    0xD50342DF: ("msr daifset, #2", "MSR"),
    0xD51B4220: ("msr daif, x0", "MSR"),
    0xD5184101: ("msr sp_el0, x1", "MSR"),
    0xD5384101: ("mrs x1, sp_el0", "MRS of a register other than DAIF"),
    0xD53B4202: ("mrs x2, nzcv", "MRS of a register other than DAIF"),
    0xD503203F: ("yield", "hint"),
    0xD503205F: ("wfe", "hint"),
    0xD503207F: ("wfi", "hint"),
    0xD503209F: ("sev", "hint"),
    0xD50320BF: ("sevl", "hint"),
    0xD503219F: ("autia1716", "hint"),
    0xD50321DF: ("autib1716", "hint"),
    0xD503239F: ("autiaz", "hint"),
    0xD50323BF: ("autiasp", "hint"),
    0xD50323DF: ("autibz", "hint"),
    0xD50323FF: ("autibsp", "hint"),
    0xD503221F: ("esb", "hint"),
    0xD503223F: ("psb csync", "hint"),
    0xD503229F: ("csdb", "hint"),
    0xD5032FFF: ("hint #0x7f", "hint"),
    0xC85F7C20: ("ldxr x0, [x1]", "exclusive"),
    0x885FFC20: ("ldaxr w0, [x1]", "exclusive"),
    0xC8027C20: ("stxr w2, x0, [x1]", "exclusive"),
    0xC802FC20: ("stlxr w2, x0, [x1]", "exclusive"),
    0xC87F0440: ("ldxp x0, x1, [x2]", "exclusive"),
    0xC8230440: ("stxp w3, x0, x1, [x2]", "exclusive"),
}
MOPS = {0x19010440: "cpyfp [x0]!, [x1]!, x2!", 0x19C20420: "setp [x0]!, x1!, x2"}
SIMD_LITERALS = {0x1C000200: "ldr s0, lit", 0x5C000201: "ldr d1, lit", 0x9C000202: "ldr q2, lit"}
LDXR, STXR, ADD, LDAR = (w.to_bytes(4, "little") for w in (0xC85F7C20, 0xC8027C20, 0x8B020020, 0xC8DFFC20))
VERSIONS = [(6, 1), (6, 12)]


def _ids(table: dict[int, object]) -> list[str]:
    return [f"{w:08x}" for w in table]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("word", list(SIMULATED), ids=_ids(SIMULATED))
def test_branches_and_adr_are_simulated(word: int, version: tuple[int, int]) -> None:
    for decode in (arm_probe_decode_insn, arm_kprobe_decode_insn):
        decoded = decode(word, version=version)
        assert (decoded.kind, decoded.handler) == (SIM, SIMULATED[word][1]), SIMULATED[word][0]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("word", list(STEPPED), ids=_ids(STEPPED))
def test_steppable_instructions_run_out_of_line(word: int, version: tuple[int, int]) -> None:
    assert arm_kprobe_decode_insn(word, version=version).kind is GOOD, STEPPED[word]
    assert arch_uprobe_analyze_insn(word.to_bytes(4, "little"), version) is None


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("word", list(REJECTED), ids=_ids(REJECTED))
def test_rejected_with_the_reason(word: int, version: tuple[int, int]) -> None:
    name, why = REJECTED[word]
    decoded = arm_kprobe_decode_insn(word, version=version)
    assert decoded.kind is REJ, name
    assert decoded.reason is not None and why in decoded.reason
    refusal = arch_uprobe_analyze_insn(word.to_bytes(4, "little"), version)
    assert refusal is not None and refusal.endswith("(EINVAL)")


@pytest.mark.parametrize("word", list(LITERAL_LOADS), ids=_ids(LITERAL_LOADS))
def test_literal_loads_are_simulated_for_kprobes_and_for_uprobes_only_before_6_12(word: int) -> None:
    handler = LITERAL_LOADS[word][1]
    for version in VERSIONS:
        decoded = arm_kprobe_decode_insn(word, version=version)
        assert (decoded.kind, decoded.handler) == (SIM, handler)
    # 6.12's "Remove broken LDR (literal) uprobe support", in 6.1's stable series from 6.1.113.
    assert arm_probe_decode_insn(word, (6, 1)).handler == handler
    assert arm_probe_decode_insn(word, (6, 1, 112)).handler == handler
    assert arm_probe_decode_insn(word, (6, 1, 113)).kind is REJ
    assert arm_probe_decode_insn(word, (6, 12)).kind is REJ
    assert arch_uprobe_analyze_insn(word.to_bytes(4, "little"), (6, 12)) is not None


@pytest.mark.parametrize("word", list(MOPS), ids=_ids(MOPS))
def test_mops_are_refused_from_6_13_and_6_12_2(word: int) -> None:
    for version in ((6, 1), (6, 12), (6, 12, 1), (6, 11, 10)):
        assert arm_kprobe_decode_insn(word, version=version).kind is GOOD
    for version in ((6, 12, 2), (6, 12, 41), (6, 11, 11), (6, 13)):
        decoded = arm_kprobe_decode_insn(word, version=version)
        assert decoded.kind is REJ and decoded.reason is not None and "MOPS" in decoded.reason


@pytest.mark.parametrize("word", list(SIMD_LITERALS), ids=_ids(SIMD_LITERALS))
def test_simd_literal_loads_are_refused_by_kprobes(word: int) -> None:
    """The kernel steps them out of line (its literal test misses them); a copy would load the wrong address."""
    assert arm_probe_decode_insn(word).kind is GOOD  # the kernel's own decoder, as uprobes use it
    decoded = arm_kprobe_decode_insn(word)
    assert decoded.kind is REJ and decoded.reason is not None and "SIMD&FP" in decoded.reason


def test_uprobes_refuse_their_own_breakpoint_as_a_trap() -> None:
    assert arch_uprobe_analyze_insn((0xD42000A0).to_bytes(4, "little")) == (
        "the uprobe breakpoint instruction is there already (ENOTSUPP)"
    )


def test_an_address_after_an_open_exclusive_load_is_refused() -> None:
    decoded = arm_kprobe_decode_insn(0x8B020020, LDXR + ADD)
    assert decoded.kind is REJ and decoded.reason is not None and "atomic sequence" in decoded.reason
    assert "2 instruction(s) before" in decoded.reason
    # The 6.1/6.12 load_ex mask takes LDAR for an exclusive load too.
    assert arm_kprobe_decode_insn(0x8B020020, LDAR).kind is REJ
    assert is_probed_address_atomic(ADD + LDXR + ADD) == 4


def test_an_exclusive_store_closes_the_sequence() -> None:
    assert arm_kprobe_decode_insn(0x8B020020, LDXR + ADD + STXR + ADD).kind is GOOD
    assert is_probed_address_atomic(LDXR + STXR) is None


def test_the_scan_looks_back_32_instructions() -> None:
    within = LDXR + ADD * (MAX_ATOMIC_CONTEXT_SIZE - 1)
    assert arm_kprobe_decode_insn(0x8B020020, within).kind is REJ
    assert arm_kprobe_decode_insn(0x8B020020, LDXR + ADD * MAX_ATOMIC_CONTEXT_SIZE).kind is GOOD
    assert arm_kprobe_decode_insn(0x8B020020, b"").kind is GOOD  # no symbol, no scan (as the kernel)


def test_a_rejected_instruction_keeps_its_own_reason_in_a_sequence() -> None:
    decoded = arm_kprobe_decode_insn(0xD4000001, LDXR)
    assert decoded.reason is not None and "exception" in decoded.reason
    # A simulated one is refused for the sequence.
    assert arm_kprobe_decode_insn(0x54000200, LDXR).kind is REJ


# (pstate's NZCV, conditions true) for the condition checks of lib/insn.c.
N, Z, C, V = 8, 4, 2, 1
COND_NAMES = ("eq", "ne", "cs", "cc", "mi", "pl", "vs", "vc", "hi", "ls", "ge", "lt", "gt", "le", "al", "nv")


@pytest.mark.parametrize("nzcv", range(16))
def test_condition_checks_follow_the_architecture(nzcv: int) -> None:
    n, z, c, v = (bool(nzcv & bit) for bit in (N, Z, C, V))
    want = {"eq": z, "ne": not z, "cs": c, "cc": not c, "mi": n, "pl": not n, "vs": v, "vc": not v,
            "hi": c and not z, "ls": not c or z, "ge": n == v, "lt": n != v, "gt": not z and n == v,
            "le": z or n != v, "al": True, "nv": True}  # fmt: skip
    got = {name: check(nzcv << 28 | 0x3C5) for name, check in zip(COND_NAMES, aarch32_opcode_cond_checks, strict=True)}
    assert got == want
