"""The shell's ShellTarget Protocol: qprobe.api.Target provides it, and so does the fake the shell's tests use."""

from __future__ import annotations

import ast
import inspect
import typing

from shell_fakes import FakeTarget

from qprobe.api import Target
from qprobe.events.funcs import Sites
from qprobe.shell.target import ShellProbes, ShellTarget


def members(protocol: type) -> set[str]:
    """The names a Protocol declares, its bases' included (annotations, methods, properties)."""
    out: set[str] = set()
    for cls in protocol.__mro__:
        if cls not in (object, typing.Protocol, typing.Generic) and getattr(cls, "_is_protocol", False):
            out |= set(getattr(cls, "__annotations__", {}))
            out |= {
                n for n, v in vars(cls).items() if not n.startswith("_") and (callable(v) or isinstance(v, property))
            }
    return out


def test_the_fake_is_a_shell_target() -> None:
    fake = FakeTarget()
    assert isinstance(fake, ShellTarget)
    assert all(hasattr(fake.kprobes, name) for name in members(ShellProbes))
    assert all(hasattr(fake.kprobes.sites, name) for name in members(Sites))


def test_the_real_target_provides_every_member() -> None:
    """Each member is a method or property of Target, an attribute its constructor assigns, or one of the
    parts its class declares (qprobe.wiring assigns them)."""
    assigned = {
        node.attr
        for node in ast.walk(ast.parse(inspect.getsource(Target)))
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
        and isinstance(node.ctx, ast.Store)
    } | set(inspect.get_annotations(Target))  # fmt: skip
    missing = sorted(n for n in members(ShellTarget) if not hasattr(Target, n) and n not in assigned)
    assert not missing, f"qprobe.api.Target lacks {missing}"
    assert {"enabled", "points", "sites"} <= members(ShellProbes)
    assert {"blacklist", "reserved"} <= members(Sites)
