"""bpftrace's map functions in the shell: sum, avg, min, max, stats, lhist, keys of several parts, every S.

Expected texts follow bpftrace's TextOutput (src/output.cpp): ``map_keyval_to_str``,
``map_stats_to_str`` ("count N, average A, total T", the average a C integer
division), ``lhist_to_str`` and ``lhist_index_label``, and its lhist index
(0 below min, ``(max - min) / step + 1`` above max, ``(v - min) / step + 1`` else).
"""

from __future__ import annotations

import re

import pytest
from shell_fakes import make_shell

from qprobe.events import EventHit
from qprobe.shell.collect import Aggregation
from qprobe.shell.parse import Call, ShellUsageError, parse_collect, split_call
from qprobe.shell.render import c_div, lhist_bucket, lhist_index_label, render_lhist


def hit(comm: str = "cat", pid: int = 7, **args: str) -> EventHit:
    return EventHit("rd", 0, pid, comm, 0.0, 0, "", dict(args), "")


def bar(n: int, top: int) -> str:
    return f"|{'@' * int(n / top * 52):<52}|"


def test_lhist_buckets_and_labels_as_bpftrace() -> None:
    assert [lhist_bucket(v, 0, 100, 10) for v in (-1, 0, 9, 10, 99, 100, 101)] == [0, 1, 1, 2, 10, 11, 11]
    assert [lhist_index_label(n) for n in (0, 512, 1024, 3072, 1 << 20, 1000)] == ["0", "512", "1K", "3K", "1M",
                                                                                    "1000"]  # fmt: skip
    text = render_lhist({0: 1, 1: 1, 2: 2, 11: 1}, 0, 100, 10)
    rows = text.splitlines()
    assert rows[0] == f"{'(..., 0)':<16}{1:>8} {bar(1, 2)}"
    assert rows[1] == f"{'[0, 10)':<16}{1:>8} {bar(1, 2)}"
    assert rows[2] == f"{'[10, 20)':<16}{2:>8} {bar(2, 2)}"
    assert rows[3] == f"{'[20, 30)':<16}{0:>8} {bar(0, 2)}"
    assert rows[-1] == f"{'[100, ...)':<16}{1:>8} {bar(1, 2)}" and len(rows) == 12
    assert render_lhist({}, 0, 100, 10) == ""


def test_sum_min_max_avg_stats_by_a_key_of_two_parts() -> None:
    values = [("cat", "3", "10"), ("cat", "3", "-7"), ("ls", "4", "5"), ("cat", "5", "1")]
    maps = {kind: Aggregation(kind, ("$comm", "fd"), "count") for kind in ("sum", "min", "max", "avg", "stats")}
    for comm, fd, count in values:
        for agg in maps.values():
            agg.add(None, hit(comm, fd=fd, count=count))
    # Sorted by value, smallest first; a two-part key prints as bpftrace prints a tuple key.
    assert maps["sum"].render() == "@count[cat, 5]: 1\n@count[cat, 3]: 3\n@count[ls, 4]: 5\n"
    assert maps["min"].render() == "@count[cat, 3]: -7\n@count[cat, 5]: 1\n@count[ls, 4]: 5\n"
    assert maps["max"].render() == "@count[cat, 5]: 1\n@count[ls, 4]: 5\n@count[cat, 3]: 10\n"
    assert maps["avg"].render() == "@count[cat, 3]: 1\n@count[cat, 5]: 1\n@count[ls, 4]: 5\n"  # ties by key
    assert maps["stats"].render() == (
        "@count[cat, 5]: count 1, average 1, total 1\n"
        "@count[cat, 3]: count 2, average 1, total 3\n"
        "@count[ls, 4]: count 1, average 5, total 5\n"
    )
    assert c_div(-7, 2) == -3 and c_div(7, 2) == 3 and c_div(5, 0) == 0


def test_count_by_comm_and_pid_and_a_keyed_lhist() -> None:
    agg = Aggregation("count", ("$comm", "$pid"))
    for comm, pid in (("cat", 1), ("cat", 1), ("sh", 2)):
        agg.add(None, hit(comm, pid))
    assert agg.render() == "@[sh, 2]: 1\n@[cat, 1]: 2\n"
    lh = Aggregation("lhist", ("$comm",), "count", bounds=(0, 4096, 1024))
    for comm, count in (("cat", "100"), ("cat", "2000"), ("sh", "5000")):
        lh.add(None, hit(comm, count=count))
    assert lh.render() == (
        f"@count[sh]: \n{'[4K, ...)':<16}{1:>8} {bar(1, 1)}\n\n"
        f"@count[cat]: \n{'[0, 1K)':<16}{1:>8} {bar(1, 1)}\n{'[1K, 2K)':<16}{1:>8} {bar(1, 1)}\n\n"
    )
    assert lh.take() and lh.render() == ""  # take() clears


def test_parsing_calls_keys_and_every() -> None:
    assert split_call("sum(count) rd by $comm, fd every 2 for 10") == (
        Call("sum", "count"),
        "rd by $comm, fd every 2 for 10",
    )
    assert split_call("lhist(count, 0, 4096, 512) rd") == (Call("lhist", "count", (0, 4096, 512)), "rd")
    assert split_call("count rd") is None and split_call("sym vfs_read") is None
    spec = parse_collect("rd by $comm, fd every 2 for 10", verb="sum")
    assert spec.keys == ("$comm", "fd") and spec.every == 2 and spec.seconds == 10
    assert parse_collect("rd by $comm,fd ,$cpu", verb="sum").keys == ("$comm", "fd", "$cpu")
    for bad, message in [
        ("lhist(count, 0, 10) rd", "usage: lhist(VALUE, MIN, MAX, STEP)"),
        ("lhist(count, 10, 0, 1) rd", "lhist: STEP must be positive and MAX above MIN"),
        ("lhist(count, 0, 100000, 1) rd", "lhist: at most 1000 buckets"),
        ("sum($comm) rd", "sum() takes a numeric value"),
        ("avg(a, b) rd", "avg() takes one value"),
    ]:
        with pytest.raises(ShellUsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
            split_call(bad)
    with pytest.raises(ShellUsageError, match="an empty key part"):
        parse_collect("rd by $comm,", verb="count")


def test_shell_sum_and_stats_over_a_guest_command() -> None:
    shell, _t, out = make_shell()
    shell.execute("p:rd vfs_read count=%dx:u64")
    out.seek(0)
    out.truncate()
    shell.execute("sum(count) rd by $comm run workload read 3 100")
    assert out.getvalue().splitlines()[-1] == "@count[workload]: 300"
    out.seek(0)
    out.truncate()
    shell.execute("stats(count) rd run workload read 4 10")
    assert out.getvalue().splitlines()[-1] == "@count: count 4, average 10, total 40"
    out.seek(0)
    out.truncate()
    shell.execute("max(size) rd")
    assert out.getvalue() == "error: kprobes/rd has no argument 'size' (count); `help count` lists the keys\n"


@pytest.mark.parametrize("kind", ["count", "sum", "min", "max", "avg", "stats", "hist"])
def test_a_map_folded_in_the_guest_prints_as_the_same_hits_folded_on_the_host(kind: str) -> None:
    """The guest's slots (count, sum, min, max by key; a histogram's bucket the key's last part) give the map
    the host's own folding of those hits gives."""
    from qprobe.arch.inguest import MapSlot
    from qprobe.shell.render import log2_bucket

    values = [("cat", "3", 10), ("cat", "3", -7), ("ls", "4", 5), ("cat", "5", 1), ("cat", "3", 0)]
    value = None if kind == "count" else "count"
    host, guest = Aggregation(kind, ("$comm", "fd"), value), Aggregation(kind, ("$comm", "fd"), value)
    slots: dict[tuple[str | int, ...], MapSlot] = {}
    for comm, fd, count in values:
        host.add(None, hit(comm, fd=fd, count=str(count)))
        key: tuple[str | int, ...] = (comm, fd, log2_bucket(count)) if kind == "hist" else (comm, fd)
        one = MapSlot(1, count, count, count)
        slots[key] = slots[key].merge(one) if key in slots else one
    guest.add_slots(slots)
    assert guest.render() == host.render() and guest.total == host.total == len(values)


def test_trace_map_takes_the_shell_s_functions_and_keys_and_nothing_else() -> None:
    from qprobe.fetch import ProbeEvent, parse_event
    from qprobe.shell.collect import check_map_names, parse_map

    agg, every = parse_map("sum(count) by $comm, $pid every 2")
    assert (agg.kind, agg.keys, agg.value, every) == ("sum", ("$comm", "$pid"), "count", 2.0)
    agg, every = parse_map("count")
    assert (agg.kind, agg.keys, agg.value, every) == ("count", (), None, None)
    for bpftrace in ("count()", "count() by $comm"):  # bpftrace's spelling
        assert parse_map(bpftrace)[0].kind == "count"
    assert parse_map("count() by $comm")[0].keys == ("$comm",)
    agg, _ = parse_map("lhist(count, 0, 4096, 512) by $func")
    assert agg.bounds == (0, 4096, 512) and agg.keys == ("$func",)
    for bad, says in [
        ("tally by $comm", "expected count [by KEY, ...] or FUNC(VALUE)"),
        ("count rd by $comm", "the events are trace's definitions"),
        ("count by $comm run workload", "the events are trace's definitions"),
        ("sum($comm)", "takes a numeric value"),
    ]:
        with pytest.raises(ShellUsageError, match=re.escape(says)):
            parse_map(bad)
    ev = parse_event("p:rd ksys_read fd=%di:s32 count=%dx:u64", symbol_exists=lambda n: True)
    assert isinstance(ev, ProbeEvent)
    check_map_names(parse_map("sum(count) by fd, $comm")[0], [ev])
    with pytest.raises(ShellUsageError, match=r"^rd has no argument 'size' \(fd, count\)$"):
        check_map_names(parse_map("sum(size)")[0], [ev])
