"""Issue 3: a probe on every instruction boundary of hot kernel functions, under load.

For each function every boundary is probed at once (so RIP-relative
operands, calls, jumps, conditional jumps, ret and, in the running text,
pushf are all executed out of line or emulated), the guest workload that
reaches the function runs, and then: the function was entered exactly as
often as the workload says (or at least that often, for functions others
call too), what the workload reports is right, no oops, and the text is
byte-identical afterwards.
"""

from __future__ import annotations

import collections

import pytest

import qprobe
from qprobe import Kprobe
from qprobe.arch.x86_64.decode import Insn, decode_all
from qprobe.errors import ProbeError

from .conftest import branches_to, text_symbols, workload_result

pytestmark = pytest.mark.vm
N = 5
# function -> (workload command, exact entry count or None for "at least N", 0 for "at least once").
# A function the image's kernel lacks is skipped, naming the image: Linux 6.12's struct fd rework
# made fdget_pos and fdget the out-of-line functions in place of 6.1's __fdget_pos and __fget_light
# (fdget is not on the lseek path there: the guest shell's own calls reach it).
HOT = {
    "__x64_sys_getppid": (f"workload getppid {N}", N),
    "__x64_sys_lseek": (f"workload lseek {N}", N),
    "ksys_lseek": (f"workload lseek {N}", N),
    "generic_file_llseek_size": (f"workload lseek {N}", None),
    "shmem_file_llseek": (f"workload lseek {N}", N),
    "__task_pid_nr_ns": (f"workload getppid {N}", None),
    "__x64_sys_read": (f"workload read {N} 64", None),
    "ksys_read": (f"workload read {N} 64", None),
    "vfs_read": (f"workload read {N} 64", None),
    "__x64_sys_write": (f"workload write {N} 64", None),
    "ksys_write": (f"workload write {N} 64", None),
    "vfs_write": (f"workload write {N} 64", None),
    "__fdget_pos": (f"workload lseek {N}", None),
    "__fget_light": (f"workload lseek {N}", None),
    "fdget_pos": (f"workload lseek {N}", None),
    "fdget": (f"workload lseek {N}", 0),
    "rw_verify_area": (f"workload read {N} 64", None),
    "security_file_permission": (f"workload read {N} 64", None),
    "do_sys_openat2": (f"workload open {N} /etc/passwd", None),
    "getname": (f"workload open {N} /etc/passwd", None),
    "fput": (f"workload open {N} /etc/passwd", None),
    "_raw_spin_lock_irqsave": (f"workload getppid {N}", 0),
    "strncpy_from_user": (f"workload open {N} /etc/passwd", None),  # exception-table loads
}
# function -> the function its workload calls it from. A compiler may inline a function there and
# keep an out-of-line copy for its other callers, which the workload never enters: minimal-6.12
# (Linux 6.12 without CONFIG_SECURITY, so security_file_permission is an empty inline) has
# rw_verify_area inlined into vfs_read and called only from splice and aio.
CALLED_FROM = {"rw_verify_area": "vfs_read"}
USER_ACCESS = {"strncpy_from_user"}
KINDS = ("rip-relative", "call", "jmp", "jcc", "ret", "pushfq", "push", "pop")


def _kind(text: str) -> str:
    mnemonic = text.split()[0]
    if "rip" in text:
        return "rip-relative"
    if mnemonic.startswith("j") and mnemonic != "jmp":
        return "jcc"
    return mnemonic if mnemonic in ("call", "jmp", "ret", "pushfq", "popfq", "push", "pop") else "other"


def _not_entered(target: qprobe.Target, func: str) -> str | None:
    """Why the workload never enters ``func`` on this image (read from its vmlinux with binutils), or None."""
    cmd, _ = HOT[func]
    caller = CALLED_FROM.get(func)
    assert target.image is not None
    if caller is not None and branches_to(target.image.vmlinux, caller, func) == ([], []):
        return f"{target.image.name}: {caller} has no call of {func} (inlined there): `{cmd}` never enters it"
    return None


def _probe_every_boundary(target: qprobe.Target, insns: list[Insn]) -> list[tuple[Kprobe, Insn]]:
    """A probe on each of ``insns`` that the kernel's rules allow; (probe, its instruction) of those registered."""
    probes = []
    for insn in insns:
        kp = Kprobe(addr=insn.addr)
        try:
            target.register_kprobe(kp)
        except ProbeError as exc:
            # Padding int3s after a ret, instructions with a stated reason, or text the kernel rewrites
            # (jump labels, static calls: the kernel refuses those too).
            refusable = insn.mnemonic in ("int3", "ud2", "nop")
            assert refusable or "cannot probe" in str(exc) or "is reserved" in str(exc), exc
            continue
        probes.append((kp, insn))
    return probes


@pytest.mark.parametrize("func", [pytest.param(f, marks=pytest.mark.qprobe_needs_symbol(f)) for f in HOT])
def test_every_boundary_of_a_hot_function(target: qprobe.Target, func: str) -> None:
    cmd, exact = HOT[func]
    why_not = _not_entered(target, func)
    if why_not is not None:
        pytest.skip(why_not)
    sym = target.symbols.lookup(func)
    before = target.read(sym.addr, sym.size)
    # Registered with jump optimization off and turned on once all are in: the state the workload meets is
    # the one registering them one by one with it on reaches (with every boundary probed, a jump fits only
    # over an instruction of 5 bytes or more, and takes it either way), without a grace period and an
    # optimizer pass per instruction.
    target.set_kprobes_optimization(False)
    try:
        probes = _probe_every_boundary(target, decode_all(before, sym.addr))
    finally:
        target.set_kprobes_optimization(True)
    try:
        res = workload_result(target.run(cmd, timeout=900).check().output)
    finally:
        target.unregister_kprobes([kp for kp, _ in probes])
    assert int(res["errors"]) == 0 and int(res["n"]) == N
    entry = probes[0][0]
    assert probes[0][1].addr == sym.addr
    if exact:
        assert entry.nhit == exact, f"{func} entered {entry.nhit} times, the workload made {exact} calls"
    else:
        assert entry.nhit >= (N if exact is None else 1)
    # The body ran past the entry (functions leave through ret or a jmp to the return thunk).
    assert sum(kp.nhit for kp, _ in probes[1:]) >= entry.nhit
    assert all(kp.nmissed == 0 for kp, _ in probes)
    faulted = [insn.text for kp, insn in probes if kp.nfaults]
    if func in USER_ACCESS:
        # Word-at-a-time user loads may fault at a page end; the kernel's exception
        # table fixes that up, which only works because the fault is reported at the
        # original address, not the slot.  The result above proves it did.
        assert all("[" in text for text in faulted), faulted
    else:
        assert faulted == []
    assert target.read(sym.addr, sym.size) == before
    assert target.oopses() == [], target.console.tail(60)  # type: ignore[union-attr]


def test_the_sweep_covered_every_kind_of_instruction(target: qprobe.Target) -> None:
    """Each kind of instruction is among those the sweep above probes on this image.

    It registers the sweep's probes itself (what is registered is what this counts; the sweep's workloads
    add nothing to it) instead of reading what the sweep's cases left behind, so that run alone, with some
    of them deselected or before them, it checks the same thing and cannot pass or skip for want of them.
    """
    assert target.image is not None
    in_vmlinux = text_symbols(target.image.vmlinux)
    swept = [f for f in HOT if f in in_vmlinux and _not_entered(target, f) is None]
    assert swept, f"none of the sweep's functions is in {target.image.name}'s vmlinux"
    seen: collections.Counter[str] = collections.Counter()
    target.set_kprobes_optimization(False)  # as the sweep registers them; no jump is wanted to count kinds
    try:
        for func in swept:
            sym = target.symbols.lookup(func)
            probes = _probe_every_boundary(target, decode_all(target.read(sym.addr, sym.size), sym.addr))
            target.unregister_kprobes([kp for kp, _ in probes])
            seen.update(_kind(insn.text) for _, insn in probes)
    finally:
        target.set_kprobes_optimization(True)
    for kind in KINDS:
        assert seen[kind] > 0, f"no {kind} instruction was probed in {swept}: {dict(seen)}"
