"""One count over the same hot loop from every front end: the shell (keyless, by ``$comm``, bpftrace's
spelling), ``qprobe trace --run --map``'s path, the Python API's, and the pytest plugin's bare Kprobe.

Every row is the wall time of one ``workload read N 1`` while its count runs (and with the count's set-up
and read-back around it), against the same command unprobed; each row's count of the command's reads
must be N (the keyless counts and the plugin's count every read in the VM: the guest shell's too).  Where
the guest kernel has uprobes, the same again over a uprobe: ``uprog call N``'s calls of ``qpt_target``.
"""

from __future__ import annotations

import io
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import qprobe
from qprobe.errors import QprobeError
from qprobe.events.fold import GuestMaps, fold_path
from qprobe.proctree import ProcessTree
from qprobe.shell import Shell
from qprobe.shell.collect import Collector, parse_map

if TYPE_CHECKING:
    from qprobe.vmm.console import RunResult

MAP_READS = 100_000


@dataclass(frozen=True)
class MapWorkload:
    """A hot loop, the event every front end counts over it, and the plugin's bare probe at the same place."""

    cmd: str  # runs ``hits`` times through the event's probe, in a process named ``comm``
    hits: int
    comm: str
    definition: str  # the event, named qpbench/EVENT
    plain: Callable[[], qprobe.Kprobe | qprobe.Uprobe]  # the pytest plugin's documented count: nhit, no handler


KERNEL = MapWorkload(f"workload read {MAP_READS} 1", MAP_READS, "workload",
                     "p:qpbench/rd ksys_read fd=%di:s32 count=%dx:u64",
                     lambda: qprobe.Kprobe(symbol_name="ksys_read"))  # fmt: skip
# The same from user space: a uprobe's count is the guest kernel's own uprobe with qprobe's consumer.
USER = MapWorkload(f"uprog call {MAP_READS} 1 2 m", MAP_READS, "uprog", "p:qpbench/rd /bin/uprog:qpt_target a=%di:s64",
                   lambda: qprobe.Uprobe("/bin/uprog", symbol="qpt_target"))  # fmt: skip


def _timed(fn: Callable[[], int]) -> tuple[float, int]:
    t = time.perf_counter()
    n = fn()
    return time.perf_counter() - t, n


class _TimedRuns:
    """The target as a front end sees it, the wall time of each run of ``cmd`` kept: the command alone, without
    the count's set-up and read-back around it."""

    _target: qprobe.Target
    _cmd: str
    seconds: list[float]

    def __init__(self, target: qprobe.Target, cmd: str) -> None:
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_cmd", cmd)
        object.__setattr__(self, "seconds", [])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target, name)

    def __setattr__(self, name: str, value: object) -> None:
        setattr(self._target, name, value)

    def run(self, command: str, **kwargs: Any) -> RunResult:
        t = time.perf_counter()
        result: RunResult = self._target.run(command, **kwargs)
        if command == self._cmd:
            self.seconds.append(time.perf_counter() - t)
        return result


def _map_rows(target: qprobe.Target, w: MapWorkload) -> tuple[list[tuple[str, str]], list[str]]:
    """The rows, and the target: every front end's count within 2x of the others'."""
    cmd, comm = w.cmd, w.comm
    timed = _TimedRuns(target, cmd)
    timed.run(cmd, timeout=1800).check()  # the first run pages the workload in
    timed.run(cmd, timeout=1800).check()
    base = timed.seconds[-1]
    rows = [(f"`{cmd}` unprobed", f"{base:.2f} s")]
    te = target.add_event(w.definition)  # no callback: its hits are recorded, unless a map folds them
    out = io.StringIO()
    shell = Shell(cast("qprobe.Target", timed), out=out)

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
                timed.run(cmd, timeout=1800).check()
        finally:
            tree.close()
        return agg.counts.get(comm, -1)

    def python_api() -> int:  # the chooser and the in-guest maps, by hand
        assert fold_path([te], "count", ("$comm",), None) == "guest map"
        maps = GuestMaps([te], ("$comm",))
        maps.start()
        try:
            timed.run(cmd, timeout=1800).check()
        finally:
            folded = maps.stop()
        return sum(slot.count for _, slots in folded for key, slot in slots.items() if key == (comm,))

    def plugin() -> int:  # the pytest plugin's documented count: a probe without a handler, its nhit
        probe = w.plain()
        if isinstance(probe, qprobe.Kprobe):
            target.register_kprobe(probe)
        else:
            target.register_uprobe(probe)
        try:
            before = probe.nhit
            timed.run(cmd, timeout=1800).check()
            target.sync()
            return probe.nhit - before
        finally:
            if isinstance(probe, qprobe.Kprobe):
                target.unregister_kprobe(probe)
            else:
                target.unregister_uprobe(probe)

    paths: list[tuple[str, Callable[[], int]]] = [
        ("shell `count rd` (no key)", shell_line("count qpbench/rd", r"^@: (\d+)$")),
        ("shell `count rd by $comm`", shell_line("count qpbench/rd by $comm", rf"^@\[{comm}\]: (\d+)$")),
        ("shell `@[$comm] = count() rd`", shell_line("@[$comm] = count() qpbench/rd", rf"^@\[{comm}\]: (\d+)$")),
        ("`trace --run --map 'count() by $comm'`'s path", trace_map),
        ("Python API: `fold_path` + `GuestMaps` by $comm", python_api),
    ]
    # For comparison, not a front end's choice: the same map with every hit through the rings to the host.
    reference = ("every hit through the rings (the map printed every S: `count rd by $comm every 3600`)",
                 shell_line("count qpbench/rd by $comm every 3600", rf"^@\[{comm}\]: (\d+)$"))  # fmt: skip
    costs: dict[str, float] = {}

    def measure(label: str, fn: Callable[[], int]) -> float:
        total, n = _timed(fn)
        seconds = timed.seconds[-1]
        rows.append((f"count over `{cmd}`: {label}", f"{seconds:.2f} s ({seconds / base:.2f}x unprobed; "
                     f"{total:.2f} s with the set-up), {n} of the command's {w.hits} hits"))  # fmt: skip
        return seconds

    try:
        for label, fn in paths:
            costs[label] = measure(label, fn)
        measure(*reference)
    finally:
        target.remove_event(te)
    # Alone at the function: an event's recording probe there would make the point's detour record every hit.
    label = f"pytest plugin: a handler-less `{type(w.plain()).__name__}`'s nhit"
    costs[label] = measure(label, plugin)
    worst, best = max(costs.values()), min(costs.values())
    ok = worst <= 2 * best
    return rows, [f"- {'met' if ok else 'NOT met'}: every front end's count over `{cmd}` within 2x of the others' "
                  f"({best:.2f} to {worst:.2f} s)"]  # fmt: skip
