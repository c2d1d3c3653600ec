"""The guest kernel's own uprobe_events as the oracle of qprobe's uprobe language, in one VM per image.

Every definition of the table (the ftrace selftests' uprobe cases, and ours
covering each fetch argument, type and error) is written to the guest's
``uprobe_events``; qprobe's parser, over the same guest files, must give the
same verdict, the same error_log text and caret, and the same listing.  Cases
are sequences of lines on an emptied ``uprobe_events``, so appending to an
event, deleting it and the registration checks are asked about too.
"""

from __future__ import annotations

import pytest

import qprobe
from qprobe.errors import FetchArgError
from qprobe.fetch import (
    FAULT,
    DeleteEvent,
    UprobeEvent,
    check_uprobe_append,
    format_uprobe_event,
    format_uprobe_hit,
    format_uprobe_profile,
    parse_uprobe_event,
    print_fmt,
)
from qprobe.fetch.dialect import Dialect
from qprobe.images import cache
from qprobe.images.guest import guest_sources
from qprobe.kernel.ufile import UserFiles
from qprobe.kernel.userelf import UserElf

from .guest_oracle import TRACE_LINE, TRACING, Verdict, guest_verdicts
from .one_tcg_thread import qprobe_boot_kwargs

pytestmark = [pytest.mark.vm, pytest.mark.qprobe_needs_config("UPROBE_EVENTS")]
__all__ = ["qprobe_boot_kwargs"]  # a fixture: the guest enables its own events

W = "/bin/workload"  # static, built by the image
SH = "/bin/sh"  # a symlink to /bin/busybox: the kernel follows it


def _workload_elf(target: qprobe.Target) -> UserElf:
    """The guest's /bin/workload, from the host's copy of the file the image was built with."""
    path = cache.subdir("guest") / guest_sources().key() / "workload"
    data = path.read_bytes()
    size = target.run(f"wc -c < {W}").check().output.strip()
    assert size == str(len(data)), f"the guest's {W} ({size} bytes) is not the host's {path} ({len(data)})"
    return UserElf(data, W)


def _workload_offsets(target: qprobe.Target) -> tuple[int, int]:
    """File offsets of the guest's /bin/workload's ``main`` and ``malloc``."""
    elf = _workload_elf(target)
    return elf.resolve("main"), elf.resolve("malloc")


def _cases(main: int, malloc: int) -> list[list[str]]:
    m, a = f"{W}:{main:#x}", f"{W}:{malloc:#x}"
    single = [
        # tools/testing/selftests/ftrace/test.d/dynevent/add_remove_uprobe.tc (its offset: the text mapping's)
        f"p:myevent {m}",
        # tools/testing/selftests/ftrace/test.d/kprobe/uprobe_syntax_errors.tc
        "p /non_exist_file:100",
        "p /sys:100",
        "p /bin/sh:10a",
        "p /bin/sh:10(1a)",
        "p /bin/sh:10(10",
        "p /bin/sh:10(10)a",
        "p /bin/sh:10 @+ab",
        "p /bin/sh:10 @symbol",
        # the probe point
        f"p {m}",
        f"r {m}",
        f"p {m}%return",
        f"p {m}(0x10)",
        f"p {m}%return(0x10)",
        f"r {a}(8)",
        f"p {m}(0)",
        f"p {m}(0x10)%return",
        f"p {m}%ret",
        f"p {m}%returnx",
        "p /bin/sh:0x",
        "p /bin/sh:99999999999999999999",
        "p /bin/sh:10",
        "p /bin/busybox:0x1000",
        "p /init:16",
        "p /:10",
        "p /bin:10",
        "p /dev/null:10",
        "p /bin/sh:abc",
        "p /bin/sh",
        "p bin:10",
        "p",
        "x /bin/sh:10",
        "p1 /bin/sh:10",
        "rfoo /bin/sh:10",
        # event names
        f"p:grp/ev {m}",
        f"p:grp/ {m}",
        f"p:grp.ev {m}",
        f"p:/ev {m}",
        f"p: {m}",
        f"p:g/1ev {m}",
        f"p:g-x/ev {m}",
        f"p:{'e' * 63} {m}",
        f"p:{'e' * 64} {m}",
        f"p:{'g' * 64}/ev {m}",
        # fetch arguments
        f"p {m} %ax %bx %cx %dx %si %di %bp %sp %r8 %r15 %ip %flags %orig_ax %cs %ss",
        f"p {m} %foo",
        f"p {m} $stack $stack0 $stack9 $stack100000",
        f"p {m} $stackx",
        f"p {m} $stack0x1",
        f"p {m} $comm $COMM c=$comm:string",
        f"p {m} $comm:u32",
        f"p {m} $comm:string[2]",
        f"p {m} +0($comm)",
        f"p {m} $retval",
        f"r {m} $retval $retval:s32",
        f"r {m} $retvalx",
        f"p {m} $arg1",
        f"p {m} $arg0",
        f"p {m} $argx",
        f"p {m} foo",
        f"p {m} _x",
        f"p {m} \\1 \\-1 \\+5 \\0x10:x8",
        f"p {m} \\abc",
        f'p {m} \\"abc" s=\\"x y":string',
        f'p {m} \\"abc',
        f'p {m} \\"abc":u32',
        f"p {m} @0x1000 @4096:u32 @0:string",
        f"p {m} @0xz",
        f"p {m} @+0 @+0x10:u64 @+-16:s8 @+16:string",
        f"p {m} @+",
        f"p {m} @++8",
        f"p {m} @main",
        f"p {m} +0(%sp) -8(%sp):s32 +u0(%sp) +0(+8(%sp)):string +u8(%sp):ustring",
        f"p {m} +0(%di):ustring +0(%di):string[2] +0(%sp):u8[4] +u0(%sp):u8[2]",
        f"p {m} +0%ax",
        f"p {m} +z(%ax)",
        f"p {m} +0(%ax",
        f"p {m} +0(+0(+0(+0(+0(+0(+0(+0(+0(+0(+0(+0(+0(+0(%ax))))))))))))))",
        f"p {m} +0(+0(+0(+0(+0(+0(+0(+0(+0(+0(+0(+0(+0(%ax)))))))))))))",
        # types
        f"p {m} %ax:u8 %ax:u16 %ax:u32 %ax:u64 %ax:s8 %ax:s16 %ax:s32 %ax:s64",
        f"p {m} %ax:x8 %ax:x16 %ax:x32 %ax:x64",
        f"p {m} %ax:char",
        f"p {m} %ax:symbol",
        f"p {m} %ax:symstr",
        f"p {m} +0(%sp):symstr",
        f"p {m} %ax:b4@2/32 +0(%sp):b1@7/8",
        f"p {m} %ax:b40@0/32",
        f"p {m} %ax:b4@2/31",
        f"p {m} %ax:foo",
        f"p {m} %ax:string",
        f"p {m} %ax:u8[2]",
        f"p {m} +0(%sp):u8[2",
        f"p {m} +0(%sp):u8[2]x",
        f"p {m} +0(%sp):u8[0]",
        f"p {m} +0(%sp):u8[65]",
        f"p {m} +0(%sp):u8[64]",
        f"p {m} %ax:%pd",
        # names
        f"p {m} name=%ax a=%ax b=%bx",
        f"p {m} {'a' * 32}=%ax",
        f"p {m} {'a' * 33}=%ax",
        f"p {m} =%ax",
        f"p {m} 1a=%ax",
        f"p {m} a=%ax a=%bx",
        f"p {m} common_pid=%ax",
        f"p {m} __probe_ip=%ax",
        f"p {m} a=",
        f"p {m} a=+0(+0(+0(+0(+0(+0(+0(+0(+0(+0(+0(+0(+0(+0(+0(%ax)))))))))))))))",
        # MAX_TRACE_ARGS: 6.1 parses the first 128 and ignores the rest, 6.12 refuses 129 (-E2BIG, not logged)
        f"p {m} " + " ".join(f"a{i}=%ax" for i in range(128)),
        f"p {m} " + " ".join(f"a{i}=%ax" for i in range(129)),
        # trace_parse_run_command: a line must fit WRITE_BUFSIZE with its newline and NUL
        f"p {m} a={'x' * 4100}",
        # deletions
        "-:",
        "-:uprobes/",
        "-:nonexist",
        "-",
    ]
    multi = [
        [f"p:e {m} a=%ax", f"p:e {a} a=%ax"],
        [f"p:e {m} a=%ax", f"p:e {m} a=%ax"],
        [f"p:e {m} a=%ax", f"p:e {m} a=%bx"],
        [f"p:e {m} a=%ax", f"r:e {a} a=%ax"],
        [f"p:e {m} a=%ax", f"p:e {a} b=%ax"],
        [f"p:e {m} a=%ax", f"p:e {a} a=%ax:u32"],
        [f"p:e {m} a=%ax", f"p:e {a} a=%ax b=%bx"],
        [f"p:e {m}", "-:e"],
        [f"p:g/e {m}", "-:g/e"],
        [f"p:g/e {m}", "-:g/"],
        [f"p:e {m} a=%ax", f"-:e {W}:0x{main:016x} a=%ax"],
        [f"p:e {m} a=%ax", f"-:e {W}:0x{main:016x} a=%bx"],
        [f"p:e {m}", f"p:f {a}", "-:e", "-:f"],
        [f"p:a {m}(0x10)", f"p:b {m}(0x20)"],
        [f"p:a {m}(0x10)", f"p:b {m}(0x10)"],
        [f"p:a {m}(0x10)", f"p:a {m}(0x20) x=%ax"],
    ]
    return [[line] for line in single] + multi


def _qprobe_verdicts(cases: list[list[str]], dialect: Dialect, kinds: dict[str, str]) -> list[list[Verdict]]:
    """qprobe's verdict on each line, with a list of registered probes per case as trace_uprobe.c keeps them."""
    out: list[list[Verdict]] = []
    for case in cases:
        probes: list[UprobeEvent] = []
        got: list[Verdict] = []
        for line in case:
            try:
                ev = parse_uprobe_event(line, dialect, file_check=lambda p: kinds[p])  # type: ignore[arg-type,return-value]
                if isinstance(ev, DeleteEvent):
                    gone = [p for p in probes if ev.matches(p)]  # type: ignore[arg-type]
                    if not gone:
                        raise FetchArgError("no such event (-ENOENT)", line, 0, logged=False)
                    probes = [p for p in probes if p not in gone]
                else:
                    # validate_ref_ctr_offset: one reference counter per (file, offset); -EINVAL, pr_warn only.
                    if any((p.path, p.offset) == (ev.path, ev.offset)
                           and (p.ref_ctr_offset or 0) != (ev.ref_ctr_offset or 0) for p in probes):  # fmt: skip
                        raise FetchArgError("reference counter offset mismatch", line, 0, logged=False)
                    check_uprobe_append(ev, [p for p in probes if (p.group, p.event) == (ev.group, ev.event)], dialect)
                    probes.append(ev)
            except FetchArgError as exc:
                got.append(Verdict(False, exc.reason if exc.logged else "", exc.column if exc.logged else -1))
            else:
                got.append(Verdict(True, listing=tuple(format_uprobe_event(p) for p in probes)))
        out.append(got)
    return out


def _file_kinds(target: qprobe.Target, cases: list[list[str]]) -> dict[str, str]:
    """What kern_path and d_is_reg say of every path in the table: qprobe's reading of the guest's dentry cache.

    Checked against the guest's own shell (``test -f`` follows symbolic links
    as kern_path's LOOKUP_FOLLOW does), so that a wrong answer shows as such.
    """
    paths = sorted({w.rsplit(":", 1)[0] for case in cases for line in case for w in line.split()[1:2] if "/" in w})
    files = UserFiles(target.kernel.prog)
    kinds = {p: files.file_kind(p) for p in paths}
    script = "; ".join(
        f"if [ -f '{p}' ]; then echo regular; elif [ -e '{p}' ]; then echo other; else echo missing; fi" for p in paths
    )
    assert dict(zip(paths, target.run(script).check().output.split(), strict=True)) == kinds
    return kinds


def test_verdicts_and_listings_equal_the_guest_kernels(target: qprobe.Target) -> None:
    main, malloc = _workload_offsets(target)
    cases = _cases(main, malloc)
    kernel = guest_verdicts(target, cases, events="uprobe_events", subsystem="trace_uprobe")
    kinds = _file_kinds(target, cases)  # after the kernel's own lookups, as qprobe's parse comes after them
    ours = _qprobe_verdicts(cases, target.dialect, kinds)
    differ = []
    for case, k_case, q_case in zip(cases, kernel, ours, strict=True):
        for line, k, q in zip(case, k_case, q_case, strict=True):
            same = k.ok == q.ok and (k.ok or (k.message, k.column) == (q.message, q.column))
            if not same or (k.ok and k.listing != q.listing):
                differ.append(f"{line!r}: kernel {k} {k.listing}, qprobe {q} {q.listing}")
    total = sum(map(len, cases))
    assert not differ, f"{len(differ)} of {total} definitions differ:\n" + "\n".join(differ)


def test_listing_trace_lines_profile_and_format_equal_the_guest_kernels(target: qprobe.Target) -> None:
    """One entry and one return probe on the static workload's ``main``, hit once by ``workload getppid 3``.

    Where the probe is (main's address: the program is not position-independent)
    and what it fetches (argc, comm, constants) are known without qprobe's engine,
    so each of the guest's texts is compared whole with qprobe's.  The constant
    string is a fault in a uprobe (strncpy_from_user of a kernel address).
    """
    elf = _workload_elf(target)
    assert not elf.is_pie
    main = elf.functions("main")[0]
    entry = parse_uprobe_event(f'p:uprobes/umain {W}:{main.offset:#x} argc=%di:u32 c=$comm s=\\"lit" k=\\5:s8')
    ret = parse_uprobe_event(f"r:uprobes/uret {W}:{main.offset:#x} c=$comm")
    assert isinstance(entry, UprobeEvent) and isinstance(ret, UprobeEvent)
    events = f"{TRACING}/uprobe_events"
    target.run(f"echo > {events} && echo > {TRACING}/trace").check()
    try:
        for ev in (entry, ret):
            target.run(f"echo '{ev.text}' >> {events} && echo 1 > {TRACING}/events/uprobes/{ev.event}/enable").check()
        target.run(f"{W} getppid 3").check()
        target.run(f"echo 0 > {TRACING}/events/uprobes/enable").check()
        listing = target.run(f"cat {events}").check().output.splitlines()
        profile = target.run(f"cat {TRACING}/uprobe_profile").check().output.splitlines()
        trace = target.run(f"cat {TRACING}/trace").check().output.splitlines()
        fmts = [target.run(f"grep '^print fmt: ' {TRACING}/events/uprobes/{ev.event}/format").check().output.strip()
                for ev in (entry, ret)]  # fmt: skip
    finally:
        target.run(f"echo 0 > {TRACING}/events/uprobes/enable; echo > {events}")
    assert listing == [format_uprobe_event(entry), format_uprobe_event(ret)]
    assert profile == [format_uprobe_profile(entry, 1), format_uprobe_profile(ret, 1)]
    assert fmts == [f"print fmt: {print_fmt(entry)}", f"print fmt: {print_fmt(ret)}"]
    hits = {m["event"]: m["body"] for m in map(TRACE_LINE.match, trace) if m and m["comm"].strip() == "workload"}
    assert hits["umain"] == format_uprobe_hit(entry, [3, "workload", FAULT, 5], main.vaddr)
    back = hits["uret"].split(" ", 1)[0].removeprefix("(")  # where main returned to: its caller's, not known here
    assert hits["uret"] == format_uprobe_hit(ret, ["workload"], int(back, 16), main.vaddr)
