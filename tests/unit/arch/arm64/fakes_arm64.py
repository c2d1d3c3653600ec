"""Fake arm64 registers and guest memory for the arm64 instruction tests."""

from __future__ import annotations

REG_NAMES = (*(f"x{n}" for n in range(31)), "sp", "pc", "pstate", "ELR_EL1", "SPSR_EL1")


class FakeRegs:
    """A trapped context's registers by pt_regs name (and ELR_EL1, SPSR_EL1), as qprobe.arch.Registers reads them."""

    def __init__(self, **values: int) -> None:
        unknown = set(values) - set(REG_NAMES)
        assert not unknown, unknown
        object.__setattr__(self, "_values", dict.fromkeys(REG_NAMES, 0) | values)
        object.__setattr__(self, "_dirty", set())

    def __getattr__(self, name: str) -> int:
        try:
            return self._values[name]  # type: ignore[no-any-return]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name: str, value: int) -> None:
        if name not in REG_NAMES:
            raise AttributeError(name)
        assert 0 <= value < 1 << 64, (name, value)
        self._values[name] = value
        self._dirty.add(name)

    def dirty(self) -> dict[str, int]:
        return {name: self._values[name] for name in sorted(self._dirty)}

    def as_dict(self) -> dict[str, int]:
        return dict(self._values)


class FakeMem:
    """Sparse byte-addressed memory; reading an unwritten byte is an error."""

    def __init__(self) -> None:
        self.bytes: dict[int, int] = {}

    def write(self, addr: int, data: bytes) -> None:
        for i, b in enumerate(data):
            self.bytes[addr + i] = b

    def read(self, addr: int, size: int) -> bytes:
        return bytes(self.bytes[addr + i] for i in range(size))
