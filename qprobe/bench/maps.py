"""One count over the same hot loop from every front end: the shell (keyless, by ``$comm``, bpftrace's
spelling), ``qprobe trace --run --map``'s path, the Python API's, and the pytest plugin's bare Kprobe.

Every row is the wall time of one ``workload read N 1`` with its count set up and read back around it,
against the same command unprobed; each row's count of the command's reads must be N.
"""

from __future__ import annotations

import io
import re
import time
from collections.abc import Callable

import qprobe
from qprobe.errors import QprobeError
from qprobe.events.fold import GuestMaps, fold_path
from qprobe.proctree import ProcessTree
from qprobe.shell import Shell
from qprobe.shell.collect import Collector, parse_map

MAP_READS = 20_000
DEFINITION = "p:qpbench/rd ksys_read fd=%di:s32 count=%dx:u64"


def _timed(fn: Callable[[], int]) -> tuple[float, int]:
    t = time.perf_counter()
    n = fn()
    return time.perf_counter() - t, n


def _map_rows(target: qprobe.Target) -> tuple[list[tuple[str, str]], list[str]]:
    """The rows, and the target: every front end's count within 2x of the others'."""
    cmd = f"workload read {MAP_READS} 1"
    te = target.add_event(DEFINITION)
    out = io.StringIO()
    shell = Shell(target, out=out)

    def shell_line(line: str, pattern: str) -> Callable[[], int]:
        def run() -> int:
            out.seek(0)
            out.truncate()
            shell.execute(f"{line} run {cmd}")
            m = re.search(pattern, out.getvalue(), re.M)
            return int(m.group(1)) if m else -1

        return run

    def trace_map() -> int:  # qprobe trace --run CMD --map 'count() by $comm': its collector and process tree
        agg, _ = parse_map("count() by $comm")
        try:
            tree = ProcessTree(target)
        except QprobeError:  # no struct task_struct to read a pid from (trace --run needs the kernel's types)
            return -1
        try:
            with Collector([te], agg, owns=lambda event, pid, hits: tree.owns_pid(pid)):
                target.run(cmd, timeout=1800).check()
        finally:
            tree.close()
        return agg.counts.get("workload", -1)

    def python_api() -> int:  # the chooser and the in-guest maps, by hand
        assert fold_path([te], "count", ("$comm",), None) == "guest map"
        maps = GuestMaps([te], ("$comm",))
        maps.start()
        try:
            target.run(cmd, timeout=1800).check()
        finally:
            folded = maps.stop()
        return sum(slot.count for _, slots in folded for key, slot in slots.items() if key == ("workload",))

    def plugin() -> int:  # the pytest plugin's documented count: a Kprobe without a handler, its nhit
        kp = qprobe.Kprobe(symbol_name="ksys_read")
        target.register_kprobe(kp)
        try:
            before = kp.nhit
            target.run(cmd, timeout=1800).check()
            target.sync()
            return kp.nhit - before
        finally:
            target.unregister_kprobe(kp)

    paths: list[tuple[str, Callable[[], int]]] = [
        ("shell `count rd` (no key)", shell_line("count qpbench/rd", r"^@: (\d+)$")),
        ("shell `count rd by $comm`", shell_line("count qpbench/rd by $comm", r"^@\[workload\]: (\d+)$")),
        ("shell `@[$comm] = count() rd`", shell_line("@[$comm] = count() qpbench/rd", r"^@\[workload\]: (\d+)$")),
        ("`trace --run --map 'count() by $comm'`'s path", trace_map),
        ("Python API: `fold_path` + `GuestMaps` by $comm", python_api),
        ("pytest plugin: a handler-less `Kprobe`'s nhit", plugin),
    ]
    rows: list[tuple[str, str]] = []
    costs: dict[str, float] = {}
    try:
        base = _timed(lambda: target.run(cmd, timeout=1800).check().status)[0]
        rows.append((f"`{cmd}` unprobed", f"{base:.2f} s"))
        for label, fn in paths:
            seconds, n = _timed(fn)
            costs[label] = seconds
            rows.append((f"count over `{cmd}`: {label}", f"{seconds:.2f} s ({seconds / base:.2f}x unprobed), "
                         f"{n} of the command's {MAP_READS} reads"))  # fmt: skip
    finally:
        target.remove_event(te)
    if not costs:
        return rows, []
    worst, best = max(costs.values()), min(costs.values())
    ok = worst <= 2 * best
    return rows, [f"- {'met' if ok else 'NOT met'}: every front end's count over `{cmd}` within 2x of the others' "
                  f"({best:.2f} to {worst:.2f} s)"]  # fmt: skip
