"""The aggregations a bpftrace user types first, exact on a hot loop, with the guest kernel as the oracle.

``workload read N 1`` makes N reads; the guest's own kprobe event on the same
function, enabled only while the workload runs (one command line, so the shell
reads nothing in between), counts them in ``kprobe_profile``.  Every map the
shell and ``qprobe trace --map`` print over the same run must give that number:
no key, ``$comm``, ``$pid``, ``$func`` with ``$comm``, ``sum`` and ``hist`` of
the byte count, with one workload and with one on each of two vCPUs at once.
"""

from __future__ import annotations

import io
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import qprobe
from qprobe.events.fold import GuestMaps, fold_path
from qprobe.shell.core import Shell

from .conftest import IMAGE, shell_do, workload_result
from .guest_oracle import TRACING

pytestmark = pytest.mark.vm
ROOT = Path(__file__).resolve().parents[2]
N = 100_000
DEFINITION = "p:rd ksys_read fd=%di:s32 count=%dx:u64"


@pytest.fixture
def guest_event(target: qprobe.Target) -> Iterator[str]:
    """The guest's own kprobe event on ksys_read, defined but disabled; yields its events directory."""
    if target.run(f"test -e {TRACING}/kprobe_events").status != 0:
        pytest.skip("the guest kernel has no kprobe_events (CONFIG_KPROBE_EVENTS)")
    target.run(f"echo 'p:grd ksys_read' >> {TRACING}/kprobe_events").check()
    try:
        yield f"{TRACING}/events/kprobes/grd"
    finally:
        target.run(f"echo 0 > {TRACING}/events/kprobes/grd/enable; echo '-:grd' >> {TRACING}/kprobe_events")


def _bracketed(events: str, command: str) -> str:
    """``command`` with the guest's event enabled around it only, on one line the shell reads at once."""
    return f"echo 1 > {events}/enable; {command}; echo 0 > {events}/enable"


def _guest_hits(target: qprobe.Target) -> int:
    profile = target.run(f"cat {TRACING}/kprobe_profile").check().output
    row = next(line.split() for line in profile.splitlines() if line.split()[:1] == ["grd"])
    return int(row[1])


def _rows(text: str, name: str = "") -> dict[str, int]:
    """``@NAME[KEY]: N`` rows of a map as bpftrace prints it, key -> N."""
    return {m[1]: int(m[2]) for m in re.finditer(rf"^@{name}\[(.*)\]: (-?\d+)$", text, re.M)}


@pytest.mark.parametrize("vcpus", [1, 2], ids=["one-workload", "a-workload-per-vcpu"])
def test_shell_maps_over_a_hot_loop_equal_the_workload_and_kprobe_profile(
    target: qprobe.Target, guard: dict[int, bytes], guest_event: str, vcpus: int
) -> None:
    online = target.run("cat /sys/devices/system/cpu/online").check().output.strip()
    if vcpus > _count_cpus(online):  # the VM's vCPUs are --qprobe-smp's: as many as the guest brought up
        pytest.skip(f"the guest has CPUs {online} online, the test needs {vcpus}")
    out = io.StringIO()
    sh = Shell(target, out=out)
    sh.execute(DEFINITION)
    work = " & ".join([f"workload read {N} 1"] * vcpus) + ("; wait" if vcpus > 1 else "")
    profile = _guest_hits(target)
    try:
        for line, check in [
            # Every read in the VM: the workloads' and the few of the guest shell reading the command line.
            ("count rd", lambda text, pids: vcpus * N <= _total(text) <= vcpus * N + 200),
            ("count rd by $comm", lambda text, pids: _rows(text)["workload"] == vcpus * N),
            # bpftrace's spellings of the same maps
            ("count() rd", lambda text, pids: vcpus * N <= _total(text) <= vcpus * N + 200),
            ("@[$comm] = count() rd", lambda text, pids: _rows(text)["workload"] == vcpus * N),
            ("count rd by $pid", lambda text, pids: all(_rows(text)[p] == N for p in pids)),
            ("count rd by $func, $comm", lambda text, pids: _rows(text)["ksys_read, workload"] == vcpus * N),
            ("sum(count) rd by $comm", lambda text, pids: _rows(text, "count")["workload"] == vcpus * N),
            ("hist(count) rd by $comm", lambda text, pids: _hist_row(text, "workload", "[1]") == vcpus * N),
        ]:
            text = shell_do(sh, out, f"{line} run {_bracketed(guest_event, work)}")
            pids = [res["pid"] for res in _workloads(text)]
            assert len(pids) == vcpus and all(int(r["n"]) == N for r in _workloads(text)), text[-800:]
            assert check(text, pids), f"{line}:\n{text[-1500:]}"
            assert "@lost" not in text, text[-500:]
            # The guest's own probe, on at the same function only while the workloads ran, saw their reads.
            now = _guest_hits(target)
            assert now - profile == vcpus * N, (line, now - profile)
            profile = now
    finally:
        sh.execute("-:rd")


def _count_cpus(ranges: str) -> int:
    """How many CPUs a sysfs CPU list names ("0-1,3")."""
    count = 0
    for part in ranges.split(","):
        first, _, last = part.partition("-")
        count += int(last or first) - int(first) + 1
    return count


def _total(text: str) -> int:
    m = re.search(r"^@: (\d+)$", text, re.M)
    assert m is not None, text[-500:]
    return int(m[1])


def _workloads(text: str) -> list[dict[str, str]]:
    return [workload_result(line) for line in text.splitlines() if line.startswith("workload ")]


def _hist_row(text: str, key: str, bucket: str) -> int:
    """The count of ``bucket`` in the histogram of ``@count[key]``."""
    block = text.split(f"@count[{key}]:", 1)[1]
    return int(next(line.split()[1] for line in block.splitlines() if line.startswith(bucket)))


def test_python_api_and_plugin_counts_equal_the_workload(target: qprobe.Target, guest_event: str) -> None:
    """The chooser and the in-guest maps by hand, and the plugin's handler-less Kprobe, over the same loop."""
    te = target.add_event(DEFINITION)
    try:
        assert fold_path([te], "count", ("$comm",), None) == "guest map"
        assert fold_path([te], "count", (), None, owned=True) == "guest map"
        maps = GuestMaps([te], ("$comm",))
        assert maps.start()
        try:
            res = workload_result(target.run(f"workload read {N} 1").check().output)
        finally:
            folded = maps.stop()
        assert int(res["n"]) == N
        assert [(t, slots[("workload",)].count) for t, slots in folded] == [(te, N)], folded
    finally:
        target.remove_event(te)
    kp = qprobe.Kprobe(symbol_name="ksys_read")
    target.register_kprobe(kp)
    try:
        before, profile = kp.nhit, _guest_hits(target)
        target.run(_bracketed(guest_event, f"workload read {N} 1")).check()
        target.sync()
        # Every read in the VM while it ran: the workload's and the guest shell's reading the command line.
        assert _guest_hits(target) - profile == N
        assert N <= kp.nhit - before <= N + 200, kp.nhit - before
    finally:
        target.unregister_kprobe(kp)


def test_trace_map_counts_the_command_s_reads_exactly() -> None:
    """``qprobe trace --run CMD --map``: the map holds the command's hits, all of them, and none of the
    guest shell's or the launcher's."""
    out = subprocess.run([sys.executable, "-m", "qprobe.cli", "trace", "--image", IMAGE, "--run",
                          f"workload read {N} 1", "--map", "sum(count) by $comm, $pid", DEFINITION],
                         capture_output=True, text=True, timeout=900, cwd=ROOT)  # fmt: skip
    assert out.returncode == 0, out.stderr
    res = workload_result(out.stderr)
    assert _rows(out.stdout, "count") == {f"workload, {res['pid']}": N}, out.stdout
    summary = next(line for line in out.stdout.splitlines() if line.startswith("# rd:"))
    assert summary.startswith(f"# rd: hits={N} nmissed=0 lost=0 "), out.stdout
    # bpftrace's spelling, no key: the command's reads alone (the map folded in the guest by pid as well)
    out = subprocess.run([sys.executable, "-m", "qprobe.cli", "trace", "--image", IMAGE, "--run",
                          f"workload read {N} 1", "--map", "count()", DEFINITION],
                         capture_output=True, text=True, timeout=900, cwd=ROOT)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert re.findall(r"^@: (\d+)$", out.stdout, re.M) == [str(N)], out.stdout
    bad = subprocess.run([sys.executable, "-m", "qprobe.cli", "trace", "--map", "sum(size) by $comm", DEFINITION],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)  # fmt: skip
    assert bad.returncode == 2 and bad.stderr.splitlines() == [
        "qprobe: error: rd has no argument 'size' (fd, count)"
    ], bad.stderr
