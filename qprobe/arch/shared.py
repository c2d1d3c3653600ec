"""What every architecture's implementation does the same way, over the seam's types."""

from __future__ import annotations

from qprobe.arch import ExceptionTable, RegisterLayout, Resume


def search_exception_tables(table: ExceptionTable | None, addr: int) -> bool:
    """True if ``addr`` has an exception-table (fixup) entry; None means an empty table."""
    if table is None:
        return False
    if callable(table):
        return bool(table(addr))
    return addr in table


def resume_registers(layout: RegisterLayout, resume: Resume) -> dict[str, int]:
    """A ``Resume`` as the gdbstub registers to write: what changed, then sp, flags and ip by the layout's names."""
    out = dict(resume.changed)
    if resume.sp is not None:
        out[layout.gdb_name[layout.sp]] = resume.sp
    if resume.flags is not None:
        out[layout.gdb_name[layout.flags]] = resume.flags
    out[layout.gdb_name[layout.ip]] = resume.ip
    return out


__all__ = ["resume_registers", "search_exception_tables"]
