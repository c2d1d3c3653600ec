"""The GDB rows: GDB's Python breakpoint on the workloads, in a second VM with nothing else attached."""

from __future__ import annotations

import argparse
import shutil
import signal
import statistics
import subprocess
import tempfile
import time

from qprobe.bench.common import WORKLOADS, Row, _plain_vm, workload_function


def _gdb_rows(args: argparse.Namespace) -> list[Row]:
    """GDB 13 on the gdbstub of a second, qprobe-free VM: a Python ``gdb.Breakpoint.stop()`` reading one register."""
    if shutil.which("gdb") is None:
        return []
    rows = []
    with _plain_vm(args) as (qemu, console):
        for name, funcs, cmd, _fast, slow in WORKLOADS:
            found = console.run(f"grep -E ' ({'|'.join(funcs)})$' /proc/kallsyms").check().output.splitlines()
            addrs = {line.split()[-1]: int(line.split()[0], 16) for line in found}
            func = workload_function(addrs.__contains__, funcs)
            n = max(slow * args.hits // 2000, 5)

            def timed(command: str) -> float:
                t = time.perf_counter()
                console.run(command, timeout=1800).check()
                return time.perf_counter() - t

            base = statistics.median(timed(cmd.format(n=n)) for _ in range(3)) / n
            addr = addrs[func]
            with tempfile.NamedTemporaryFile("w", suffix=".py") as script:
                script.write(GDB_SCRIPT.format(addr=addr))
                script.flush()
                gdb = subprocess.Popen(["gdb", "-batch", "-nx", "-ex", "set pagination off", "-ex",
                                        f"target remote {qemu.gdb_path}", "-x", script.name],
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
                assert gdb.stdout is not None
                for line in gdb.stdout:  # the breakpoint is in and the guest runs again
                    if line.startswith("QPROBE-GDB-ARMED"):
                        break
                seconds = timed(cmd.format(n=n))
                gdb.send_signal(signal.SIGINT)
                out, _ = gdb.communicate(timeout=120)
            hits = int(next(x.split()[1] for x in out.splitlines() if x.startswith("QPROBE-GDB-HITS")))
            rows.append(Row(name, "gdb", "GDB 13, Python gdb.Breakpoint.stop() reading one register", n, hits,
                            seconds, base))  # fmt: skip
    return rows


GDB_SCRIPT = """
import gdb
class Hit(gdb.Breakpoint):
    hits = 0
    def stop(self):
        gdb.selected_frame().read_register("pc")
        Hit.hits += 1
        return False
Hit("*{addr:#x}")
print("QPROBE-GDB-ARMED", flush=True)
try:
    gdb.execute("continue")
except gdb.error:
    pass  # interrupted
print("QPROBE-GDB-HITS", Hit.hits, flush=True)
gdb.execute("delete")
gdb.execute("detach")
"""
