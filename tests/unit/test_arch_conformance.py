"""Every registered architecture has every member of the Arch protocol, each method with Arch's parameters,
and so has each optional facet it provides (OptProbes, GuestRam, TrapStep, Uprobes) and its Traps.

make lint's mypy check is the full one (types included); this is its quick
counterpart in the unit tests, so that a missing or reshaped member also fails
``pytest tests/unit``.
"""

from __future__ import annotations

import inspect

import pytest

from qprobe.arch import Arch, GuestRam, OptProbes, Traps, TrapStep, Uprobes
from qprobe.arch.select import ARCHES

# Arch's attribute -> the protocol of the facet it holds (or None; ``traps`` is never None).
FACETS: dict[str, type] = {"optprobes": OptProbes, "guest_ram": GuestRam, "trap_step": TrapStep, "uprobes": Uprobes,
                           "traps": Traps}  # fmt: skip


def members(protocol: type) -> tuple[set[str], set[str]]:
    """(data members, methods) ``protocol`` declares."""
    methods = {n for n, v in vars(protocol).items() if inspect.isfunction(v) and not n.startswith("_")}
    data = {n for n in protocol.__annotations__ if not n.startswith("_")} - methods
    return data, methods


def check(protocol: type, obj: object) -> None:
    """``obj`` has every member of ``protocol``, each method with the protocol's parameters."""
    data, methods = members(protocol)
    missing = sorted(n for n in data | methods if not hasattr(obj, n))
    assert not missing, f"{type(obj).__name__} lacks {', '.join(missing)}"
    for method in sorted(methods):
        want = list(inspect.signature(getattr(protocol, method)).parameters.values())[1:]  # without self
        got = list(inspect.signature(getattr(obj, method)).parameters.values())
        assert [p.kind for p in got] == [p.kind for p in want], f"{method}: {got} for {protocol.__name__}'s {want}"
        assert len(got) == len(want), f"{method}: {len(got)} parameters, {protocol.__name__}'s has {len(want)}"


@pytest.mark.parametrize("name", sorted(ARCHES))
def test_the_arch_implements_the_protocol(name: str) -> None:
    check(Arch, ARCHES[name][1]())


# (architecture, facet) for every facet an architecture provides; a facet it leaves None is no case.
PROVIDED = [(name, facet) for name in sorted(ARCHES) for facet in sorted(FACETS)
            if getattr(ARCHES[name][1](), facet) is not None]  # fmt: skip


@pytest.mark.parametrize(("name", "facet"), PROVIDED)
def test_each_facet_the_arch_provides_implements_its_protocol(name: str, facet: str) -> None:
    check(FACETS[facet], getattr(ARCHES[name][1](), facet))


def test_the_protocol_s_data_members_and_methods_are_both_found() -> None:
    """The introspection the check relies on sees attributes (annotations) and methods (functions) alike."""
    data, methods = members(Arch)
    assert {"registers", "breakpoint", "trap_watch", *FACETS} <= data
    assert {"arch_prepare_kprobe", "resume_registers", "page_tables", "jump_label_size"} <= methods
    assert {"decode_trap", "kprobe_break_hook"} <= members(Traps)[1] and "trap_entries" in members(Traps)[0]
    assert members(GuestRam)[0] >= {"mailbox_size", "ring_entries"} and "read_mailbox" in members(GuestRam)[1]
