"""Uprobes counted in the guest (qprobe.core.uguest): the guest kernel's own uprobes, with qprobe's consumer.

A Uprobe with nothing to run on the host is registered through the kernel's uprobe_register(): no gdbstub
breakpoint, no VM stop at a hit.  Every count is checked against the guest's: each program's own summary
line (``calls=``), and the guest kernel's uprobe_profile for a trace_uprobe of its own uprobe_events on the
same instruction in the same run (one kernel uprobe, two consumers: both see every hit).  The probed
files' bytes are unchanged (the fixtures check the md5sums); the probed processes see the kernel's int3 in
their own memory, as with uprobe_events.
"""

from __future__ import annotations

import contextlib
import io
import re
from collections.abc import Iterator

import lief
import pytest

import qprobe
from qprobe import Uprobe, Uretprobe
from qprobe.errors import InvalidProbe
from qprobe.events.fold import fold_path
from qprobe.images.guest import guest_tree
from qprobe.shell import Shell

from .conftest import shell_do as do
from .guest_oracle import TRACING, enable_uprobe_events
from .one_tcg_thread import qprobe_boot_kwargs
from .test_uprobe_lifecycle import (
    LIB,
    PROG,
    STATIC,
    background,
    collect,
    files,
    off,
    ok,
    run,
    summary,
    wait_for,
)

pytestmark = pytest.mark.vm
__all__ = ["files", "off", "qprobe_boot_kwargs"]  # fixtures (files and off shared with the lifecycle tests)

EVENT = "uprobes/qpig"


@pytest.fixture
def counted(target: qprobe.Target, files: None) -> None:
    """A kernel that can count uprobes (CONFIG_UPROBES: the uprobe_register() qprobe calls)."""
    if "uprobe_register" not in target.symbols:
        pytest.skip("the guest kernel has no uprobe_register() (CONFIG_UPROBES)")


@contextlib.contextmanager
def guest_uprobe(target: qprobe.Target, spec: str) -> Iterator[None]:
    """The guest's own uprobe_events ``spec`` (named EVENT), enabled: its uprobe_profile is the reference."""
    if target.run(f"test -w {TRACING}/uprobe_events").status != 0:
        pytest.skip("the guest kernel has no CONFIG_UPROBE_EVENTS")
    target.run(f"echo '{spec}' > {TRACING}/uprobe_events && echo 1 > {TRACING}/events/{EVENT}/enable").check()
    try:
        yield
    finally:
        target.run(f"echo 0 > {TRACING}/events/{EVENT}/enable; echo '-:{EVENT}' >> {TRACING}/uprobe_events").check()


@pytest.fixture
def profile(target: qprobe.Target, counted: None, off: dict[str, int]) -> Iterator[None]:
    """The guest's own entry uprobe on /bin/uprog's qpt_target."""
    with guest_uprobe(target, f"p:{EVENT} {PROG}:{off[PROG]:#x}"):
        yield


def kernel_hits(target: qprobe.Target) -> int:
    """uprobe_profile's hit count of the guest's own uprobe (``  PATH  EVENT  HITS``)."""
    out = target.run(f"cat {TRACING}/uprobe_profile").check().output
    return next(int(line.split()[-1]) for line in out.splitlines() if EVENT.split("/")[1] in line.split())


def calls_of(out: str) -> int:
    """Every call the output's programs report: summary lines, forked children's and pre-exec images'."""
    total = 0
    for line in out.splitlines():
        if line.startswith("uprog-child "):
            total += int(summary(line, "uprog-child ")["calls"])
        elif line.startswith("uprog-exec "):
            total += int(summary(line, "uprog-exec ")["calls"])
        elif line.startswith("uprog mode=fork"):
            total += int(summary(line)["m"])  # the parent's own; its calls= counts the children's too
        elif line.startswith("uprog mode="):
            total += int(summary(line)["calls"])
    return total


@pytest.mark.parametrize(
    "command",
    [
        "uprog call 300 1 1 a",
        "uprog call 300 1 1 a > /tmp/p1.out & uprog call 200 2 2 b > /tmp/p2.out & wait; cat /tmp/p1.out /tmp/p2.out",
        "uprog fork 3 50",
        "uprog exec 40",
        "uprog threads 4 50",
    ],
    ids=["one", "two-at-once", "fork", "exec", "threads"],
)
def test_counts_equal_the_program_and_the_guest_s_uprobe_profile(
    target: qprobe.Target, profile: None, off: dict[str, int], command: str
) -> None:
    before = kernel_hits(target)
    up = Uprobe(PROG, off[PROG])
    target.register_uprobe(up)
    try:
        assert up.in_guest is True and not target.uprobes.points  # no gdbstub breakpoint: no VM stop
        out = run(target, command)
    finally:
        target.unregister_uprobe(up)
    assert re.search(r"^rc=0$", out, re.M) and "bad=0" in out and "bad=1" not in out, out
    expected = calls_of(out)
    assert expected > 0 and up.nhit == expected == kernel_hits(target) - before, (up, out)


def test_a_static_program_and_a_shared_library_at_once(
    target: qprobe.Target, counted: None, off: dict[str, int]
) -> None:
    ups = [Uprobe(STATIC, off[STATIC]), Uprobe(LIB, off[LIB])]
    for up in ups:
        target.register_uprobe(up)
    try:
        static = ok(run(target, f"{STATIC} call 250 1 1 s"))
        lib = ok(run(target, "uprog lib 120"))
    finally:
        for up in ups:
            target.unregister_uprobe(up)
    assert [up.nhit for up in ups] == [int(static["calls"]), int(lib["calls"])] == [250, 120]
    assert all(up.in_guest for up in ups) and not target.uprobes.registered()


def test_registered_and_unregistered_while_the_program_runs(
    target: qprobe.Target, counted: None, off: dict[str, int]
) -> None:
    """The kernel arms the running process's page at registration and disarms it at unregistration."""
    calls = 200_000
    up = Uprobe(PROG, off[PROG])
    background(target, f"uprog wait-then-call 1 {calls}", "/tmp/ig.out")
    wait_for(target, "/tmp/ig.out", r"^uprog pid=")
    target.register_uprobe(up)
    while up.nhit < 100:
        target.wait(0.01)
    target.unregister_uprobe(up)
    res = ok(collect(target, "/tmp/ig.out"))
    assert 100 <= up.nhit < int(res["calls"]) == calls, (up, res)


def test_a_handler_is_refused_with_in_guest(counted: None) -> None:
    with pytest.raises(InvalidProbe, match="counted in the guest runs nothing on the host") as info:
        Uprobe(PROG, 0, handler=lambda _u, _r: None, in_guest=True)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("command", ["uprog recurse 12", "uprog threads 3 20", "uprog call 150 1 1 r"])
def test_a_return_probe_counts_every_return_as_the_guest_s_own(
    target: qprobe.Target, counted: None, off: dict[str, int], command: str
) -> None:
    """Each entry and each return, counted by the kernel's own return_instance chain (recursion: 13 nested
    calls of one task; threads: each task's own chain)."""
    func = off["recurse"] if "recurse" in command else off[PROG]
    with guest_uprobe(target, f"r:{EVENT} {PROG}:{func:#x}"):
        before = kernel_hits(target)
        rp = Uretprobe(PROG, func)
        target.register_uprobe(rp)
        try:
            assert rp.in_guest is True and not target.uprobes.points
            res = ok(run(target, command))
        finally:
            target.unregister_uprobe(rp)
        returned = kernel_hits(target) - before
    calls = int(res["calls"])
    assert rp.nhit == rp.nreturns == calls == returned, (rp, res)


def test_the_shell_folds_a_uprobe_event_s_maps_in_the_guest(target: qprobe.Target, profile: None) -> None:
    """``count``, ``count by $comm`` and ``hist(a)`` over a uprobe event: each the guest kernel's uprobe with
    a consumer of qprobe's (the fold path every front end takes), equal to the program's calls and to
    uprobe_profile's count of the guest's own uprobe on the same instruction."""
    out = io.StringIO()
    sh = Shell(target, out=out)
    do(sh, out, "p:ug /bin/uprog:qpt_target a=%di:s64 b=%si:s64")
    try:
        te = target.events["uprobes/ug"]
        assert fold_path([te], "count", ("$comm",), None) == "guest map"
        assert fold_path([te], "hist", (), "a") == "guest map"
        before = kernel_hits(target)
        text = do(sh, out, "count ug by $comm run uprog call 3000 1 2 c")
        assert "@[uprog]: 3000" in text.splitlines() and "calls=3000 bad=0" in text, text
        text = do(sh, out, "count ug run uprog call 500 1 2 k")
        assert "@: 500" in text.splitlines(), text
        text = do(sh, out, "hist(a) ug run uprog call 64 0 0 h")  # a = 0..63
        rows = dict(re.findall(r"^(\[[^]\n]*[])])\s+(\d+) \|", text, re.M))
        assert rows == {"[0]": "1", "[1]": "1", "[2, 4)": "2", "[4, 8)": "4", "[8, 16)": "8", "[16, 32)": "16",
                        "[32, 64)": "32"}, text  # fmt: skip
        assert kernel_hits(target) - before == 3000 + 500 + 64
        assert not target.uprobes.points  # every hit the kernel's: no gdbstub breakpoint
    finally:
        do(sh, out, "-:ug")
    assert not target.events and not target.uprobes.registered()


@pytest.mark.parametrize(
    "command",
    [
        "uprog call 20 1 1 a > /tmp/m1.out & uprog threads 2 5 > /tmp/m2.out & wait; cat /tmp/m1.out /tmp/m2.out",
        "uprog fork 3 5",
        "uprog exec 5",
        "uprog threads 4 10",
    ],
    ids=["two-at-once", "fork", "exec", "threads"],
)
def test_libc_malloc_entries_and_returns_equal_the_guest_s_own(
    target: qprobe.Target, counted: None, libc: tuple[str, int], command: str
) -> None:
    """libc's ``malloc``, an entry and a return probe counted in the guest, beside the guest's own ``p`` and
    ``r`` uprobe_events on the same offset: uprobe_profile's counts are qprobe's, hit for hit (only the
    dynamic programs call this libc: the shell and its tools are busybox, linked statically)."""
    path, offset = libc
    if target.run(f"test -w {TRACING}/uprobe_events").status != 0:
        pytest.skip("the guest kernel has no CONFIG_UPROBE_EVENTS")
    target.run(f"echo 'p:uprobes/qpm {path}:{offset:#x}' > {TRACING}/uprobe_events && "
               f"echo 'r:uprobes/qpmr {path}:{offset:#x}' >> {TRACING}/uprobe_events && "
               f"echo 1 > {TRACING}/events/uprobes/enable").check()  # fmt: skip
    up, rp = Uprobe(path, offset), Uretprobe(path, offset)
    try:
        target.register_uprobe(up)
        target.register_uprobe(rp)
        try:
            before = profile_hits(target)
            out = run(target, command)
            after = profile_hits(target)
        finally:
            target.unregister_uprobe(up)
            target.unregister_uprobe(rp)
    finally:
        target.run(f"echo 0 > {TRACING}/events/uprobes/enable; echo > {TRACING}/uprobe_events").check()
    assert "bad=1" not in out and calls_of(out) > 0, out
    entries, returns = after["qpm"] - before["qpm"], after["qpmr"] - before["qpmr"]
    assert entries > 0 and up.in_guest and rp.in_guest, (entries, out)
    assert (up.nhit, rp.nhit, rp.nreturns) == (entries, entries, returns), (up, rp, before, after)


@pytest.fixture(scope="module")
def libc() -> tuple[str, int]:
    """The guest's libc.so.6 (its path in the guest) and malloc's file offset, from the host's copy."""
    tree = guest_tree()
    found = sorted(p for p in tree.rglob("libc.so.6") if p.is_file() and not p.is_symlink())
    assert found, f"no libc.so.6 in {tree}"
    elf = lief.ELF.parse(str(found[0]))
    assert isinstance(elf, lief.ELF.Binary)
    (sym,) = [s for s in elf.dynamic_symbols if s.name == "malloc" and s.value]
    offset = elf.virtual_address_to_offset(sym.value)
    assert isinstance(offset, int)
    return "/" + found[0].relative_to(tree).as_posix(), offset


def profile_hits(target: qprobe.Target) -> dict[str, int]:
    """uprobe_profile's hit count of each of the guest's own uprobes, by event name."""
    out = target.run(f"cat {TRACING}/uprobe_profile").check().output
    return {line.split()[1]: int(line.split()[-1]) for line in out.splitlines() if len(line.split()) == 3}


LINE = re.compile(r"^\s*(?P<comm>.{1,16})-(?P<pid>\d+)\s+\[\d+\].*?\s(?P<event>gtlr?): (?P<body>.*)$")


@pytest.mark.parametrize("command", ["uprog call 200 -5 3 a", "uprog threads 3 40", "uprog fork 2 30"],
                         ids=["one", "threads", "fork"])  # fmt: skip
def test_trace_lines_recorded_in_the_guest_equal_the_guest_s_own(
    target: qprobe.Target, counted: None, off: dict[str, int], command: str
) -> None:
    """An entry and a return event whose arguments are registers (and ``$comm``) are recorded by the guest
    kernel's uprobes into the record rings, no VM stop: every line, per task and in order, is the line of the
    guest's own uprobe_events on the same instruction in the same run."""
    if target.run(f"test -w {TRACING}/uprobe_events").status != 0:
        pytest.skip("the guest kernel has no CONFIG_UPROBE_EVENTS")
    where = f"{PROG}:{off[PROG]:#x}"
    args, ret_args = "a=%di:s64 b=%si:s64 c=$comm", "ret=$retval:s64"
    enable_uprobe_events(target, f"p:uprobes/gtl {where} {args}", f"r:uprobes/gtlr {where} {ret_args}")
    entry = target.add_event(f"p:qtl {where} {args}")
    ret = target.add_event(f"r:qtlr {where} {ret_args}")
    try:
        for te in (entry, ret):
            assert te.probe is not None and te.probe.in_guest and te.probe.recorder is not None
        assert not target.uprobes.points  # no gdbstub breakpoint: no VM stop at a hit
        out = run(target, command)
    finally:
        target.remove_events([entry, ret])
        target.run(f"echo 0 > {TRACING}/events/uprobes/enable").check()
    trace = target.run(f"cat {TRACING}/trace").check().output
    target.run(f"echo > {TRACING}/uprobe_events").check()
    assert re.search(r"^rc=0$", out, re.M) and "bad=1" not in out, out
    kernel: dict[tuple[str, int], list[str]] = {}
    for m in filter(None, map(LINE.match, trace.splitlines())):
        ours = m["event"].replace("g", "q", 1)  # the guest's gtl is qprobe's qtl
        kernel.setdefault((ours, int(m["pid"])), []).append(f"{m['comm'].strip()} {m['body']}")
    mine: dict[tuple[str, int], list[str]] = {}
    for te in (entry, ret):
        for h in te.hits:
            mine.setdefault((h.event, h.pid), []).append(f"{h.comm} {h.body}")
    calls = calls_of(out)
    assert sum(map(len, mine.values())) == 2 * calls == entry.nhit + ret.nhit
    assert mine == kernel
    assert entry.lost == ret.lost == 0


def test_a_ring_handler_takes_a_uprobe_event_s_values_as_the_program_passed_them(
    target: qprobe.Target, counted: None, off: dict[str, int]
) -> None:
    """``ring_buffer`` on a uprobe event, entry and return: batches off the rings, each value the one the
    program passed to ``qpt_target(A+i, B, s)`` or got back (``A+i+B``), in its order, no VM stop."""
    where = f"{PROG}:{off[PROG]:#x}"
    got: list[tuple[int, int, str, int]] = []
    rets: list[int] = []

    def entries(samples: qprobe.events.Samples) -> None:
        got.extend((int(s.args["a"]), int(s.args["b"]), s.comm, s.pid) for s in samples)

    def returns(samples: qprobe.events.Samples) -> None:
        rets.extend(int(s.args["ret"]) for s in samples)

    entry = target.ring_buffer(f"p:qrb {where} a=%di:s64 b=%si:s64", entries)
    ret = target.ring_buffer(f"r:qrbr {where} ret=$retval:s64", returns)
    try:
        assert not target.uprobes.points  # no gdbstub breakpoint: no VM stop at a hit
        res = ok(run(target, "uprog call 300 -7 3 x"))
    finally:
        target.remove_events([entry, ret])
    pid = int(res["pid"])
    assert got == [(-7 + i, 3, "uprog", pid) for i in range(300)]
    assert rets == [-7 + i + 3 for i in range(300)]
    assert entry.nhit == ret.nhit == 300 and entry.lost == ret.lost == 0


def test_a_ring_handler_refuses_a_uprobe_event_that_reads_user_memory(
    target: qprobe.Target, counted: None, off: dict[str, int]
) -> None:
    """A string is read from the process's memory at the hit: only the host can, so no ring takes it."""
    with pytest.raises(InvalidProbe, match="read from memory at the hit") as info:
        target.ring_buffer(f"p:qrbs {PROG}:{off[PROG]:#x} s=+0(%dx):string", lambda samples: None)
    assert "\n" not in str(info.value) and "uprobes/qrbs" not in target.events
