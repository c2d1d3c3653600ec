"""Histograms and count maps rendered exactly as bpftrace's TextOutput prints them."""

from __future__ import annotations

import pytest

from qprobe.shell.collect import Aggregation
from qprobe.shell.render import (
    bar_width,
    bucket_label,
    hist_buckets,
    hist_index_label,
    log2_bucket,
    render_counts,
    render_hist,
    render_hist_map,
    sort_counts,
)


def row(label: str, count: int, bar: int) -> str:
    return f"{label:<16}{count:>8} |{'@' * bar:<52}|\n"


def test_bucket_indexes_follow_bpftrace_log2() -> None:
    assert [log2_bucket(v) for v in (-5, -1, 0, 1, 2, 3, 4, 7, 8, 1023, 1024)] == [0, 0, 1, 2, 3, 3, 4, 4, 5, 11, 12]
    assert log2_bucket(2**64 - 1) == 65


def test_bucket_labels() -> None:
    labels = [bucket_label(i) for i in range(0, 8)]
    assert labels == ["(..., 0)", "[0]", "[1]", "[2, 4)", "[4, 8)", "[8, 16)", "[16, 32)", "[32, 64)"]
    assert bucket_label(log2_bucket(600)) == "[512, 1K)"
    assert bucket_label(log2_bucket(3000)) == "[2K, 4K)"
    assert bucket_label(log2_bucket(1 << 20)) == "[1M, 2M)"
    assert bucket_label(log2_bucket((1 << 30) + 5)) == "[1G, 2G)"
    assert bucket_label(log2_bucket(1 << 40)) == "[1T, 2T)"
    # bpftrace has no suffix past T: 2**50 is "1024T", exactly as hist_index_label computes it.
    assert hist_index_label(50) == "1024T" and hist_index_label(9) == "512" and hist_index_label(10) == "1K"


def test_hist_matches_bpftrace_runtime_output() -> None:
    # bpftrace's tests/runtime/outputs/hist.txt: @ = hist() of -1, 2, 3, 4, 16 (negative, gap rows kept).
    text = render_hist_map("", {None: hist_buckets([-1, 2, 3, 4, 16])})
    assert text == (
        "@: \n"
        "(..., 0)               1 |@@@@@@@@@@@@@@@@@@@@@@@@@@                          |\n"
        "[0]                    0 |                                                    |\n"
        "[1]                    0 |                                                    |\n"
        "[2, 4)                 2 |@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@|\n"
        "[4, 8)                 1 |@@@@@@@@@@@@@@@@@@@@@@@@@@                          |\n"
        "[8, 16)                0 |                                                    |\n"
        "[16, 32)               1 |@@@@@@@@@@@@@@@@@@@@@@@@@@                          |\n"
        "\n"
    )


def test_hist_of_0_to_20_starts_at_the_zero_bucket() -> None:
    text = render_hist(hist_buckets(range(21)))
    assert text == (
        row("[0]", 1, 6) + row("[1]", 1, 6) + row("[2, 4)", 2, 13) + row("[4, 8)", 4, 26)
        + row("[8, 16)", 8, 52) + row("[16, 32)", 5, 32)
    )  # fmt: skip
    assert all(len(line) == 16 + 8 + 2 + 52 + 1 for line in text.splitlines())


def test_bar_scaling_truncates_in_single_precision() -> None:
    assert bar_width(1, 3) == 17 and bar_width(2, 3) == 34 and bar_width(3, 3) == 52
    assert bar_width(0, 5) == 0 and bar_width(5, 0) == 0
    # 1/52 of the top still shows one '@'; just under it shows none.
    assert bar_width(100, 5200) == 1 and bar_width(99, 5200) == 0
    # Wide counts push the bar out of the column, as setw(8) does.
    assert render_hist({2: 123456789}) == f"{'[1]':<16}123456789 |{'@' * 52}|\n"


def test_empty_hist_prints_nothing() -> None:
    assert render_hist({}) == "" and render_hist({3: 0}) == ""


def test_keyed_hists_sorted_by_total_and_separated_by_blank_lines() -> None:
    text = render_hist_map("bytes", {"big": {3: 5}, "small": {1: 1}})
    assert text == "@bytes[small]: \n" + row("[0]", 1, 52) + "\n@bytes[big]: \n" + row("[2, 4)", 5, 52) + "\n"


def test_count_map_sorted_by_value_smallest_first() -> None:
    counts = {"sh": 3, "workload": 5, "init": 1, "cat": 3}
    assert [k for k, _ in sort_counts(counts)] == ["init", "cat", "sh", "workload"]
    assert render_counts("", counts) == "@[init]: 1\n@[cat]: 3\n@[sh]: 3\n@[workload]: 5\n"
    assert render_counts("", {None: 7}) == "@: 7\n"
    assert render_counts("", {10: 2, 9: 2, 100: 1}) == "@[100]: 1\n@[9]: 2\n@[10]: 2\n"


def test_stack_keys_print_as_indented_frames() -> None:
    text = render_counts("", {("vfs_read+0", "ksys_read+103"): 4, ("vfs_read+0", "kernel_read+30"): 1})
    assert text == (
        "@[\n        vfs_read+0\n        kernel_read+30\n]: 1\n@[\n        vfs_read+0\n        ksys_read+103\n]: 4\n"
    )


def test_hist_aggregation_skips_values_that_are_not_numbers() -> None:
    from shell_fakes import FakeTarget

    t = FakeTarget()
    te = t.add_event("p:rd vfs_read count=%dx:u64 name=+0(%si):string")
    agg = Aggregation("hist", value="count")
    for v in ("4096", "0x1000", "(fault)", "-3", "0"):
        t.fire(te, count=v, name='"x"')
        agg.add(te, te.hits[-1])
    assert agg.buckets == {14: 2, 0: 1, 1: 1} and agg.skipped == 1 and agg.total == 5
    assert agg.render().startswith("@count: \n(..., 0) ")


def test_aggregation_rejects_a_hist_without_key() -> None:
    with pytest.raises(ValueError):
        Aggregation("hist")
