"""Property tests: the parser only ever fails with FetchArgError, evaluation
never raises, and ``parse(format_event(parse(x)))`` is ``parse(x)``."""

from __future__ import annotations

from fetch_fakes import FakeContext
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from qprobe.errors import FetchArgError
from qprobe.fetch import DeleteEvent, ProbeEvent, format_event, format_hit, parse_event, print_fmt

# Pieces of the kprobe_events grammar, so random text is often nearly valid.
PIECES = [
    "p", "r", "r10", "-", ":", "/", ".", "kprobes", "grp", "ev", "vfs_read", "do_sys_open", "mod:f",
    "+", "-", "0", "10", "0x10", "4096", "%return", "%", " ", "\t", "#",
    "%ax", "%di", "%ip", "%orig_ax", "%ex", "$stack", "$stack1", "$stack3000", "$arg", "$arg1", "$arg0",
    "$retval", "$comm", "$COMM", "$foo", "@", "@_sdata", "@0x1000", "@+1", "\\", '\\"', '"', "\\-1", "\\0x",
    "+0(", "-8(", "+u0(", "(", ")", "[", "]", "[2]", "[65]", "=", "x=", "arg1=", "common_pid=",
    ":u8", ":s16", ":x32", ":x64", ":u64", ":string", ":ustring", ":symbol", ":b4@4/32", ":b0@1/8",
    ":b4@60/8", ":b3@x/8", ":y16", "::", "abc", "&", "*", "é",
]  # fmt: skip
ALPHABET = 'pr-:/._azAZ09xX%$@+()[]\\"=#& \t\n'


def _check_parse(text: str) -> None:
    try:
        ev = parse_event(text)
    except FetchArgError as exc:
        assert exc.text == text
        assert 0 <= exc.column <= len(text) + 1
        return
    if isinstance(ev, ProbeEvent):
        values = ev.evaluate(FakeContext(ret=0))
        format_hit(ev, values, "f+0x0/0x1", "g")
        format_event(ev)
        print_fmt(ev)
    else:
        assert isinstance(ev, DeleteEvent)


@settings(max_examples=600, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(PIECES), max_size=14).map("".join))
def test_grammar_pieces_never_crash(text: str) -> None:
    _check_parse(text)


@settings(max_examples=400)
@given(st.text(alphabet=ALPHABET, max_size=40))
def test_grammar_alphabet_never_crashes(text: str) -> None:
    _check_parse(text)


# --- generated valid definitions ------------------------------------------------
IDENT = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,12}", fullmatch=True)
REGS = ["ax", "bx", "cx", "dx", "si", "di", "bp", "sp", "ip", "flags", "r8", "r15", "orig_ax", "cs", "ss"]
INT_TYPES = [f"{k}{w}" for k in "usx" for w in (8, 16, 32, 64)] + ["symbol"]


def _exprs(allow_retval: bool, allow_args: bool) -> st.SearchStrategy[tuple[str, str]]:
    """(kind, text): kind is "mem", "umem", "imm", "istr", "comm" or "val"."""
    leaves = st.one_of(
        st.sampled_from(REGS).map(lambda r: ("val", "%" + r)),
        st.integers(0, 2048).map(lambda n: ("val", f"$stack{n}")),
        st.just(("val", "$stack")),
        st.sampled_from(["_sdata", "jiffies", "init_task"]).flatmap(
            lambda s: st.sampled_from(["", "+8", "-16", "+0x10"]).map(lambda o: ("mem", f"@{s}{o}"))
        ),
        st.integers(0xFFFF_8000_0000_0000, (1 << 64) - 1).map(lambda a: ("mem", f"@0x{a:x}")),
        st.integers(-(1 << 63), (1 << 64) - 1).map(lambda v: ("imm", f"\\{v}" if v < 0 else f"\\{v:#x}")),
    )
    if allow_retval:
        leaves |= st.just(("val", "$retval"))
    if allow_args:
        leaves |= st.integers(1, 20).map(lambda n: ("val", f"$arg{n}"))

    def deref(inner: st.SearchStrategy[tuple[str, str]]) -> st.SearchStrategy[tuple[str, str]]:
        return st.tuples(st.sampled_from(["+", "-", "+u", "-u"]), st.integers(0, 4096), inner).map(
            lambda t: ("umem" if "u" in t[0] else "mem", f"{t[0]}{t[1]}({t[2][1]})")
        )

    tree = st.recursive(leaves, deref, max_leaves=3)
    special = st.one_of(
        st.just(("comm", "$comm")),
        st.from_regex(r"[a-z0-9_]{0,10}", fullmatch=True).map(lambda s: ("istr", f'\\"{s}"')),
    )
    return tree | special


@st.composite
def fetch_arg(draw: st.DrawFn, allow_retval: bool, allow_args: bool) -> str:
    kind, expr = draw(_exprs(allow_retval, allow_args))
    if kind in ("comm", "istr"):
        return expr + draw(st.sampled_from(["", ":string"]))
    choices = [""] + [":" + t for t in INT_TYPES]
    if kind in ("mem", "umem", "imm"):
        choices += [":string", ":ustring"]
    width = draw(st.sampled_from([8, 16, 32, 64]))
    bits = draw(st.integers(1, width))
    choices.append(f":b{bits}@{draw(st.integers(0, width - bits))}/{width}")
    typ = draw(st.sampled_from(choices))
    arrayable = kind == "mem" or (kind in ("umem", "imm") and typ.endswith("string"))
    if arrayable and typ and draw(st.booleans()):
        typ += f"[{draw(st.integers(1, 64))}]"
    return expr + typ


@st.composite
def definitions(draw: st.DrawFn) -> str:
    kind = draw(st.sampled_from(["p", "r"]))
    head = kind + (str(draw(st.integers(1, 4096))) if kind == "r" and draw(st.booleans()) else "")
    if draw(st.booleans()):
        group = draw(st.one_of(st.just(""), IDENT.map(lambda g: g + "/")))
        head += ":" + group + draw(IDENT)
    where = draw(st.sampled_from(["sym", "addr"]))
    symbolic = where == "sym"
    if symbolic:
        sym = draw(st.sampled_from(["vfs_read", "do_sys_open", "foo.isra.0", "ext4:ext4_sync_fs"]))
        offset = 0 if kind == "r" else draw(st.sampled_from([0, 0, 5, 0x10, 4096]))
        point = sym + (f"+{offset}" if offset or draw(st.booleans()) else "")
        if kind == "p" and offset == 0 and draw(st.booleans()):
            point += "%return"
            kind = "r"
    else:
        offset = 1
        point = f"0x{draw(st.integers(0xFFFF_FFFF_8000_0000, (1 << 64) - 1)):x}"
    args = draw(st.lists(fetch_arg(kind == "r" and symbolic, kind == "p" and symbolic and offset == 0), max_size=6))
    named = [a if draw(st.booleans()) else f"v{i}={a}" for i, a in enumerate(args)]
    assume(all(len(a.split("=", 1)[-1]) <= 63 for a in named))
    return " ".join([head, point, *named])


def _shape(ev: ProbeEvent) -> tuple[object, ...]:
    return (
        ev.kind,
        ev.group,
        ev.event,
        ev.symbol,
        ev.offset,
        ev.addr,
        ev.maxactive,
        [(a.name, a.body, a.type, a.expr) for a in ev.args],
    )


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(definitions())
def test_format_event_round_trips(text: str) -> None:
    ev = parse_event(text)
    assert isinstance(ev, ProbeEvent)
    listing = format_event(ev)
    again = parse_event(listing)
    assert isinstance(again, ProbeEvent)
    assert _shape(again) == _shape(ev)
    assert format_event(again) == listing
    values = ev.evaluate(FakeContext(ret=0))
    assert len(values) == len(ev.args)
