"""The int3 single-step: a probe's copy runs out of line to an int3 after it, and the second trap finishes the hit.

Every boundary of hot kernel functions gets a probe with a pre_handler and a
post_handler (a post_handler rules out boosting and the jump, so every hit
is an int3: emulated, run to the int3 after its copy, or stepped by the
host).  The guest itself is the oracle for what the post_handler must see:
when the next probe that vCPU hits is the one at the post_handler's ip, its
pre_handler's registers are the state the guest went on from, and they
must be the post_handler's exactly; a call and a ret are checked against the
guest's stack.  Then: hits exact, nothing missed, no oops, text
byte-identical.

A copy with an exception-table entry is still stepped by the host: a fault
there reaches the fault_handler and the kernel's fixup (a user page touched
for the first time by ``copy_to_user``) resolves it at the probed address.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator

import pytest
from iced_x86 import OpKind, Register

import qprobe
from qprobe import Kprobe
from qprobe.arch.x86_64.decode import Insn, decode_all
from qprobe.arch.x86_64.ptregs import PT_NAME
from qprobe.errors import ProbeError
from qprobe.pytest_plugin import qprobe_scope

from .conftest import entry_offset, text_symbols, vmlinux_of, workload_result

pytestmark = pytest.mark.vm
N = 5
REGS = ("ax", "bx", "cx", "dx", "si", "di", "bp", "sp", "r8", "r9", "r10", "r11", "r12", "r13", "r14", "r15", "ip",
        "flags")  # fmt: skip
IF = 0x200
# function -> (workload, exact entry count or None, least entry count); others call the inexact ones too.
# A function the image's kernel lacks is skipped, naming the image: Linux 6.12's struct fd rework made
# fdget_pos the out-of-line function in place of 6.1's __fdget_pos.
FUNCS = {
    "ksys_lseek": (f"workload lseek {N}", N, N),
    "__x64_sys_lseek": (f"workload lseek {N}", N, N),
    "__fdget_pos": (f"workload lseek {N}", None, N),
    "fdget_pos": (f"workload lseek {N}", None, N),
    "vfs_read": (f"workload read {N} 64", None, N),
    "ksys_read": (f"workload read {N} 64", None, N),
    "_raw_spin_lock_irqsave": (f"workload getppid {N}", None, 1),  # pushfq; pop; cli
}
_REGISTER_NAMES = {value: name for name, value in vars(Register).items() if not name.startswith("_")}
KINDS = ("rip-relative", "call", "jmp", "jcc", "ret", "pushfq", "push", "pop", "other")


def _kind(insn: Insn) -> str:
    mnemonic = insn.text.split()[0]
    if "rip" in insn.text:
        return "rip-relative"
    if mnemonic.startswith("j") and mnemonic != "jmp":
        return "jcc"
    return mnemonic if mnemonic in ("call", "jmp", "ret", "pushfq", "push", "pop") else "other"


def _indirect(insn: Insn, before: dict[str, int], target: qprobe.Target) -> int:
    """Where ``call reg``/``call [mem]`` goes, from the registers before it (a kernel built without
    retpolines calls through ``f_op`` tables like this; they stay put while the file is open)."""
    i = insn.instr

    def reg(r: int) -> int:
        return before[PT_NAME[_REGISTER_NAMES[r].lower()]]  # iced's RAX is gdb's rax, pt_regs' ax

    if i.op0_kind == OpKind.REGISTER:
        return reg(i.op0_register)
    assert i.op0_kind == OpKind.MEMORY and i.memory_base != Register.RIP, insn.text
    where = i.memory_displacement
    if i.memory_base != Register.NONE:
        where += reg(i.memory_base)
    if i.memory_index != Register.NONE:
        where += reg(i.memory_index) * i.memory_index_scale
    return int.from_bytes(target.read(where & 0xFFFFFFFFFFFFFFFF, 8), "little")


def _snap(regs: qprobe.PtRegs) -> dict[str, int]:
    return {name: getattr(regs, name) for name in REGS}


@contextlib.contextmanager
def _all_boundaries(target: qprobe.Target, func: str) -> Iterator[tuple[list, list]]:
    """Probes with both handlers on every boundary of ``func``; (probes with their insns, events)."""
    sym = target.symbols.lookup(func)
    before = target.read(sym.addr, sym.size)
    events: list[tuple[str, int, int, dict[str, int], int]] = []  # (pre/post, probe addr, vcpu, regs, [sp])

    def pre(kp: Kprobe, regs: qprobe.PtRegs) -> None:
        top = int.from_bytes(regs.read(regs.sp, 8), "little")
        events.append(("pre", kp.resolved, regs.vcpu, _snap(regs), top))

    def post(kp: Kprobe, regs: qprobe.PtRegs) -> None:
        top = int.from_bytes(regs.read(regs.sp, 8), "little")
        events.append(("post", kp.resolved, regs.vcpu, _snap(regs), top))

    probes = []
    for insn in decode_all(before, sym.addr):
        if target.kprobes.sites.ftrace_site(insn.addr):
            continue  # the __fentry__ site: a probe there is armed on the next instruction, which has its own
        if insn.addr == sym.addr and entry_offset(vmlinux_of(target), func) > 0:
            # An ENDBR entry (boot may have sealed it into a nop): the kernel moves a probe there past it
            # (arch_adjust_kprobe_addr), onto the __fentry__ site and so to the next instruction too.
            continue
        kp = Kprobe(addr=insn.addr, pre_handler=pre, post_handler=post)
        try:
            target.register_kprobe(kp)
        except ProbeError as exc:
            assert insn.mnemonic in ("int3", "ud2", "nop") or "cannot probe" in str(exc) or "is reserved" in str(exc)
            continue
        assert kp.resolved == insn.addr, f"a probe at {insn.addr:#x} was armed at {kp.resolved:#x}"
        probes.append((kp, insn))
    try:
        yield probes, events
    finally:
        target.unregister_kprobes([kp for kp, _ in probes])
    assert target.read(sym.addr, sym.size) == before
    assert target.oopses() == [], target.console.tail(60)  # type: ignore[union-attr]


@pytest.fixture(scope=qprobe_scope)
def kinds_checked(target: qprobe.Target) -> dict[str, collections.Counter[str]]:
    """function -> how many instructions of each kind its test below checked, on this VM, once it passed."""
    return {}


@pytest.mark.parametrize("func", [pytest.param(f, marks=pytest.mark.qprobe_needs_symbol(f)) for f in FUNCS])
def test_the_post_handler_sees_the_state_after_the_instruction(
    target: qprobe.Target, kinds_checked: dict[str, collections.Counter[str]], func: str
) -> None:
    kinds_checked[func] = _check_post_handlers(target, func)


def _check_post_handlers(target: qprobe.Target, func: str) -> collections.Counter[str]:
    """Run ``func``'s workload with every boundary probed and check each post_handler against the guest;
    how many instructions of each kind were checked."""
    cmd, exact, least = FUNCS[func]
    checked: collections.Counter[str] = collections.Counter()
    with _all_boundaries(target, func) as (probes, events):
        listing = target.list_probes()
        res = workload_result(target.run(cmd, timeout=900).check().output)
        assert int(res["errors"]) == 0 and int(res["n"]) == N
        snapshot = list(events)  # handlers may still run for other callers: judge what was recorded so far
        nhit = {kp.resolved: kp.nhit for kp, _ in probes}
        entry = probes[0][0]
        assert entry.nhit == exact if exact is not None else entry.nhit >= least
        assert all(kp.nmissed == 0 and kp.nfaults == 0 for kp, _ in probes), [kp for kp, _ in probes if kp.nmissed]
        by_addr = {kp.resolved: insn for kp, insn in probes}
        pre_count = collections.Counter(a for what, a, *_ in snapshot if what == "pre")
        post_count = collections.Counter(a for what, a, *_ in snapshot if what == "post")
        # Every hit ran its pre_handler and then its post_handler (a hit on each vCPU may be half way).
        assert all(0 <= pre_count[a] - post_count[a] <= 2 for a in by_addr)
        wrong = {by_addr[a].text: (pre_count[a], nhit[a]) for a in by_addr
                 if (pre_count[a] != nhit[a] if exact is not None else pre_count[a] > nhit[a])}  # fmt: skip
        assert not wrong, wrong
        last: dict[int, tuple[str, int, dict[str, int], int]] = {}  # vcpu -> its previous event
        for what, addr, vcpu, regs, top in snapshot:
            prev = last.get(vcpu)
            last[vcpu] = (what, addr, regs, top)
            if what == "post":
                insn = by_addr[addr]
                assert prev is not None and prev[0] == "pre" and prev[1] == addr, "a post_handler without its pre"
                before = prev[2]
                kind = _kind(insn)
                if kind == "call":
                    goes = insn.branch_target if insn.branch_target is not None else _indirect(insn, before, target)
                    assert regs["ip"] == goes and regs["sp"] == before["sp"] - 8
                    assert top == addr + insn.length  # the return address the guest's stack holds
                    checked[kind] += 1
                elif kind == "ret":
                    assert regs["ip"] == prev[3] and regs["sp"] == before["sp"] + 8
                    checked[kind] += 1
                elif kind == "jmp" and insn.branch_target is not None:
                    assert regs["ip"] == insn.branch_target
                    checked[kind] += 1
                if insn.mnemonic not in ("cli", "sti", "popfq"):
                    assert regs["flags"] & IF == before["flags"] & IF, f"IF changed across '{insn.text}'"
            elif prev is not None and prev[0] == "post" and prev[2]["ip"] == regs["ip"] == addr:
                # The next probe this vCPU hit is at the post_handler's ip: the guest went on from that state.
                assert prev[2] == regs, f"after '{by_addr[prev[1]].text}': post {prev[2]} != next pre {regs}"
                checked[_kind(by_addr[prev[1]])] += 1
        assert listing.count("single-stepped through the gdbstub") == 0, listing
    return checked


def test_every_kind_of_instruction_was_checked(
    target: qprobe.Target, kinds_checked: dict[str, collections.Counter[str]]
) -> None:
    """Each kind of instruction was checked by the test above, over all its functions on this image.

    The check needs each function's workload run under its probes, too slow to do twice: what the test
    above checked on this VM is reused, and any function it has not passed here (run alone, deselected,
    failed or not run yet) is run and checked now, so this never passes or skips for want of it.
    """
    names = text_symbols(vmlinux_of(target))
    checked: collections.Counter[str] = collections.Counter()
    for func in (f for f in FUNCS if f in names):
        if func not in kinds_checked:
            kinds_checked[func] = _check_post_handlers(target, func)
        checked += kinds_checked[func]
    assert all(checked[k] > 0 for k in KINDS), dict(checked)


# Where copy_to_user's user accesses are, by kernel: 6.1's out-of-line copy_user_* routines,
# 6.12's rep_movs_alternative and the inline `rep movsb` of copy_user_generic().
COPY_OUT = ("copy_user_enhanced_fast_string", "copy_user_generic_string", "copy_user_generic_unrolled",
            "copy_user_short_string", "rep_movs_alternative", "_copy_to_user", "_copy_to_iter", "copyout")  # fmt: skip


FILE, SIZE = "/tmp/page-and-a-bit", 4200


def test_a_fault_in_a_stepped_copy_reaches_the_fault_handler(target: qprobe.Target) -> None:
    table = target.symbols.exception_table()
    sites: list[tuple[int, str]] = []
    for name in COPY_OUT:
        if name not in target.symbols:
            continue
        sym = target.symbols.lookup(name)
        if target.symbols.function(sym.addr) is None:
            continue  # an assembler label without a size, not a function qprobe probes
        sites += [(i.addr, i.text) for i in decode_all(target.read(sym.addr, sym.size), sym.addr) if i.addr in table]
    assert sites, "no exception-table instruction in copy_to_user's routines"
    pre: collections.Counter[int] = collections.Counter()
    post: collections.Counter[int] = collections.Counter()
    faults: list[tuple[int, str]] = []
    probes = [Kprobe(addr=a, pre_handler=lambda kp, r: pre.update([kp.resolved]),
                     post_handler=lambda kp, r: post.update([kp.resolved]),
                     fault_handler=lambda kp, r, e: faults.append((kp.resolved, str(e))))
              for a, _ in sites]  # fmt: skip
    before = {a: target.read(a, 16) for a, _ in sites}
    # A 128-KiB buffer is a fresh mapping whose first page malloc's header has touched: reading a file
    # of a page and a bit, copy_to_user's first store into the second page faults (demand paging).
    target.run(f"dd if=/proc/version of={FILE} bs=1 count=0 seek={SIZE} 2>/dev/null").check()
    target.register_kprobes(probes)
    try:
        listing = target.list_probes()
        out = target.run(f"workload read 1 131072 {FILE}", timeout=900).check().output
    finally:
        target.unregister_kprobes(probes)
    res = workload_result(out)
    assert int(res["errors"]) == 0 and int(res["bytes"]) == SIZE  # read, the fault fixed up

    # A call there is emulated, as the kernel's kprobes emulate every call: its one memory access is the
    # push onto the kernel stack, and the user accesses are the callee's own (6.12's copy_user_generic()
    # is an inline `rep movsb` that boot's alternatives make a call of rep_movs_alternative on a CPU
    # without FSRM). Every other instruction there is stepped.
    stepped = {a for a, text in sites if text.split()[0] != "call"}
    noted = "single-stepped through the gdbstub: it has an exception-table entry"
    assert {int(line.split()[0], 16) for line in listing.splitlines() if noted in line} == stepped, listing
    assert faults and all("faulted" in e for _, e in faults), faults
    for kp in probes:
        a = kp.resolved
        assert kp.nfaults == sum(1 for f, _ in faults if f == a)
        # Every hit ran its pre_handler; the faulted ones went back to the probed address (a second hit)
        # instead of to their post_handler.
        assert kp.nhit == pre[a] == post[a] + kp.nfaults and kp.nmissed == 0
    assert {a: target.read(a, 16) for a, _ in sites} == before
    assert target.oopses() == [], target.console.tail(60)  # type: ignore[union-attr]
