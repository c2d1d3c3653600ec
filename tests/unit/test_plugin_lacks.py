"""``--qprobe-lacks``: under ``--qprobe-no-skip`` a skip stands only where the list says the test's image lacks the
fact its reason names; every other skip fails, naming its reason and the image."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from qprobe.pytest_lacks import Lacks, LacksError

INNER = """
import pytest


def test_kprobe_events(qprobe_image):
    pytest.skip(f"image {qprobe_image}: CONFIG_KPROBE_EVENTS is not set")


def test_uprobe_events(qprobe_image):
    pytest.skip("the guest kernel has no uprobe_events (CONFIG_UPROBE_EVENTS)")


def test_a_longer_option(qprobe_image):
    pytest.skip(f"image {qprobe_image}: CONFIG_KPROBE_EVENTS_ON_NOTRACE is not set")


def test_runs(qprobe_image):
    pass
"""

LACKS = """
["minimal-6.12"]
CONFIG_KPROBE_EVENTS = "tinyconfig-based, no tracing"
bp_desc = "no such symbol here"
"""

IMAGES = ("--qprobe-image", "debian-cloud", "--qprobe-image", "minimal-6.12")


def _pytest(tmp_path: Path, *args: str, inner: str = INNER, lacks: str = LACKS) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_inner.py").write_text(inner)
    (tmp_path / "lacks.toml").write_text(lacks)
    return subprocess.run([sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", "test_inner.py", *args],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)  # fmt: skip


def _outcomes(stdout: str) -> dict[str, str]:
    """test id -> PASSED/SKIPPED/FAILED, from -rA's short summary."""
    out = {}
    for line in stdout.splitlines():
        word, _, rest = line.partition(" ")
        if word in ("PASSED", "SKIPPED", "FAILED") and "::" in rest:
            out[rest.split("::")[1].split(" ")[0]] = word
        elif word == "SKIPPED" and rest.startswith("[1] test_inner.py:"):  # -rA gives a skip's place, not its id
            out.setdefault("skips", "")
            out["skips"] += rest + "\n"
    return out


def test_a_listed_fact_skips_on_its_image_and_fails_everywhere_else(tmp_path: Path) -> None:
    run = _pytest(tmp_path, "--qprobe-no-skip", "--qprobe-lacks", "lacks.toml", *IMAGES)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "5 failed, 2 passed, 1 skipped" in run.stdout, run.stdout
    outcomes = _outcomes(run.stdout)
    assert {k: v for k, v in outcomes.items() if v == "FAILED"} == {
        "test_kprobe_events[debian-cloud]": "FAILED",  # listed, but for another image
        "test_uprobe_events[debian-cloud]": "FAILED",  # listed for no image
        "test_uprobe_events[minimal-6.12]": "FAILED",
        "test_a_longer_option[debian-cloud]": "FAILED",
        "test_a_longer_option[minimal-6.12]": "FAILED",  # the listed option is only a prefix of the named one
    }
    # The one skip that stands is the listed fact on its image, with the list's reason beside the test's.
    assert ("image minimal-6.12: CONFIG_KPROBE_EVENTS is not set (lacks.toml: tinyconfig-based, no tracing)"
            in outcomes["skips"]), run.stdout  # fmt: skip
    assert ("skipped on image debian-cloud, and --qprobe-no-skip makes a skip a failure: Skipped: image "
            "debian-cloud: CONFIG_KPROBE_EVENTS is not set (it names no fact lacks.toml lists for debian-cloud)"
            ) in run.stdout, run.stdout  # fmt: skip
    assert ("skipped on image minimal-6.12, and --qprobe-no-skip makes a skip a failure: Skipped: the guest kernel "
            "has no uprobe_events (CONFIG_UPROBE_EVENTS) (it names no fact lacks.toml lists for minimal-6.12)"
            ) in run.stdout, run.stdout  # fmt: skip
    # A listed fact no skip named is said, so that the list does not outlive what it excuses.
    assert "qprobe: no skip of this run named these facts lacks.toml lists: minimal-6.12: bp_desc" in run.stdout


def test_only_the_facts_of_images_tests_ran_on_are_said_unused(tmp_path: Path) -> None:
    # Tests of no image (unit tests) with minimal-6.12 selected: none ran on it, so its facts are not asked about.
    inner = "def test_plain():\n    pass\n"
    run = _pytest(tmp_path, "--qprobe-no-skip", "--qprobe-lacks", "lacks.toml", *IMAGES, inner=inner)
    assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout
    assert "no skip of this run named" not in run.stdout, run.stdout


def test_the_list_changes_nothing_without_no_skip(tmp_path: Path) -> None:
    run = _pytest(tmp_path, "--qprobe-lacks", "lacks.toml", *IMAGES)
    assert run.returncode == 0 and "2 passed, 6 skipped" in run.stdout, run.stdout
    assert "no skip of this run named" not in run.stdout


def test_a_skip_while_collecting_is_a_failure_too(tmp_path: Path) -> None:
    inner = 'import pytest\n\npytest.importorskip("no_such_module_here")\n\n\ndef test_x():\n    pass\n'
    assert "1 skipped" in _pytest(tmp_path, inner=inner).stdout
    run = _pytest(tmp_path, "--qprobe-no-skip", inner=inner)
    assert run.returncode == 2 and "collected 0 items / 1 error" in run.stdout, run.stdout
    assert ("skipped, and --qprobe-no-skip makes a skip a failure: Skipped: could not import 'no_such_module_here'"
            in run.stdout), run.stdout  # fmt: skip


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('["debian-cloud-6.13"]\nCONFIG_X = "why"\n', "lacks.toml: unknown image 'debian-cloud-6.13'; known: "),
        ('["minimal-6.12"]\nCONFIG_X = 1\n', "lacks.toml: ['minimal-6.12'] CONFIG_X: give the reason"),
        ('["minimal-6.12"]\nCONFIG_X = " "\n', "lacks.toml: ['minimal-6.12'] CONFIG_X: give the reason"),
        ('["minimal-6.12"]\n" CONFIG_X" = "why"\n', "a fact is a word or name as the skip reasons write it"),
        ('"minimal-6.12" = "everything"\n', "['minimal-6.12'] must be a table"),
        ('["minimal-6.12"\n', "lacks.toml is not valid TOML: "),
    ],
)
def test_a_bad_list_is_one_line(tmp_path: Path, text: str, error: str) -> None:
    run = _pytest(tmp_path, "--qprobe-no-skip", "--qprobe-lacks", "lacks.toml", lacks=text)
    assert run.returncode == 4, run.stdout + run.stderr
    assert run.stderr.startswith("ERROR: --qprobe-lacks: lacks.toml") and error in run.stderr, run.stderr
    assert run.stderr.strip().count("\n") == 0, run.stderr


def test_a_missing_list_is_one_line(tmp_path: Path) -> None:
    run = _pytest(tmp_path, "--qprobe-no-skip", "--qprobe-lacks", "nosuch.toml")
    assert run.returncode == 4 and "ERROR: --qprobe-lacks: cannot read nosuch.toml: No such file" in run.stderr


@pytest.mark.parametrize(
    ("reason", "named"),
    [
        ("image minimal-6.12: its vmlinux has no symbol 'bp_desc'", "bp_desc"),
        ("the guest kernel has no kprobe_events (CONFIG_KPROBE_EVENTS)", "CONFIG_KPROBE_EVENTS"),
        ("image minimal-6.12: CONFIG_KPROBE_EVENTS_ON_NOTRACE is not set", None),  # a longer name
        ("image minimal-6.12: CONFIG_KPROBE_EVENTS is y, the test needs m", "CONFIG_KPROBE_EVENTS"),
        ("no symbol 'bp_desc_x'", None),
        ("no symbol 'x_bp_desc'", None),
        ("config_kprobe_events is not set", None),  # as the reasons write it: case counts
    ],
)
def test_a_fact_is_named_as_a_whole_word(tmp_path: Path, reason: str, named: str | None) -> None:
    path = tmp_path / "lacks.toml"
    path.write_text(LACKS)
    lacks = Lacks.load(path, ["debian-cloud", "minimal-6.12"])
    assert lacks.named("minimal-6.12", reason) == named
    assert lacks.named("debian-cloud", reason) is None


def test_unused_lists_what_no_skip_named(tmp_path: Path) -> None:
    path = tmp_path / "lacks.toml"
    path.write_text(LACKS)
    lacks = Lacks.load(path, ["debian-cloud", "minimal-6.12"])
    assert lacks.unused(["minimal-6.12"], {("minimal-6.12", "bp_desc")}) == ["minimal-6.12: CONFIG_KPROBE_EVENTS"]
    assert lacks.unused(["debian-cloud"], set()) == []  # an image not in the run is not asked about
    with pytest.raises(LacksError, match=r"unknown image 'minimal-6\.12'"):
        Lacks.load(path, ["debian-cloud"])
