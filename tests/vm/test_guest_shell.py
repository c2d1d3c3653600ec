"""A guest command's output is exactly what it wrote, whatever the kernel logs meanwhile.

The kernel's console (ttyS0) carries its log; the guest shell has a serial port of its own (ttyS1). Here
a background process makes the kernel log through /dev/kmsg while the command prints, at a priority every
console prints (KERN_CRIT), and the output must hold the command's bytes and nothing else.
"""

from __future__ import annotations

import base64
import hashlib

import pytest

import qprobe

pytestmark = pytest.mark.vm

NOISE = 200  # kernel messages written while the command prints
LINES = 3000


def test_output_is_the_commands_own_while_the_kernel_logs(target: qprobe.Target) -> None:
    assert target.console is not None
    start = target.console.end
    # Ten lines into the command the background writer starts, so that its messages come in the middle.
    noise = f'(i=0; while [ $i -lt {NOISE} ]; do echo "<2>qprobe-noise $i of {NOISE}" > /dev/kmsg; i=$((i+1)); done) &'
    command = (
        f'i=0; while [ $i -lt {LINES} ]; do [ $i = 10 ] && {{ {noise} }}; echo "line $i of the command"; '
        f"i=$((i+1)); done; wait; exit 7"
    )
    result = target.run(command, timeout=300)
    assert result.status == 7
    assert result.output == "".join(f"line {i} of the command\n" for i in range(LINES))
    # The kernel did log meanwhile, every message on its console and none of the command's lines there.
    target.console.wait_for(f"qprobe-noise {NOISE - 1} of {NOISE}", 30, start)
    log = target.console.slice(start, target.console.end)
    assert sum(f"qprobe-noise {i} of {NOISE}\n" in log for i in range(NOISE)) == NOISE
    assert "of the command" not in log
    assert target.oopses() == []


def test_binary_output_is_byte_identical(target: qprobe.Target) -> None:
    """Every byte value a command prints but NUL and newline, CR among them, as the file holds it."""
    data = bytes(b for b in range(1, 256) if b != 0x0A) + b"\r\nend"
    target.run(f"echo {base64.b64encode(data).decode()} | base64 -d > /tmp/bytes").check()
    assert target.run("md5sum /tmp/bytes").check().output.split()[0] == hashlib.md5(data).hexdigest()
    got = target.run("cat /tmp/bytes").check().output
    # Bytes that are not UTF-8 come back as U+FFFD; the rest exactly, a carriage return included.
    assert got == data.decode("utf-8", "replace")
