"""A definition's text is tokenised once: every tokeniser and parser entry counted, through the real events layer.

The front ends (CLI, shell, API) parse a definition into its typed form once
(``parse_definition``); the events layer checks, expands and arms that form
without reading the text again.  Each entry (conftest.py's ENTRIES) is wrapped
in every qprobe module that imported it, so a parse that any module makes is seen.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from types import SimpleNamespace

from qprobe import fetch
from qprobe.arch.x86_64.arch import X86_64
from qprobe.events import define
from qprobe.events.kprobe import KprobeEvent
from qprobe.events.uprobe import UprobeTraceEvent
from qprobe.fetch import ProbeEvent
from qprobe.fetch.dialect import BASE
from qprobe.kernel.symbols import Symbols
from qprobe.kernel.vmlinux import Section

T = 0xFFFF_FFFF_8100_0000
FUNCS = {"vfs_read": T + 0x100, "vfs_write": T + 0x140, "ksys_read": T + 0x200}
ROWS = [(name, addr, 0x40, "func") for name, addr in FUNCS.items()]
SECTIONS = [Section(".text", T, 0x1000, 0x1000, True)]


class FakeKprobeBackend:
    """Registers nothing: the events layer's parsing, not the probes, is what is counted."""

    booting = False
    records_in_guest = False  # a uprobe event takes the stop path: nothing is recorded in a guest
    sites = SimpleNamespace(blacklist=SimpleNamespace(lookup=lambda addr: None), reserved=None)

    def __init__(self) -> None:
        self.registered: list[object] = []

    def entry_skip(self, addr: int) -> int:
        return 0

    def register(self, events: list[object]) -> None:
        self.registered.extend(events)


class FakeRegistry:
    """The EventRegistry of a kernel with three functions (each with its __fentry__ site) and one user file."""

    def __init__(self) -> None:
        self.events: dict[str, object] = {}
        self.symbols = Symbols(Path("vmlinux-test"), "00", ROWS, SECTIONS)
        self.arch = X86_64
        self.dialect = BASE  # a front end's language: what it parsed is checked, not parsed again
        self.ftrace_locations = sorted(addr + 4 for addr in FUNCS.values())
        self.trace_events: frozenset[tuple[str, str]] = frozenset()
        self.modules = SimpleNamespace(started=True, loaded=lambda: [])
        self.kprobe_backend = FakeKprobeBackend()
        self.uprobe_backend = FakeKprobeBackend()

    def user_file_kind(self, path: str) -> str:
        return "regular"

    def resolve_user_symbol(self, path: str, spec: str) -> int:
        assert (path, spec) == ("/bin/uprog", "qpt_target")
        return 0x1A50


def _texts(counts: Counter[str]) -> dict[str, int]:
    return {text: n for text, n in counts.items() if n}


def test_a_kprobe_definition_is_tokenised_once(parse_reads: dict[str, Counter[str]]) -> None:
    reg = FakeRegistry()
    text = "p:rd vfs_read fd=%di:s32 n=%dx"
    te = define.add_event(reg, text)  # type: ignore[arg-type]
    assert isinstance(te, KprobeEvent) and te.definition.symbol == "vfs_read"
    assert _texts(parse_reads["split_args"]) == {text: 1}
    assert _texts(parse_reads["parse_definition"]) == {text: 1}
    assert _texts(parse_reads["parse_event"]) == {text: 1}
    assert not any(parse_reads[name] for name in ("parse_uprobe_event", "parse_perf_probe", "user_form_definition"))


def test_a_front_end_s_parsed_event_is_checked_not_parsed_again(parse_reads: dict[str, Counter[str]]) -> None:
    text = "r:rr vfs_write ret=$retval"
    ev = fetch.parse_event(text)  # as the CLI does before a VM boots
    assert isinstance(ev, ProbeEvent)
    define.add_event(FakeRegistry(), ev)  # type: ignore[arg-type]
    assert _texts(parse_reads["split_args"]) == {text: 1}
    assert _texts(parse_reads["parse_event"]) == {text: 1}


def test_a_glob_expands_on_the_parsed_form(parse_reads: dict[str, Counter[str]]) -> None:
    reg = FakeRegistry()
    text = "p:vfs vfs_* fd=%di"
    found = define.add_events(reg, text)  # type: ignore[arg-type]
    assert sorted(te.name for te in found.events) == ["vfs/vfs_read", "vfs/vfs_write"]
    # The user's text is read once; each function's definition is that form with its point replaced.
    assert _texts(parse_reads["split_args"]) == {text: 1}
    assert _texts(parse_reads["parse_definition"]) == {text: 1}
    assert _texts(parse_reads["parse_event"]) == {
        "p:vfs/vfs_read vfs_read fd=%di": 1,
        "p:vfs/vfs_write vfs_write fd=%di": 1,
    }


def test_a_uprobe_definition_is_tokenised_once(parse_reads: dict[str, Counter[str]]) -> None:
    reg = FakeRegistry()
    text = "p:uq /bin/uprog:qpt_target a=%di"
    te = define.add_event(reg, text)  # type: ignore[arg-type]
    assert isinstance(te, UprobeTraceEvent) and te.udef.offset == 0x1A50
    assert _texts(parse_reads["split_args"]) == {text: 1}
    assert _texts(parse_reads["parse_definition"]) == {text: 1}
    # Parsed once, in the form its symbol resolved to (the words rewritten, not read again).
    assert _texts(parse_reads["parse_uprobe_event"]) == {"p:uq /bin/uprog:0x1a50 a=%di": 1}
    assert not parse_reads["parse_event"]


def test_a_definition_parsed_by_a_front_end_is_not_read_again(parse_reads: dict[str, Counter[str]]) -> None:
    reg = FakeRegistry()
    definition = fetch.parse_definition("p:wr vfs_write")  # as the shell does
    define.add_event(reg, definition)  # type: ignore[arg-type]
    assert _texts(parse_reads["split_args"]) == {"p:wr vfs_write": 1}
    assert _texts(parse_reads["parse_definition"]) == {"p:wr vfs_write": 1}


def test_boot_s_uprobe_check_is_the_cli_s_one_parse(parse_reads: dict[str, Counter[str]]) -> None:
    """--boot's EVENTs are parsed once, before boot, for the uprobe refusal too: the parsed form goes down."""
    from qprobe import cli
    from qprobe.cli import definitions

    text = "p:a vfs_read"
    args = cli.build_parser().parse_args(["shell", "--boot", text])
    definitions._check_boot(args)
    down, _ = definitions._parse_definitions(args)
    assert [d.text for d in down if not isinstance(d, str)] == [text]  # a ProbeEvent where the host knows the kernel
    assert _texts(parse_reads["parse_definition"]) == {text: 1}
