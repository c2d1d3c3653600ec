"""The commands that list: the probes armed, the functions that can be probed, the images, the blacklist."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from qprobe.errors import QprobeError

from .boot import _boot, _say_booting
from .definitions import _arm, _check_symbols, _parse_definitions, _perf_definitions, _user_forms
from .host import _host_probeability


def cmd_list(args: argparse.Namespace) -> int:
    """Arm the given events (if any) and print the probe list as debugfs's kprobes/list does, with reasons."""
    from qprobe.fetch import ProbeEvent
    from qprobe.kernel.usyntax import is_user_form
    from qprobe.shell.parse import is_definition

    _perf_definitions(args)
    for text in args.events:
        # `qprobe list 'vfs_*'`, as bpftrace -l and perf probe -F list functions
        if not is_definition(text) and not is_user_form(text):
            raise QprobeError(f"list arms EVENT definitions and lists the probes; to find functions: "
                              f"qprobe funcs {text!r}")  # fmt: skip
    definitions, checked = _parse_definitions(args)
    _check_symbols(args, [ev for ev in checked if isinstance(ev, ProbeEvent)])
    _say_booting(args)
    with _boot(args) as target:
        definitions = _user_forms(target, definitions, args.quiet)
        events = [te for d in definitions for te in _arm(target, d, anywhere=args.anywhere)]
        try:
            listing = target.list_probes()
        finally:
            target.remove_events(events)
    if not listing:
        # debugfs's list is empty then; a user who typed `qprobe list` wants to know why nothing came.
        print("qprobe: no probes are armed (list shows the EVENTs given to it: qprobe list 'p:rd vfs_read')",
              file=sys.stderr)  # fmt: skip
    print(listing, end="")
    return 0


def cmd_funcs(args: argparse.Namespace) -> int:
    """The kernel's functions matching GLOBs, each with whether qprobe can probe it, from vmlinux alone."""
    from qprobe.events.funcs import render_funcs

    if args.x is not None:
        return _user_funcs(args)
    prob = _host_probeability(args)
    if prob is None:  # --attach without --vmlinux: the attached VM's own file
        with _boot(args) as target:
            from qprobe.events.funcs import Probeability

            return _print_funcs(render_funcs(Probeability.of_target(target), args.globs))
    return _print_funcs(render_funcs(prob, args.globs))


def _user_funcs(args: argparse.Namespace) -> int:
    """``funcs -x PATH``: the functions of a guest program or library, from its ELF in the guest's page cache."""
    from qprobe.kernel.usyntax import render_user_funcs

    path = args.x
    if not path.startswith("/"):
        raise QprobeError(f"-x {path!r}: give the file's absolute path in the guest")
    _say_booting(args)
    with _boot(args) as target:
        elf = target.user_elf(path)
        return _print_funcs(render_user_funcs(elf, path, args.globs))


def _print_funcs(result: tuple[str, str, int]) -> int:
    text, summary, found = result
    sys.stdout.write(text)
    sys.stdout.flush()
    print(summary, file=sys.stderr)
    return 0 if found else 1


def cmd_images(args: argparse.Namespace) -> int:
    from qprobe.images import get_image, list_images

    if getattr(args, "images_command", None) == "add":
        from qprobe.images.useradd import add_buildroot_image

        manifest, found = add_buildroot_image(args.name, Path(args.buildroot), args.description)
        print(f"added image {args.name} to {manifest}:{found}")
        return 0
    if args.fetch:
        for name in args.fetch:
            img = get_image(name)
            print(f"{name}: ready ({img.kernel_version}, preempt={img.preempt})")
        return 0
    infos = list_images()
    width = max((len(info.name) for info in infos), default=0)  # the names' column fits the longest
    for info in infos:
        print(f"{info.name:{width}} {info.state:12} {info.description}")
    return 0


def cmd_blacklist(args: argparse.Namespace) -> int:
    with _boot(args) as target:
        for line in target.blacklist():
            print(line)
    return 0
