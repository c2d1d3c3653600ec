"""Issue 4/6: kprobe_events definitions evaluated on the host, through the API and `qprobe trace`."""

from __future__ import annotations

import argparse
import collections
import functools
import io
import json
import signal
import subprocess
import sys
import threading
import time

import pytest

import qprobe
from qprobe.arch.x86_64.decode import decode_all
from qprobe.errors import FetchArgError
from qprobe.images import get_image
from qprobe.shell.core import Shell
from qprobe.shell.render import log2_bucket

from .conftest import IMAGE, workload_result
from .guest_oracle import readme_lacks

pytestmark = pytest.mark.vm


def test_fetch_args_registers_memory_strings_and_retval(target: qprobe.Target, guard: dict[int, bytes]) -> None:
    seek = target.add_event("p:myseek ksys_lseek fd=%di off=%si:s64 whence=%dx:u32 who=$comm")
    ret = target.add_event("r:retseek ksys_lseek ret=$retval:s64")
    opens = target.add_event("p:opens do_sys_openat2 path=+0(%si):ustring first=+u0(%si):u8 kern=+0(%si):u8 "
                             "str=+0(%si):string")  # fmt: skip
    try:
        res = workload_result(target.run("workload lseek 4; cat /etc/hostname").check().output)
    finally:
        for te in (seek, ret, opens):
            target.remove_event(te)
    fd = int(res["fd"])
    assert [h.args for h in seek.hits] == [
        {"fd": f"{fd:#x}", "off": str(i), "whence": "0", "who": '"workload"'} for i in range(1, 5)
    ]
    assert [h.args["ret"] for h in ret.hits] == ["1", "2", "3", "4"]
    assert all(h.pid == int(res["pid"]) and h.comm == "workload" for h in seek.hits)
    paths = [h.args["path"] for h in opens.hits]
    assert '"/etc/hostname"' in paths and '"/tmp/qprobe-lseek"' in paths
    hostname = next(h for h in opens.hits if h.args["path"] == '"/etc/hostname"')
    assert hostname.args["first"] == str(ord("/"))
    assert hostname.args["str"] == '"/etc/hostname"'  # :string on a user pointer, as 6.1 on x86 does
    # A kernel-memory fetch from a user pointer reads user memory, as trace_kprobe.c's probe_mem_read
    # does on x86 (non-overlapping address spaces).
    assert hostname.args["kern"] == str(ord("/"))
    assert hostname.line().lstrip().startswith("cat-") and ": opens: (do_sys_openat2+0x0/" in hostname.line()
    assert seek.listing() == "p:kprobes/myseek ksys_lseek fd=%di off=%si:s64 whence=%dx:u32 who=$comm"
    assert not target.events


def test_btf_parameter_names_and_entry_arguments_in_return_probes(target: qprobe.Target) -> None:
    """Where the kernel's README lists them: ``$argN`` named and typed by BTF, and fetched at the entry
    for a return probe (lseek(fd, i, SEEK_SET) for i = 1..4 returns i)."""
    lacks = readme_lacks(target, "btf_args", "return_args")
    if lacks is not None:
        pytest.skip(lacks)
    entry = target.add_event("p:bseek ksys_lseek $arg*")
    ret = target.add_event("r:rseek ksys_lseek $arg2 wh=$arg3 ret=$retval")
    try:
        res = workload_result(target.run("workload lseek 4").check().output)
    finally:
        target.remove_event(entry)
        target.remove_event(ret)
    assert entry.listing() == "p:kprobes/bseek ksys_lseek fd=fd offset=offset whence=whence"
    mine = [h for h in entry.hits if h.pid == int(res["pid"])]
    # unsigned int fd, off_t offset, unsigned int whence: u32, s64, u32 from BTF, printed in decimal.
    assert [h.args for h in mine] == [{"fd": res["fd"], "offset": str(i), "whence": "0"} for i in range(1, 5)]
    assert [h.args for h in ret.hits if h.pid == int(res["pid"])] == [
        {"offset": str(i), "wh": "0x0", "ret": str(i)} for i in range(1, 5)
    ]


# What reads a definition's text, as tests/unit/test_one_parse.py's ENTRIES (kept the same).
PARSE_ENTRIES = (
    ("qprobe.fetch.kstrto", "split_args"),
    ("qprobe.fetch.definition", "parse_definition"),
    ("qprobe.fetch.event", "parse_event"),
    ("qprobe.fetch.event", "parse_events"),
    ("qprobe.fetch.uevent", "parse_uprobe_event"),
    ("qprobe.fetch.uevent", "parse_uprobe_events"),
    ("qprobe.kernel.perfsyntax", "parse_perf_probe"),
    ("qprobe.kernel.usyntax", "user_form_definition"),
    ("qprobe.kernel.usyntax", "symbolic_user_form"),
    ("qprobe.kernel.usyntax", "perf_uprobe_definition"),
    ("qprobe.kernel.usyntax", "bpftrace_uprobe_definition"),
)


def test_a_definition_parsed_before_boot_is_armed_without_a_second_parse(
    target: qprobe.Target, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`qprobe trace` parses a definition in the host vmlinux's language before it boots; the running
    kernel's answers (its language, symbols and function entries) agree with that parse, so the same
    ProbeEvent is armed, never parsed again, and its hits are the guest's (lseek(fd, i) for i = 1..3).

    Every tokeniser and parser entry (those tests/unit/test_one_parse.py counts) is refused in every
    qprobe module that imported it, so a parse any module makes fails the test."""
    from qprobe.cli import host as cli_host
    from qprobe.fetch import ProbeEvent, parse_event

    language = cli_host._host_language(argparse.Namespace(image=IMAGE, vmlinux=None, attach=None, file=[]))
    assert language is not None
    host, _ = language
    assert host == target.dialect
    ev = parse_event("p:once ksys_lseek fd=%di off=%si:s64", dialect=host)
    assert isinstance(ev, ProbeEvent)

    def no_parse(*args: object, **kw: object) -> None:
        raise AssertionError(f"parsed again: {args[0]!r}")

    for module, name in PARSE_ENTRIES:
        __import__(module)
        original = getattr(sys.modules[module], name)
        for holder in [m for n, m in list(sys.modules.items()) if n.startswith("qprobe")]:
            if getattr(holder, name, None) is original:
                monkeypatch.setattr(holder, name, no_parse)
    te = target.add_event(ev)
    try:
        res = workload_result(target.run("workload lseek 3").check().output)
    finally:
        target.remove_event(te)
    assert te.definition is ev
    assert [h.args for h in te.hits] == [{"fd": f"{int(res['fd']):#x}", "off": str(i)} for i in (1, 2, 3)]


def test_bad_definitions_point_at_the_column_and_change_nothing(target: qprobe.Target) -> None:
    before = dict(target.journal.patches)
    for text, at in (("p:ev ksys_lseek x=%zz", "%zz"), ("r:ev ksys_lseek+8 x=$retval", "ksys_lseek+8"),
                     ("p:ev ksys_lseek $retval", "$retval")):  # fmt: skip
        with pytest.raises(FetchArgError) as e:
            target.add_event(text)
        assert e.value.column == text.index(at), (text, e.value)
    # The second byte of vfs_read's first long instruction, in the running kernel's text.
    sym = target.symbols.lookup("vfs_read")
    inside = next(i.addr + 1 - sym.addr for i in decode_all(target.read(sym.addr, sym.size), sym.addr) if i.length > 1)
    with pytest.raises(FetchArgError, match="Probe point is not an instruction boundary") as e:
        target.add_event(f"p:ev vfs_read+{inside}")  # the kernel's error_log text; qprobe's reason follows it
    assert e.value.column == 5 and isinstance(e.value.__cause__, qprobe.NotInstructionBoundary)
    assert target.journal.patches == before and not target.events


def _qprobe(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "qprobe.cli", *args], capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def test_cli_trace_json() -> None:
    out = _qprobe("trace", "--image", IMAGE, "--json", "--run", "workload getppid 7",
                  "p:gp __x64_sys_getppid", "r:gpr __x64_sys_getppid ret=$retval:s32")  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    hits, summary = rows[:-1], rows[-1]["summary"]
    # With --run, hits are the command's (bpftrace -c); "others" counts the other processes' hits.
    assert summary == {"gp": {"hits": 7, "nmissed": 0, "lost": 0, "others": 0},
                       "gpr": {"hits": 7, "nmissed": 0, "lost": 0, "others": 0}}  # fmt: skip
    assert {h["event"] for h in hits} == {"gp", "gpr"} and all(h["comm"] == "workload" for h in hits)
    assert len({h["args"]["ret"] for h in hits if h["event"] == "gpr"}) == 1  # the same parent every time
    # A return hit names its return site, in the caller, as the text line does; func is the probed function.
    # The entry is +0x0, or +0x4 past an endbr64 on IBT kernels: where the entry probe armed.
    returns = [h for h in hits if h["event"] == "gpr"]
    entry = {h["symbol"] for h in hits if h["event"] == "gp"}
    assert len(entry) == 1 and entry <= {"__x64_sys_getppid+0x0", "__x64_sys_getppid+0x4"}, entry
    assert all(h["func"] in entry and not h["symbol"].startswith("__x64_sys_getppid")
               for h in returns), returns[:1]  # fmt: skip
    assert "mode=getppid n=7" in out.stderr


def test_cli_trace_rejects_bad_syntax_before_booting() -> None:
    t0 = time.monotonic()
    out = _qprobe("trace", "p:bad vfs_read x=%zz", timeout=60)
    assert out.returncode == 2 and time.monotonic() - t0 < 30
    assert out.stderr.splitlines() == ["qprobe: error: Invalid register name", "p:bad vfs_read x=%zz",
                                       " " * 17 + "^"]  # fmt: skip


def test_cli_trace_filter_keeps_matching_hits_and_counts_the_rest() -> None:
    out = _qprobe("trace", "--image", IMAGE, "--json", "--filter", 'count == 128 && comm == "workload"',
                  "--run", "workload read 6 64; workload read 4 128", "p:rd ksys_read count=%dx:u64")  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    hits, summary = rows[:-1], rows[-1]["summary"]["rd"]
    assert len(hits) == 4 and all(h["args"]["count"] == 128 and h["comm"] == "workload" for h in hits)
    assert summary["hits"] == 4 and summary["filtered"] >= 6 and summary["nmissed"] == 0


def test_cli_trace_bad_filter_points_at_the_column_before_booting() -> None:
    out = _qprobe("trace", "--filter", "size > 3", "p:rd ksys_read count=%dx:u64", timeout=60)
    assert out.returncode == 2
    assert out.stderr.splitlines() == ["qprobe: error: Field not found", "size > 3", "^"]


def test_sigint_during_a_trace_removes_probes_prints_the_summary_and_fails() -> None:
    # Started with SIGINT ignored, as `qprobe trace ... &` from a script starts it: SIGINT still ends it.
    proc = subprocess.Popen([sys.executable, "-m", "qprobe.cli", "trace", "--image", IMAGE, "p:gp __x64_sys_getppid"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))  # fmt: skip
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 300
        line = ""
        while "Ctrl-C" not in line and time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line or proc.poll() is None, "qprobe trace exited before arming"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    assert out.splitlines()[-1].startswith("# gp: hits=") and "Traceback" not in err


def test_register_only_event_is_recorded_in_the_guest_as_the_stop_path_would(
    target: qprobe.Target, guard: dict[int, bytes]
) -> None:
    """Fetch args that are all registers: the detour snapshots them into a per-CPU ring, nobody is woken."""
    opt = target.kprobes.optimizer
    assert opt is not None
    seek = target.add_event("p:myseek ksys_lseek fd=%di off=%si:s64 whence=%dx:u32 who=$comm")
    try:
        point = target.kprobes.points[seek.probe.resolved]  # type: ignore[union-attr]
        assert point.opt is not None and point.opt.kind == "record"
        served = opt.served
        res = workload_result(target.run("workload lseek 300").check().output)
        deadline = time.monotonic() + 5
        while seek.nhit + seek.nmissed < 300 and time.monotonic() < deadline:  # drained every 20 ms
            time.sleep(0.02)
        assert opt.served == served and opt.records is not None and opt.records.ring_errors == 0
        in_guest = list(seek.hits)
        target.set_kprobes_optimization(False)  # the same event, now an int3 and a Python handler
        res2 = workload_result(target.run("workload lseek 3").check().output)
        stop_based = list(seek.hits)[len(in_guest) :]
    finally:
        target.set_kprobes_optimization(True)
        target.remove_event(seek)
    fd, fd2 = f"{int(res['fd']):#x}", f"{int(res2['fd']):#x}"
    expected = [{"fd": fd, "off": str(i), "whence": "0", "who": '"workload"'} for i in range(1, 301)]
    lost = seek.probe.nlost  # type: ignore[union-attr]
    # Every call accounted for: recorded, or counted as lost on a full ring (never silently).
    assert len(in_guest) + lost == 300 and seek.nmissed == lost and seek.lost == lost
    got = [h.args for h in in_guest]
    assert got == expected if lost == 0 else all(g in expected for g in got)
    assert [int(g["off"]) for g in got] == sorted(int(g["off"]) for g in got)  # delivered in order
    assert all(h.pid == int(res["pid"]) and h.comm == "workload" for h in in_guest)
    assert [h.ts for h in in_guest] == sorted(h.ts for h in in_guest)
    assert [h.args for h in stop_based] == [{**e, "fd": fd2} for e in expected[:3]]
    assert stop_based[0].body == in_guest[0].body.replace(fd, fd2)  # the same ftrace line either way


def test_a_guest_scribbling_over_the_rings_gives_counted_errors(target: qprobe.Target, guard: dict[int, bytes]) -> None:
    """Ring heads and entries are checked before use: garbage is counted and skipped, never trusted."""
    from qprobe.arch.x86_64.detour import ENTRY_SIZE, R_HEAD, RING_HEADER

    opt = target.kprobes.optimizer
    assert opt is not None and opt.ram is not None and opt.records is not None
    rings = opt.records
    seek = target.add_event("p:myseek ksys_lseek off=%si:s64")
    try:
        target.run("workload lseek 5").check()
        deadline = time.monotonic() + 5
        while seek.nhit < 5 and time.monotonic() < deadline:
            time.sleep(0.02)
        scratch, ncpus, entries = target.kprobes.scratch, len(target.machine.vcpus), rings.entries
        errors = rings.ring_errors
        # A head far past the tail (as if the guest wrote it): refused, counted, resynchronised.
        head0 = scratch.phys_of(rings.rings) + R_HEAD
        opt.ram.write_u64_phys(head0, opt.ram.read_u64_phys(head0) + 10 * entries)
        # An entry with a probe id nobody has and a CPU that is not its ring's, published on CPU 1's ring.
        head1 = head0 + RING_HEADER
        n = opt.ram.read_u64_phys(head1)
        entry = rings.rings + RING_HEADER * ncpus + (entries + n % entries) * ENTRY_SIZE
        opt.ram.write_phys(scratch.phys_of(entry), bytes(range(256)) * (ENTRY_SIZE // 256))
        opt.ram.write_u64_phys(head1, n + 1)
        deadline = time.monotonic() + 5
        while rings.ring_errors < errors + 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert rings.ring_errors == errors + 2
        target.run("workload lseek 3").check()  # and records flow on
        deadline = time.monotonic() + 5
        while seek.nhit < 8 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        target.remove_event(seek)
    assert [h.args["off"] for h in seek.hits] == ["1", "2", "3", "4", "5", "1", "2", "3"]


def test_a_register_filter_runs_in_the_detour(target: qprobe.Target, guard: dict[int, bytes]) -> None:
    """``count == 128`` on %dx: compiled into the detour; rejected hits never reach the ring, and are counted."""
    rd = target.add_event("p:rd ksys_read count=%dx:u64 fd=%di:s32", filter="count == 128 && fd >= 0")
    try:
        point = target.kprobes.points[rd.probe.resolved]  # type: ignore[union-attr]
        assert point.opt is not None and point.opt.kind == "filtered"
        target.run("workload read 6 64; workload read 4 128").check()
    finally:
        target.remove_event(rd)
    assert [h.args["count"] for h in rd.hits] == ["128"] * 4 and rd.nhit == 4
    assert rd.probe.nfiltered >= 6 and rd.filtered == rd.probe.nfiltered  # type: ignore[union-attr]
    assert rd.probe.nhit == 4 + rd.probe.nfiltered  # type: ignore[union-attr]


def _cold_part(image: str) -> str | None:
    """A GCC-split ``.cold`` text part of the image's kernel with a unique name (Debian's 6.12 has none)."""
    system_map = get_image(image, fetch=False).system_map
    assert system_map is not None
    names = collections.Counter(
        line.split()[2] for line in system_map.read_text().splitlines() if len(line.split()) == 3
    )
    return next((n for n, k in names.items() if n.endswith(".cold") and k == 1), None)


def test_cli_list_shows_the_probes_and_why_one_is_not_optimized() -> None:
    cold = _cold_part(IMAGE)
    events = ["p:seek ksys_lseek"] + ([f"p:cold {cold}"] if cold else [])
    out = _qprobe("list", "--image", IMAGE, *events, timeout=600)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert any(x.split()[1:3] == ["k", "ksys_lseek+0x0"] and x.endswith("[OPTIMIZED]") for x in lines), out.stdout
    if cold is not None:
        listed = next(x for x in lines if f"{cold}+0x0" in x)
        assert "[OPTIMIZED]" not in listed and "(not optimized: " in listed and "cold part" in listed


def test_keyed_counts_run_in_the_guest(target: qprobe.Target, guard: dict[int, bytes]) -> None:
    """Maps in guest RAM (per-CPU tables, nobody woken), exact per key: by a register argument, its hist()
    bucket, and by $comm, $pid, $cpu and $func with a value's sum, min and max."""
    te = target.add_event("p:seek ksys_lseek fd=%di:s32 off=%si:x64 whence=%dx:u32")
    try:
        assert te.count_in_guest(["off"])
        point = target.kprobes.points[te.probe.resolved]  # type: ignore[union-attr]
        assert point.opt is not None and point.opt.kind == "keyed"
        served, traps, recorded = target.kprobes.optimizer.served, target.kprobes.dispatcher.ntraps, len(te.hits)  # type: ignore[union-attr]
        target.run("workload lseek 300", timeout=300).check()
        assert target.kprobes.optimizer.served == served and target.kprobes.dispatcher.ntraps == traps  # type: ignore[union-attr]
        counts = te.stop_counting_in_guest()
        assert len(te.hits) == recorded  # counted, not recorded
        # The keys as the event formats them (x64: hex), each offset once.
        assert {k: s.count for k, s in counts.items()} == {(hex(i),): 1 for i in range(1, 301)}
        assert te.count_in_guest([], "off", hist=True)
        target.run("workload lseek 300", timeout=300).check()
        buckets = te.stop_counting_in_guest()
        assert {k: s.count for k, s in buckets.items()} == {
            (b,): n for b, n in collections.Counter(log2_bucket(i) for i in range(1, 301)).items()
        }
        # The task's name and pid, the CPU and the function, with the offsets' sum, min and max.
        assert te.count_in_guest(["$func", "$comm", "$pid", "$cpu"], "off")
        res = workload_result(target.run("workload lseek 200", timeout=300).check().output)
        folded = te.stop_counting_in_guest()
        mine = [(k, s) for k, s in folded.items() if k[1] == "workload"]
        assert {k[:3] for k, _ in mine} == {("ksys_lseek", "workload", int(res["pid"]))}, folded
        assert all(0 <= k[3] < len(target.machine.vcpus) for k, _ in mine)  # a row per vCPU it ran on
        slot = functools.reduce(lambda a, b: a.merge(b), (s for _, s in mine))
        assert (slot.count, slot.total, slot.min, slot.max) == (200, sum(range(1, 201)), 1, 200)
        # Back to recording: the next hits are records again.
        assert target.kprobes.points[te.probe.resolved].opt.kind == "record"  # type: ignore[union-attr]
        target.run("workload lseek 2").check()
        assert [h.args["off"] for h in list(te.hits)[-2:]] == ["0x1", "0x2"]
    finally:
        target.remove_event(te)
    assert te.probe.nhit == te.nhit == 802 + sum(s.count for k, s in folded.items() if k[1] != "workload")  # type: ignore[union-attr]
    assert te.probe.nmissed == 0  # type: ignore[union-attr]


def test_shell_count_is_exact_or_says_what_it_lost(target: qprobe.Target, guard: dict[int, bytes]) -> None:
    """`count EV by $comm` over a fast loop: the workload's calls are all counted, or the missing ones are printed."""
    out = io.StringIO()
    shell = Shell(target, out=out)
    shell.execute("p:seek ksys_lseek fd=%di")
    try:
        shell.execute("count seek by $comm run workload lseek 30000")
    finally:
        shell.execute("-:seek")
    text = out.getvalue()
    n = int(workload_result(text)["n"])
    counted = sum(int(line.rsplit(":", 1)[1]) for line in text.splitlines() if line.startswith("@[workload]"))
    lost = sum(int(line.split(":")[1]) for line in text.splitlines() if line.startswith("@lost:"))
    assert counted + lost >= n and counted <= n, text[-500:]


def test_wildcard_events_are_removed_in_one_vm_stop(target: qprobe.Target, monkeypatch: pytest.MonkeyPatch) -> None:
    """Removing N events costs what arming them did: one VM stop for every entry probe, not one each."""
    found = target.add_events("p:qpwild vfs_*")
    assert len(found.events) > 20, found.refused
    target.run("workload lseek 2").check()
    stops = 0
    call, me = target.machine.call, threading.current_thread()

    def counted(fn, timeout=60.0):  # type: ignore[no-untyped-def]
        nonlocal stops
        stops += threading.current_thread() is me  # the stop clock calibrates from a thread of its own
        return call(fn, timeout)

    monkeypatch.setattr(target.machine, "call", counted)
    target.remove_events(found.events)
    monkeypatch.undo()
    assert stops == 1, f"{stops} VM stops to remove {len(found.events)} events"
    assert not any(name.startswith("qpwild/") for name in target.events)
    assert all(not te.probe.registered for te in found.events if te.probe is not None)
    assert "vfs_" not in target.list_probes()
