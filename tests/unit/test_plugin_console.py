"""The pytest plugin's failure report shows what the guest printed, not qprobe's framing of its commands."""

from __future__ import annotations

from qprobe.pytest_plugin import guest_console


def test_markers_and_their_blank_lines_are_left_out() -> None:
    # What Console.run's printf framing leaves on the console around a command's output (vmm/console.py).
    text = (
        "[    2.75] Run /init as init process\n\nQPROBE-READY\n"
        "\n@@qp-begin-dc485e724ff8@@\nworkload mode=lseek n=4 pid=97\n\n@@qp-end-dc485e724ff8@@0\n"
        "\n@@qp-begin-0123456789ab@@\n\n@@qp-end-0123456789ab@@127\n"
        "[   9.1] a line the kernel printed\n"
    )
    assert guest_console(text, 40).splitlines() == [
        "[    2.75] Run /init as init process",
        "workload mode=lseek n=4 pid=97",
        "[   9.1] a line the kernel printed",
    ]
    assert guest_console(text, 1) == "[   9.1] a line the kernel printed"
