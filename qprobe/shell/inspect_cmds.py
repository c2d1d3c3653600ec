"""Shell commands that look at the kernel rather than at events: sym, addr, x, regs, bt, drgn, py, load, gdb."""

from __future__ import annotations

import fnmatch
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

from qprobe.errors import GoneInterrupt, SymbolError, TargetError

from . import gdbcmd
from .parse import ShellUsageError, parse_int
from .render import hexdump, render_registers

if TYPE_CHECKING:
    from .context import Handler, ShellContext
    from .target import ShellTarget

MAX_DUMP = 1 << 20
DEFAULT_DUMP = 64
MAX_LISTED = 200


class InspectCommands:
    """sym, addr, x, regs, bt, drgn, py, load and gdb."""

    def __init__(self, shell: ShellContext) -> None:
        self.shell = shell

    def handlers(self) -> dict[str, Handler]:
        return {"sym": self.cmd_sym, "addr": self.cmd_addr, "x": self.cmd_x, "regs": self.cmd_regs,
                "bt": self.cmd_bt, "drgn": self.cmd_drgn, "py": self.cmd_py, "load": self.cmd_load,
                "gdb": self.cmd_gdb}  # fmt: skip

    def cmd_sym(self, rest: str) -> None:
        if not rest or len(rest.split()) != 1:
            raise ShellUsageError("usage: sym NAME|GLOB")
        symbols = self.shell.target.symbols
        if any(c in rest for c in "*?["):
            names = sorted(n for n in symbols.names() if fnmatch.fnmatchcase(n, rest))
            if not names:
                raise SymbolError(f"no symbol matches {rest!r}")
            for name in names[:MAX_LISTED]:
                self._print_symbol(name)
            if len(names) > MAX_LISTED:
                self.shell.note(f"... and {len(names) - MAX_LISTED} more")
            return
        if rest not in symbols and rest in symbols.percpu:
            self.shell.out.parts((rest, "key"), (f"  per-CPU offset {symbols.percpu[rest]:#x}", None))
            return
        self._print_symbol(rest)

    def _print_symbol(self, name: str) -> None:
        symbols = self.shell.target.symbols
        sym = symbols.lookup(name)
        section = symbols.section_at(sym.addr)
        self.shell.out.parts((sym.name, "key"), (f"  {sym.addr:#018x}", "addr"),
                             (f"  size {sym.size:#x} ({sym.size})  {sym.kind}"
                              f"{'  ' + section.name if section is not None else ''}", None))  # fmt: skip

    def cmd_addr(self, rest: str) -> None:
        if not rest:
            raise ShellUsageError("usage: addr ADDR")
        addr = self.shell.target.symbols.resolve(rest)
        sym = self.shell.target.symbols.containing(addr)
        if sym is None:
            self.shell.out.parts((f"{addr:#018x}", "addr"), ("  not inside a known symbol", "note"))
            return
        off = addr - sym.addr
        size = f"/{sym.size:#x}" if sym.size else ""
        self.shell.out.parts((f"{addr:#018x}", "addr"), ("  ", None), (f"{sym.name}+{off:#x}{size}", "key"),
                             (f"  {sym.kind}", "note"))  # fmt: skip

    def cmd_x(self, rest: str) -> None:
        words = rest.split()
        if not 1 <= len(words) <= 2:
            raise ShellUsageError("usage: x ADDR|SYM[+OFF] [LEN]")
        symbols = self.shell.target.symbols
        addr = symbols.resolve(words[0])
        if len(words) == 2:
            length = parse_int(words[1], "LEN")
        else:
            sym = symbols.lookup(words[0]) if words[0] in symbols else None
            length = min(sym.size, 256) if sym is not None and sym.size else DEFAULT_DUMP
        if not 0 < length <= MAX_DUMP:
            raise ShellUsageError(f"LEN must be 1..{MAX_DUMP}, not {length}")
        self.shell.out.write(hexdump(addr, self.shell.target.read(addr, length)))

    def _vcpu(self, rest: str, verb: str) -> int:
        words = rest.split()
        if len(words) > 1:
            raise ShellUsageError(f"usage: {verb} [CPU]")
        cpu = parse_int(words[0], "CPU") if words else 0
        if not 0 <= cpu < self.shell.target.vcpus:
            raise ShellUsageError(f"CPU must be 0..{self.shell.target.vcpus - 1}, not {cpu}")
        return cpu

    def cmd_regs(self, rest: str) -> None:
        cpu = self._vcpu(rest, "regs")
        regs = self.shell.target.registers(cpu)
        arch = self.shell.target.arch
        self.shell.out.write(render_registers(regs, arch.registers, self.shell.target.symbols.symbolize))
        if arch.user_mode(regs):
            self.shell.note(f"vCPU {cpu} is in user mode")
            return
        try:
            task = self.shell.target.kernel.read_task(regs=regs)
            self.shell.note(f"vCPU {cpu} in the kernel, current task {task.comm}-{task.pid}")
        except Exception:  # a vCPU in early entry code may not have a usable per-CPU base yet
            pass

    def cmd_bt(self, rest: str) -> None:
        cpu = self._vcpu(rest, "bt")
        values, stack = self.shell.target.stack_trace(cpu)
        if stack is None:
            pc = self.shell.target.arch.registers.pc
            self.shell.note(f"vCPU {cpu} is in user mode ({pc} {values.get(pc, 0):#x}): no kernel stack")
            return
        self.shell.out.write(f"{stack}\n")

    def cmd_drgn(self, rest: str) -> None:
        if rest:
            raise ShellUsageError("usage: drgn")
        drgn_session(self.shell.target)

    def cmd_py(self, rest: str) -> None:
        import code

        import qprobe

        namespace = {"target": self.shell.target, "qprobe": qprobe, "shell": self.shell}
        try:
            import readline  # noqa: F401 - line editing for input()
        except ImportError:
            pass
        interact = self.shell.interact or code.interact
        banner = "Python REPL: `target`, `qprobe` and `shell` are bound; Ctrl-D returns to qprobe."
        try:
            interact(banner=banner, local=namespace, exitmsg="")
        except SystemExit:  # exit() or quit() typed in the REPL: back to the shell
            pass

    def cmd_load(self, rest: str) -> None:
        if not rest:
            raise ShellUsageError("usage: load FILE.py")
        path = Path(rest).expanduser()
        try:
            source = path.read_text()
        except OSError as exc:
            raise ShellUsageError(f"load: cannot read {path}: {exc.strerror}") from None
        import qprobe

        target = self.shell.target
        before = self._probe_ids()
        namespace: dict[str, object] = {"__name__": "__qprobe_load__", "__file__": str(path), "target": target,
                                        "qprobe": qprobe, "shell": self.shell}  # fmt: skip
        try:
            exec(compile(source, str(path), "exec"), namespace)
        except SyntaxError as exc:
            raise ShellUsageError(f"load {path}: line {exc.lineno}: {exc.msg}") from None
        except Exception as exc:
            line = next((f.lineno for f in reversed(traceback.extract_tb(exc.__traceback__))
                         if f.filename == str(path)), None)  # fmt: skip
            where = f" line {line}:" if line else ""
            raise ShellUsageError(f"load {path}:{where} {type(exc).__name__}: {exc}") from None
        self.shell.loaded[str(path)] = namespace
        added = len(self._probe_ids() - before)
        self.shell.note(f"loaded {path}: {added} new probe(s); `list` shows them")

    def _probe_ids(self) -> set[int]:
        return {id(kp) for point in list(self.shell.target.kprobes.points.values()) for kp in list(point.probes)}

    def cmd_gdb(self, rest: str) -> None:
        if not rest:
            raise ShellUsageError("usage: gdb CMD")
        out = self.shell.target.gdb_command(rest)
        if out is not None:
            if out:
                self.shell.out.write(out if out.endswith("\n") else f"{out}\n")
            return
        if not gdbcmd.is_static(rest):
            raise ShellUsageError(gdbcmd.LIVE_HINT)
        symbols = self.shell.target.symbols
        index_dir = _gdb_index_dir()
        if not gdbcmd.index_exists(index_dir, symbols.build_id):
            self.shell.note("gdb: indexing vmlinux once (about 20 s on TCG hosts; later runs take a second)")
            self.shell.out.flush()
        try:
            sections = [(s.name, s.addr) for s in symbols.sections if s.addr]
            run = gdbcmd.run_static(Path(symbols.path), self.shell.target.slide, rest, index_dir, sections)
        except OSError as exc:
            raise TargetError(f"gdb: {exc}") from None
        self.shell.out.write(run.stdout)
        for line in run.stderr.splitlines():
            if line.strip():
                self.shell.out.line(line, "error")
        self.shell.note(
            "(static: vmlinux as built, at the running kernel's addresses; live-target commands need the gdb transport)"
        )


def drgn_session(target: ShellTarget) -> None:
    """drgn's interactive mode on the live guest (probes stay armed): ``prog`` and ``target`` bound."""
    import drgn.cli

    prog = target.prog  # loaded before the banner, so that a vmlinux drgn cannot use is one error line

    def more_globals(namespace: dict[str, object]) -> dict[str, object]:
        return {**namespace, "target": target}

    def banner(text: str) -> str:
        return f"{text}\n>>> target  # qprobe's Target: probes stay armed; Ctrl-D returns"

    try:
        # A VM that dies while drgn waits for a line (or runs one) ends the session at once.
        with target.interrupt_when_gone():
            drgn.cli.run_interactive(prog, banner_func=banner, globals_func=more_globals)
    except GoneInterrupt as exc:
        raise exc.gone from None
    except SystemExit:  # exit() or quit() typed in the REPL: back to the caller
        pass


def _gdb_index_dir() -> Path:
    from qprobe.paths import cache_dir

    return cache_dir("gdb-index")


__all__ = ["InspectCommands", "drgn_session"]
