"""Forwarding descriptors: a façade's public methods and attributes, each handed on to the object that has it.

``Target`` (qprobe.api) is a façade over the objects qprobe.wiring composes; it says which of them
answers each name rather than inheriting their APIs or repeating their methods::

    class Target:
        register_kprobe = forward(ProbeAPI.register_kprobe, "probe_api")
        kprobes: Via[KprobeManager] = Via("parts")

A :class:`Forward` is no method of the façade's (it adds none to its count) but reads as the method it
forwards to: its name, doc and signature (``help()``, ``inspect.signature``); its type is that method's,
so that mypy checks every call through the façade.  A :class:`Via` reads and writes an attribute of the
named object under the same name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Concatenate, Generic, ParamSpec, Self, TypeVar, overload

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


class Forward(Generic[P, R]):
    """A façade's method that is ``method`` of the object the façade holds as ``via`` (bound to it)."""

    def __init__(self, method: Callable[Concatenate[Any, P], R], via: str) -> None:
        self.via = via
        self.attr = method.__name__  # the name on ``via``: the façade's may differ
        self.__name__ = method.__name__
        self.__qualname__ = method.__qualname__
        self.__doc__ = method.__doc__
        self.__wrapped__ = method  # inspect.signature: the implementation's, self first as on a method

    def __set_name__(self, owner: type, name: str) -> None:
        self.__name__ = name
        self.__qualname__ = f"{owner.__qualname__}.{name}"

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> Self: ...
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> Callable[P, R]: ...
    def __get__(self, obj: object, owner: type | None = None) -> Self | Callable[P, R]:
        if obj is None:
            return self
        bound: Callable[P, R] = getattr(getattr(obj, self.via), self.attr)
        return bound

    def __call__(self, obj: object, /, *args: P.args, **kwargs: P.kwargs) -> R:
        """Called on the class, as a method is: ``Target.register_kprobe(target, kp)``."""
        return self.__get__(obj)(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<forward {self.__qualname__} to .{self.via}.{self.attr}>"


def forward(method: Callable[Concatenate[Any, P], R], via: str) -> Forward[P, R]:
    """``method`` (a function of the class of the façade's ``via``), as the façade's own."""
    return Forward(method, via)


class Via(Generic[T]):
    """A façade's attribute that is the same-named attribute of the object it holds as ``via``."""

    def __init__(self, via: str) -> None:
        self.via = via
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> Self: ...
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> T: ...
    def __get__(self, obj: object, owner: type | None = None) -> Self | T:
        if obj is None:
            return self
        value: T = getattr(getattr(obj, self.via), self.name)
        return value

    def __set__(self, obj: object, value: T) -> None:
        setattr(getattr(obj, self.via), self.name, value)


__all__ = ["Forward", "Via", "forward"]
