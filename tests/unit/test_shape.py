"""The package's shape, held by a test: no module over 500 lines, no class over 25 methods or 400 lines
(Protocols included), and a README of at most 200 lines.  Nothing is exempt: what outgrows a limit is
split along its concepts.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "qprobe"
MODULE_LINES, CLASS_METHODS, CLASS_LINES, README_LINES = 500, 25, 400, 200


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
    assert lines <= MODULE_LINES, f"{name} has {lines} lines, over {MODULE_LINES}: split it along its concepts"


def test_a_class_stays_within_its_methods_and_lines() -> None:
    over = [f"{name}: {methods} methods, {lines} lines (at most {CLASS_METHODS} and {CLASS_LINES})"
            for name, (methods, lines) in _classes().items()
            if methods > CLASS_METHODS or lines > CLASS_LINES]  # fmt: skip
    assert not over, f"split along their concepts: {over}"


def test_the_readme_stays_short() -> None:
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_LINES, f"README.md has {lines} lines, over {README_LINES}: the rest belongs in docs/"
