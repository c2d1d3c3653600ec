"""kprobe_events definitions to put to the guest kernel and to qprobe alike.

The ftrace selftests' argument tables (test.d/kprobe/kprobe_args_syntax.tc,
kprobe_syntax_errors.tc of Linux 6.1) and generated definitions over every
register, type, dereference depth, ``$`` variable, event-name rule and
probe-point form.  A case is a sequence of lines written one after another
(the event table starts empty for each case).
"""

from __future__ import annotations

import itertools
import random

FUNC = "vfs_read"  # has an __fentry__ site, reached by every read
RFUNC = "ksys_lseek"

REGS = ("r15", "r14", "r13", "r12", "r11", "r10", "r9", "r8", "bx", "cx", "dx", "si", "di", "bp", "ax",
        "orig_ax", "ip", "cs", "flags", "sp", "ss")  # fmt: skip
BAD_REGS = ("ex", "rax", "eax", "RAX", "Ax", "r16", "")
TYPES = ("u8", "u16", "u32", "u64", "s8", "s16", "s32", "s64", "x8", "x16", "x32", "x64",
         "string", "ustring", "symbol", "symstr", "b4@2/32", "b1@0/8", "b8@56/64", "b3@6/8",
         "u8[3]", "x32[2]", "s16[1]", "string[2]", "u64[16]", "u64[17]", "u8[0]",
         "u7", "x128", "b0@1/8", "b9@0/8", "b4@5/8", "b4@2/12", "char", "int", "y16", "")  # fmt: skip
VARS = ("$stack", "$stack0", "$stack1", "$stack3", "$stackp", "$stack0+10", "$retval", "$comm",
        "$arg1", "$arg2", "$arg6", "$arg7", "$arg0", "$argx", "$ret", "$", "$Comm", "$COMM")  # fmt: skip

# kprobe_args_syntax.tc (x86_64: GOODREG=%ax BADREG=%ex, GOODSYM=_sdata)
SELFTEST_GOOD = ("%ax", "@_sdata", "@_sdata+10", "@_sdata-10", "$stack", "$stack0", "$stack1", "$comm",
                 "+0(%ax)", "-0(%ax)", "+10($stack)", "+0($stack1)", "+10(@_sdata-10)",
                 "+0(+10(+20($stack)))", "varname=%ax", "%ax:x16", "$comm:string", "+0($stack):string")  # fmt: skip
SELFTEST_BAD = ("%ex", "@", "@deaqswdefr", "@_sdata*10", "@_sdata/10", "@_sdata%10", "@_sdata&10",
                "@_sdata|10", "$stackp", "$stack0+10", "$stack1-10", "+(%ax)", "(%ax+10)", "-(%ax)",
                "(%ax)", "+10($comm)", "varname=varname2=%ax", "%ax::x16", "%ax:y16", "x16:%ax",
                "$comm:x64", "$stack:string", "%ax:string", "+0(%ax)+10")  # fmt: skip
# kprobe_syntax_errors.tc's lines that need no module, uprobe or BTF.
SELFTEST_ERRORS = (
    "p:/bar vfs_read", "p:+1/bar vfs_read", "p:a/+1 vfs_read",
    "p:" + "a" * 64 + "/b vfs_read", "p:a/" + "b" * 64 + " vfs_read",
    "p:foo/ vfs_read", "p vfs_read%", "p vfs_read%ret", "p vfs_read%return",
    "p vfs_read+16%return", "r1 vfs_read", "p1 vfs_read", "r1a vfs_read",
    "r0 vfs_read", "r9999 vfs_read", "r vfs_read+8", "p 0x1000", "p nosuchsym_qprobe",
    "p vfs_read+1", "p vfs_read+1000000", "p vfs_read %", "p vfs_read $", "p vfs_read $foo",
    "p vfs_read +0()", "p vfs_read +0(%)", "p vfs_read +0(%di", "p vfs_read +0(%di)x",
    "p vfs_read @+0", "p vfs_read \\", "p vfs_read \\a", "p vfs_read \\\"", "p vfs_read \\\"abc",
    "p vfs_read \\\"abc\\\"", "p vfs_read \\1:string", "p vfs_read \\1", "p vfs_read \\-1:s8",
    "p vfs_read =%di", "p vfs_read foo=", "p vfs_read 1foo=%di", "p vfs_read f-o=%di",
    "p vfs_read " + "a" * 32 + "=%di", "p vfs_read a=%di a=%si", "p vfs_read %di:b0@1/8",
    "p vfs_read %di:u8[1", "p vfs_read %di:u8[]", "p vfs_read %di:u8[65]",
    "p vfs_read %di:symbol[2]", "p vfs_read $comm:string[2]", "p vfs_read +0(%di):string[]",
)  # fmt: skip


# The accepted arguments of the selftests' argument tables, for their values at FUNC: the guest's event and
# qprobe's print the same value at each hit.  kprobe_args_syntax.tc's good arguments (SYMADDR: _sdata's
# address); kprobe_args.tc's, kprobe_args_type.tc's (every width) and kprobe_args_symbol.tc's (the symbol
# arguments over linux_proc_banner); kprobe_args_string.tc's, kprobe_args_user.tc's and kprobe_args_comm.tc's;
# kprobe_args_char.tc's (Linux 6.5 on), with their registers and stack moved to FUNC's.
SELFTEST_VALUES = {
    "syntax": (*(a for a in SELFTEST_GOOD if a != "varname=%ax"), "@SYMADDR", "varname=%ax"),
    "types": ("$stack", "$stack0", "+0($stack)",
              *(f"$stack0:{t}{w}" for w in (64, 32, 16, 8) for t in ("s", "u", "x")),
              *(f"$stack0:b4@4/{w}" for w in (64, 32, 16, 8)),
              *(f"@linux_proc_banner:{t}{w}" for t in ("u", "s", "x") for w in (64, 32, 16, 8)),
              "@linux_proc_banner:b8@4/32", "@linux_proc_banner:string"),
    "strings": ("+0(%di):string", "+0($arg2):ustring", "+u0($arg2):string", "+0(%si):ustring", "+u0(%si):string",
                "$comm", "$comm:string", "+0($stack):string"),
    "char": ("%di:char", "+0(%si):char[4]"),
    # Not the selftests': one read in each kind of kernel mapping and across page and mapping boundaries.
    # The per-CPU areas (cpu0's start; this_cpu_off in cpu0's and cpu1's, THIS_CPU_OFF its offset), the CPU
    # entry area (its read-only IDT: Linux 4.15 on, at the area's base), the direct map (physical 0, across
    # 4K, 1M and 2M boundaries, at 16M and 256M), the vmalloc and vmemmap areas, the vsyscall page (refused
    # by copy_from_kernel_nofault_allowed since Linux 6.8), kernel text, the kernel stack (vmalloc'd: to its
    # end and past), the user buffer read into (past its page) and slab objects through the file.
    "regions": ("+0(@__per_cpu_offset)", "+THIS_CPU_OFF(@__per_cpu_offset)", "+THIS_CPU_OFF(@__per_cpu_offset+8)",
                "@0xfffffe0000000000", "@0xfffffe0000000ffc", "+0(@page_offset_base)", "+0xffc(@page_offset_base)",
                "+0xffffc(@page_offset_base)", "+0x1ffffc(@page_offset_base)", "+0x1000000(@page_offset_base)",
                "+0x10000000(@page_offset_base)", "+0(@vmalloc_base)", "+0(@vmemmap_base)", "+0x40(@vmemmap_base)",
                "@0xffffffffff600000", "@_stext", "+0(%sp)", "+0xff8(%sp)", "+0x3ffc(%sp)", "+0(%si)", "+u0(%si)",
                "+0xffc(%si)", "+0(+0(%di))", "+0(+0x18(%di))", "+0(+0x28(%di))"),
}  # fmt: skip


# Later kernels' language (Linux 6.12's selftests: kprobe_syntax_errors.tc's BTF part,
# add_remove_btfarg.tc, kprobe_args_vfs.tc, kprobe_args_char.tc, kretprobe_entry_arg.tc):
# every one is refused by a kernel without it, with that kernel's error.
BTF_LINES = (
    f"p {FUNC} file", f"p {FUNC} file->f_pos", f"p {FUNC} file->f_path.dentry->d_name.name:string",
    f"p {FUNC} $arg*", f"p {FUNC} $arg2:string", f"p {FUNC} buf:ustring", f"p {FUNC} count:string",
    f"p {FUNC} nosuch", f"p {FUNC} file->nosuch", f"p {FUNC} file.f_pos", f"p {FUNC} file-f_pos",
    f"p {FUNC} count->x", f"p {FUNC} $arg* $arg*", f"p {FUNC} $arg1 file", f"p {FUNC} a=$arg1:%pD",
    f"p {FUNC} $arg1:%pD", "p dput $arg1:%pd", "p dput d=$arg1:%pd", f"p {FUNC}+4 file", f"p {FUNC}+4 $arg*",
    "p kfree $arg1", "p kfree $arg10", "r kfree $retval", "p ksys_sync $arg1", "p ksys_sync $arg*",
    f"p {FUNC} %di:char", f"p {FUNC} +0(%si):char[4]", f"r {RFUNC} $retval->x", f"r {RFUNC} fd",
    f"r {RFUNC} $arg*", f"r {RFUNC} $retval", f"r {RFUNC} a=$arg2:s32 $arg3", f"p {FUNC} $retval",
    f"p {FUNC} args=$arg*", f"p {FUNC} +0($arg*)", f"p {FUNC} $arg1x", f"p {FUNC} $arg",
    "p wake_up_new_task p->sched_reset_on_fork", "p wake_up_new_task b=p->sched_remote_wakeup:u8",
)  # fmt: skip


def _padded(head: str, length: int) -> str:
    """``head`` with a comment making the line ``length`` bytes long (the kernel's line limit counts them)."""
    return head + " #" + "c" * (length - len(head) - 2)


# The kernel's limits: address 0 (no address: -EINVAL), MAX_TRACE_ARGS (6.1 ignores the arguments past it,
# 6.5 on refuses the definition), the line a write to kprobe_events holds (WRITE_BUFSIZE - 2 bytes).
LIMITS = (
    "p:z0 0", "p:z1 0x0", "r:z2 0",
    f"p:a128 {FUNC} " + " ".join(f"a{i}=%di" for i in range(128)),
    f"p:a129 {FUNC} " + " ".join(f"a{i}=%di" for i in range(129)),
    f"p:a129bad {FUNC} " + " ".join(f"a{i}=%di" for i in range(128)) + " x=%ex",
    _padded(f"p:long {FUNC}", 4094), _padded(f"p:toolong {FUNC}", 4095), _padded(f"p:waytoolong {FUNC}", 10_000),
)  # fmt: skip


def _single(line: str) -> list[str]:
    return [line]


def cases(seed: int = 61, generated: int = 120) -> list[list[str]]:
    """Every case, in a fixed order (the generated part is random but seeded)."""
    out: list[list[str]] = []
    out += [_single(f"p {FUNC} {a}") for a in SELFTEST_GOOD + SELFTEST_BAD]
    out += [_single(x) for x in SELFTEST_ERRORS]
    out += [_single(x) for x in LIMITS]
    out += [_single(f"p {FUNC} %{r}") for r in REGS + BAD_REGS]
    out += [_single(f"p {FUNC} +0(%di):{t}") for t in TYPES]
    out += [_single(f"p {FUNC} %si:{t}") for t in TYPES]
    out += [_single(f"p {FUNC} {v}") for v in VARS]
    out += [_single(f"r {RFUNC} {v}") for v in VARS]
    out += [_single(f"p {RFUNC}+4 {v}") for v in ("$arg1", "$retval", "$stack")]
    out += [_single(x) for x in BTF_LINES]
    # Dereference depth and offsets.
    for depth, off in itertools.product((1, 2, 3), ("+0", "-8", "+0x44", "+u0", "+8")):
        expr = "%di"
        for _ in range(depth):
            expr = f"{off}({expr})"
        out.append(_single(f"p {FUNC} {expr}:x64"))
    # Event and group names.
    names = ("e", "_e", "e1", "1e", "e-1", "e.1", "grp/e", "grp.e", "g-1/e", "a" * 63, "a" * 64, "a" * 65,
             "g/" + "a" * 63, "g/" + "a" * 64, "sched/sched_switch", "kprobes/e2", "ftrace/e3")  # fmt: skip
    for name in names:
        out.append(_single(f"p:{name} {FUNC}"))
    # The event table: same name, same probe, different type, different args.
    ev = f"p:dup {FUNC} a=%di"
    out += [
        [ev, ev],
        [ev, f"p:dup {FUNC} b=%di"],
        [ev, f"p:dup {FUNC} a=%di:u32"],
        [ev, f"p:dup {FUNC}+4 a=%di"],
        [ev, f"p:dup {RFUNC} a=%di"],
        [ev, f"r:dup {RFUNC} a=%di"],
        [ev, f"p:dup {FUNC} a=%di b=%si"],
        [f"p {FUNC}", f"p {FUNC}"],
        [f"p {FUNC} %di", f"p {FUNC} %si"],
        [f"r {RFUNC}", f"r {RFUNC}"],
        [f"r:rr {RFUNC}", f"p:rr {RFUNC}"],
    ]
    # Random definitions: a name, a place and up to four arguments.
    rng = random.Random(seed)
    atoms = [f"%{r}" for r in REGS] + list(VARS[:10]) + ["@_sdata", "\\7", '\\"x"']
    for _ in range(generated):
        kind = rng.choice(("p", "p", "r"))
        place = FUNC if kind == "p" else RFUNC
        args = []
        for i in range(rng.randint(0, 4)):
            atom = rng.choice(atoms)
            for _ in range(rng.choice((0, 0, 1, 2))):
                atom = f"{rng.choice(('+0', '+8', '-8', '+u0'))}({atom})"
            t = rng.choice((*TYPES[:20], ""))
            named = rng.random() < 0.5
            args.append((f"a{i}=" if named else "") + atom + (f":{t}" if t else ""))
        out.append(_single(" ".join([f"{kind}:gen{len(out)} {place}", *args])))
    return out
