"""Uprobes through the front ends: ``qprobe trace`` and ``qprobe funcs -x`` as subprocesses, the shell line by line.

The oracle is the guest's program: ``uprog call N A B STR`` calls ``qpt_target(A+i, B, STR)``, i = 0..N-1,
which returns A+i+B, and says so in its summary line; ``uprog lib N A B`` calls ``qpt_lib_add(A+i, B)`` in
``/usr/lib/libqpt.so``.  File offsets come from LIEF on the host's copy of the guest tree (the same bytes).
"""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import lief
import pytest

import qprobe
from qprobe.images.guest import guest_tree
from qprobe.shell import Shell

from .conftest import IMAGE
from .conftest import shell_do as do

pytestmark = pytest.mark.vm
ROOT = Path(__file__).resolve().parents[2]
# One ftrace line's event and body: "uprog-57 [001] ..... 1.2: uq: (0x5654...) a=0x1 ...", a uprobe's place
# "(IP)" or "(IP <- FUNC)"
LINE = re.compile(r"^\s*(\S+)-(\d+)\s+\[\d+\] \S+\s+[\d.]+: (\w+): \((0x[0-9a-f]+|)(?: <- (0x[0-9a-f]+))?[^)]*\)(.*)$")


def _qprobe(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "qprobe.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)  # fmt: skip


def uprog_summary(text: str, mode: str) -> dict[str, str]:
    """The keys of the ``uprog mode=MODE`` line."""
    (line,) = [ln for ln in text.splitlines() if ln.startswith(f"uprog mode={mode} ")]
    return dict(kv.split("=", 1) for kv in line.split()[1:])


def functions(path: str) -> dict[str, tuple[int, int]]:
    """Name -> (file offset, size) of the functions ``path`` defines, from LIEF on the host's copy."""
    elf = lief.parse(str(guest_tree() / path.lstrip("/")))
    assert elf is not None
    return {s.name: (int(elf.virtual_address_to_offset(s.value)), s.size) for s in elf.symtab_symbols
            if s.type == lief.ELF.Symbol.TYPE.FUNC and s.shndx != 0 and s.value}  # fmt: skip


def test_trace_prints_the_programs_calls_and_returns() -> None:
    """A symbol, an offset with %return and a kprobe in one command: exactly the command's hits."""
    offset, _ = functions("/bin/uprog")["qpt_target"]
    out = _qprobe("trace", "--image", IMAGE, "--run", "uprog call 5 1 2 hi; uprog getppid 2",
                  "p:uq /bin/uprog:qpt_target a=%di b=%si s=+0(%dx):string",
                  f"p:uqr /bin/uprog:{offset:#x}%return ret=$retval:s64",
                  "p:gp __x64_sys_getppid")  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    res = uprog_summary(out.stderr, "call")
    assert (res["n"], res["calls"], res["bad"], res["a"], res["b"], res["s"]) == ("5", "5", "0", "1", "2", "hi")
    lines = out.stdout.splitlines()
    hits = [LINE.match(ln) for ln in lines if not ln.startswith("#")]
    assert all(hits), lines
    entries = [m.group(6) for m in hits if m and m.group(3) == "uq"]
    a, b = int(res["a"]), int(res["b"])
    assert entries == [f' a={a + i:#x} b={b:#x} s="hi"' for i in range(5)], lines
    rets = [m for m in hits if m and m.group(3) == "uqr"]
    assert [m.group(6) for m in rets] == [f" ret={a + i + b}" for i in range(5)], lines
    assert int(res["ret"]) == a + 4 + b
    # Each return names the probed address: the entry's.
    entry_ips = {m.group(4) for m in hits if m and m.group(3) == "uq"}
    assert {m.group(5) for m in rets} == entry_ips and len(entry_ips) == 1
    assert len([m for m in hits if m and m.group(3) == "gp"]) == 2
    assert [ln for ln in lines if ln.startswith("#")] == [
        "# uq: hits=5 nmissed=0 lost=0 others=0",
        "# uqr: hits=5 nmissed=0 lost=0 others=0",
        "# gp: hits=2 nmissed=0 lost=0 others=0",
    ]


def test_trace_a_shared_librarys_function_into_a_map_by_comm() -> None:
    out = _qprobe("trace", "--image", IMAGE, "--run", "uprog lib 4 10 5", "--map", "sum(arg0) by $comm",
                  "uprobe:/usr/lib/libqpt.so:qpt_lib_add arg0")  # fmt: skip
    assert out.returncode == 0, out.stderr
    res = uprog_summary(out.stderr, "lib")
    assert (res["calls"], res["bad"], res["a"]) == ("4", "0", "10")
    assert "writing event: p:uprobes/qpt_lib_add /usr/lib/libqpt.so:0x" in out.stderr
    assert out.stdout.splitlines() == ["@arg0[uprog]: 46", "# qpt_lib_add: hits=4 nmissed=0 lost=0 others=0"]


def test_trace_json_of_a_perf_x_definition() -> None:
    out = _qprobe("trace", "--image", IMAGE, "--json", "--run", "uprog lib 2 7 1",
                  "perf -x /usr/lib/libqpt.so qpt_lib_add a=%di:s64 b=%si:s64")  # fmt: skip
    assert out.returncode == 0, out.stderr
    offset, _ = functions("/usr/lib/libqpt.so")["qpt_lib_add"]
    line = f"p:probe_libqpt/qpt_lib_add /usr/lib/libqpt.so:{offset:#x} a=%di:s64 b=%si:s64"
    assert f"qprobe: writing event: {line}" in out.stderr.splitlines()
    rows = [json.loads(ln) for ln in out.stdout.splitlines()]
    assert [r["args"] for r in rows[:-1]] == [{"a": 7, "b": 1}, {"a": 8, "b": 1}], rows
    assert {r["comm"] for r in rows[:-1]} == {"uprog"}
    assert rows[-1]["summary"]["qpt_lib_add"]["hits"] == 2


def test_funcs_x_lists_a_programs_functions_with_their_file_offsets() -> None:
    out = _qprobe("funcs", "--image", IMAGE, "-x", "/bin/uprog", "qpt_*")
    assert out.returncode == 0, out.stderr
    want = {name: v for name, v in functions("/bin/uprog").items() if name.startswith("qpt_")}
    got = {}
    for line in out.stdout.splitlines():
        offset, size, name = line.split()
        got[name] = (int(offset, 16), int(size))
    assert got == want and want, out.stdout
    assert f"{len(want)} functions match 'qpt_*' in /bin/uprog" in out.stderr


def test_a_bad_symbol_is_one_line_and_exit_2() -> None:
    out = _qprobe("trace", "--image", IMAGE, "--run", "true", "p:uq /bin/uprog:qpt_nope a=%di")
    assert out.returncode == 2
    errors = [ln for ln in out.stderr.splitlines() if not ln.startswith("qprobe: booting")]
    assert "Traceback" not in out.stderr
    assert errors[0].startswith("qprobe: error: ") and "/bin/uprog has no function 'qpt_nope'" in errors[0], errors
    assert errors[1:] == ["p:uq /bin/uprog:qpt_nope a=%di", " " * 5 + "^"], errors


@pytest.fixture
def shell(target: qprobe.Target, qprobe_reset: object) -> Iterator[tuple[Shell, io.StringIO]]:
    out = io.StringIO()
    yield Shell(target, out=out), out
    for te in list(target.events.values()):
        target.remove_event(te)


def test_shell_adds_lists_counts_and_removes_uprobe_events(
    target: qprobe.Target, shell: tuple[Shell, io.StringIO]
) -> None:
    sh, out = shell
    offset, _ = functions("/usr/lib/libqpt.so")["qpt_lib_add"]
    added = do(sh, out, "p:ul /usr/lib/libqpt.so:qpt_lib_add a=%di:s64 b=%si:s64")
    assert added.startswith("added uprobes/ul  (user-space probe on /usr/lib/libqpt.so:0x"), added
    assert do(sh, out, "events") == f"p:uprobes/ul /usr/lib/libqpt.so:0x{offset:016x} a=%di:s64 b=%si:s64\n"
    assert "writing event: r:uprobes/qpt_target__return /bin/uprog:0x" in do(
        sh, out, "uretprobe:/bin/uprog:qpt_target retval"
    )
    text = do(sh, out, "count ul by $comm run uprog lib 4 10 5")
    assert "@[uprog]: 4" in text.splitlines() and "calls=4 bad=0" in text, text
    text = do(sh, out, "sum(a) ul by $pid run uprog lib 3 10 5")
    pid = uprog_summary(text, "lib")["pid"]
    assert f"@a[{pid}]: 33" in text.splitlines(), text  # 10 + 11 + 12
    text = do(sh, out, "count qpt_target__return by retval run uprog call 2 1 2 x")
    assert {"@[3]: 1", "@[4]: 1"} <= set(text.splitlines()), text
    shown = do(sh, out, "show ul run uprog lib 2 7 1")
    bodies = [m.group(6) for m in map(LINE.match, shown.splitlines()) if m and m.group(3) == "ul"]
    assert bodies == [" a=7 b=1", " a=8 b=1"], shown
    assert do(sh, out, "-:ul") == "removed uprobes/ul (9 hits)\n"
    assert do(sh, out, "-:qpt_target__return") == "removed uprobes/qpt_target__return (2 hits)\n"
    assert not target.events and not target.uprobes.registered()
