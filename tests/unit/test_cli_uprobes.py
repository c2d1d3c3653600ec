"""qprobe trace/list/funcs with uprobe lines: what can be judged without the guest is refused before boot,
one line (a definition's with the kernel's caret), exit 2."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from types import SimpleNamespace

import pytest

import qprobe
import qprobe.wiring
from qprobe import cli
from qprobe.arch.x86_64.arch import X86_64
from qprobe.cli import definitions
from qprobe.fetch import parse_definition
from qprobe.kernel.usyntax import is_user_form, render_user_funcs, unresolved_syntax, user_form_definition

X86 = X86_64.registers  # the default image's architecture


@pytest.fixture(autouse=True)
def no_vm(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a VM was booted or attached for bad input")

    monkeypatch.setattr(qprobe, "boot", refuse)
    monkeypatch.setattr(qprobe, "attach", refuse)


CARETS = [
    # (definition, the kernel's text, its column in the definition as typed)
    ("p:uq /bin/uprog:qpt_target a=%zz", "Invalid register name", 29),  # the symbol's width kept
    ("p:uq /bin/uprog:qpt_target+4%retx", "Invalid probed address suffix", 28),
    ("p:uq /bin/uprog:0x1a50 s=+0(%dx):strung", "Unknown type is specified", 33),
    ("p:uq /bin/uprog:0x1a50 $retval", "$retval is not available", 23),
    ("perf -x /bin/uprog qpt_target a=%zz", "Invalid register name", 0),  # shown as the line perf writes
]


@pytest.mark.parametrize(("definition", "message", "column"), CARETS)
def test_a_uprobe_line_is_judged_before_boot_with_the_kernels_caret(
    capsys: pytest.CaptureFixture[str], definition: str, message: str, column: int
) -> None:
    assert cli.main(["trace", "--run", "true", definition]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"qprobe: error: {message}")
    if not definition.startswith("perf"):
        assert err[1:] == [definition, " " * column + "^"]


CASES = [
    (["trace", "--format", '"%d\\n", nope', "p:uq /bin/uprog:qpt_target a=%di"], ["--format names 'nope'"]),
    (["trace", "--map", "count by nope", "p:uq /bin/uprog:qpt_target a=%di"], ["uq has no argument 'nope'"]),
    (["trace", "uprobe:/bin/uprog:qpt_target retval"], ["retval: bpftrace has it in uretprobes only"]),
    (["trace", "uretprobe:/bin/uprog:qpt_target+4"], ["a uretprobe is on a function's entry"]),
    (["trace", "perf -x /bin/uprog qpt_target:12"], ["lines need DWARF"]),
    (["trace", "perf -x /bin/uprog qpt_target file->f_pos"], ["C variables need the program's DWARF"]),
    (["trace", "perf -x /bin/uprog"], ["usage: perf -x PATH"]),
    (["funcs", "-x", "bin/uprog"], ["-x 'bin/uprog': give the file's absolute path"]),
]


@pytest.mark.parametrize(("argv", "words"), CASES, ids=[" ".join(a) for a, _ in CASES])
def test_bad_uprobe_input_is_one_line(capsys: pytest.CaptureFixture[str], argv: list[str], words: list[str]) -> None:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    for word in words:
        assert word in err


def test_a_filter_is_checked_against_a_uprobe_lines_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["trace", "--filter", "x == 1", "p:uq /bin/uprog:qpt_target a=%di"]) == 2
    assert capsys.readouterr().err.splitlines() == ["qprobe: error: Field not found", "x == 1", "^"]


def test_uprobes_go_down_parsed_user_forms_as_text_and_kprobes_as_parsed() -> None:
    args = cli.build_parser().parse_args(
        ["trace", "p:uq /bin/uprog:qpt_target a=%di", "p:rd vfs_read", "uprobe:/bin/uprog:qpt_target arg0"]
    )
    down, checked = definitions._parse_definitions(args)
    assert down[0] == parse_definition("p:uq /bin/uprog:qpt_target a=%di")
    assert down[2] == "uprobe:/bin/uprog:qpt_target arg0"
    assert not isinstance(down[1], str) and down[1].symbol == "vfs_read"
    assert [ev.event for ev in checked] == ["uq", "rd", "qpt_target"]
    assert [a.name for a in checked[2].args] == ["arg0"]


def test_before_boot_the_registers_are_those_of_the_vmlinux_s_architecture(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """bpftrace's argN become the argument registers of the architecture vmlinux is built for, which its
    language takes as %REG, and x86's %di is refused there as the kernel refuses it."""
    other = replace(X86, arg_regs=("x0", "x1"), stack_args=0, pt_regs=("x0", "x1", "sp", "pc"))
    monkeypatch.setattr(qprobe.wiring, "vmlinux_arch", lambda symbols: SimpleNamespace(registers=other))
    args = cli.build_parser().parse_args(["trace", "uprobe:/bin/uprog:qpt_target arg0 arg2"])
    _, checked = definitions._parse_definitions(args)
    assert [a.definition for a in checked[0].args] == ["arg0=%x0:u64", "arg2=+0(%sp):u64"]
    assert cli.main(["trace", "--run", "true", "p:uq /bin/uprog:qpt_target a=%di"]) == 2
    assert capsys.readouterr().err.startswith("qprobe: error: Invalid register name")


def test_user_forms() -> None:
    def resolve(path: str, spec: str) -> int:
        return {"qpt_target": 0x1A50, "qpt_target+4": 0x1A54}[spec]

    zeros = unresolved_syntax(parse_definition("p:uq /bin/uprog:qpt_target+4%return a=1"))
    assert zeros == parse_definition("p:uq /bin/uprog:000000000000%return a=1")
    assert unresolved_syntax(parse_definition("p:uq /bin/uprog:0x1a50 a=%di")).text == "p:uq /bin/uprog:0x1a50 a=%di"
    assert is_user_form("perf -x /bin/uprog qpt_target") and is_user_form("uprobe:/bin/uprog:qpt_target")
    assert not is_user_form("perf vfs_read") and not is_user_form("p:uq /bin/uprog:qpt_target")
    assert user_form_definition("perf -x /bin/uprog qpt_target%return ret=$retval", resolve, X86) == (
        "r:probe_uprog/qpt_target__return /bin/uprog:0x1a50 ret=$retval"
    )
    assert user_form_definition("uprobe:/bin/uprog:qpt_target+4 arg1 comm pid", resolve, X86) == (
        "p:uprobes/qpt_target /bin/uprog:0x1a54 arg1=%si:u64 comm=$comm"
    )


def test_funcs_x_lines() -> None:
    from qprobe.kernel.userelf import UserFunction

    class Elf:
        def functions(self, pattern: str = "*") -> list[UserFunction]:
            import fnmatch

            fs = [UserFunction("qpt_target", 0x1A50, 0x1A50, 60), UserFunction("main", 0x1100, 0x1100, 300)]
            return [f for f in fs if fnmatch.fnmatchcase(f.name, pattern)]

    text, summary, n = render_user_funcs(Elf(), "/bin/uprog", [])  # type: ignore[arg-type]
    assert text == "0x00001100      300 main\n0x00001a50       60 qpt_target\n" and n == 2
    assert summary == "2 functions match any name in /bin/uprog (file offset, size, name)"
    assert render_user_funcs(Elf(), "/bin/uprog", ["nope*"])[1:] == ("no function of /bin/uprog matches 'nope*'", 0)  # type: ignore[arg-type]


def test_funcs_x_marks_an_indirect_function() -> None:
    from qprobe.kernel.userelf import UserFunction

    class Elf:
        def functions(self, pattern: str = "*") -> list[UserFunction]:
            return [
                UserFunction("strlen", 0x9F1C0, 0x9F1C0, 129, ifunc=True),
                UserFunction("getppid", 0xD54F0, 0xD54F0, 8),
            ]

    text, summary, n = render_user_funcs(Elf(), "/lib/libc.so.6", [])  # type: ignore[arg-type]
    assert text == "0x0009f1c0      129 strlen [ifunc]\n0x000d54f0        8 getppid\n" and n == 2
    assert summary == ("2 functions match any name in /lib/libc.so.6 (file offset, size, name); [ifunc]: an indirect "
                       "function, at its resolver (NAME@impl: the implementation picked)")  # fmt: skip


def test_each_definition_is_read_once_before_boot(parse_reads: dict[str, Counter[str]]) -> None:
    texts = ["p:uq /bin/uprog:qpt_target a=%di", "p:rd vfs_read", "uprobe:/bin/uprog:qpt_target arg0"]
    definitions._parse_definitions(cli.build_parser().parse_args(["trace", *texts]))
    symbolic = "p:uprobes/qpt_target /bin/uprog:qpt_target arg0=%di:u64"  # the bpftrace form, translated once
    assert {t: n for t, n in parse_reads["symbolic_user_form"].items() if n} == {texts[2]: 1}
    assert {t: n for t, n in parse_reads["split_args"].items() if n} == {texts[0]: 1, texts[1]: 1, symbolic: 1}
    assert {t: n for t, n in parse_reads["parse_definition"].items() if n} == {texts[0]: 1, texts[1]: 1, symbolic: 1}
