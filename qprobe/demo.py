"""``make run``: boot the default image with demonstration probes and show them firing.

Two probes are armed: the files the guest opens (the path argument of
``do_sys_openat2``, read from user memory by the host) and a count of
``getppid`` calls.  A short scripted activity runs; then, on a terminal,
the user types guest commands and sees the probes fire live.
"""

from __future__ import annotations

import argparse
import sys
import threading

import qprobe
from qprobe.core.regs import PtRegs


def run_demo(args: argparse.Namespace) -> int:
    print(f"qprobe: booting {args.image} ({args.smp} vCPUs, TCG unless KVM works)...", flush=True)
    lock = threading.Lock()
    opened: list[str] = []

    def on_open(kp: qprobe.Kprobe, regs: PtRegs) -> None:
        # do_sys_openat2(int dfd, const char __user *filename, struct open_how *how)
        path = regs.read_string(regs.si, 256)
        with lock:
            opened.append(path)
        print(f"  [vcpu {regs.vcpu}] open {path!r}", flush=True)

    with qprobe.boot(args.image, smp=args.smp, memory=args.memory) as target:
        print(f"booted in {target.timings['boot']:.1f} s; kernel slide {target.slide:#x}")
        opens = qprobe.Kprobe(symbol_name="do_sys_openat2", pre_handler=on_open)
        getppid = qprobe.Kprobe(symbol_name="__x64_sys_getppid")
        target.register_kprobes([opens, getppid])
        print("probes armed (debugfs kprobes/list format):")
        print(target.list_probes(), end="")
        for cmd in ("cat /etc/hostname", "ls /proc/self/fd", "workload getppid 25"):
            print(f"guest$ {cmd}")
            print("  " + target.run(cmd).output.strip().replace("\n", "\n  "))
        print(f"do_sys_openat2: {opens.nhit} hits; __x64_sys_getppid: {getppid.nhit} hits "
              f"(the workload made 25 calls)")  # fmt: skip
        if sys.stdin.isatty():
            print("\nType guest commands (Ctrl-D to quit); probe hits print as they happen.")
            while True:
                try:
                    line = input("guest$ ").strip()
                except EOFError:
                    break
                if line:
                    try:
                        print(target.run(line, timeout=300).output, end="")
                    except qprobe.QprobeError as exc:
                        print(f"error: {exc}")
        target.unregister_kprobes([opens, getppid])
        print(f"probes removed; totals: opens={opens.nhit} getppid={getppid.nhit}; kernel text restored")
    return 0
