"""bpftrace's spellings of a map in the shell and ``trace --map``: the same maps as the shell's own words."""

from __future__ import annotations

import io

import pytest
from shell_fakes import make_shell

from qprobe.shell import Shell
from qprobe.shell.collect import parse_map
from qprobe.shell.mapsyntax import map_line
from qprobe.shell.parse import ShellUsageError


def run(shell: Shell, out: io.StringIO, line: str) -> list[str]:
    out.seek(0)
    out.truncate()
    shell.execute(line)
    return out.getvalue().splitlines()


@pytest.mark.parametrize(
    ("line", "named"),
    [
        ("count()", (None, "count")),
        ("count() rd by $comm run workload read 5 1", (None, "count rd by $comm run workload read 5 1")),
        ("@[$comm] = count() rd run workload  read 5 1", ("", "count rd by $comm run workload  read 5 1")),
        ("@x = sum(count)", ("x", "sum(count)")),
        ("@[$comm, $pid]=count()", ("", "count by $comm, $pid")),
        ("@b[$comm] = lhist(count, 0, 4096, 512) rd every 1", ("b", "lhist(count, 0, 4096, 512) rd by $comm every 1")),
        ("@ = hist(count)", ("", "hist(count)")),
        ("@m[fd] = max(count) rd", ("m", "max(count) rd by fd")),
        ("sum(count) rd", None),  # the shell's own spelling
        ("counter", None),
    ],
)
def test_bpftrace_spellings_become_the_shell_s_own(line: str, named: tuple[str | None, str] | None) -> None:
    assert map_line(line) == named


@pytest.mark.parametrize(
    ("line", "error"),
    [
        ("count(x)", "count() takes no argument, not 'x' (count by KEY counts by a key)"),
        ("@x[$comm = count()", "'@x[$comm = count()': '[' without ']' (expected @NAME[KEY, ...] = FUNC(ARGS))"),
        (
            "@x = foo(a)",
            "unknown map function foo(): one of count(), sum(), avg(), min(), max(), stats(), hist(), lhist()",
        ),
        (
            "@x = 3",
            "@x = needs a map function (count(), sum(), avg(), min(), max(), stats(), hist(), lhist()), not '3'",
        ),
        ("@[] = count()", "@[]: an empty key (give KEY, ... inside the brackets, or no brackets)"),
        ("@[$comm] = count() by $pid", "a map's keys go in its brackets or after 'by', not both"),
        ("@x count()", "'@x count()': expected @NAME[KEY, ...] = FUNC(ARGS)"),
    ],
)
def test_a_bad_spelling_is_one_line_naming_the_problem(line: str, error: str) -> None:
    with pytest.raises(ShellUsageError) as exc:
        map_line(line)
    assert str(exc.value) == error


@pytest.mark.parametrize(
    ("text", "kind", "keys", "value", "name"),
    [
        ("count", "count", (), None, ""),
        ("count()", "count", (), None, ""),
        ("count() by $comm", "count", ("$comm",), None, ""),
        ("@[$comm] = count()", "count", ("$comm",), None, ""),
        ("@n[$comm] = count()", "count", ("$comm",), None, "n"),
        ("@[$comm] = sum(count)", "sum", ("$comm",), "count", ""),
        ("sum(count) by $comm", "sum", ("$comm",), "count", "count"),
        ("@bytes = avg(count)", "avg", (), "count", "bytes"),
        ("@[$pid] = min(count)", "min", ("$pid",), "count", ""),
        ("@[$pid] = max(count)", "max", ("$pid",), "count", ""),
        ("@h = hist(count)", "hist", (), "count", "h"),
        ("@l[$comm] = lhist(count, 0, 4096, 512)", "lhist", ("$comm",), "count", "l"),
    ],
)
def test_trace_map_takes_every_spelling(
    text: str, kind: str, keys: tuple[str, ...], value: str | None, name: str
) -> None:
    agg, every = parse_map(text)
    assert (agg.kind, agg.keys, agg.value, agg.name, every) == (kind, keys, value, name, None)


def test_the_shell_counts_with_bpftrace_s_spelling_and_its_name() -> None:
    shell, _t, out = make_shell()
    run(shell, out, "p:rd ksys_read fd=%di:s32 count=%dx:u64")
    assert "@reads[workload]: 3" in run(shell, out, "@reads[$comm] = count() rd run workload getppid 3")
    assert "@: 2" in run(shell, out, "count() rd run workload getppid 2")
    assert run(shell, out, "@x = foo(count) rd") == [
        "error: unknown map function foo(): one of count(), sum(), avg(), min(), max(), stats(), hist(), lhist()"
    ]
