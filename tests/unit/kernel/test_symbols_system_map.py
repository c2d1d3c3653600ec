"""System.map as the fallback symbol source for a stripped vmlinux."""

from __future__ import annotations

from qprobe.kernel.vmlinux import parse_system_map

MAP = """\
0000000000000000 D fixed_percpu_data
000000000001fb80 D current_task
ffffffff81000000 T _stext
ffffffff81000000 T startup_64
ffffffff81000100 t helper
ffffffff81000180 T main_func
ffffffff82000000 R linux_banner
ffffffff82000100 B some_bss
garbage line
"""


def test_parse_system_map_sizes_kinds_and_percpu() -> None:
    syms, percpu = parse_system_map(MAP)
    by_name = {name: (addr, size, kind) for name, addr, size, kind in syms}
    assert by_name["startup_64"] == (0xFFFFFFFF81000000, 0x100, "func")
    assert by_name["helper"] == (0xFFFFFFFF81000100, 0x80, "func")
    assert by_name["main_func"][1] == 0xFFFFFFFF82000000 - 0xFFFFFFFF81000180
    assert by_name["linux_banner"][2] == "object" and by_name["some_bss"] == (0xFFFFFFFF82000100, 0, "object")
    assert percpu == {"fixed_percpu_data": 0, "current_task": 0x1FB80}
