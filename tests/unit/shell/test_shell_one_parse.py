"""The shell reads a definition's text once: its kprobe_events, uprobe_events and bpftrace lines."""

from __future__ import annotations

from collections import Counter

from shell_fakes import make_shell


def _texts(counts: Counter[str]) -> dict[str, int]:
    return {text: n for text, n in counts.items() if n}


def test_a_kprobe_line_is_tokenised_once(parse_reads: dict[str, Counter[str]]) -> None:
    shell, t, _out = make_shell()
    text = "p:rd vfs_read fd=%di:s32"
    shell.execute(text)
    assert "kprobes/rd" in t.events
    assert _texts(parse_reads["split_args"]) == {text: 1}
    assert _texts(parse_reads["parse_definition"]) == {text: 1}


def test_a_uprobe_line_is_tokenised_once(parse_reads: dict[str, Counter[str]]) -> None:
    shell, t, _out = make_shell()
    text = "p:uq /bin/uprog:qpt_target a=%di"
    shell.execute(text)
    assert "uprobes/uq" in t.events
    assert _texts(parse_reads["split_args"]) == {text: 1}
    assert _texts(parse_reads["parse_definition"]) == {text: 1}


def test_a_bpftrace_line_is_translated_then_tokenised_once(parse_reads: dict[str, Counter[str]]) -> None:
    shell, t, _out = make_shell()
    text = "uprobe:/bin/uprog:qpt_target arg0"
    shell.execute(text)
    assert "uprobes/qpt_target" in t.events
    line = "p:uprobes/qpt_target /bin/uprog:0x1a50 arg0=%di:u64"
    assert _texts(parse_reads["user_form_definition"]) == {text: 1}
    assert _texts(parse_reads["split_args"]) == {line: 1}
    assert _texts(parse_reads["parse_definition"]) == {line: 1}
