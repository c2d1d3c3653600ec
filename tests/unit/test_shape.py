"""The package's shape, held by a test: no module over 500 lines, no class over 25 methods or 400 lines
(Protocols included), and a README of at most 200 lines.

What is over a limit today is listed with its size now, as a ceiling: it may shrink, never grow, and
its entry must go once it is within the limits (the test says so), so the list only gets shorter.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "qprobe"
MODULE_LINES, CLASS_METHODS, CLASS_LINES, README_LINES = 500, 25, 400, 200

# module -> its lines now
MODULES_OVER = {
    "qprobe/api.py": 822,
    "qprobe/arch/x86_64/arch.py": 531,
    "qprobe/core/uprobes.py": 512,
    "qprobe/fetch/event.py": 536,
    "qprobe/kernel/perfprobe.py": 586,
    "qprobe/kernel/symbols.py": 553,
}
# module:class -> (its methods, its lines) now
CLASSES_OVER = {
    "qprobe/api.py:Target": (38, 615),
    "qprobe/arch/__init__.py:Arch": (52, 132),
    "qprobe/arch/x86_64/arch.py:X86_64": (53, 396),
    "qprobe/core/kprobes.py:KprobeManager": (27, 454),
    "qprobe/core/uprobes.py:UprobeManager": (29, 367),
    "qprobe/kernel/symbols.py:Symbols": (28, 290),
    "qprobe/vmm/gdbmi.py:GdbMiRemote": (27, 331),
    "qprobe/vmm/gdbremote.py:GdbRemote": (26, 280),
}


def _sources() -> dict[str, str]:
    return {path.relative_to(ROOT).as_posix(): path.read_text() for path in sorted(PACKAGE.rglob("*.py"))}


def _classes() -> dict[str, tuple[int, int]]:
    out = {}
    for name, text in _sources().items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                methods = sum(isinstance(b, ast.FunctionDef | ast.AsyncFunctionDef) for b in node.body)
                assert node.end_lineno is not None
                out[f"{name}:{node.name}"] = (methods, node.end_lineno - node.lineno + 1)
    return out


@pytest.mark.parametrize("name", sorted(_sources()))
def test_a_module_stays_within_its_lines(name: str) -> None:
    lines = len(_sources()[name].splitlines())
    ceiling = MODULES_OVER.get(name)
    if ceiling is None:
        assert lines <= MODULE_LINES, f"{name} has {lines} lines, over {MODULE_LINES}: split it along its concepts"
    else:
        assert lines <= ceiling, f"{name} grew to {lines} lines (it had {ceiling}, over {MODULE_LINES} already)"
        assert lines > MODULE_LINES, f"{name} is within {MODULE_LINES} lines now: take it out of MODULES_OVER"


def test_a_class_stays_within_its_methods_and_lines() -> None:
    found = _classes()
    grown = []
    for name, (methods, lines) in found.items():
        cm, cl = CLASSES_OVER.get(name, (CLASS_METHODS, CLASS_LINES))
        if methods > cm or lines > cl:
            grown.append(f"{name}: {methods} methods, {lines} lines (at most {cm} and {cl})")
    assert not grown, grown
    within = [n for n in CLASSES_OVER if n in found and found[n][0] <= CLASS_METHODS and found[n][1] <= CLASS_LINES]
    assert not within, f"within {CLASS_METHODS} methods and {CLASS_LINES} lines now, take out of CLASSES_OVER: {within}"
    assert set(CLASSES_OVER) <= set(found), f"gone, take out of CLASSES_OVER: {set(CLASSES_OVER) - set(found)}"


def test_the_readme_stays_short() -> None:
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_LINES, f"README.md has {lines} lines, over {README_LINES}: the rest belongs in docs/"
