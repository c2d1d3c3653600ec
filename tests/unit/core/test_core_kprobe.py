"""Kprobe: argument validation as register_kprobe's EINVAL checks (and every probe kind's handler check),
flags and printing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from qprobe.core.kprobe import KPROBE_FLAG_DISABLED, KPROBE_FLAG_GONE, Kprobe, Kretprobe
from qprobe.core.uprobe import Uprobe
from qprobe.errors import InvalidProbe, ProbeError


def handler(kp: Kprobe, regs: Any) -> int:
    return 0


INVALID: list[tuple[str, dict[str, Any], str]] = [
    ("symbol-and-addr", {"symbol_name": "vfs_read", "addr": 0xFFFF_FFFF_8130_0000}, "not both"),
    ("symbol-and-addr-0", {"symbol_name": "vfs_read", "addr": 0}, "not both"),
    ("neither", {}, "needs a symbol_name or an addr"),
    ("offset-only", {"offset": 4}, "needs a symbol_name or an addr"),
    ("negative-offset", {"symbol_name": "vfs_read", "offset": -1}, "non-negative"),
    ("str-offset", {"symbol_name": "vfs_read", "offset": "4"}, "non-negative int"),
    ("float-offset", {"symbol_name": "vfs_read", "offset": 4.0}, "non-negative int"),
    ("none-offset", {"symbol_name": "vfs_read", "offset": None}, "non-negative int"),
    ("pre-not-callable", {"symbol_name": "vfs_read", "pre_handler": 1}, "pre_handler must be callable, not int"),
    ("post-not-callable", {"addr": 0xFFFF_FFFF_8130_0000, "post_handler": "x"},
     "post_handler must be callable, not str"),
    ("fault-not-callable", {"symbol_name": "vfs_read", "fault_handler": [handler]},
     "fault_handler must be callable, not list"),
]  # fmt: skip


@pytest.mark.parametrize(("kwargs", "words"), [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_invalid_probe(kwargs: dict[str, Any], words: str) -> None:
    with pytest.raises(InvalidProbe, match=words) as info:
        Kprobe(**kwargs)
    text = str(info.value)
    assert "(EINVAL)" in text and "\n" not in text
    assert isinstance(info.value, ProbeError)


VALID: list[tuple[dict[str, Any], str]] = [
    ({"symbol_name": "vfs_read"}, "vfs_read+0x0"),
    ({"symbol_name": "vfs_read", "offset": 0x10}, "vfs_read+0x10"),
    ({"addr": 0xFFFF_FFFF_8130_0004}, "0xffffffff81300004"),
    ({"symbol_name": "do_sys_open", "pre_handler": handler, "post_handler": handler, "fault_handler": handler},
     "do_sys_open+0x0"),
    ({"symbol_name": "vfs_read", "pre_handler": lambda kp, regs: None}, "vfs_read+0x0"),
    ({"symbol_name": "cleanup_module.isra.0", "offset": 0}, "cleanup_module.isra.0+0x0"),
]  # fmt: skip


@pytest.mark.parametrize(("kwargs", "where"), VALID)
def test_valid_probe(kwargs: dict[str, Any], where: str) -> None:
    kp = Kprobe(**kwargs)
    assert kp.where() == where
    assert (kp.nhit, kp.nmissed, kp.nfaults, kp.errors, kp.registered) == (0, 0, 0, [], False)
    assert kp.flags == 0 and not kp.disabled and not kp.gone
    assert repr(kp) == f"<Kprobe {where} nhit=0 nmissed=0>"
    for name in ("symbol_name", "addr", "pre_handler", "post_handler", "fault_handler"):
        assert getattr(kp, name) is kwargs.get(name)
    assert kp.offset == kwargs.get("offset", 0)


def test_handlers_are_kept_as_given() -> None:
    class Handler:
        def __call__(self, kp: Kprobe, regs: Any) -> None:
            return None

    c = Handler()
    kp = Kprobe("vfs_read", post_handler=c)
    assert kp.post_handler is c


def test_disabled_flag() -> None:
    kp = Kprobe("vfs_read", disabled=True)
    assert kp.disabled and kp.flags == KPROBE_FLAG_DISABLED
    kp.flags |= KPROBE_FLAG_GONE
    assert kp.gone and kp.disabled
    kp.flags &= ~KPROBE_FLAG_DISABLED
    assert not kp.disabled and kp.gone


def test_where_follows_the_resolved_address() -> None:
    kp = Kprobe(addr=0xFFFF_FFFF_8130_0000)
    kp.addr = 0xFFFF_FFFF_8130_0010
    assert kp.where() == "0xffffffff81300010"
    kp.addr = None
    assert kp.where() == "?"


def test_positional_arguments_follow_the_kernel_struct_order() -> None:
    kp = Kprobe("vfs_read", 8)
    assert (kp.symbol_name, kp.offset, kp.addr) == ("vfs_read", 8, None)


HANDLERS_NOT_CALLABLE: list[tuple[Callable[..., object], dict[str, Any], str]] = [
    (Kretprobe, {"symbol_name": "vfs_read", "handler": 1}, "handler must be callable, not int"),
    (Kretprobe, {"symbol_name": "vfs_read", "entry_handler": "x"}, "entry_handler must be callable, not str"),
    (Uprobe, {"path": "/bin/true", "offset": 0, "handler": 2}, "handler must be callable, not int"),
    (Uprobe, {"path": "/bin/true", "offset": 0, "ret_handler": [handler]}, "ret_handler must be callable, not list"),
    (Uprobe, {"path": "/bin/true", "offset": 0, "filter": True}, "filter must be callable, not bool"),
]


@pytest.mark.parametrize(("make", "kwargs", "words"), HANDLERS_NOT_CALLABLE)
def test_every_probe_kind_refuses_a_handler_it_cannot_call_naming_it(
    make: Callable[..., object], kwargs: dict[str, Any], words: str
) -> None:
    with pytest.raises(InvalidProbe, match=f"^{words} \\(EINVAL\\)$"):
        make(**kwargs)
