"""Kernels qprobe builds itself from a Debian source package (``source = "build"``).

The build is scripts/build-minimal-kernel.sh: ``apt-get download`` of the
``linux-source-X.Y`` package, ``make tinyconfig`` with the image's config
fragment merged over it, ``make bzImage``. It takes minutes (see
docs/performance.md), so it runs once: the result lands in
``<cache>/kernels/<image>-<key>/`` by one directory rename, under the same
kind of build lock the Debian downloads take, and the key hashes the script
and the fragment, so editing either builds again. As with Debian images, a
cached kernel is reused when apt has a newer source package; delete its
directory to build the newer one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from qprobe.errors import ImageError
from qprobe.images import cache
from qprobe.images.debian import KernelFiles
from qprobe.images.image import check_config, check_kernel, check_vmlinux
from qprobe.images.manifest import ImageSpec
from qprobe.images.progress import Reporter
from qprobe.paths import check_owned

__all__ = ["build_kernel", "build_state", "built_kernel", "script_path"]

_STAMP = "build.json"
_LOG_TAIL = 15


def script_path() -> Path:
    """scripts/build-minimal-kernel.sh of this checkout."""
    return Path(__file__).resolve().parents[2] / "scripts" / "build-minimal-kernel.sh"


def _inputs(spec: ImageSpec) -> tuple[Path, Path]:
    assert spec.fragment is not None
    script = script_path()
    for path, what in ((script, "build script"), (spec.fragment, f"config fragment of image {spec.name!r}")):
        if not path.is_file():
            raise ImageError(f"{what} {path} not found")
    return script, spec.fragment


def _directory(spec: ImageSpec) -> Path:
    script, fragment = _inputs(spec)
    assert spec.package is not None
    key = cache.hash_inputs(
        [("package", spec.package.encode()), ("script", script.read_bytes()), ("fragment", fragment.read_bytes())]
    )
    return cache.cache_dir() / "kernels" / f"{spec.name}-{key}"


def _files(directory: Path) -> KernelFiles | None:
    stamp = directory / _STAMP
    try:
        info = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return None
    files = KernelFiles(
        release=str(info.get("release", "")),
        vmlinuz=directory / "bzImage",
        config=directory / "config",
        vmlinux=directory / "vmlinux",
        system_map=directory / "System.map",
        version=str(info.get("version", "")),
    )
    if not all(p.is_file() for p in (files.vmlinuz, files.config, files.vmlinux, files.system_map)):
        return None
    # What qprobe boots and trusts is read from the cache itself, never through a link planted there.
    for path in (directory, stamp, files.vmlinuz, files.config, files.vmlinux, files.system_map):
        check_owned(path)
    return files


def built_kernel(spec: ImageSpec) -> KernelFiles | None:
    """The cached build of ``spec``'s kernel, if it is complete."""
    return _files(_directory(spec))


def build_state(spec: ImageSpec) -> tuple[str, str | None]:
    """("ready" | "partial" | "not fetched", release) without building anything."""
    directory = _directory(spec)
    files = _files(directory)
    if files is not None:
        return "ready", files.release
    leftovers = list(directory.parent.glob(f"{cache.TMP_PREFIX}{directory.name}*"))
    return ("partial" if leftovers or directory.exists() else "not fetched"), None


def build_kernel(spec: ImageSpec, reporter: Reporter) -> KernelFiles:
    """``spec``'s kernel from the cache, building it first if needed."""
    script, fragment = _inputs(spec)
    assert spec.package is not None
    dest = _directory(spec)
    kernels = cache.subdir("kernels")
    with cache.locked(kernels, spec.name):
        files = _files(dest)
        if files is not None:
            return files
        cache.remove_leftovers(kernels, dest.name)
        work = cache.subdir("build") / spec.name
        log = cache.subdir("logs") / f"build-{spec.name}.log"
        reporter.note(f"building kernel {spec.name} from {spec.package} with {fragment.name} (minutes; log in {log})")
        start = time.monotonic()
        with cache.atomic_dir(dest) as tmp, log.open("w") as out:
            proc = subprocess.run(
                ["sh", str(script), spec.package, str(fragment), str(work), str(tmp)],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                check=False,
                env={**os.environ, "LC_ALL": "C"},
            )
            if proc.returncode != 0:
                shutil.rmtree(work, ignore_errors=True)
                tail = log.read_text(errors="replace").strip().splitlines()[-_LOG_TAIL:]
                detail = "\n  ".join(tail) or f"exit status {proc.returncode}"
                raise ImageError(f"building kernel {spec.name} failed (log {log}):\n  {detail}")
            check_kernel(tmp / "bzImage")
            check_vmlinux(tmp / "vmlinux")
            check_config(tmp / "config")
            tmp.chmod(0o755)
        # Builds from an older script or fragment: a vmlinux with DWARF each.
        cache.prune(kernels, f"{spec.name}-*", keep=1, protect=[dest], min_age=0)
        files = _files(dest)
        if files is None:
            raise ImageError(f"kernel {spec.name} was built but {dest} is incomplete; delete it and retry")
        reporter.note(f"built {files.release} in {time.monotonic() - start:.0f} s")
        return files
