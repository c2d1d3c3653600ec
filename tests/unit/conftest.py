"""``parse_reads``: every entry that reads a probe definition's text, counted per text, for the one-parse
tests of the events layer (test_one_parse.py) and of the shell (shell/test_shell_one_parse.py)."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from qprobe.fetch import Definition

# Every entry that reads a definition's text (or a word list made from it): (module, function).
ENTRIES = (
    ("qprobe.fetch.kstrto", "split_args"),
    ("qprobe.fetch.definition", "parse_definition"),
    ("qprobe.fetch.event", "parse_event"),
    ("qprobe.fetch.event", "parse_events"),
    ("qprobe.fetch.uevent", "parse_uprobe_event"),
    ("qprobe.fetch.uevent", "parse_uprobe_events"),
    ("qprobe.kernel.perfsyntax", "parse_perf_probe"),
    ("qprobe.kernel.usyntax", "user_form_definition"),
    ("qprobe.kernel.usyntax", "symbolic_user_form"),
    ("qprobe.kernel.usyntax", "perf_uprobe_definition"),
    ("qprobe.kernel.usyntax", "bpftrace_uprobe_definition"),
)


def _key(value: object) -> str:
    """The text an entry was given: a text, a Definition's text, or a word list's line."""
    return value.text if isinstance(value, Definition) else str(value)


@pytest.fixture
def parse_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Counter[str]]]:
    """For each entry, how many times each text went through it."""
    counts: dict[str, Counter[str]] = {name: Counter() for _, name in ENTRIES}
    for module, name in ENTRIES:
        __import__(module)
        original = getattr(sys.modules[module], name)

        def counting(*args: Any, _f: Callable[..., Any] = original, _n: str = name, **kwargs: Any) -> Any:
            counts[_n][_key(args[0])] += 1
            return _f(*args, **kwargs)

        holders = [m for n, m in list(sys.modules.items())
                   if n.startswith("qprobe") and getattr(m, name, None) is original]  # fmt: skip
        assert sys.modules[module] in holders
        for holder in holders:
            monkeypatch.setattr(holder, name, counting)
    yield counts
