"""The ``qprobe`` command: a thin layer over the Python API.

Every ``QprobeError`` is printed as one line and the exit status is non-zero;
tracebacks are only for bugs.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from qprobe import __version__
from qprobe.errors import FetchArgError, QprobeError

from .bench import BENCH_SECTIONS, _sections, cmd_bench, cmd_demo
from .boot import cmd_attach, cmd_boot
from .interactive import cmd_drgn, cmd_shell
from .listing import cmd_blacklist, cmd_funcs, cmd_images, cmd_list
from .trace import cmd_trace


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line, like every other qprobe error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"qprobe: error: {message} (see {self.prog} --help)\n")


def _number(kind: type[int] | type[float], lo: float, hi: float) -> Callable[[str], int | float]:
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not lo <= value <= hi:
            bounds = f"{int(lo)}..{int(hi)}" if kind is int else f"{lo:g}..{hi:g}"
            raise argparse.ArgumentTypeError(f"{text} is outside {bounds}")
        return value

    return parse


def _memory(text: str) -> str:
    from qprobe.vmm.qemu import parse_memory

    try:
        size = parse_memory(text)
    except QprobeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not 128 << 20 <= size <= 64 << 30:
        raise argparse.ArgumentTypeError(f"{text} is outside 128M..64G")
    return text


def _target_options(p: argparse.ArgumentParser, attach: bool = True) -> None:
    p.add_argument("--image", default="debian-cloud", help="image to boot (see `qprobe images`)")
    p.add_argument("--smp", type=_number(int, 1, 64), default=2, help="number of vCPUs (default 2)")
    p.add_argument("--memory", type=_memory, default="512M", help="guest RAM (default 512M)")
    p.add_argument("--file", action="append", default=[], metavar="HOST:GUEST",
                   help="add a host file to the guest's root filesystem (repeatable)")  # fmt: skip
    p.add_argument("--transport", choices=("rsp", "gdb"), default="rsp",
                   help="qprobe's own gdbstub client (fast, default) or a real gdb through GDB/MI")  # fmt: skip
    p.add_argument("--tcg-thread", choices=("single", "multi"), default="",
                   help="TCG's thread mode for the VM it boots: every vCPU on one host thread, or one each "
                   "(QEMU's default; see docs/reliability.md)")  # fmt: skip
    if attach:
        p.add_argument("--attach", metavar="ADDR", help="attach to a running QEMU instead of booting")
        p.add_argument("--vmlinux", help="the running kernel's vmlinux (for --attach)")
        p.add_argument("--allow-remote", action="store_true", help="allow attaching to a non-local address")
        p.add_argument("--console", metavar="SOCK",
                       help="for --attach: the Unix socket of the guest's console (its kernel log, and its shell "
                       "without --shell)")  # fmt: skip
        p.add_argument("--shell", metavar="SOCK",
                       help="for --attach: the Unix socket of the serial port the guest's shell runs on")  # fmt: skip


def _attached_boot_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kernel-image", metavar="PATH",
                   help="with --boot --attach: the kernel image QEMU boots (its KASLR alignment), where its "
                   "command line has no -kernel to read it from")  # fmt: skip
    p.add_argument("--kernel-cmdline", metavar="ARGS",
                   help="with --boot --attach: the whole command line QEMU gives the kernel, where its command "
                   "line has no -append to read it from")  # fmt: skip


def _anywhere_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--anywhere", action="store_true",
                   help="arm the probes with QEMU's own breakpoints, writing nothing into the guest: also on the "
                   "kernel's blacklist (entry text, noinstr, the int3/NMI paths) and notrace functions; two VM "
                   "stops a hit (return probes too: the return caught where it lands)")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="qprobe", description="Linux kprobes from outside a QEMU guest.")
    parser.add_argument("--version", action="version", version=f"qprobe {__version__}")
    parser.add_argument("-q", "--quiet", action="store_true", help="only errors")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("boot", help="boot an image and keep the VM running for `qprobe attach`")
    _target_options(p, attach=False)
    p.add_argument("--detach", action="store_true", help="return once the VM is ready; it runs in the background")
    p.set_defaults(func=cmd_boot)

    p = sub.add_parser("attach", help="attach to a running VM, restore leftovers of a crashed qprobe, detach")
    p.add_argument("attach", metavar="ADDR", help="unix:PATH of the gdbstub (printed by `qprobe boot`) or HOST:PORT")
    p.add_argument("--vmlinux", help="the running kernel's vmlinux (found automatically for `qprobe boot` VMs)")
    p.add_argument("--allow-remote", action="store_true", help="allow a non-local HOST:PORT")
    p.set_defaults(func=cmd_attach)

    p = sub.add_parser("trace", help="trace kprobe_events and uprobe_events definitions, one line per hit (ftrace)")
    _target_options(p)
    p.add_argument("--run", metavar="CMD", help="run CMD in the guest while tracing, then stop")
    p.add_argument("--boot", action="store_true",
                   help="arm the events before the kernel's first instruction (QEMU's breakpoints, the int3 path once "
                   "booted) and trace its boot from start_kernel on, __init functions too; then --run/--duration as "
                   "usual, every hit printed")  # fmt: skip
    p.add_argument(
        "--cmdline",
        default="",
        metavar="ARGS",
        help="more kernel command line for the VM it boots (e.g. initcall_debug); not with --attach",
    )
    _attached_boot_options(p)
    p.add_argument(
        "--duration", type=_number(float, 0.001, 1e7), metavar="S", help="trace for S seconds (default: until Ctrl-C)"
    )
    p.add_argument("--timeout", type=_number(float, 0.001, 1e7), default=600, help="limit for --run (default 600 s)")
    p.add_argument("--json", action="store_true", help="one JSON object per hit and a final summary object")
    _anywhere_option(p)
    p.add_argument("--lossy", action="store_true",
                   help="drop a hit's record when its CPU's ring is full and count it lost, as perf and bpftrace "
                   "do (default: the hitting vCPU waits for qprobe to drain the ring, so no line is lost)")  # fmt: skip
    p.add_argument("--buffer-size-kb", type=_number(int, 1, 1 << 22), metavar="KB",
                   help="each CPU's record ring, in KiB, as ftrace's buffer_size_kb (default 1024: 4096 records); "
                   "the burst a vCPU holds before it waits for qprobe (or, with --lossy, drops)")  # fmt: skip
    p.add_argument("--format", metavar="PRINTF",
                   help="print each hit with bpftrace's printf arguments: '\"%%-16s %%d\\n\", $comm, count' "
                   "($comm $pid $cpu $event $func $ts $addr or argument names)")  # fmt: skip
    p.add_argument("--map", metavar="AGG",
                   help="instead of lines, one bpftrace map over every event, printed at the end (or every S): "
                   "'count by $comm', 'sum(count) by $comm, $pid', 'hist(count)', 'lhist(count, 0, 4096, 512)', "
                   "'count by $func every 1', bpftrace's 'count()' and '@[$comm] = count()'; keys $comm $pid $cpu "
                   "$func $event $stack or argument names")  # fmt: skip
    p.add_argument(
        "--filter",
        metavar="EXPR",
        help="ftrace event filter over the events' arguments and common_pid/comm/cpu, "
        "e.g. 'count >= 4096 && comm == \"cat\"'; rejected hits are only counted",
    )
    p.add_argument(
        "events",
        nargs="+",
        metavar="EVENT",
        help="kprobe_events syntax: 'p:myread vfs_read count=%%dx:u64', 'r:ret ksys_read ret=$retval'; "
        "or perf probe's after the word perf: 'perf vfs_read:23 ret file->f_pos', 'perf fs/read_write.c:473 ret'; "
        "a uprobe on a guest file: 'p:uq /bin/prog:func a=%%di' (uprobe_events syntax, PATH:SYMBOL or PATH:OFFSET), "
        "'perf -x /bin/prog func a=%%di', bpftrace's 'uprobe:/bin/prog:func arg0 comm' or "
        "'uretprobe:/bin/prog:func retval'",
    )
    p.set_defaults(func=cmd_trace)

    p = sub.add_parser(
        "list",
        help="arm EVENTs and print the probe list (debugfs kprobes/list format, with why a probe is not optimized)",
    )
    _target_options(p)
    _anywhere_option(p)
    p.add_argument(
        "events",
        nargs="*",
        metavar="EVENT",
        help="kprobe_events definitions to arm first (or 'perf DEF' in perf probe's language)",
    )
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("funcs", help="kernel functions matching GLOBs and whether each can be probed (no boot); "
                       "-x PATH: a guest program's or library's functions (boots)")  # fmt: skip
    p.add_argument("-x", metavar="PATH",
                   help="list the functions of this guest program or library (its ELF symbols: file offset, size, "
                   "name, as PATH:SYMBOL and PATH:0xOFFSET probe them); the file is read from the guest, so this "
                   "boots the image (or uses --attach)")  # fmt: skip
    p.add_argument("--file", action="append", default=[], metavar="HOST:GUEST",
                   help="with -x: add a host file to the guest's root filesystem first (repeatable)")  # fmt: skip
    p.add_argument("--image", default="debian-cloud", help="whose vmlinux (see `qprobe images`)")
    p.add_argument("--attach", metavar="ADDR", help="a running VM's (its vmlinux, or --vmlinux's)")
    p.add_argument("--vmlinux", help="this vmlinux, not an image's")
    p.add_argument("--allow-remote", action="store_true", help="allow attaching to a non-local address")
    p.add_argument("globs", nargs="*", metavar="GLOB", help="shell patterns such as 'vfs_*' (default: every function)")
    p.set_defaults(func=cmd_funcs, transport="rsp", smp=2, memory="512M")

    p = sub.add_parser("images", help="list the known images, or fetch/build them")
    p.add_argument("--fetch", nargs="+", metavar="NAME", help="fetch and build these images")
    p.set_defaults(func=cmd_images)
    images_sub = p.add_subparsers(dest="images_command", metavar="add")
    add = images_sub.add_parser("add", help="add an image of yours to $QPROBE_IMAGES (~/.config/qprobe/images.toml)")
    add.add_argument("name", metavar="NAME", help="the image's name (--image NAME)")
    add.add_argument("--buildroot", required=True, metavar="PATH/output",
                     help="buildroot's output directory: images/bzImage, the rootfs, images/start-qemu.sh and "
                     "build/linux-*/vmlinux, .config and System.map are found there")  # fmt: skip
    add.add_argument("--description", default="", help="a line for `qprobe images`")

    p = sub.add_parser("blacklist", help="print the addresses qprobe refuses to probe")
    _target_options(p)
    p.set_defaults(func=cmd_blacklist)

    p = sub.add_parser("shell", help="an interactive shell: kprobe_events definitions, live hits, counts, histograms")
    _target_options(p)
    p.add_argument("--boot", action="store_true",
                   help="arm the EVENTs before the kernel's first instruction (QEMU's breakpoints, the int3 path once "
                   "booted): at the prompt they are events of the shell, with their hits since start_kernel "
                   "(stats, list, events; -:NAME removes one)")  # fmt: skip
    p.add_argument("--cmdline", default="", metavar="ARGS",
                   help="more kernel command line for the VM it boots (e.g. initcall_debug); not with "
                   "--attach")  # fmt: skip
    _attached_boot_options(p)
    p.add_argument("events", nargs="*", metavar="EVENT",
                   help="kprobe_events definitions (or 'perf DEF') to add before the prompt; with --boot, "
                   "before the kernel runs")  # fmt: skip
    p.set_defaults(func=cmd_shell)

    p = sub.add_parser("drgn", help="drgn's interactive mode on the live guest (`prog` bound, EVENTs armed)")
    _target_options(p)
    p.add_argument("events", nargs="*", metavar="EVENT", help="kprobe_events definitions to arm for the session")
    p.set_defaults(func=cmd_drgn)

    p = sub.add_parser("demo", help="boot the default image with demonstration probes (make run)")
    _target_options(p, attach=False)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("bench", help="measure boot, symbol loading, stub round trips and probe hit rates")
    _target_options(p, attach=False)
    p.add_argument("--hits", type=_number(int, 1, 10**9), default=2000, help="probe hits to time (default 2000)")
    p.add_argument("--output", type=Path, help="also write the report (markdown) to this file")
    p.add_argument("--sections", type=_sections, default=BENCH_SECTIONS,
                   help="comma-separated parts to run: probes (the cost matrix), trace (lines through the rings), "
                        "scale, gdb, maps (one count from every front end; default all five); the boot and "
                        "round-trip rows always run")  # fmt: skip
    p.set_defaults(func=cmd_bench)
    return parser


def _error_prefix() -> str:
    """``qprobe: error: ``, in bold red where stderr is a terminal that has colour (and NO_COLOR is not set)."""
    colour = sys.stderr.isatty() and "NO_COLOR" not in os.environ and os.environ.get("TERM", "dumb") != "dumb"
    return "\x1b[1;31mqprobe: error:\x1b[0m " if colour else "qprobe: error: "


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = logging.ERROR if args.quiet else logging.DEBUG if args.verbose else logging.WARNING
    logging.basicConfig(level=level, format="qprobe: %(message)s")
    from qprobe.lifetime import UNWIND_SIGNALS, unwind_on_signal

    # SIGINT is how a trace ends and a booted VM stops (Ctrl-C, bpftrace's and perf's way, and `kill -INT`
    # from a script), also where qprobe was started with SIGINT ignored (`qprobe boot ... &` from a
    # non-interactive shell, or from a process that itself runs so, whose children inherit it).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # SIGTERM and SIGHUP (the terminal went away) unwind like Ctrl-C: probes removed, QEMU stopped.
    for signum in UNWIND_SIGNALS:
        signal.signal(signum, unwind_on_signal)
    try:
        return int(args.func(args) or 0)
    except FetchArgError as exc:
        # The kernel's error_log style: the message, the definition, a caret under the column.
        print(f"{_error_prefix()}{exc.explained}\n{exc.caret()}", file=sys.stderr)
        return 2
    except QprobeError as exc:
        notes = "".join(f" ({note})" for note in getattr(exc, "__notes__", []))
        print(f"{_error_prefix()}{exc}{notes}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("qprobe: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`qprobe blacklist | head`): not an error of ours.  Python would
        # complain again when it flushes stdout at exit, so point stdout at /dev/null first.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
