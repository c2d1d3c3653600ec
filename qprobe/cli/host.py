"""What the host knows before a VM boots: the inputs checked, and the kernel's vmlinux read for its symbols,
its kprobe_events language, its probe refusals and its debug information."""

from __future__ import annotations

import argparse
import functools
import os
from pathlib import Path
from typing import TYPE_CHECKING

from qprobe.errors import FetchArgError, QprobeError

if TYPE_CHECKING:
    from qprobe.arch import RegisterLayout
    from qprobe.events.funcs import Probeability
    from qprobe.fetch.dialect import Dialect
    from qprobe.kernel.symbols import Symbols


def _files(specs: list[str]) -> dict[str, str]:
    out = {}
    for spec in specs:
        host, sep, guest = spec.rpartition(":")
        if not sep or not host or not guest.startswith("/"):
            raise QprobeError(f"bad --file {spec!r}: expected HOST_PATH:/GUEST/PATH")
        if not os.path.isfile(host) or not os.access(host, os.R_OK):
            raise QprobeError(f"bad --file {spec!r}: {host} is not a readable file")
        out[guest] = host
    return out


def _check_image(args: argparse.Namespace) -> None:
    """An unknown image is refused before anything is fetched or booted."""
    from qprobe.images.manifest import load_specs

    if getattr(args, "attach", None) is None and args.image not in load_specs():
        raise QprobeError(f"unknown image {args.image!r}; see `qprobe images`")


def _host_symbols(args: argparse.Namespace) -> Symbols | None:
    """The vmlinux on the host, without booting; None if it is not known here.

    A VM to attach to has its vmlinux named by ``--vmlinux``, or by the session file a VM that
    ``qprobe boot`` started keeps beside its gdbstub (else it is found once attached).
    """
    from qprobe.images import get_image

    vmlinux = getattr(args, "vmlinux", None)
    if vmlinux:
        return _load_symbols(str(vmlinux), None)
    if getattr(args, "attach", None) is not None:
        from qprobe.session import read_session
        from qprobe.vmm.connection import parse_address

        where = parse_address(args.attach)
        session = read_session(Path(where)) if isinstance(where, str) and Path(where).exists() else None
        return _load_symbols(str(session["vmlinux"]), None) if session is not None else None
    _check_image(args)
    _files(getattr(args, "file", []))  # every other input is checked before the image is fetched
    img = get_image(args.image)
    return _load_symbols(str(img.vmlinux), img.system_map)


@functools.lru_cache(maxsize=2)
def _loaded(vmlinux: str, system_map: Path | None, mtime_ns: int) -> Symbols:
    from qprobe.kernel.symbols import Symbols

    return Symbols.load(vmlinux, system_map)


def _load_symbols(vmlinux: str, system_map: Path | None) -> Symbols:
    """A vmlinux's symbols, read once for every check of one command (each read takes 0.2 s)."""
    try:
        mtime = os.stat(vmlinux).st_mtime_ns
    except OSError:
        mtime = 0  # Symbols.load says what is wrong with it
    return _loaded(vmlinux, system_map, mtime)


def _host_language(args: argparse.Namespace) -> tuple[Dialect, RegisterLayout] | None:
    """The kprobe_events language of the vmlinux on the host, and its architecture's registers (what the
    user forms' ``argN`` become); None if it is not known here.

    Without it (a VM to attach to, no --vmlinux) definitions are checked once attached,
    in the running kernel's language, not before in another one's.
    """
    from qprobe.kernel.features import init_stack_span
    from qprobe.kernel.tracefs import probe_dialect
    from qprobe.wiring import vmlinux_arch

    symbols = _host_symbols(args)
    if symbols is None:
        return None
    registers = vmlinux_arch(symbols).registers
    return probe_dialect(symbols, registers.regoffset_table, init_stack_span(symbols)), registers


def _host_probeability(args: argparse.Namespace) -> Probeability | None:
    """The kernel's probe refusals from the vmlinux on the host, without booting; None if it is not known here."""
    from qprobe.events.funcs import Probeability
    from qprobe.wiring import vmlinux_arch

    symbols = _host_symbols(args)
    return None if symbols is None else Probeability.of(symbols, vmlinux_arch(symbols))


def _need_dwarf(args: argparse.Namespace, what: str) -> None:
    """A feature that reads the kernel's DWARF refused before boot, in one line, where vmlinux has none."""
    from qprobe.kernel.debuginfo import need_dwarf

    symbols = _host_symbols(args)
    if symbols is not None:
        need_dwarf(symbols.path, what)


def _without_btf(args: argparse.Namespace, exc: FetchArgError) -> FetchArgError:
    """The kernel's refusal of a named (BTF) argument, with why where the vmlinux has no BTF."""
    from qprobe.fetch.messages import NOSUP_BTFARG
    from qprobe.kernel.debuginfo import BTF_FRAGMENT, has_btf_section

    symbols = _host_symbols(args)
    if exc.reason != NOSUP_BTFARG or symbols is None or has_btf_section(symbols.path):
        return exc
    why = f"{symbols.path.name} has no BTF: named arguments need a kernel built with {BTF_FRAGMENT}"
    return FetchArgError(exc.reason, exc.text, exc.column, logged=exc.logged, detail=why)
