"""Evaluation and printing of fetch arguments against a fake guest."""

from __future__ import annotations

import pytest
from fetch_fakes import KALLSYMS, FakeContext, lookup, symbol_exists, u64

from qprobe.arch.x86_64.paging import X86PageTables
from qprobe.fetch import (
    FAULT,
    Bitfield,
    Deref,
    FetchContext,
    ProbeEvent,
    Reg,
    SymbolAddr,
    SymbolValue,
    format_event,
    format_hit,
    parse_event,
    print_fmt,
)

KBUF = 0xFFFF_8880_0010_0000
UBUF = 0x0000_7FFD_0000_0000
SP = 0xFFFF_C900_0001_3F00


def parse(text: str) -> ProbeEvent:
    ev = parse_event(text, symbol_exists=symbol_exists)
    assert isinstance(ev, ProbeEvent)
    return ev


def hit(text: str, ctx: FetchContext) -> list[str]:
    """``name=value`` of every argument, evaluated in ``ctx``."""
    ev = parse(text)
    return [a.format(v) for a, v in zip(ev.args, ev.evaluate(ctx), strict=True)]


def test_fake_context_is_a_fetch_context() -> None:
    assert isinstance(FakeContext(), FetchContext)


@pytest.mark.parametrize(
    ("arg", "ax", "out"),
    [
        ("%ax", 0x10, "arg1=0x10"),  # default x64, no zero padding
        ("%ax:x8", 0x105, "arg1=0x5"),
        ("%ax:x32", 0xFFFF_FFFF_1234_5678, "arg1=0x12345678"),
        ("%ax:u8", 0x1FF, "arg1=255"),
        ("%ax:s8", 0x1FF, "arg1=-1"),
        ("%ax:s16", 0x8000, "arg1=-32768"),
        ("%ax:s32", 0x7FFF_FFFF, "arg1=2147483647"),
        ("%ax:u64", (1 << 64) - 1, "arg1=18446744073709551615"),
        ("%ax:s64", (1 << 64) - 2, "arg1=-2"),
        ("%ax:b4@4/8", 0xAB, "arg1=10"),
        ("%ax:b1@0/8", 0xAB, "arg1=1"),
        ("%ax:b8@0/8", 0x1AB, "arg1=171"),
        ("%ax:b4@60/64", 0xC000_0000_0000_0000, "arg1=12"),
        ("%ax:b0x10@0x10/0x20", 0x1234_5678, "arg1=4660"),
        ("x=%ax:symbol", KALLSYMS["vfs_read"][0] + 0x10, "x=vfs_read+0x10/0x1a0"),
        ("x=%ax:symbol", 0xFFFF_FFFF_9000_0000, "x=0xffffffff90000000"),
        ("x=%ax:symbol", KALLSYMS["trace_printk:trace_printk_irq_work"][0],
         "x=trace_printk_irq_work+0x0/0x60 [trace_printk]"),
    ],
)  # fmt: skip
def test_register_types(arg: str, ax: int, out: str) -> None:
    assert hit(f"p vfs_read {arg}", FakeContext(regs={"ax": ax})) == [out]


def test_symbol_value_keeps_the_address() -> None:
    ev = parse("p vfs_read %ax:symbol")
    value = ev.evaluate(FakeContext(regs={"ax": KALLSYMS["vfs_read"][0]}))[0]
    assert isinstance(value, SymbolValue)
    assert value == KALLSYMS["vfs_read"][0] and value.text == "vfs_read+0x0/0x1a0"


def test_memory_and_nesting() -> None:
    mem = {KBUF: u64(KBUF + 0x20) + u64(0xDEAD) + bytes(16) + u64(0) + u64(0xBEEF_CAFE)}
    ctx = FakeContext(regs={"di": KBUF + 8}, memory=mem)
    assert hit("p vfs_read +0(%di) -8(%di):x64 +8(+-8(%di)):u32 +0x100000000(%di)", ctx) == [
        "arg1=0xdead",
        "arg2=0xffff888000100020",
        "arg3=3203386110",
        "arg4=0xdead",  # the offset is a C int: 0x100000000 becomes 0
    ]
    assert parse("p vfs_read +8(+0(%di)):u32").args[0].expr == Deref(Deref(Reg("di"), 0), 8)


def test_arrays() -> None:
    mem = {KBUF: bytes([1, 0, 2, 0, 3, 0])}
    ctx = FakeContext(regs={"di": KBUF}, memory=mem)
    assert hit("p vfs_read +0(%di):u16[3] +0(%di):x8[2] +4(%di):u16[2]", ctx) == [
        "arg1={1,2,3}",
        "arg2={0x1,0x0}",
        "arg3={3,(fault)}",
    ]


def test_string_array_is_an_array_of_pointers() -> None:
    s1, s2 = KBUF + 0x100, KBUF + 0x200
    mem = {KBUF: u64(s1) + u64(s2), s1: b"first\0", s2: b"second\0"}
    ctx = FakeContext(regs={"di": KBUF}, memory=mem)
    # string[1] is not string: the array reads pointers, the scalar reads bytes.
    assert hit("p vfs_read +0(%di):string[2] +0(%di):string[1] +0(+0(%di)):string", ctx) == [
        'arg1={"first","second"}',
        'arg2={"first"}',
        'arg3="first"',
    ]
    assert hit("p vfs_read +8(%di):string", ctx) == ['arg1=""']  # the pointer's low byte is 0


def test_strings() -> None:
    mem = {KBUF: b"hello\0", KBUF + 0x1000: b"a" * 5000 + b"\0"}
    ctx = FakeContext(regs={"di": KBUF, "si": KBUF + 0x1000, "dx": KBUF + 0x10_0000}, memory=mem, task_comm="sh")
    out = hit('p vfs_read +0(%di):string +2(%di):string +0(%dx):string $comm \\"lit" \\"" +0(%si):string', ctx)
    assert out[:6] == ['arg1="hello"', 'arg2="llo"', "arg3=(fault)", 'arg4="sh"', 'arg5="lit"', 'arg6=""']
    assert out[6] == 'arg7="' + "a" * 4095 + '"'  # MAX_STRING_SIZE with its NUL


def test_string_ending_at_the_end_of_a_mapping() -> None:
    end = KBUF + 0x1000
    ctx = FakeContext(regs={"di": end - 4}, memory={KBUF: bytes(0xFFC) + b"abc\0"})
    assert hit("p vfs_read +0(%di):string", ctx) == ['arg1="abc"']
    ctx = FakeContext(regs={"di": end - 4}, memory={KBUF: bytes(0xFFC) + b"abcd"})
    assert hit("p vfs_read +0(%di):string", ctx) == ["arg1=(fault)"]


def test_kernel_and_user_address_spaces() -> None:
    ctx = FakeContext(
        regs={"di": UBUF, "si": KBUF},
        memory={KBUF: b"kern\0\0\0\0", UBUF: b"user\0\0\0\0"},  # a bogus fake: the evaluator refuses
        user_memory={UBUF: b"user\0\0\0\0", KBUF: b"kern\0\0\0\0"},
    )
    assert hit(
        "p vfs_read +0(%di):string +u0(%di):string +0(%di):ustring +0(%si):ustring +0(%di):u8 +u0(%di):u8",
        ctx,
    ) == ['arg1="user"', 'arg2="user"', 'arg3="user"', "arg4=(fault)", "arg5=117", "arg6=117"]
    # arg1, arg5: on x86 (non-overlapping address spaces) trace_kprobe.c's fetch_store_string and
    # probe_mem_read read an address below TASK_SIZE from user memory; arg4: a user read of a kernel
    # address faults (access_ok).


def test_an_empty_user_string_is_recorded_as_a_fault() -> None:
    """strncpy_from_user_nofault returns 0 for "" (strncpy_from_kernel_nofault 1): the kernel prints (fault)."""
    ctx = FakeContext(regs={"di": UBUF, "si": KBUF}, memory={KBUF: b"\0"}, user_memory={UBUF: b"\0x\0"})
    assert hit("p vfs_read +0(%di):ustring +0(%di):string +u0(%di):string +1(%di):ustring +0(%si):string", ctx) == [
        "arg1=(fault)", "arg2=(fault)", "arg3=(fault)", 'arg4="x"', 'arg5=""'
    ]  # fmt: skip


def test_five_level_paging_kernel_addresses() -> None:
    """With LA57 the direct map and slab start at 0xff11..., stacks at 0xff66...: kernel memory, readable."""
    slab, stack = 0xFF33_0FED_81A1_8C00, 0xFF66_0000_0001_3F00
    five = FakeContext(regs={"di": slab, "si": stack}, memory={slab: u64(0x1122), stack: u64(7)},
                       task_size_max=X86PageTables(5).task_size_max())  # fmt: skip
    assert hit("p vfs_read +0(%di):x64 +0(%si):u64", five) == ["arg1=0x1122", "arg2=7"]
    # The same addresses are non-canonical with 4-level paging: the kernel refuses them.
    four = FakeContext(regs={"di": slab, "si": stack}, memory={slab: u64(0x1122), stack: u64(7)})
    assert hit("p vfs_read +0(%di):x64 +0(%si):u64", four) == ["arg1=(fault)", "arg2=(fault)"]
    # A 5-level user address (above 4-level's TASK_SIZE_MAX) is user memory there.
    high_user = 0x0000_7FFF_FFFF_F000 + 0x1000_0000
    five_user = FakeContext(
        regs={"di": high_user}, user_memory={high_user: b"hi\0"}, task_size_max=X86PageTables(5).task_size_max()
    )
    assert hit("p vfs_read +0(%di):string +0(%di):u8", five_user) == ['arg1="hi"', "arg2=104"]


def test_immediates() -> None:
    assert hit("p vfs_read \\123 \\-1 \\-1:s64 \\+0x10:u8 \\0777:u16", FakeContext()) == [
        "arg1=0x7b",
        "arg2=0xffffffffffffffff",
        "arg3=-1",
        "arg4=16",
        "arg5=511",
    ]


def test_vars_and_args() -> None:
    stack = u64(0xFFFF_FFFF_8100_0042) + u64(7) + u64(8)
    regs = {"sp": SP, "di": 1, "si": 2, "dx": 3, "cx": 4, "r8": 5, "r9": 6, "orig_ax": 0x27, "flags": 0x246}
    ctx = FakeContext(regs=regs, memory={SP: stack})
    assert hit("p vfs_read $arg1:u8 $arg6:u8 $arg7:u8 $arg8:u8 $stack $stack1:u8 %orig_ax %flags", ctx) == [
        "arg1=1",
        "arg2=6",
        "arg3=7",
        "arg4=8",
        f"arg5=0x{SP:x}",
        "arg6=7",
        "arg7=0x27",
        "arg8=0x246",
    ]


def test_retval() -> None:
    assert hit("r vfs_read $retval:s32 ret=$retval", FakeContext(ret=-14 & (1 << 64) - 1)) == [
        "arg1=-14",
        "ret=0xfffffffffffffff2",
    ]


def test_symbol_memory_and_unknown_symbol_at_run_time() -> None:
    ev = parse("p vfs_read @_sdata:u32 @_sdata+4:u8 +0(@_sdata-8):x16")
    assert ev.args[0].expr == Deref(SymbolAddr("_sdata", "_sdata", 0), 0)
    sdata = KALLSYMS["_sdata"][0]
    ctx = FakeContext(memory={sdata - 8: u64(sdata) + (0x1234_5678).to_bytes(4, "little") + b"\x99"})
    assert [a.format(v) for a, v in zip(ev.args, ev.evaluate(ctx), strict=True)] == [
        "arg1=305419896",
        "arg2=153",
        "arg3=0x5678",
    ]
    unknown = parse_event("p vfs_read @no_such_var:u32")  # no symbol check at parse time
    assert isinstance(unknown, ProbeEvent)
    assert unknown.evaluate(FakeContext()) == [FAULT]


def test_format_hit_kprobe_and_kretprobe() -> None:
    ev = parse("p:myprobe vfs_read count=%dx:u64")
    vals = ev.evaluate(FakeContext(regs={"dx": 17}))
    assert format_hit(ev, vals, KALLSYMS["vfs_read"][0], lookup=lookup) == "(vfs_read+0x0/0x1a0) count=17"
    assert format_hit(ev, vals, 0, lookup=lookup) == "(0) count=17"
    assert format_hit(ev, vals, 0xFFFF_FFFF_9000_0000, lookup=lookup) == "(0xffffffff90000000) count=17"
    rp = parse("r:myret vfs_read $retval")
    vals = rp.evaluate(FakeContext(ret=3))
    caller = KALLSYMS["ksys_read"][0] + 0x1B
    assert format_hit(rp, vals, caller, KALLSYMS["vfs_read"][0], lookup=lookup) == (
        "(ksys_read+0x1b/0xd0 <- vfs_read) arg1=0x3"
    )
    tramp = KALLSYMS["__kretprobe_trampoline"][0]
    assert format_hit(rp, vals, tramp, KALLSYMS["vfs_read"][0], lookup=lookup, trampoline=tramp) == (
        "([unknown/kretprobe'd] <- vfs_read) arg1=0x3"
    )
    assert format_hit(rp, vals, "a+0x1/0x2", "b") == "(a+0x1/0x2 <- b) arg1=0x3"


@pytest.mark.parametrize(
    ("text", "listing"),
    [
        ("p:myprobe vfs_read count=%dx:u64", "p:kprobes/myprobe vfs_read count=%dx:u64"),
        ("p vfs_read+0", "p:kprobes/p_vfs_read_0 vfs_read"),
        ("p vfs_read+0x10 %ax", "p:kprobes/p_vfs_read_16 vfs_read+16 arg1=%ax"),
        ("r4:g/e  vfs_read \t $retval:s32", "r4:g/e vfs_read arg1=$retval:s32"),
        ("p:g.e vfs_read", "p:g/e vfs_read"),
        ("p:grp/ vfs_read", "p:grp/p_vfs_read_0 vfs_read"),
        ("p 0xffffffff81000000", "p:kprobes/p_0xffffffff81000000 0xffffffff81000000"),
        ("r 18446744071578845184", "r:kprobes/r_0xffffffff81000000 0xffffffff81000000"),
        ("pfoo:bar vfs_read", "p:kprobes/bar vfs_read"),  # the kernel only looks at argv[0][0]
        ("p vfs_read # a comment", "p:kprobes/p_vfs_read_0 vfs_read"),
    ],
)
def test_format_event(text: str, listing: str) -> None:
    assert format_event(parse(text)) == listing


def test_print_fmt() -> None:
    ev = parse("p:myprobe do_sys_open dfd=%ax filename=%dx flags=%cx mode=+4($stack)")
    assert print_fmt(ev) == (
        '"(%lx) dfd=0x%Lx filename=0x%Lx flags=0x%Lx mode=0x%Lx", '
        "REC->__probe_ip, REC->dfd, REC->filename, REC->flags, REC->mode"
    )
    rp = parse("r:r vfs_read s=+0(%ax):string a=+0(%ax):u8[2] b=%ax:b1@0/8 $retval:symbol")
    assert print_fmt(rp) == (
        '"(%lx <- %lx) s=\\"%s\\" a={%u,%u} b=%u arg4=%pS", REC->__probe_func, REC->__probe_ret_ip, '
        "__get_str(s), REC->a[0], REC->a[1], REC->b, REC->arg4"
    )


def test_fetch_types() -> None:
    ev = parse("p vfs_read %ax:b4@4/32 +0(%ax):x16[4] $comm +0(%ax):ustring %ax")
    bf, arr, comm, ustr, default = (a.type for a in ev.args)
    assert (bf.name, bf.size, bf.bitfield, bf.spec) == ("u32", 4, Bitfield(4, 4, 32), "b4@4/32")
    assert (arr.name, arr.array, arr.hex, arr.spec, arr.fmttype) == ("x16", 4, True, "x16[4]", "u16")
    assert (comm.name, comm.string, comm.spec) == ("string", True, None)
    assert (ustr.name, ustr.user, ustr.fmttype) == ("ustring", True, "__data_loc char[]")
    assert (default.name, default.size, default.signed, default.spec) == ("x64", 8, False, None)


def test_args_past_128_are_dropped_like_61() -> None:
    ev = parse("p vfs_read " + " ".join(["%ax"] * 130))
    assert len(ev.args) == 128 and ev.args[-1].name == "arg128"
