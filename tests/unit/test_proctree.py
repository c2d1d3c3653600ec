"""Which hits ``ProcessTree`` takes for the command: the command's process and its descendants, from their forks.

The guest's shell (pid 100) forks a launcher, which forks the command's process; the fork events
come as the kernel's ``wake_up_new_task`` hits do, in the parent's context with the child's pid.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import drgn

from qprobe.arch.x86_64.arch import X86_64
from qprobe.events import EventHit
from qprobe.proctree import ProcessTree

SHELL = 100


class FakeTarget:
    """What ProcessTree asks of a Target: its architecture, the task_struct type, the guest shell's pid, events."""

    arch = X86_64()

    def __init__(self) -> None:
        prog = drgn.Program(drgn.host_platform)
        self.task = prog.struct_type("task_struct", 64, [drgn.TypeMember(prog.int_type("int", 4, True), "pid", 320)])
        self.prog = SimpleNamespace(type=lambda name: self.task)
        self.events: list[tuple[str, Any]] = []
        self.removed: list[Any] = []

    def run(self, command: str) -> Any:
        assert command == "echo $$"
        return SimpleNamespace(check=lambda: SimpleNamespace(output=f"{SHELL}\n"))

    def add_event(self, definition: str, callback: Any) -> str:
        self.events.append((definition, callback))
        return definition

    def remove_event(self, event: Any) -> None:
        self.removed.append(event)


def _hit(pid: int, **args: int) -> EventHit:
    return EventHit(event="e", cpu=0, pid=pid, comm="sh", ts=0.0, addr=0, symbol="s",
                    args={k: str(v) for k, v in args.items()}, body="")  # fmt: skip


def test_the_command_counts_from_its_fork_and_the_shell_and_launcher_never() -> None:
    target = FakeTarget()
    roots: list[int] = []
    tree = ProcessTree(target, roots.append)  # type: ignore[arg-type]
    [(definition, fork)] = target.events
    assert definition == "p:qprobe_cpid/fork wake_up_new_task child=+40(%di):s32"
    fork(_hit(7, child=8))  # a fork elsewhere, before the command's
    fork(_hit(SHELL, child=200))  # the launcher
    assert tree.cpid is None and not tree.owns(_hit(200)) and not tree.owns(_hit(SHELL))
    fork(_hit(200, child=201))  # the command's process: an applet that never execs is the command's
    assert tree.cpid == 201 and roots == [201] and tree.owns(_hit(201))
    fork(_hit(201, child=202))  # a pipeline's process
    fork(_hit(202, child=203))  # and one it forks
    fork(_hit(SHELL, child=300))  # the shell's, and another fork of the launcher's, are not the command's
    fork(_hit(200, child=301))
    fork(_hit(7, child=9))
    assert [p for p in (SHELL, 200, 201, 202, 203, 300, 301, 7, 8, 9) if tree.owns(_hit(p))] == [201, 202, 203]
    assert roots == [201]
    tree.close()
    assert target.removed == [definition]
