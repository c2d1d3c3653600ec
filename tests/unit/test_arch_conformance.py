"""Every registered architecture has every member of the Arch protocol, each method with Arch's parameters.

make lint's mypy check is the full one (types included); this is its quick
counterpart in the unit tests, so that a missing or reshaped member also fails
``pytest tests/unit``.
"""

from __future__ import annotations

import inspect

import pytest

from qprobe.arch import Arch
from qprobe.arch.select import ARCHES


def members() -> tuple[set[str], set[str]]:
    """(data members, methods) Arch declares."""
    methods = {n for n, v in vars(Arch).items() if inspect.isfunction(v) and not n.startswith("_")}
    data = {n for n in Arch.__annotations__ if not n.startswith("_")} - methods
    return data, methods


@pytest.mark.parametrize("name", sorted(ARCHES))
def test_the_arch_implements_the_protocol(name: str) -> None:
    arch = ARCHES[name][1]()
    data, methods = members()
    missing = sorted(n for n in data | methods if not hasattr(arch, n))
    assert not missing, f"{type(arch).__name__} lacks {', '.join(missing)}"
    for method in sorted(methods):
        want = list(inspect.signature(getattr(Arch, method)).parameters.values())[1:]  # without self
        got = list(inspect.signature(getattr(arch, method)).parameters.values())
        assert [p.kind for p in got] == [p.kind for p in want], f"{method}: {got} for Arch's {want}"
        assert len(got) == len(want), f"{method}: {len(got)} parameters, Arch's has {len(want)}"


def test_the_protocol_s_data_members_and_methods_are_both_found() -> None:
    """The introspection the check relies on sees attributes (annotations) and methods (functions) alike."""
    data, methods = members()
    assert {"registers", "breakpoint", "trap_watch"} <= data
    assert {"arch_prepare_kprobe", "decode_trap", "page_tables", "jump_label_size"} <= methods
