"""The probe table as the kernel's debugfs kprobes/list shows it."""

from __future__ import annotations

from qprobe.core.anywhere import InternalProbe
from qprobe.core.kprobes import KprobeManager


def list_probes(km: KprobeManager, sync: bool = True) -> str:
    """The debugfs kprobes/list format."""
    if sync:
        for point in km.points.values():
            km.optimizer.sync_missed(point)
    lines = []
    for addr in sorted(km.stubs.points):  # the kernel's list has no such probe: its own flag
        stub = km.stubs.points[addr]
        for kp in stub.probes:
            if isinstance(kp, InternalProbe):  # qprobe's own (a return probe's return site: listed at its entry)
                continue
            kind = "r" if kp.kretprobe is not None else "k"
            flags = "[GONE]" if kp.gone else "[DISABLED]" if kp.disabled else ""
            lines.append(f"{addr:016x}  {kind}  {stub.where}    [ANYWHERE]{flags}")
    for addr in sorted(km.points):
        point = km.points[addr]
        for kp in point.probes:
            flags = ("[GONE]" if kp.gone else "") + ("[DISABLED]" if kp.disabled and not kp.gone else "")
            if not km.enabled and not kp.disabled:
                flags += "[DISABLED]"
            if point.opt is not None:
                flags += "[OPTIMIZED]"
            elif point.not_optimized is not None and point.armed:
                flags += f"  (not optimized: {point.not_optimized})"
            if point.opt is None and point.prep.step_reason is not None and point.armed:
                flags += f"  (single-stepped through the gdbstub: {point.prep.step_reason})"
            kind = "r" if kp.kretprobe is not None else "k"
            at, where = addr, point.where
            if kp.at != addr:  # moved off an __fentry__ site: listed where asked, as the kernel's [FTRACE]
                at, where, flags = kp.at, km.symbols.symbolize(kp.at), "[FTRACE]" + flags
            lines.append(f"{at:016x}  {kind}  {where}    {flags}".rstrip())
    for kp, (at, rest) in sorted(km.table.gone.items(), key=lambda item: item[1]):
        lines.append(f"{at:016x}  {'r' if kp.kretprobe is not None else 'k'}  {rest}")
    return "\n".join(lines) + ("\n" if lines else "")
