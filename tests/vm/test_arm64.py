"""arm64 guests: probes from the host as arm64's kprobes put them, against the guest kernel's own in the same VM.

A probe is ``brk #KPROBES_BRK_IMM`` in the text, heard on the EL1 synchronous vector; the guest's own kprobes
put the same BRK on the same instructions, so where both probe one function here, the guest's event is on
the function's first instruction and qprobe's on its third: the two before it are the patchable entry's
(``mov x9, x30`` since boot, and the NOP ftrace turns into a call), straight-line code that changes only
x9, so both see every call with the same argument registers.
"""

from __future__ import annotations

import random
import re

import pytest

import qprobe
from qprobe import Kprobe, Kretprobe

from .conftest import IMAGE, sigkill_when, workload_result
from .guest_oracle import TRACING, guest_hits, guest_verdicts, qprobe_verdicts
from .test_boot_probes import boot_trace, check_boot_trace

# CONFIG_ARM64: an arm64 kernel, told from its config before anything boots.
pytestmark = [
    pytest.mark.vm,
    pytest.mark.qprobe_needs_config("ARM64"),
    pytest.mark.qprobe_needs_config("KPROBE_EVENTS"),
]

NOP, PACIASP = 0xD503201F, 0xD503233F
# The workload's lseek(fd, i, SEEK_SET) reaches the kernel through the syscall wrapper, whose one argument
# is the pt_regs of the call (ksys_lseek and vfs_llseek are inlined into it on Debian's arm64 builds).
LSEEK = "__arm64_sys_lseek"
ARGS = "fd=+0(%x0):u64 off=+8(%x0):s64 whence=+16(%x0):u32 sp=%sp lr=%x30 who=$comm"


def _words(target: qprobe.Target, name: str, count: int) -> list[int]:
    """The function's first ``count`` instructions as linked."""
    sym = target.symbols.lookup(name)
    raw = target.symbols.file_bytes(sym.addr, 4 * count)
    return [int.from_bytes(raw[i : i + 4], "little") for i in range(0, len(raw), 4)]


def _body(line: str) -> str:
    """A trace line's fields after its probe point."""
    return line.split(") ", 1)[1] if line.startswith("(") else line


def _guest_event(target: qprobe.Target, definition: str) -> None:
    target.run(f"echo '{definition}' >> {TRACING}/kprobe_events && echo > {TRACING}/trace").check()


def _clear_guest(target: qprobe.Target) -> None:
    target.run(f"echo 0 > {TRACING}/events/kprobes/enable; echo > {TRACING}/kprobe_events")


def test_every_hits_values_equal_the_guests_own_event(target: qprobe.Target) -> None:
    assert _words(target, LSEEK, 3)[:2] == [NOP, NOP]  # the patchable entry, as the module docstring says
    te = target.add_event(f"p:qhit {LSEEK}+8 {ARGS}")
    try:
        _guest_event(target, f"p:ghit {LSEEK} {ARGS}")
        target.run(f"echo 1 > {TRACING}/events/kprobes/ghit/enable").check()
        res = workload_result(target.run("workload lseek 40").check().output)
        target.run(f"echo 0 > {TRACING}/events/kprobes/ghit/enable").check()
        pid, n = int(res["pid"]), int(res["n"])
        guest = [(c, p, cpu, _body(b)) for c, p, cpu, b in guest_hits(target, "ghit") if p == pid]
    finally:
        target.remove_event(te)
        _clear_guest(target)
    ours = [(h.comm, h.pid, h.cpu, _body(h.body)) for h in te.hits if h.pid == pid]
    assert len(guest) == n == 40
    assert ours == guest
    # lseek(fd, i, SEEK_SET) for i = 1..n, as the workload made the calls.
    assert [re.search(r" off=(\d+) ", b)[1] for *_, b in ours] == [str(i) for i in range(1, n + 1)]  # type: ignore[index]


def test_a_kretprobe_sees_every_return_with_its_value(target: qprobe.Target) -> None:
    values: list[int] = []
    rp = Kretprobe(symbol_name="__arm64_sys_getppid", handler=lambda ri, regs: values.append(regs.return_value()))
    target.register_kretprobe(rp)
    try:
        res = workload_result(target.run("workload getppid 200").check().output)
    finally:
        target.unregister_kretprobe(rp)
    mine = values.count(int(res["ret"]))  # the workload's parent, what each of its calls returned
    assert int(res["n"]) == 200 and int(res["errors"]) == 0
    assert mine >= 200 and rp.nmissed == 0


def _callees(target: qprobe.Target, func: str, depth: int) -> list[str]:
    """Functions ``func`` calls with ``bl``, and those they call, to ``depth`` levels (as linked)."""
    seen: list[str] = []
    todo = [func]
    for _ in range(depth):
        nxt = []
        for name in todo:
            sym = target.symbols.lookup(name)
            for i, word in enumerate(_words(target, name, sym.size // 4)):
                if word >> 26 != 0b100101:  # BL imm26
                    continue
                dest = sym.addr + 4 * i + (((word & 0x3FFFFFF) ^ 0x2000000) - 0x2000000) * 4
                callee = target.symbols.function(dest)
                if callee is not None and callee.addr == dest and callee.name not in seen:
                    seen.append(callee.name)
                    nxt.append(callee.name)
        todo = nxt
    return seen


def test_hit_counts_on_random_functions_equal_the_guests_own(target: qprobe.Target) -> None:
    """Thirty functions the lseek and read paths reach, each probed by the guest (first instruction) and by
    qprobe (third): the same number of hits by the workload's process, function by function."""
    syscalls = (LSEEK, "__arm64_sys_read", "__arm64_sys_write", "__arm64_sys_openat", "__arm64_sys_close")
    reached = [name for call in syscalls for name in _callees(target, call, 3)]
    names = sorted({n for n in reached if _words(target, n, 3) == [NOP, NOP, PACIASP]})
    random.Random(39).shuffle(names)
    filt = 'comm == "workload"'
    ours: dict[str, qprobe.TraceEvent] = {}
    for name in names:
        if len(ours) == 30:
            break
        try:
            ours[name] = target.add_event(f"p:q{len(ours)} {name}+8", filter=filt)
        except qprobe.QprobeError:
            continue  # not probeable (blacklisted, reserved): the kernel's verdicts are compared elsewhere
    guest = {name: f"g{i}" for i, name in enumerate(ours)}
    try:
        script = "; ".join(f"echo 'p:{g} {name}' >> {TRACING}/kprobe_events" for name, g in guest.items())
        target.run(f"{script}; echo > {TRACING}/trace").check()
        target.run(f"for f in {TRACING}/events/kprobes/g*/filter; do echo '{filt}' > $f; done; "
                   f"echo 1 > {TRACING}/events/kprobes/enable").check()  # fmt: skip
        # Every hit stops the VM (arm64 has no in-guest records yet): a few thousand of them.
        target.run("workload lseek 40; workload read 10 64; workload open 10 /tmp/qprobe-open", timeout=600).check()
        target.run(f"echo 0 > {TRACING}/events/kprobes/enable").check()
        target.remove_events(list(ours.values()))
        counts = target.run(f"grep -oE ': g[0-9]+: ' {TRACING}/trace | sort | uniq -c").check().output
        profile = target.run(f"cat {TRACING}/kprobe_profile").check().output
    finally:
        target.remove_events([te for te in ours.values() if target.events.get(te.name) is te])
        _clear_guest(target)
    theirs = {m[2]: int(m[1]) for line in counts.splitlines() if (m := re.fullmatch(r"\s*(\d+) : (\w+):\s*", line))}
    # A hit the guest's own probe handling reentered counts only as missed there; qprobe, outside, sees it.
    reentered = {f.split()[0] for f in profile.splitlines() if len(f.split()) == 3 and f.split()[2] != "0"}
    compared = {name: (theirs.get(g, 0), ours[name].nhit) for name, g in guest.items() if g not in reentered}
    assert len(ours) == 30 and len(compared) >= 25, (len(ours), compared)
    assert sum(g for g, _ in compared.values()) >= 50, compared
    assert all(g == q for g, q in compared.values()), {k: v for k, v in compared.items() if v[0] != v[1]}


def test_text_is_byte_identical_after_unregistering(target: qprobe.Target) -> None:
    names = [n for n in _callees(target, LSEEK, 2) if _words(target, n, 3) == [NOP, NOP, PACIASP]][:20]
    before = {n: target.read(target.symbols.address(n), 64) for n in names}
    kps = [Kprobe(symbol_name=n, offset=off) for n in names for off in (0, 8, 12)]
    for kp in kps:
        target.register_kprobe(kp)
    brk = target.arch.breakpoint
    armed = {n: target.read(target.symbols.address(n), 64) for n in names}
    res = workload_result(target.run("workload lseek 20").check().output)
    for kp in kps:
        target.unregister_kprobe(kp)
    assert int(res["errors"]) == 0
    assert all(armed[n][0:4] == armed[n][8:12] == armed[n][12:16] == brk for n in names)
    assert {n: target.read(target.symbols.address(n), 64) for n in names} == before


# The kernel's own verdicts, line for line: entry, the ftrace call site (refused: arm64's kprobes do not
# run from ftrace), the instruction after it, unaligned, the EL1 vectors' text, arm64's register names
# and x86's.
VERDICTS = [
    [f"p:v0 {LSEEK}"],
    [f"p:v1 {LSEEK}+4"],
    [f"p:v2 {LSEEK}+8 a=%x0 b=%x30 c=%sp d=%pc e=%pstate"],
    [f"p:v3 {LSEEK}+2"],
    ["p:v4 el1h_64_sync"],
    [f"p:v5 {LSEEK} a=%di"],
    [f"r:v6 {LSEEK} ret=$retval"],
    [f"p:v7 {LSEEK} a=$arg1 s=$stack0 c=$comm"],
]


def test_verdicts_equal_the_guest_kernels(target: qprobe.Target) -> None:
    kernel = guest_verdicts(target, VERDICTS)
    ours = qprobe_verdicts(target, VERDICTS)
    differ = [
        f"{line!r}: kernel {k} {k.listing}, qprobe {q} {q.listing}"
        for case, k_case, q_case in zip(VERDICTS, kernel, ours, strict=True)
        for line, k, q in zip(case, k_case, q_case, strict=True)
        if k.ok != q.ok
        or (k.ok and k.listing != q.listing)
        or (not k.ok and (k.message, k.column) != (q.message, q.column))
    ]
    assert not differ, "\n".join(differ)
    assert not target.events


def test_a_uprobe_counts_exactly_what_the_guests_own_counts(target: qprobe.Target) -> None:
    """A uprobe on the static workload's ``syscall()``, on a stub breakpoint, beside the guest's own uprobe on the
    same instruction: ``workload getppid N`` calls it N times with SYS_getppid (173 in arm64's generic table)."""
    if target.run(f"test -w {TRACING}/uprobe_events").status != 0:
        pytest.skip("the guest kernel has no CONFIG_UPROBE_EVENTS")
    md5 = target.run("md5sum /bin/workload").check().output.split()[0]
    te = target.add_event("p:qsys /bin/workload:syscall nr=%x0:s64")
    try:
        # The guest's own uprobe at the offset qprobe resolved (its listing: PATH:0xOFFSET).
        point = te.listing().split()[1]
        assert re.fullmatch(r"/bin/workload:0x[0-9a-f]+", point), te.listing()
        target.run(f"echo 'p:gsys {point} nr=%x0:s64' >> {TRACING}/uprobe_events && "
                   f"echo 1 > {TRACING}/events/uprobes/gsys/enable").check()  # fmt: skip
        res = workload_result(target.run("workload getppid 50").check().output)
        target.run(f"echo 0 > {TRACING}/events/uprobes/gsys/enable").check()
        profile = target.run(f"cat {TRACING}/uprobe_profile").check().output
    finally:
        target.remove_event(te)
        target.run(f"echo 0 > {TRACING}/events/uprobes/enable; echo > {TRACING}/uprobe_events")
    pid = int(res["pid"])
    ours = [h.body for h in te.hits if h.pid == pid]
    guest_count = next(int(line.split()[-1]) for line in profile.splitlines() if "gsys" in line)
    assert int(res["n"]) == 50 and int(res["errors"]) == 0
    assert [body.split(") ", 1)[1] for body in ours] == ["nr=173"] * 50, ours  # arm64's __NR_getppid
    assert len(te.hits) == guest_count  # every process that ran the file: this one alone
    assert target.run("md5sum /bin/workload").check().output.split()[0] == md5


def test_boot_trace_lists_the_kernels_initcalls_and_its_cpus_bring_up() -> None:
    """``trace --boot`` from the kernel's first instruction, against its own ``initcall_debug`` account and
    its own boot-time event, as tests/vm/test_boot_probes.py checks on x86.  qprobe finds the slide at the
    boot CPU's branch to its virtual addresses (qprobe.kernel.bootswitch); the initcall's function is x0, and
    the kernel's bring-up of a secondary CPU is secondary_start_kernel."""
    check_boot_trace(boot_trace("%x0", "secondary_start_kernel"))


def test_without_kaslr_the_scratch_area_is_not_where_vmalloc_allocates_next() -> None:
    """Without KASLR vmalloc's area starts at the image and hands out its lowest free range: each fork's
    VMAP stack lands just above the image. A scratch block there was walked as a table by the next fork
    (an oops, the shell's loop killed by SIGSEGV). Forks with a probe armed; then the guest's own
    /proc/vmallocinfo, read with real addresses, must hold stacks in the image's table and none in the area."""
    with qprobe.boot(IMAGE, cmdline="nokaslr") as t:
        assert "KASLR disabled" in t.run("dmesg").check().output
        kp = Kprobe("__arm64_sys_getppid")
        t.register_kprobe(kp)
        n, forks = 20, 300
        loop = f"i=0; while [ $i -lt {forks} ]; do /bin/true; i=$((i+1)); done; echo forked $i"
        out = t.run(f"workload getppid {n}; {loop}", timeout=300).check().output
        assert workload_result(out)["n"] == str(n) and f"forked {forks}" in out, out
        assert kp.nhit == n
        assert t.oopses() == [], t.console.tail(60)  # type: ignore[union-attr]
        info = t.run("echo 1 > /proc/sys/kernel/kptr_restrict; cat /proc/vmallocinfo").check().output
        stacks = [(int(a, 16), int(b, 16)) for a, b in re.findall(r"^0x(\w+)-0x(\w+)\s+\d+ kernel_clone", info, re.M)]
        area = t.kprobes.scratch
        table = area.base & -(1 << 30), (area.base & -(1 << 30)) + (1 << 30)  # the 1 GiB the image's table maps
        assert any(table[0] <= a < table[1] for a, _ in stacks), info  # what made the old place wrong
        assert not [r for r in stacks if r[0] < area.base + area.mapped_size and area.base < r[1]], info
        t.unregister_kprobe(kp)


def test_a_fault_in_the_copy_is_the_kernel_s_at_the_probed_instruction() -> None:
    """A pre_handler makes the probed load fault once (x0, the pt_regs the syscall wrapper is handed, set to
    NULL). The kernel must take that fault at the probed instruction, as its kprobe_fault_handler() arranges,
    so its oops names the probed function rather than the slot; the hit ends there, and every later hit on
    any CPU is a hit again. Its own boot: the oops taints the kernel and kills the workload."""
    with qprobe.boot(IMAGE) as t:
        off = 4 * _words(t, LSEEK, 32).index(0xB9400000)  # ldr w0, [x0]: the fd, from the pt_regs
        nulled: list[int] = []

        def null_once(kp: Kprobe, regs: qprobe.PtRegs) -> int:
            if not nulled:
                nulled.append(regs.ip)
                regs.x0 = 0
            return 0

        kp = Kprobe(LSEEK, offset=off, pre_handler=null_once)
        t.register_kprobe(kp)
        killed = t.run("workload lseek 1", timeout=120)
        oops = t.run("dmesg").check().output
        assert killed.status != 0 and "Unable to handle kernel NULL pointer dereference" in oops, oops
        assert f"pc : {LSEEK}+{off:#x}/" in oops, oops
        assert workload_result(t.run("workload lseek 30").check().output)["errors"] == "0"
        assert (kp.nhit, kp.nmissed, kp.nfaults) == (31, 0, 1), kp.errors
        t.unregister_kprobe(kp)


PROBER = """
import sys, qprobe, time
t = qprobe.attach(sys.argv[1])
t.register_kprobes([qprobe.Kprobe(symbol_name=n) for n in sys.argv[2:]])
t.register_kretprobe(qprobe.Kretprobe("__arm64_sys_getppid"))
print("ARMED", flush=True)
while True:
    time.sleep(1)
"""


def test_sigkill_with_probes_armed_then_attach_restores_text(booted: str) -> None:
    """A qprobe killed with its BRKs in the text: the next attach restores every byte from its journal."""
    names = ("__arm64_sys_getppid", "__arm64_sys_lseek")
    with qprobe.attach(booted) as t:
        before = {n: t.read(n, t.symbols.lookup(n).size) for n in names}
    sigkill_when(PROBER, [booted, *names], "ARMED")
    with qprobe.attach(booted) as t:
        # Two BRKs (the kretprobe's entry shares getppid's) and the scratch area's table entries were left.
        assert t.recovered >= 2
        for n in names:
            assert t.read(n, len(before[n])) == before[n], f"{n} was not restored"
        res = workload_result(t.run("workload getppid 20").check().output)
        assert res["n"] == "20" and res["errors"] == "0"
        assert t.oopses() == [], t.console.tail(60)  # type: ignore[union-attr]
    with qprobe.attach(booted) as t:
        assert t.recovered == 0
