"""The guest's user-space test programs: uprog (dynamic, with the host's libc), uprog-static and libqpt.so run.

Nothing is probed: these check the programs the user-space probe tests rely on do what their summary lines say, on
each image's kernel (minimal-6.12 included: threads need its CONFIG_FUTEX) and from the ext2 disk
(``--qprobe-image debian-cloud-disk``).
"""

from __future__ import annotations

import re

import pytest

import qprobe

from .conftest import workload_result

PROGRAMS = ["uprog", "uprog-static"]
ARITHMETIC_FLAGS = 0x8D5  # CF, PF, AF, ZF, SF, OF
ZF = 0x40


def uprog_result(output: str) -> dict[str, str]:
    """The ``uprog mode=...`` summary line's key=value pairs."""
    line = next((x for x in output.splitlines() if x.startswith("uprog mode=")), None)
    if line is None:
        pytest.fail(f"uprog printed no summary line; its output was {output!r}")
    return dict(part.split("=", 1) for part in line.split()[1:])


def run_uprog(target: qprobe.Target, command: str) -> tuple[dict[str, str], str]:
    r = target.run(command)
    assert r.status == 0, f"{command} exited {r.status}: {r.output!r}"
    return uprog_result(r.output), r.output


@pytest.mark.parametrize("prog", PROGRAMS)
def test_calls_and_returns(target: qprobe.Target, prog: str) -> None:
    build = "static" if prog.endswith("static") else "dynamic"
    res, _ = run_uprog(target, f"{prog} call 3 10 5 hi")
    assert res == {"mode": "call", "build": build, "n": "3", "pid": res["pid"], "ret": "17", "calls": "3",
                   "bad": "0", "a": "10", "b": "5", "s": "hi"}  # fmt: skip
    res, _ = run_uprog(target, f"{prog} lib 4 -5 3")
    assert (res["ret"], res["calls"], res["bad"]) == ("1", "4", "0")
    res, _ = run_uprog(target, f"{prog} recurse 50")
    assert (res["ret"], res["calls"], res["bad"]) == ("50", "51", "0")
    # getppid: sh -c runs uprog as a child (not its last command, so not exec'd).
    res, out = run_uprog(target, f"sh -c '{prog} getppid 2; echo sh=$$'")
    assert f"sh={res['ret']}" in out.splitlines() and res["calls"] == "2"


@pytest.mark.parametrize("prog", PROGRAMS)
def test_processes_threads_and_mappings(target: qprobe.Target, prog: str) -> None:
    res, out = run_uprog(target, f"{prog} fork 2 3")
    children = [line for line in out.splitlines() if line.startswith("uprog-child ")]
    assert len(children) == 2 and all(f"ppid={res['pid']} " in c and "calls=3 " in c for c in children)
    assert (res["calls"], res["children"], res["crashed"], res["bad"]) == ("9", "2", "0", "0")
    res, _ = run_uprog(target, f"{prog} threads 3 10")
    assert (res["calls"], res["ret"], res["threads"], res["bad"]) == ("30", "12", "3", "0")
    res, _ = run_uprog(target, f"{prog} selfmod 4")
    assert (res["calls"], res["ret"], res["bad"]) == ("4", "3", "0")
    res, _ = run_uprog(target, f"{prog} remap 4")
    assert (res["calls"], res["ret"], res["bad"]) == ("4", "3", "0")
    res, out = run_uprog(target, f"{prog} exec 2")
    pre = re.search(r"^uprog-exec pid=(\d+) calls=2 ret=1 bad=0 exe=/bin/(\S+)$", out, re.M)
    assert pre and pre[1] == res["pid"] and pre[2] == prog
    assert (res["mode"], res["calls"], res["s"]) == ("call", "2", "exec")


def test_dynamic_program_maps_the_libraries(target: qprobe.Target) -> None:
    """While it sleeps, /proc/PID/maps shows uprog's loader, libc and libqpt at the paths the docs give."""
    r = target.run("uprog wait-then-call 2 3 >/tmp/uprog.out & sleep 1; cat /proc/$!/maps; wait $!; cat /tmp/uprog.out")
    assert r.status == 0, r.output
    mapped = {line.split()[-1] for line in r.output.splitlines() if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line)}
    assert {"/bin/uprog", "/usr/lib/libqpt.so", "/lib64/ld-linux-x86-64.so.2"} <= mapped
    assert any(path.endswith("/libc.so.6") for path in mapped), mapped
    res = uprog_result(r.output)
    assert (res["calls"], res["lib_calls"], res["ret"], res["bad"]) == ("3", "3", "2", "0")
    assert re.search(rf"^uprog pid={res['pid']} target=0x[0-9a-f]+ lib=0x[0-9a-f]+$", r.output, re.M)


def test_the_guest_cpu_gives_cmpxchg16b_its_flags_or_does_not_offer_it(target: qprobe.Target) -> None:
    """QEMU 7.2's TCG leaves an earlier operand in EFLAGS after cmpxchg16b (the kernel double-faulted on it in
    SLUB's fast path during probed boots): the guest's CPU either does not offer the instruction or gives it
    the flags a real CPU does (a successful compare: ZF, IF and the always-one bit, nothing else)."""
    r = target.run("workload cx16")
    assert r.status == 0, r.output
    found = workload_result(r.output)
    assert found.get("cx16") in ("0", "1"), r.output
    if found["cx16"] == "1":
        flags = int(found["flags"], 16)
        assert flags & ~ARITHMETIC_FLAGS == 0x202 and flags & ZF, f"EFLAGS after cmpxchg16b: {flags:#x}"
