"""Target is a façade: it inherits nothing, and every method the reference documents is on it with the
documented signature, the forwarded ones with their implementation's signature and doc (qprobe.facade);
its parts are one Parts, which the wiring makes and every object it is composed of reads."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import pydoc
import re
from pathlib import Path
from typing import Any, cast

import pytest

from qprobe.api import Target
from qprobe.eventapi import EventAPI
from qprobe.facade import Forward, Via, forward
from qprobe.parts import Parts
from qprobe.probeapi import ProbeAPI
from qprobe.wiring import Wiring

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "reference.md"


def documented() -> dict[str, list[tuple[str, object]] | None]:
    """The reference's ``Target`` methods (name → parameters and defaults) and attributes (name → None)."""
    text = REFERENCE.read_text().split("`Target` methods and attributes:", 1)[1].split("\n### ", 1)[0]
    out: dict[str, list[tuple[str, object]] | None] = {}
    for row in re.findall(r"^\| (.+?) \| ", text, re.M)[1:]:  # past the header (the rule below it has no spaces)
        for name, args in re.findall(r"`(\w+)(?:\(([^)]*)\))?`", row):
            if "(" not in row.split(f"`{name}", 1)[1][:1]:
                out[name] = None
                continue
            fn = ast.parse(f"def f({args}): pass").body[0]
            assert isinstance(fn, ast.FunctionDef)
            names = [a.arg for a in fn.args.args]
            defaults = [inspect.Parameter.empty] * (len(names) - len(fn.args.defaults))
            defaults += [ast.literal_eval(d) for d in fn.args.defaults]
            out[name] = list(zip(names, defaults, strict=True))
    return out


def test_target_inherits_nothing() -> None:
    assert Target.__bases__ == (object,)


def test_the_reference_lists_the_apis_target_forwards() -> None:
    doc = documented()
    assert {"register_kprobe", "add_event", "run", "prog", "kprobes_optimization"} <= set(doc)


@pytest.mark.parametrize("name", sorted(documented()))
def test_a_documented_name_is_on_target_with_its_documented_signature(name: str) -> None:
    assert hasattr(Target, name) or name in inspect.get_annotations(Target), f"Target has no {name}"
    params = documented()[name]
    if params is None:
        return
    method = getattr(Target, name)
    got = [(p.name, p.default) for p in inspect.signature(method).parameters.values()][1:]  # past self
    assert got == params


def _forwards() -> dict[str, Forward[..., object]]:
    return {n: v for n, v in vars(Target).items() if isinstance(v, Forward)}


def test_the_kprobes_and_kprobe_events_apis_are_forwarded_whole() -> None:
    """Every public method of ProbeAPI and EventAPI is on Target, forwarded to the object that has it."""
    for api, via in ((ProbeAPI, "probe_api"), (EventAPI, "event_api")):
        public = {n for n, v in vars(api).items() if not n.startswith("_") and inspect.isfunction(v)}
        forwarded = {n for n, f in _forwards().items() if f.via == via}
        assert public == forwarded, api.__name__


@pytest.mark.parametrize("name", sorted(_forwards()))
def test_a_forwarded_method_reads_as_its_implementation(name: str) -> None:
    fwd = _forwards()[name]
    impl = fwd.__wrapped__
    assert inspect.signature(getattr(Target, name)) == inspect.signature(impl)
    assert getattr(Target, name).__doc__ == impl.__doc__
    assert inspect.getdoc(Target.__dict__[name]) == inspect.getdoc(impl)


def test_a_forwarded_property_is_read_where_it_lives() -> None:
    for name in ("kprobes_optimization", "dialect", "ftrace_locations", "modules", "trace_events"):
        assert isinstance(vars(Target)[name], Via)


class _Part:
    def __init__(self) -> None:
        self.value = 1
        self.calls: list[tuple[int, str]] = []

    def act(self, n: int, tag: str = "x") -> int:
        """Act on ``n``."""
        self.calls.append((n, tag))
        return n + 1


class _Facade:
    act = forward(_Part.act, "part")
    do = forward(_Part.act, "part")  # under another name
    value: Via[int] = Via("part")

    def __init__(self) -> None:
        self.part = _Part()


def test_forward_binds_the_part_s_method_and_reads_as_it() -> None:
    f = _Facade()
    assert f.act(1) == 2 and f.do(2, tag="y") == 3 and _Facade.act(f, 3) == 4
    assert f.part.calls == [(1, "x"), (2, "y"), (3, "x")]
    assert f.act.__self__ is f.part  # type: ignore[attr-defined]
    assert _Facade.do.__name__ == "do" and _Facade.do.__doc__ == "Act on ``n``."
    assert str(inspect.signature(f.do)) == "(n: 'int', tag: 'str' = 'x') -> 'int'"
    assert "act(self, n: 'int', tag: 'str' = 'x') -> 'int'\n |      Act on ``n``." in pydoc.render_doc(
        _Facade, renderer=pydoc.plaintext
    )
    assert inspect.isroutine(vars(_Facade)["act"])  # help() lists it with the methods


def test_via_reads_and_writes_the_part_s_attribute() -> None:
    f = _Facade()
    assert f.value == 1
    f.value = 5
    assert f.part.value == 5 and "value" not in vars(f)


def test_a_part_target_shows_is_a_part_and_is_read_and_written_there() -> None:
    shown = {n for n, v in vars(Target).items() if isinstance(v, Via) and v.via == "parts"}
    assert shown <= {f.name for f in dataclasses.fields(Parts)}
    target = Target.__new__(Target)
    target.parts = Parts(cast(Any, "qemu"), "unix:/x/gdb.sock")
    target.qemu = None  # as qprobe.plugin.reset does, so that close() leaves QEMU alone
    assert target.parts.qemu is None and "qemu" not in vars(target)


def test_a_part_not_made_yet_is_absent() -> None:
    """What ending a failed attach reads (qprobe.lifetime) tells a part not made by hasattr."""
    parts = Parts(None, "unix:/x/gdb.sock")
    assert not hasattr(parts, "kprobes") and not hasattr(parts, "machine")
    assert parts.events == {} and parts.console is None


def test_the_wiring_composes_every_object_on_one_parts() -> None:
    wiring = Wiring("unix:/x/gdb.sock", "vmlinux", qemu=None, ram=None, ram_size=0, console=None, boot_timeout=1.0,
                    doorbell=None, shell=None, system_map=None, transport="rsp")  # fmt: skip
    parts = wiring.parts
    assert parts.address == "unix:/x/gdb.sock" and parts.qemu is None
    assert wiring.lifetime.target is parts and wiring.guest.target is parts and wiring.views.target is parts
    assert wiring.probe_api.parts is parts and wiring.event_api.parts is parts
    assert wiring.event_api.run == wiring.guest.run
