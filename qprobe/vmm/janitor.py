"""Stop a QEMU and remove its files once the qprobe process that started it is gone.

Run as a script (``python -I -S janitor.py QEMU_PID DIR...``), not imported:
it must start in milliseconds and must not depend on the qprobe package.
Its standard input is the read end of a pipe whose only write end is held
by the owning qprobe process, so end-of-file means the owner closed it or
died, however it died (SIGKILL, the OOM killer, a closed terminal).  Then the
QEMU, if it still runs, is killed and the run directory and the /dev/shm RAM
file are removed, and the files the owner named on the pipe (``rm:PATH``, its
undo journal: of no use once the VM is gone).  ``keep`` on the pipe tells the
janitor to leave the VM alone (a VM handed over to the user).  Each message
ends with a NUL.

QEMU is named by a pidfd taken at start-up, so a recycled pid can never be
killed by mistake.  The janitor runs in its own session: a terminal's
SIGHUP or Ctrl-C reaches the owner, never the janitor.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import sys

KILL_WAIT = 10.0


def main(argv: list[str]) -> int:
    pid, dirs = int(argv[1]), argv[2:]
    try:
        pidfd: int | None = os.pidfd_open(pid)
    except ProcessLookupError:
        pidfd = None  # already gone (and reaped): only its files are left
    os.write(1, b"ready\n")  # the owner waits for this before it may reap QEMU
    os.close(1)
    said = b""
    while chunk := os.read(0, 4096):
        said += chunk
        if b"keep" in said.split(b"\0")[:-1]:
            return 0
    files = [m[3:] for m in said.split(b"\0")[:-1] if m.startswith(b"rm:")]
    if pidfd is not None:
        if not select.select([pidfd], [], [], 0)[0]:  # a pidfd is readable once its process has exited
            try:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass
            select.select([pidfd], [], [], KILL_WAIT)
        os.close(pidfd)
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
    for f in files:
        try:
            os.unlink(f)
        except OSError:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
