"""Boot an image once and run the workload: a self-check of the images alone.

``python -m qprobe.images.smoke [NAME...]`` boots each image under QEMU
(TCG, no gdbstub, nothing probed), waits for ``QPROBE-READY``, runs
``workload getppid 10`` through the console shell and prints how long the
boot took. It tells apart "the image is broken" from "the probing is
broken" when something fails further up. It is not the launcher qprobe
uses to probe.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from qprobe.errors import ImageError
from qprobe.images.image import Image
from qprobe.images.registry import get_image

__all__ = ["SmokeResult", "qemu_command", "smoke_boot"]

READY = b"QPROBE-READY\n"


@dataclass(frozen=True)
class SmokeResult:
    """What one boot showed."""

    image: str
    boot_seconds: float  # QEMU start to QPROBE-READY
    workload_line: str  # the summary line `workload getppid 10` printed


def qemu_command(image: Image, memory_mb: int = 512, cpus: int = 2) -> list[str]:
    """The plain QEMU command line that boots ``image`` with its console on stdio."""
    append = " ".join(part for part in ("console=ttyS0 panic=-1 oops=panic", image.cmdline) if part)
    return [
        "qemu-system-x86_64",
        "-accel",
        "tcg",
        "-m",
        str(memory_mb),
        "-smp",
        str(cpus),
        "-nographic",
        "-no-reboot",
        *image.qemu_boot_args(),
        "-append",
        append,
    ]


def smoke_boot(image: Image, timeout: float = 120.0) -> SmokeResult:
    """Boot, wait for QPROBE-READY, run the workload; QEMU is always killed."""
    start = time.monotonic()
    proc = subprocess.Popen(
        qemu_command(image), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    assert proc.stdin is not None and proc.stdout is not None
    out = bytearray()
    lock = threading.Lock()
    stdout = proc.stdout

    def reader() -> None:
        while chunk := os.read(stdout.fileno(), 65536):
            with lock:
                out.extend(chunk)

    threading.Thread(target=reader, daemon=True).start()

    def wait_for(needle: bytes, since: int, deadline: float) -> int:
        while time.monotonic() < deadline:
            with lock:
                at = out.find(needle, since)
            if at >= 0:
                return at
            if proc.poll() is not None:
                break
            time.sleep(0.02)
        with lock:
            tail = bytes(out[-600:]).decode(errors="replace").strip().splitlines()[-3:]
        raise ImageError(f"{image.name}: no {needle.decode().strip()!r} from the guest; last output: {tail}")

    try:
        deadline = start + timeout
        ready = wait_for(READY, 0, deadline)
        boot_seconds = time.monotonic() - start
        since = ready + len(READY)
        proc.stdin.write(b"workload getppid 10; echo __SMOKE_DONE__\n")
        proc.stdin.flush()
        done = wait_for(b"__SMOKE_DONE__\n", since, deadline)
        with lock:
            lines = bytes(out[since:done]).decode(errors="replace").splitlines()
        summary = [line for line in lines if line.startswith("workload mode=getppid n=10 ")]
        if not summary or "errors=0" not in summary[0]:
            raise ImageError(f"{image.name}: the workload did not run as expected: {lines}")
        return SmokeResult(image.name, boot_seconds, summary[0])
    finally:
        proc.kill()
        proc.wait()


def main(argv: list[str] | None = None) -> int:
    """Smoke-boot the named images (default: debian-cloud)."""
    parser = argparse.ArgumentParser(prog="python -m qprobe.images.smoke", description=__doc__)
    parser.add_argument("names", nargs="*", default=["debian-cloud"])
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args(argv)
    failed = 0
    for name in args.names:
        try:
            result = smoke_boot(get_image(name), args.timeout)
        except ImageError as exc:
            print(f"FAIL {name}: {exc}", file=sys.stderr)
            failed += 1
            continue
        print(f"ok   {name}: QPROBE-READY after {result.boot_seconds:.2f}s; {result.workload_line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
