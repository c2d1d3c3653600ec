"""``make run``: boot the default image with demonstration probes and show them firing.

Two kprobe events are armed: the files the guest opens (the path argument of
``do_sys_openat2``, read from user memory by the host) and the ``getppid``
calls.  A short scripted activity runs; then, on a terminal, the user is left
in the qprobe shell with the demo probes listed, to add probes, watch hits,
count and histogram them.
"""

from __future__ import annotations

import argparse
import sys
import threading

import qprobe
from qprobe.events import EventHit

DEMO_EVENTS = ("p:opens do_sys_openat2 path=+0(%si):ustring", "p:getppid __x64_sys_getppid")
SHELL_HINTS = (
    ("show run cat /etc/hostname", "live hits while a guest command runs"),
    ("count opens by path run cat /etc/hostname /etc/passwd", "@[path]: count, like bpftrace"),
    ("p:rd ksys_read count=%dx:u64", "add a probe (kprobe_events syntax)"),
    ("hist rd by count run workload read 20 3000", "a log2 histogram of an argument"),
    ("count rd by $stack for 5", "kernel stacks, unwound on the host"),
)


def run_demo(args: argparse.Namespace) -> int:
    print(f"qprobe: booting {args.image} ({args.smp} vCPUs, TCG unless KVM works)...", flush=True)
    lock = threading.Lock()

    def on_open(hit: EventHit) -> None:
        with lock:
            print(f"  [vcpu {hit.cpu}] open {hit.args['path']}", flush=True)

    with qprobe.boot(args.image, smp=args.smp, memory=args.memory) as target:
        print(f"booted in {target.timings['boot']:.1f} s; kernel slide {target.slide:#x}")
        opens = target.add_event(DEMO_EVENTS[0], on_open)
        getppid = target.add_event(DEMO_EVENTS[1])
        print("probes armed (debugfs kprobes/list format):")
        print(target.list_probes(), end="")
        for cmd in ("cat /etc/hostname", "ls /proc/self/fd", "workload getppid 25"):
            print(f"guest$ {cmd}")
            print("  " + target.run(cmd).output.strip().replace("\n", "\n  "))
        print(f"opens: {opens.nhit} hits; getppid: {getppid.nhit} hits (the workload made 25 calls)")
        opens.callback = None  # from here on the shell shows hits when asked (`show`)
        if sys.stdin.isatty():
            from qprobe.shell import Shell, run_shell
            from qprobe.shell.prompt import PROMPT

            shell = Shell(target, interactive=True, prompt=PROMPT)
            print("\nqprobe shell, with the demo probes armed:")
            shell.execute("list")
            shell.execute("events")
            print("try:")
            width = max(len(cmd) for cmd, _ in SHELL_HINTS)
            for cmd, what in SHELL_HINTS:
                print(f"  {cmd:<{width}}   {what}")
            run_shell(target, shell)
        target.remove_events(list(target.events.values()))
        print(f"probes removed; totals: opens={opens.nhit} getppid={getppid.nhit}; kernel text restored")
    return 0
