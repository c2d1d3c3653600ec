"""No x86 fact in the code outside qprobe/arch/: register names, the int3 opcode, ``__fentry__``'s call size.

Everything an architecture decides reaches the rest of qprobe through the ``Arch`` seam
(qprobe/arch/__init__.py; docs/porting.md), so a second architecture changes nothing outside
qprobe/arch/.  The check reads the code's tokens: comments and docstrings may name x86's registers
(they explain, and kprobe_events' own syntax, ``%di``, is the user's language), code may not.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "qprobe"
ARCH = PACKAGE / "arch"

# x86_64's registers by the gdbstub's names, and the pt_regs field that is no register (orig_ax).
X86_REGISTERS = frozenset({"rax", "rbx", "rcx", "rdx", "rsi", "rdi", "rsp", "rbp", "rip", "eflags", "orig_ax",
                           "gs_base", "k_gs_base", "fs_base", "efer", "cr0", "cr2", "cr3", "cr4"})  # fmt: skip
# "rsp" is also the gdb Remote Serial Protocol's name (qprobe.vmm.rsp, the transport "rsp"): as a string, and
# as a module name after "." or "import", it is that.
PROTOCOL = "rsp"
INT3 = re.compile(r"^0[xX][cC][cC]$")  # the opcode as a number; in bytes literals, \xcc
FTRACE_WORD = re.compile(r"fentry|mcount|ftrace", re.IGNORECASE)
FENTRY_CALL_SIZE = "5"


def docstrings(source: str) -> set[tuple[int, int]]:
    """Where each docstring (of the module, a class, a function) starts: (line, column)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                found.add((first.lineno, first.col_offset))
    return found


def x86_facts(source: str) -> list[str]:
    """The x86 facts in ``source``'s code (not its comments or docstrings), one line each."""
    skip = docstrings(source)
    found: list[str] = []
    line: list[tokenize.TokenInfo] = []  # the logical line's code tokens

    def end_line() -> None:
        if any(t.type == tokenize.NUMBER and t.string == FENTRY_CALL_SIZE for t in line) and any(
            FTRACE_WORD.search(t.string) for t in line if t.type in (tokenize.NAME, tokenize.STRING)
        ):
            found.append(f"{line[0].start[0]}: a call size of 5 beside ftrace's call site")
        line.clear()

    previous = ""
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.COMMENT, tokenize.NL) or (tok.type == tokenize.STRING and tok.start in skip):
            continue
        if tok.type in (tokenize.NEWLINE, tokenize.ENDMARKER):
            end_line()
            continue
        line.append(tok)
        where = tok.start[0]
        if tok.type == tokenize.NAME and tok.string in X86_REGISTERS:
            if not (tok.string == PROTOCOL and previous in (".", "import")):
                found.append(f"{where}: the name {tok.string}")
        elif tok.type in (tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", -1)):
            words = set(re.findall(r"[A-Za-z_][A-Za-z_0-9]*", tok.string)) & (X86_REGISTERS - {PROTOCOL})
            found.extend(f"{where}: {word} in a string" for word in sorted(words))
            if re.search(r"\\x[cC][cC]", tok.string):
                found.append(f"{where}: the int3 opcode in a string")
        elif tok.type == tokenize.NUMBER and INT3.match(tok.string):
            found.append(f"{where}: the int3 opcode {tok.string}")
        previous = tok.string
    return found


SOURCES = sorted(p for p in PACKAGE.rglob("*.py") if ARCH not in p.parents)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_no_x86_fact_outside_the_arch_packages(path: Path) -> None:
    assert not x86_facts(path.read_text()), f"{path.relative_to(PACKAGE.parent)}: " + "; ".join(
        x86_facts(path.read_text())
    )


def test_the_check_sees_x86_facts_in_code_and_not_in_comments_or_docstrings() -> None:
    source = '''"""Reads %di and rip (a docstring)."""
from qprobe.vmm.rsp import StopReply


def f(regs: dict[str, int], transport: str = "rsp") -> int:
    """rax is in a docstring."""
    rip = regs["rip"]  # rip in a comment
    return rip + 0xCC + len(b"\\xcc") + FtraceSite("__fentry__", 5).size
'''
    assert x86_facts(source) == [
        "7: the name rip",
        "7: rip in a string",
        "8: the name rip",
        "8: the int3 opcode 0xCC",
        "8: the int3 opcode in a string",
        "8: a call size of 5 beside ftrace's call site",
    ]
