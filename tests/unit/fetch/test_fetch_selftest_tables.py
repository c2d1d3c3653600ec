"""Accept/reject cases of the other 6.1 kprobe selftests (test.d/kprobe/*.tc).

Where a selftest also looks at ``cat kprobe_events`` or the trace, the
listing or the evaluated, formatted hit is checked against the same grep.
$FUNCTION_FORK is kernel_clone in 6.1; architecture choices are x86_64's.
"""

from __future__ import annotations

import re

import pytest
from fetch_fakes import KALLSYMS, X86, FakeContext, lookup, symbol_exists, u64

from qprobe.errors import FetchArgError
from qprobe.fetch import DeleteEvent, ProbeEvent, check_append, format_event, format_hit, parse_event


def parse(text: str) -> ProbeEvent:
    ev = parse_event(text, symbol_exists=symbol_exists, dialect=X86)
    assert isinstance(ev, ProbeEvent)
    return ev


def rejects(text: str) -> bool:
    try:
        parse_event(text, symbol_exists=symbol_exists, dialect=X86)
    except FetchArgError:
        return True
    return False


# --- kprobe_args_syntax.tc (x86_64: GOODREG=%ax BADREG=%ex, GOODSYM=_sdata) ---
SDATA = KALLSYMS["_sdata"][0]
GOOD_ARGS = [
    "%ax",
    "@_sdata", f"@0x{SDATA:x}", "@_sdata+10", "@_sdata-10",
    "$stack", "$stack0", "$stack1",
    "$comm",
    "+0(%ax)", "-0(%ax)", "+10($stack)", "+0($stack1)", "+10(@_sdata-10)", "+0(+10(+20($stack)))",
    "varname=%ax",
    "%ax:x16",
    "$comm:string", "+0($stack):string",
]  # fmt: skip
BAD_ARGS = [
    "%ex",
    "@", "@deaqswdefr", "@_sdata*10", "@_sdata/10", "@_sdata%10", "@_sdata&10", "@_sdata|10",
    "$stackp", "$stack0+10", "$stack1-10",
    "+(%ax)", "(%ax+10)", "-(%ax)", "(%ax)", "+10($comm)",
    "varname=varname2=%ax",
    "%ax::x16", "%ax:y16", "x16:%ax",
    "$comm:x64", "$stack:string", "%ax:string",
]  # fmt: skip
# The selftest lists "+0(%ax)+10" as bad, but its "! echo" never fails the
# test under "set -e", and 6.1's parse_probe_arg takes the *last* ')' and
# ignores what follows, so the 6.1 kernel accepts it.  qprobe follows 6.1.
ACCEPTED_BY_61_DESPITE_SELFTEST = ["+0(%ax)+10"]


@pytest.mark.parametrize("arg", GOOD_ARGS)
def test_args_syntax_good(arg: str) -> None:
    parse(f"p vfs_read {arg}")


@pytest.mark.parametrize("arg", BAD_ARGS)
def test_args_syntax_bad(arg: str) -> None:
    assert rejects(f"p vfs_read {arg}")


@pytest.mark.parametrize("arg", ACCEPTED_BY_61_DESPITE_SELFTEST)
def test_args_syntax_61_quirk(arg: str) -> None:
    ev = parse(f"p vfs_read {arg}")
    assert format_event(ev) == f"p:kprobes/p_vfs_read_0 vfs_read arg1={arg}"


def test_args_syntax_retval() -> None:
    parse("r vfs_read $retval")
    assert rejects("p vfs_read $retval")


# --- kretprobe_maxactive.tc ----------------------------------------------------
@pytest.mark.parametrize(
    ("text", "ok", "listing"),
    [
        ("a:myprobeaccept inet_csk_accept", False, None),
        ("r1000000:myprobeaccept inet_csk_accept", False, None),
        ("r10fuzz:myprobeaccept inet_csk_accept", False, None),
        ("r:myprobeaccept inet_csk_accept", True, "r:kprobes/myprobeaccept inet_csk_accept"),
        ("r10:myprobeaccept inet_csk_accept", True, "r10:kprobes/myprobeaccept inet_csk_accept"),
        ("r inet_csk_accept", True, "r:kprobes/r_inet_csk_accept_0 inet_csk_accept"),
        ("r10 inet_csk_accept", True, "r10:kprobes/r_inet_csk_accept_0 inet_csk_accept"),
    ],
)
def test_kretprobe_maxactive(text: str, ok: bool, listing: str | None) -> None:
    if not ok:
        assert rejects(text)
        return
    assert format_event(parse(text)) == listing


# --- probepoint.tc (prev symbol at -0x40, next at +0x40) -------------------------
def test_probepoint() -> None:
    target = KALLSYMS["tracefs_create_dir"][0]
    prev = KALLSYMS["tracefs_remove"][0] - target  # negative
    nxt = KALLSYMS["tracefs_create_file"][0] - target
    overflow = f"+0x{prev & (1 << 64) - 1:x}"  # printf "0x%x" of a negative
    parse("p:testprobe tracefs_create_dir")
    assert parse(f"p:testprobe 0x{target:x}").addr == target
    assert parse(f"p:testprobe tracefs_create_dir+{nxt}").offset == nxt
    assert rejects(f"p:testprobe tracefs_create_dir{prev}")
    assert rejects(f"p:testprobe tracefs_create_dir{overflow}")


# --- kprobe_eventname.tc, kprobe_module.tc --------------------------------------
@pytest.mark.parametrize(
    ("text", "group", "event"),
    [
        ("p vfs_read", "kprobes", "p_vfs_read_0"),
        ("p:event1 vfs_read", "kprobes", "event1"),
        ("p:kprobes2/event2 vfs_read", "kprobes2", "event2"),
        ("p cleanup_module.isra.0", "kprobes", "p_cleanup_module_isra_0_0"),
        ("p trace_printk:trace_printk_irq_work", "kprobes", "p_trace_printk_trace_printk_irq_work_0"),
        ("p:event1 trace_printk:trace_printk_irq_work", "kprobes", "event1"),
        ("p:kprobes1/event1 trace_printk:trace_printk_irq_work", "kprobes1", "event1"),
    ],
)
def test_eventname(text: str, group: str, event: str) -> None:
    ev = parse(text)
    assert (ev.group, ev.event) == (group, event)


# --- kprobe_args.tc, kprobe_args_comm.tc, kretprobe_args.tc ---------------------
def _ctx() -> FakeContext:
    sp = 0xFFFF_C900_0001_3F00
    return FakeContext(
        regs={"sp": sp, "ip": KALLSYMS["kernel_clone"][0]},
        memory={sp: u64(0xFFFF_FFFF_8100_1234) + u64(0x1122_3344) + bytes(48)},
        ret=4242,
    )


def test_kprobe_args() -> None:
    ev = parse("p:testprobe kernel_clone $stack $stack0 +0($stack)")
    assert "arg1=$stack arg2=$stack0 arg3=+0($stack)" in format_event(ev)
    line = format_hit(ev, ev.evaluate(_ctx()), KALLSYMS["kernel_clone"][0], lookup=lookup)
    assert "kernel_clone" in line
    assert re.search(r"arg1=0x[0-9a-f]* arg2=0x[0-9a-f]* arg3=0x[0-9a-f]*$", line)


def test_kprobe_args_comm() -> None:
    ev = parse("p:testprobe kernel_clone comm=$comm ")
    assert "comm=$comm" in format_event(ev)
    assert re.search(r'comm=".*"', format_hit(ev, ev.evaluate(_ctx()), "kernel_clone+0x0/0x400"))


def test_kretprobe_args() -> None:
    ev = parse("r:testprobe2 kernel_clone $retval")
    assert "arg1=$retval" in format_event(ev)
    caller = KALLSYMS["kernel_clone"][0] - 0x10000  # somewhere without a symbol
    line = format_hit(ev, ev.evaluate(_ctx()), caller, KALLSYMS["kernel_clone"][0], lookup=lookup)
    assert "<- kernel_clone" in line
    assert line.endswith(" arg1=0x1092")


def test_kretprobe_return_suffix() -> None:
    r1 = format_event(parse("r:myprobeaccept vfs_read"))
    r2 = format_event(parse("p:myprobeaccept vfs_read%return"))
    assert r1 == r2 == "r:kprobes/myprobeaccept vfs_read"


# --- kprobe_args_type.tc ------------------------------------------------------------
@pytest.mark.parametrize("width", [64, 32, 16, 8])
@pytest.mark.parametrize("word", [0x0123_4567_89AB_CDEF, 0xFEDC_BA98_7654_3210, 0xFF, 0x80])
def test_args_type(width: int, word: int) -> None:
    ev = parse(f"p:testprobe kernel_clone $stack0:s{width} $stack0:u{width} $stack0:x{width} $stack0:b4@4/{width}")
    ctx = _ctx()
    ctx.memory = {ctx.regs["sp"]: u64(word)}
    line = format_hit(ev, ev.evaluate(ctx), "kernel_clone+0x0/0x400")
    m = re.search(r".* arg1=(.*) arg2=(.*) arg3=(.*) arg4=(.*)", line)
    assert m
    s, u, x, b = m.groups()
    # check_types() of the selftest, in Python.
    cw = width // 4
    x1 = f"{int(s) & (1 << 64) - 1:x}"[-cw:]
    x2 = f"{int(u):x}"
    x3 = f"{int(x, 16):x}"
    assert x1 == x2 == x3
    assert f"0x{x3}" == x
    assert f"{int(b):x}" == f"{int(x3, 16):03x}"[-2:-1]


# --- kprobe_args_string.tc ----------------------------------------------------------
def test_args_string() -> None:
    ev = parse("p:testprobe tracefs_create_dir arg1=+0(%di):string arg2=+0(%di):string")
    ctx = FakeContext(regs={"di": 0xFFFF_8880_0000_1000}, memory={0xFFFF_8880_0000_1000: b"test\0junk"})
    assert format_hit(ev, ev.evaluate(ctx), "x").endswith(' arg1="test" arg2="test"')


# --- kprobe_args_symbol.tc ----------------------------------------------------------
BANNER = b"%s version %s (buildd@lcy02) (gcc (Ubuntu 12.2.0) 12.2.0, GNU ld 2.39) %s\n\0"


@pytest.mark.parametrize(
    ("sign", "expect"),
    [
        ("u", ["7598542776403260197", "1981838117", "29477", "37"]),
        ("s", ["7598542776403260197", "1981838117", "29477", "37"]),
        ("x", ["0x6973726576207325", "0x76207325", "0x7325", "0x25"]),
    ],
)
def test_args_symbol(sign: str, expect: list[str]) -> None:
    types = [f"@linux_proc_banner:{sign}{w}" for w in (64, 32, 16, 8)]
    ev = parse(f"p:testprobe_{sign} kernel_clone " + " ".join(f"arg{i + 1}={t}" for i, t in enumerate(types)))
    ctx = FakeContext(memory={KALLSYMS["linux_proc_banner"][0]: BANNER})
    got = [a.format_value(v) for a, v in zip(ev.args, ev.evaluate(ctx), strict=True)]
    assert got == expect


def test_args_symbol_bitfield_and_string() -> None:
    ctx = FakeContext(memory={KALLSYMS["linux_proc_banner"][0]: BANNER})
    bf = parse("p:testprobe_bf kernel_clone arg1=@linux_proc_banner:b8@4/32")
    assert bf.args[0].format(bf.evaluate(ctx)[0]) == "arg1=50"  # (0x76207325 >> 4) & 0xff
    st = parse("p:testprobe_str kernel_clone arg1=@linux_proc_banner:string")
    assert st.args[0].format(st.evaluate(ctx)[0]) == 'arg1="' + BANNER[:-1].decode() + '"'


# --- kprobe_args_user.tc ------------------------------------------------------------
def test_args_user() -> None:
    text = "p:myevent do_sys_open path=+0($arg2):ustring path2=+u0($arg2):string"
    ev = parse(text)
    assert "path=+0($arg2):ustring path2=+u0($arg2):string" in format_event(ev)
    user = FakeContext(regs={"si": 0x7FFD_0000_1000}, user_memory={0x7FFD_0000_1000: b"/dev/null\0"})
    assert format_hit(ev, ev.evaluate(user), "x").endswith(' path="/dev/null" path2="/dev/null"')
    # The same syntax on kernel memory faults (vfs_symlink's 3rd argument).
    ev = parse("p:myevent vfs_symlink path=+0($arg3):ustring path2=+u0($arg3):string")
    kern = FakeContext(regs={"dx": 0xFFFF_8880_0000_2000}, memory={0xFFFF_8880_0000_2000: b"foo\0"})
    assert format_hit(ev, ev.evaluate(kern), "x").endswith(" path=(fault) path2=(fault)")


# --- kprobe_multiprobe.tc, add_and_remove.tc ------------------------------------------
def test_multiprobe() -> None:
    def1 = parse("p:kprobes/testevent kernel_clone")
    def2 = parse("p:kprobes/testevent do_exit")
    check_append(def2, [def1])
    delete_all = parse_event("-:kprobes/testevent")
    assert isinstance(delete_all, DeleteEvent)
    assert delete_all.matches(def1) and delete_all.matches(def2)
    delete_one = parse_event("-:kprobes/testevent kernel_clone")
    assert isinstance(delete_one, DeleteEvent)
    assert delete_one.matches(def1) and not delete_one.matches(def2)
    with pytest.raises(FetchArgError):
        check_append(parse("p:kprobes/testevent kernel_clone $stack"), [def1, def2])


def test_add_and_remove() -> None:
    ev = parse("p:myevent kernel_clone")
    assert format_event(ev) == "p:kprobes/myevent kernel_clone"
    delete = parse_event("-:myevent")
    assert isinstance(delete, DeleteEvent) and delete.matches(ev)


# --- multiple_kprobes.tc: "p SYM+5" on x86 (after the fentry call) ---------------------
def test_multiple_kprobes_offset() -> None:
    ev = parse("p vfs_read+5")
    assert (ev.event, format_event(ev)) == ("p_vfs_read_5", "p:kprobes/p_vfs_read_5 vfs_read+5")
