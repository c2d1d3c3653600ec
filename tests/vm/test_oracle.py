"""The guest kernel's own kprobes as the oracle, in the same VM as qprobe.

Verdicts: every definition of ``oracle_defs`` (the ftrace selftests' tables
and generated ones) is put to the guest's ``kprobe_events`` and to
``Target.add_event``: the same acceptance, error text and caret, and the same
``kprobe_events`` listing.  Hits: the guest's event and qprobe's, with the
same definition on the same function (the guest's through its ftrace site,
qprobe's on the instruction after it), print the same fields for every call
the workload makes.  Counts: ``kprobe_profile`` and ``nhit`` agree.
"""

from __future__ import annotations

import random
import re
from typing import Any

import iced_x86
import pytest

import qprobe
from qprobe import Kprobe
from qprobe.pytest_plugin import QprobeReset, qprobe_scope

from .conftest import workload_result
from .guest_oracle import TRACING, guest_hits, guest_verdicts, paired_hits, qprobe_verdicts, readme_lacks
from .oracle_defs import FUNC, SELFTEST_VALUES, cases

pytestmark = [pytest.mark.vm, pytest.mark.qprobe_needs_config("KPROBE_EVENTS")]


@pytest.fixture(scope=qprobe_scope)
def qprobe_boot_kwargs() -> dict[str, Any]:
    """This module's VM runs both vCPUs on one TCG thread.

    The hit, count and coexistence tests enable the guest's own ftrace-based events, which the guest
    patches in with text_poke_bp.  Under QEMU 7.2's multi-threaded TCG a vCPU can keep running a stale
    translation of an int3 that text_poke_bp already replaced and loop in the kernel's int3 handler
    with interrupts off: a soft lockup in __ftrace_event_enable_disable, with or without qprobe
    attached (docs/reliability.md).  With one TCG thread no vCPU runs translated code while the other
    rewrites it.  The verdict tests share the VM: one boot per image, not two.
    """
    return {"tcg_thread": "single"}


# The guest's own events (g0, g1, ...) as its trace prints them after the timestamp, for its grep -o:
# a pattern that starts with text, not one that backtracks over each line (thousands of lines,
# in busybox's regex under TCG, took more than a minute on a loaded host).
GUEST_EVENT = r": g[0-9]+: "


def test_verdicts_and_listings_equal_the_guest_kernels(target: qprobe.Target) -> None:
    defs = cases()
    kernel = guest_verdicts(target, defs)
    # A verdict or a listing does not depend on jump optimization: with it off each of the hundreds of
    # definitions is armed and removed without a grace period and an optimizer pass of its own.
    target.set_kprobes_optimization(False)
    try:
        ours = qprobe_verdicts(target, defs)
    finally:
        target.set_kprobes_optimization(True)
    differ = []
    for case, k_case, q_case in zip(defs, kernel, ours, strict=True):
        for line, k, q in zip(case, k_case, q_case, strict=True):
            same = k.ok == q.ok and (k.ok or (k.message, k.column) == (q.message, q.column))
            # The kernel hashes an address probe's address (%p) in its name and listing.
            address_probe = re.match(r"[pr]\d*(:\S+)? 0x", line) is not None
            if not same or (k.ok and not address_probe and k.listing != q.listing):
                differ.append(f"{line!r}: kernel {k} {k.listing}, qprobe {q} {q.listing}")
    assert not differ, f"{len(differ)} of {sum(map(len, defs))} definitions differ:\n" + "\n".join(differ)
    assert not target.events


# The same definition for the guest's event and qprobe's, on vfs_read: dereferences of kernel pointers
# (slab, stack) and a user one go through the host at the hit; register-only arguments are recorded by
# the jump's detour in guest RAM and drained later.
HIT_DEFINITIONS = {
    "memory": "vfs_read file=%di pos=+0(%cx):s64 mode=+0x44(%di):x32 fop=+0x28(%di):symbol ip=%ip "
              "orig=%orig_ax count=%dx:u64 first=+0(%si):u8 sp0=+0($stack):x64 who=$comm a3=$arg3 cs=%cs ss=%ss",
    "registers": "vfs_read file=%di count=%dx:u64 ip=%ip orig=%orig_ax cs=%cs ss=%ss who=$comm a2=$arg2 "
                 "sp=$stack flags=%flags:x16",
    # Where the kernel has BTF arguments: names, BTF types, fields and a file's name.
    "btf": "vfs_read $arg1 count pos=file->f_pos mode=file->f_mode name=$arg1:%pD c=+0($arg2):char",
    # task_struct's one-bit members (sched_reset_on_fork, ...), extracted as parse_btf_bitfield does.
    "bitfield": "wake_up_new_task pid=p->pid a=p->sched_reset_on_fork b=p->sched_contributes_to_load "
                "c=p->sched_remote_wakeup",
}  # fmt: skip
# What the guest's language must have for a definition (guest_oracle.README_FACTS).
HIT_NEEDS = {"btf": ("btf_args", "dentry", "char"), "bitfield": ("btf_args",)}
# The workload each definition's function sees, N calls by the workload's own process.
HIT_WORKLOADS = {"bitfield": "workload fork 3"}


@pytest.mark.qprobe_needs_config("FUNCTION_TRACER")
@pytest.mark.parametrize("kind", sorted(HIT_DEFINITIONS))
def test_every_field_of_every_hit_equals_the_guest_trace(target: qprobe.Target, kind: str) -> None:
    body = HIT_DEFINITIONS[kind]
    lacks = readme_lacks(target, *HIT_NEEDS.get(kind, ()))
    if lacks is not None:
        pytest.skip(lacks)
    guest, ours, n, in_guest, _ = paired_hits(target, body, HIT_WORKLOADS.get(kind, "workload read 5 64"))
    assert in_guest == (kind == "registers")
    assert len(guest) == n, guest
    assert ours == guest


# A dereference, OFFS(INNER) or @SYM[+-OFFS] or @ADDR, with no type or an integer one.
DEREF = re.compile(r"(?P<fetch>[+-]u?(0x[0-9a-f]+|\d+)\((?P<inner>.*)\)|@[^:]+)(:[sux]\d+)?")


def _deref_chain(arg: str) -> list[str]:
    """The dereferences an integer argument makes, innermost first (``+0(+8(%di))``: ``+8(%di)``, ``+0(+8(%di))``)."""
    m = DEREF.fullmatch(arg)
    if m is None:
        return []
    return [*(_deref_chain(m["inner"]) if m["inner"] else []), m["fetch"]]


def _last_byte(fetch: str) -> str:
    """The dereference ``fetch`` with 7 added to its address: where its 8-byte read ends."""
    if m := re.fullmatch(r"(?P<sign>[+-])(?P<u>u?)(?P<off>0x[0-9a-f]+|\d+)\((?P<inner>.*)\)", fetch):
        off = int(m["off"], 0) * (-1 if m["sign"] == "-" else 1) + 7
        return f"{'+' if off >= 0 else '-'}{m['u']}{abs(off)}({m['inner']})"
    if m := re.fullmatch(r"@(0x[0-9a-f]+)", fetch):
        return f"@{int(m[1], 16) + 7:#x}"
    m = re.fullmatch(r"@(?P<sym>[^+-]+)(?P<off>[+-]\d+)?", fetch)
    assert m, fetch
    return f"@{m['sym']}{int(m['off'] or 0) + 7:+d}"


@pytest.mark.qprobe_needs_config("FUNCTION_TRACER")
@pytest.mark.parametrize("table", sorted(SELFTEST_VALUES))
def test_every_good_argument_of_the_selftests_reads_what_the_guest_reads(target: qprobe.Target, table: str) -> None:
    """Each accepted argument of the selftests' tables, at vfs_read: the same value as the guest's, hit by hit.

    Where a dereference faults before the argument's store, the kernel stores nothing in its slot of the
    record (process_fetch_insn returns early) and leaves a string's data_loc pointing at the record's free
    area: the trace shows stale bytes of the ring buffer or of the per-CPU filter buffer, not a value read.
    So each dereference an integer argument makes has two witnesses, its first and its last byte read as
    ``:string``, whose last read is the string store, which records "(fault)" when it fails (also for an empty
    user string: see fetch/context.py's read_string).  A kernel value is compared where every read it rests on
    is witnessed; a witness is compared (qprobe's "(fault)" against the kernel's) where the reads under it are.
    """
    lacks = readme_lacks(target, "char") if table == "char" else None
    if lacks is not None:
        pytest.skip(lacks)
    # Addresses from the guest's kallsyms (a per-CPU symbol's is its offset in every CPU's area).
    kallsyms = target.run("grep -wE '_sdata|this_cpu_off' /proc/kallsyms").check().output.split()
    facts = {"SYMADDR": "_sdata", "THIS_CPU_OFF": "this_cpu_off"}
    facts = {key: "0x" + kallsyms[kallsyms.index(name) - 2] for key, name in facts.items()}
    args = [re.sub("|".join(facts), lambda m: facts[m[0]], a) for a in SELFTEST_VALUES[table]]
    chains = [_deref_chain(a) for a in args]
    witnessed = list(dict.fromkeys(fetch for chain in chains for fetch in chain))
    witnesses = [w for fetch in witnessed for w in (f"{fetch}:string", f"{_last_byte(fetch)}:string")]
    every = [*args, *witnesses]
    named = [a.split("=", 1) if "=" in a.split("(")[0] else (f"v{i}", a) for i, a in enumerate(every)]
    names = [name for name, _ in named]
    body = f"{FUNC} " + " ".join(f"{name}={a}" for name, a in named)
    guest, ours, n, _, oversized = paired_hits(target, body, "workload read 4 64 /tmp/oracle-read")
    # Kernel memory read as strings can make a record longer than the guest's ring buffer takes (a page
    # of text in the direct map): the kernel's event then leaves no line, and qprobe's none either.
    assert len(ours) == len(guest), guest
    assert len(guest) == n or oversized, guest
    differ = []
    for i, (g, o) in enumerate(zip(guest, ours, strict=True)):
        kernel, qp = _fields(g[3], names), _fields(_as_guest_prints(o[3]), names)

        def read(chain: list[str], kernel: list[str] = kernel) -> bool:
            at = [len(args) + 2 * witnessed.index(fetch) for fetch in chain]
            return all(kernel[j] != "(fault)" and kernel[j + 1] != "(fault)" for j in at)

        compared = [j for j, chain in enumerate(chains) if read(chain)]
        compared += [len(args) + 2 * k + last for k, fetch in enumerate(witnessed) for last in (0, 1)
                     if read(_deref_chain(fetch)[:-1])]  # fmt: skip
        differ += [f"hit {i}, {every[j]}: kernel {kernel[j]}, qprobe {qp[j]}" for j in compared if kernel[j] != qp[j]]
    assert not differ, "\n".join([*differ, f"kernel: {guest[0][3]}", f"qprobe: {ours[0][3]}"])


def _as_guest_prints(body: str) -> str:
    """qprobe's text as the guest console's output decodes it: bytes that are not UTF-8 replaced."""
    return body.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def _fields(body: str, names: list[str]) -> list[str]:
    """A hit's argument values in order (``(vfs_read+0x0/0x...) v0=... v1="a b"``), found by their names."""
    at: list[int] = []
    for name in names:  # each searched past the one before: a string's bytes may hold " v1=" too
        at.append(body.index(f" {name}=", at[-1] + 1 if at else 0))
    return [body[i + len(name) + 2 : j] for i, name, j in zip(at, names, [*at[1:], len(body)], strict=True)]


LINE_TOO_BIG = "[LINE TOO BIG]"


def test_a_record_longer_than_the_guests_ring_buffer_takes_leaves_no_line_on_either_side(
    target: qprobe.Target,
) -> None:
    """Paths whose records fit the ring buffer's sub-buffer with a time stamp added, and one and two bytes
    past the bound the ring buffer checks first.

    The bound is the kernel's: its sub-buffer's data (``events/header_page``) less two u32s. A record is
    the entry head (16 bytes), the string's data_loc (4) and the path with its NUL. The 8 bytes below the
    bound are left out: a record there is kept or refused by whether the ring buffer adds a time stamp to
    it (a long gap since the CPU's last event), which the host cannot see.
    """
    header = target.run(f"cat {TRACING}/events/header_page").check().output
    data = re.search(r"field: char data;\s*offset:\d+;\s*size:(\d+);", header)
    assert data, header
    bound = int(data[1]) - 8
    lengths = [100, *(bound - 21 + d for d in (-8, 1, 2))]
    body = "do_sys_openat2 path=+0(%si):ustring"
    te = target.add_event(f"p:qopen {body}")
    try:
        target.run(f"echo 'p:gopen {body}' >> {TRACING}/kprobe_events && echo > {TRACING}/trace && "
                   f"echo 1 > {TRACING}/events/kprobes/gopen/enable").check()  # fmt: skip
        for n in lengths:  # built in the guest: a command line that long is more than its tty takes
            target.run(f"p=/$(head -c {n - 1} /dev/zero | tr '\\0' a); cat $p 2>/dev/null; true").check()
        target.run(f"echo 0 > {TRACING}/events/kprobes/gopen/enable").check()
        guest = [h[3] for h in guest_hits(target, "gopen") if "/aaa" in h[3] or h[3].endswith(LINE_TOO_BIG)]
    finally:
        target.remove_event(te)
        target.run(f"echo 0 > {TRACING}/events/kprobes/gopen/enable; echo '-:gopen' >> {TRACING}/kprobe_events")
    ours = [h.body for h in te.hits if "/aaa" in h.body]
    assert len(ours) == len(guest), (guest, [len(b) for b in ours])
    for kernel, qp in zip(guest, ours, strict=True):
        # A line longer than the kernel's trace_seq (a page on Linux 6.1, more on later kernels) is cut where
        # it overflowed and marked (trace.c's s_show): the record was kept, the trace file cannot show it.
        if kernel.endswith(LINE_TOO_BIG):
            assert qp.startswith(kernel.removesuffix(LINE_TOO_BIG)) and len(qp) > len(kernel), (kernel, qp[:80])
        else:
            assert qp == kernel
    assert len(guest) < len(lengths)  # the guest refused some: the bound was crossed
    assert te.oversized == len(lengths) - len(guest)


@pytest.mark.qprobe_needs_config("FUNCTION_TRACER")
@pytest.mark.parametrize("qprobe_first", [True, False], ids=["qprobe-first", "guest-first"])
def test_coexists_with_the_guests_ftrace_on_the_same_function(
    target: qprobe.Target, qprobe_reset: QprobeReset, qprobe_first: bool
) -> None:
    """A probe at ksys_lseek+0 never writes the guest's __fentry__ site: the guest's event works either way."""
    qprobe_reset.watch("ksys_lseek")  # the text before the guest's ftrace patches it: the same at the end
    before = len(target.oopses())
    guest_on = f"echo 'p:gseek ksys_lseek' >> {TRACING}/kprobe_events && echo 1 > {TRACING}/events/kprobes/gseek/enable"
    guest_off = f"echo 0 > {TRACING}/events/kprobes/gseek/enable; echo '-:gseek' >> {TRACING}/kprobe_events"
    kp = Kprobe(symbol_name="ksys_lseek")
    if not qprobe_first:
        target.run(guest_on).check()
    target.register_kprobe(kp)
    try:
        if qprobe_first:
            target.run(guest_on).check()
        res = workload_result(target.run("workload lseek 7").check().output)
        profile = target.run(f"cat {TRACING}/kprobe_profile").check().output
        target.run(guest_off).check()
    finally:
        target.unregister_kprobe(kp)
        target.run(guest_off)
    assert res["errors"] == "0"
    hits = next(int(line.split()[1]) for line in profile.splitlines() if line.split()[:1] == ["gseek"])
    assert hits == 7 and kp.nhit == 7
    assert "[FTRACE]" not in target.list_probes()  # unregistered
    assert target.oopses()[before:] == []
    # The guest's ftrace still works afterwards (an ftrace_bug would have disabled it).
    target.run(f"echo 'p:again ksys_lseek' >> {TRACING}/kprobe_events && echo 1 > {TRACING}/events/kprobes/again/enable"
               f" && echo 0 > {TRACING}/events/kprobes/again/enable && echo '-:again' >> {TRACING}/kprobe_events"
               ).check()  # fmt: skip


def test_probe_on_an_fentry_site_is_listed_where_asked(target: qprobe.Target) -> None:
    kp = Kprobe(symbol_name="ksys_lseek")
    target.register_kprobe(kp)
    try:
        listing = target.list_probes()
        workload_result(target.run("workload lseek 2").check().output)
    finally:
        target.unregister_kprobe(kp)
    start = target.symbols.address("ksys_lseek")
    if target.read(start, 5) not in (bytes.fromhex("0f1f440000"),) and target.read(start, 1) != b"\xe8":
        pytest.skip("ksys_lseek does not start with an __fentry__ site on this kernel")
    assert f"{start:016x}  k  ksys_lseek+0x0    [FTRACE]" in listing
    assert kp.at == start and kp.resolved == start + 5 and kp.nhit == 2


def test_reserved_text_verdicts_equal_the_guest_kernels(target: qprobe.Target) -> None:
    """Jump-label sites, static-call sites and BUG/WARN instructions: refused as the kernel refuses them."""
    reserved = target.kprobes.sites.reserved
    cases = []
    for sites in (reserved.jump_labels, reserved.static_calls, sorted(reserved.bugs)):
        picked = 0
        for site in sites[:: max(1, len(sites) // 40)]:
            fn = target.symbols.function(site)
            if (
                fn is None
                or fn.addr == site
                or target.kprobes.sites.blacklist.lookup(site)
                or not target.symbols.is_text(site)
            ):
                continue
            cases.append([f"p:r{len(cases)} {fn.name}+{site - fn.addr}"])
            picked += 1
            if picked == 4:
                break
        assert picked, "the kernel has no such site in its functions"
    kernel = guest_verdicts(target, cases)
    ours = qprobe_verdicts(target, cases)
    differ = [f"{c[0]}: kernel {k[0]}, qprobe {q[0]}" for c, k, q in zip(cases, kernel, ours, strict=True)
              if (k[0].ok, k[0].message, k[0].column) != (q[0].ok, q[0].message, q[0].column)]  # fmt: skip
    assert not differ, "\n".join(differ)
    assert not any(k[0].ok for k in kernel), "the kernel accepted a reserved site"


def _callees(target: qprobe.Target, func: str, depth: int) -> list[str]:
    """Functions ``func`` calls directly, and those they call, to ``depth`` levels (from the running text)."""
    seen: list[str] = []
    todo = [func]
    for _ in range(depth):
        nxt = []
        for name in todo:
            fn = target.symbols.lookup(name)
            decoder = iced_x86.Decoder(64, target.read(fn.addr, fn.size), ip=fn.addr)
            for instr in decoder:
                if instr.mnemonic != iced_x86.Mnemonic.CALL or instr.op0_kind != iced_x86.OpKind.NEAR_BRANCH64:
                    continue
                callee = target.symbols.function(instr.near_branch_target)
                if callee is not None and callee.addr == instr.near_branch_target and callee.name not in seen:
                    seen.append(callee.name)
                    nxt.append(callee.name)
        todo = nxt
    return seen


@pytest.mark.qprobe_needs_config("FUNCTION_TRACER")
def test_hit_counts_equal_the_guest_trace_on_the_functions_a_workload_reaches(target: qprobe.Target) -> None:
    """The lseek path's functions, probed by the guest and by qprobe (in-guest records, host handlers and
    a return probe): the same number of hits for the workload's process, function by function."""
    rng = random.Random(12)
    # Two levels, and no return probe but the syscall's: deeper, the set reaches what the guest's own event code
    # calls (rcu_read_lock, cond_resched), where enabling its events beside qprobe's has wedged the guest.
    names = _callees(target, "ksys_lseek", 2)
    rng.shuffle(names)
    filt = 'comm == "workload"'
    ours: dict[str, qprobe.TraceEvent] = {}
    guest_defs: list[str] = []
    # The workload's own syscall as a kprobe and a return probe on both sides, then its callees.
    for i, (kind, name) in enumerate([("p", "ksys_lseek"), ("r", "ksys_lseek"), *(("p", n) for n in names[:40])]):
        args = " sp0=+0($stack):x64" if kind == "p" and i % 2 else ""  # a dereference: read by the host at the hit
        try:
            ours[f"e{i}"] = target.add_event(f"{kind}:q{i} {name}{args}", filter=filt)
        except qprobe.QprobeError:
            continue  # not probeable (blacklisted, reserved...): the kernel's verdicts are compared elsewhere
        guest_defs.append(f"{kind}:g{i} {name}{args}")
    removed = False
    try:
        script = "; ".join(f"echo '{d}' >> {TRACING}/kprobe_events" for d in guest_defs)
        target.run(f"{script}; echo > {TRACING}/trace").check()
        target.run(f"for f in {TRACING}/events/kprobes/g*/filter; do echo '{filt}' > $f; done; "
                   f"echo 1 > {TRACING}/events/kprobes/enable").check()  # fmt: skip
        listing = target.run(f"cat {TRACING}/kprobe_events").check().output
        missing = [d for d in guest_defs if f"/{d.split()[0][2:]} " not in listing]  # refused by the guest
        target.run("workload lseek 300").check()
        target.run(f"echo 0 > {TRACING}/events/kprobes/enable").check()
        # qprobe's events out before the guest's trace is read (their counts stay, as after the finally
        # below): armed, those with a dereference would stop the VM at every hit of grep's own reads
        # too (__rcu_read_lock on 6.12), which once kept that grep past 60 s in a full run.
        target.remove_events(list(ours.values()))
        removed = True
        # Counted in the guest: thousands of trace lines (a PREEMPT_RT kernel's spinlocks call
        # __rcu_read_lock, which two levels below ksys_lseek reach on 6.12) through a serial port
        # storm an RT guest's threaded 8250 interrupt ("nobody cared", with a Call Trace).
        trace = (
            target.run(
                f"grep entries-written {TRACING}/trace; grep -oE '{GUEST_EVENT}' {TRACING}/trace | sort | uniq -c"
            )
            .check()
            .output
        )
        profile = target.run(f"cat {TRACING}/kprobe_profile").check().output
    finally:
        if not removed:
            target.remove_events(list(ours.values()))
        target.run(f"echo 0 > {TRACING}/events/kprobes/enable; echo > {TRACING}/kprobe_events")
    assert not missing, listing
    written = re.search(r"entries-in-buffer/entries-written: (\d+)/(\d+)", trace)
    assert written and written[1] == written[2], "the guest's trace buffer overran"
    guest_counts = {
        m[2]: int(m[1]) for line in trace.splitlines() if (m := re.fullmatch(r"\s*(\d+) : (\w+):\s*", line))
    }
    # The guest misses a hit its own probe handling causes (rcu_read_lock in its event code, say): a
    # reentered kprobe only counts nmissed there.  qprobe, outside, sees those calls too.
    reentered = {f.split()[0] for f in profile.splitlines() if len(f.split()) == 3 and f.split()[2] != "0"}
    compared = {f"{te.definition.probe_point} ({key})": (guest_counts.get(f"g{key[1:]}", 0), te.nhit)
                for key, te in ours.items() if f"g{key[1:]}" not in reentered}  # fmt: skip
    assert len(compared) >= 6 and sum(g for g, _ in compared.values()) >= 300 * 3, compared
    assert all(g == q for g, q in compared.values()), {k: v for k, v in compared.items() if v[0] != v[1]}
    for key, te in ours.items():
        if f"g{key[1:]}" in reentered:
            assert te.nhit >= guest_counts.get(f"g{key[1:]}", 0), (te.definition.probe_point, te.nhit)
