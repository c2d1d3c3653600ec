"""Which functions can be probed, and the names a typo was meant to be: pure logic over a symbol table."""

from __future__ import annotations

from pathlib import Path

import pytest

from qprobe.core.blacklist import BlacklistEntry
from qprobe.errors import FetchArgError, SymbolError
from qprobe.events.funcs import Probeability, check_probe_symbol, is_glob, render_funcs, suggest, wildcard_definitions
from qprobe.fetch import messages as M
from qprobe.fetch.definition import parse_definition
from qprobe.fetch.dialect import Dialect
from qprobe.kernel.symbols import ModuleText, Symbol, Symbols
from qprobe.kernel.vmlinux import Section

T = 0xFFFF_FFFF_8100_0000
# name -> (link address, size); two static functions share "shared".
FUNCS = {
    "vfs_read": (T + 0x100, 0x40),
    "vfs_write": (T + 0x140, 0x40),
    "vfs_notrace": (T + 0x180, 0x20),
    "vfs_blocked": (T + 0x1A0, 0x20),
    "finish_task_switch.isra.0": (T + 0x1C0, 0x40),
    "ksys_read": (T + 0x200, 0x40),
    "ksys_pread64": (T + 0x240, 0x40),
    "shared": (T + 0x280, 0x10),
    "start_kernel": (T + 0x10_0000, 0x100),  # in .init.text
}
ROWS = [(name, addr, size, "func") for name, (addr, size) in FUNCS.items()] + [("shared", T + 0x290, 0x10, "func")]
SECTIONS = [Section(".text", T, 0x1000, 0x1000, True), Section(".init.text", T + 0x10_0000, 0x1000, 0x2000, True)]
# __fentry__ sites: every function but vfs_notrace has one just after its start.
FENTRY = sorted([*(addr + 4 for name, (addr, _size) in FUNCS.items() if name != "vfs_notrace"), T + 0x294])


class FakeBlacklist:
    def lookup(self, addr: int) -> BlacklistEntry | None:
        start, size = FUNCS["vfs_blocked"]
        return BlacklistEntry(start, start + size, "vfs_blocked") if start <= addr < start + size else None


@pytest.fixture
def prob() -> Probeability:
    symbols = Symbols(Path("vmlinux-test"), "00", ROWS, SECTIONS)
    dialect = Dialect(messages=frozenset({M.NON_UNIQ_SYMBOL}))
    return Probeability(symbols, FakeBlacklist(), FENTRY, None, dialect)  # type: ignore[arg-type]


def test_reasons_follow_the_kernels_checks(prob: Probeability) -> None:
    assert prob.reason("vfs_read") is None
    assert prob.reason("finish_task_switch.isra.0") is None
    assert prob.reason("nope") == "not in the symbol table"
    assert prob.reason("shared") == "not unique: 2 functions share the name (probe one by address)"
    assert prob.reason("start_kernel") == "in .init.text, not kernel text after boot"
    assert prob.reason("vfs_notrace") == "notrace: no __fentry__ site, the kernel refuses kprobe events there"
    assert prob.reason("vfs_blocked") == "blacklisted (vfs_blocked)"


def test_anywhere_lifts_only_the_refusals_of_the_kernel_s_int3(prob: Probeability) -> None:
    """A stub breakpoint writes nothing: notrace and the blacklist stop refusing; init text, a name two
    functions share and a name not in the table still do."""
    assert prob.anywhere_only("vfs_blocked") and prob.anywhere_only("vfs_notrace")
    assert not prob.anywhere_only("vfs_read") and not prob.anywhere_only("start_kernel")
    prob.anywhere = True
    try:
        assert prob.reason("vfs_blocked") is None and prob.reason("vfs_notrace") is None
        assert prob.reason("start_kernel") == "in .init.text, not kernel text after boot"
        assert prob.reason("shared") == "not unique: 2 functions share the name (probe one by address)"
    finally:
        prob.anywhere = False


def test_a_kernel_without_the_uniqueness_check_probes_a_shared_name(prob: Probeability) -> None:
    older = Probeability(prob.symbols, prob.blacklist, prob.locations, None, Dialect())
    assert older.reason("shared") is None


def test_globs_match_functions_and_say_which_can_be_probed(prob: Probeability) -> None:
    found = prob.match(["vfs_*"])
    assert [(f.name, f.probeable) for f in found] == [
        ("vfs_blocked", False), ("vfs_notrace", False), ("vfs_read", True), ("vfs_write", True),
    ]  # fmt: skip
    assert [f.name for f in prob.match(["ksys_?ead", "vfs_read", "missing"])] == ["ksys_read", "vfs_read"]
    assert is_glob("vfs_*") and is_glob("do_[rw]*") and not is_glob("vfs_read")


def test_suggestions_put_gcc_copies_first_then_close_spellings(prob: Probeability) -> None:
    names = prob.functions()
    assert suggest(names, "finish_task_switch")[0] == "finish_task_switch.isra.0"
    assert suggest(names, "ksys_raed") == ["ksys_read", "ksys_pread64"]
    assert suggest(names, "zzzzzzzz") == []


def test_check_probe_symbol_is_one_line_naming_the_problem(prob: Probeability) -> None:
    with pytest.raises(SymbolError, match=r"^no symbol 'ksys_raed' in vmlinux-test \(did you mean ksys_read, "
                                          r"ksys_pread64\?\)$"):  # fmt: skip
        check_probe_symbol(prob, "ksys_raed")
    with pytest.raises(SymbolError, match=r"^cannot probe vfs_notrace: notrace"):
        check_probe_symbol(prob, "vfs_notrace")
    assert check_probe_symbol(prob, "vfs_notrace", 8) == []  # an offset: the VM's checks decide
    with pytest.raises(SymbolError, match=r"^no function matches 'xyz_\*'$"):
        check_probe_symbol(prob, "xyz_*")
    with pytest.raises(SymbolError, match=r"^none of the 2 functions matching 'vfs_\[bn\]\*' can be probed"):
        check_probe_symbol(prob, "vfs_[bn]*")
    assert [f.name for f in check_probe_symbol(prob, "vfs_*")] == ["vfs_blocked", "vfs_notrace", "vfs_read",
                                                                  "vfs_write"]  # fmt: skip


def test_render_funcs_lists_probeable_names_bare_and_refusals_with_why(prob: Probeability) -> None:
    text, summary, n = render_funcs(prob, ["vfs_*", "ksys_raed"])
    assert text.splitlines() == [
        "vfs_blocked  cannot probe: blacklisted (vfs_blocked) (--anywhere: a stub breakpoint)",
        "vfs_notrace  cannot probe: notrace: no __fentry__ site, the kernel refuses kprobe events there "
        "(--anywhere: a stub breakpoint)",
        "vfs_read",
        "vfs_write",
    ]
    assert n == 4
    assert summary == ("4 functions match 'vfs_*' 'ksys_raed': 2 can be probed, 2 cannot; "
                       "no function 'ksys_raed' (did you mean ksys_read, ksys_pread64?)")  # fmt: skip
    assert render_funcs(prob, ["nope*"]) == ("", "no function matches 'nope*'", 0)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("p:vfs vfs_* fd=%di", ["p:vfs/vfs_read vfs_read fd=%di", "p:vfs/f_isra_0 f.isra.0 fd=%di"]),
        (
            "r:grp/ vfs_*%return ret=$retval",
            ["r:grp/vfs_read vfs_read%return ret=$retval", "r:grp/f_isra_0 f.isra.0%return ret=$retval"],
        ),
        ("p vfs_*+4", ["p vfs_read+4", "p f.isra.0+4"]),
        ("r8:vfs vfs_*", ["r8:vfs/vfs_read vfs_read", "r8:vfs/f_isra_0 f.isra.0"]),
    ],
)
def test_a_wildcard_definition_becomes_one_event_per_function(text: str, expected: list[str]) -> None:
    out = wildcard_definitions(parse_definition(text), ["vfs_read", "f.isra.0"])
    assert [d.text for _f, d in out] == expected
    # Each is the parsed form with its point replaced: the words (and their columns) a parse of its text gives.
    assert [d.words for _f, d in out] == [parse_definition(e).words for e in expected]
    assert [f for f, _d in out] == ["vfs_read", "f.isra.0"]


def test_a_wildcard_names_a_group_not_one_event() -> None:
    with pytest.raises(FetchArgError, match="one event per function") as e:
        wildcard_definitions(parse_definition("p:grp/ev vfs_*"), ["vfs_read"])
    assert e.value.column == 2
    # Two functions whose names differ only by '.' and '_': the first keeps the event name.
    assert wildcard_definitions(parse_definition("p:g x*"), ["x.a", "x_a"]) == [
        ("x.a", parse_definition("p:g/x_a x.a"))
    ]


M0 = 0xFFFF_FFFF_C000_0000  # a module's text


def _module() -> ModuleText:
    syms = [Symbol("bm_status_read", M0 + 0x10, 0x30, "func"), Symbol("bm_notrace", M0 + 0x40, 0x10, "func"),
            Symbol("bm_entry.part.0", M0 + 0x50, 0x10, "func"), Symbol("bm_entry", M0 + 0x60, 0x20, "func"),
            Symbol("vfs_read", M0 + 0x80, 0x10, "func"), Symbol("bm_data", M0 + 0x90, 0x8, "object")]  # fmt: skip
    # __fentry__ sites in bm_status_read and bm_entry only: bm_entry.part.0 is judged by bm_entry.
    return ModuleText("binfmt_misc", M0 - 0x1000, ((M0, M0 + 0x100),), tuple(syms), (M0 + 0x14, M0 + 0x64, M0 + 0x84))


def test_a_loaded_modules_functions_are_listed_with_their_module(prob: Probeability) -> None:
    unique = Dialect(messages=frozenset({M.NON_UNIQ_SYMBOL}))
    mod = Probeability(prob.symbols, prob.blacklist, prob.locations, None, unique, [_module()])
    found = {f.label: f.reason for f in mod.match(["bm_*", "vfs_read"])}
    assert found == {
        "vfs_read": "not unique: 2 functions share the name (probe one by address)",
        "bm_entry [binfmt_misc]": None,
        "bm_entry.part.0 [binfmt_misc]": None,
        "bm_notrace [binfmt_misc]": "notrace: no __fentry__ site, the kernel refuses kprobe events there",
        "bm_status_read [binfmt_misc]": None,
        "vfs_read [binfmt_misc]": "not unique: 2 functions share the name (probe MOD:SYM or one by address)",
    }
    text, summary, n = render_funcs(mod, ["bm_status_read"])
    assert (text, summary, n) == ("bm_status_read [binfmt_misc]\n",
                                  "1 function matches 'bm_status_read': 1 can be probed, 0 cannot", 1)  # fmt: skip
    assert render_funcs(mod, ["binfmt_misc:bm_status_read"])[0] == "bm_status_read [binfmt_misc]\n"
