"""A shared library with an indirect function (STT_GNU_IFUNC), built here with gcc, for the tests that read one."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

# plus_two is the implementation pick() returns; chosen_here, a local alias, makes call_chosen's call an
# IRELATIVE slot of the library's own, as glibc's hidden aliases of strlen and the rest do.
SOURCE = """
static int plus_one(int x) { return x + 1; }
static int plus_two(int x) { return x + 2; }
static void *pick(void) { return plus_two; }
int chosen(int x) __attribute__((ifunc("pick")));
static int chosen_here(int x) __attribute__((ifunc("pick")));
int call_chosen(int x) { return chosen_here(x) * 2; }
int plain(int x) { return plus_one(x) * 3; }
"""


def ifunc_library(tmp: Path) -> Path:
    """The library, built in ``tmp`` (the test skips if gcc is not there or cannot build an ifunc)."""
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc is not installed: no library with an indirect function to build")
    (tmp / "lib.c").write_text(SOURCE)
    out = tmp / "libifunc.so"
    proc = subprocess.run([gcc, "-O2", "-shared", "-fPIC", "-o", str(out), str(tmp / "lib.c")],
                          capture_output=True, text=True, check=False)  # fmt: skip
    if proc.returncode != 0:
        pytest.skip(f"gcc cannot build an ifunc library here: {proc.stderr.strip().splitlines()[-1:]}")
    return out
