"""Debian kernels: choose one with apt, download it, extract the few files used.

A Debian kernel comes in two packages built together: the image
(``linux-image-<abi>-<flavour>-unsigned``, or the signed one with the same
code) with ``boot/vmlinuz-*`` and ``boot/config-*``, and the ``-dbg`` package
with ``usr/lib/debug/boot/vmlinux-*`` (590 MB for cloud, with DWARF) and the
real ``System.map``. Both must be the same version or the symbols lie.

The ABI is never hard-coded: apt says which one the flavour's metapackage
depends on (``linux-image-<series>-<flavour>`` when a series such as "6.12"
is asked for and the release has that metapackage, as bookworm has for its
6.12 backport; else ``linux-image-<flavour>``), falling back to the highest
ABI of the series whose packages apt knows. Debian names ABIs two ways,
"6.1.0-56" and "6.12.117+deb12"; both are taken. Only
the four members are taken out of the packages, the .deb files are deleted
afterwards, and the result lands in ``<cache>/kernels/<release>/`` by one
directory rename, so that directory existing means the kernel is complete.

A flavour names its Debian architecture ("cloud-arm64"); one the host's dpkg
does not list is asked of a private apt state (qprobe.images.apt).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tarfile
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

from qprobe.errors import ImageError
from qprobe.images import cache
from qprobe.images.apt import AptState, apt_state, flavour_architecture, refresh
from qprobe.images.apt import run as _apt
from qprobe.images.image import check_config, check_kernel, check_vmlinux
from qprobe.images.manifest import ABI_PATTERN, abi_in_series
from qprobe.images.progress import Reporter, human
from qprobe.paths import check_owned

__all__ = [
    "DebianKernel",
    "KernelFiles",
    "cached_kernel",
    "deb_name",
    "download",
    "extract",
    "fetch_kernel",
    "kernel_state",
    "show",
]

_STAMP = "source.json"
_CHUNK = 1 << 20


@dataclass(frozen=True)
class DebianKernel:
    """A resolved kernel: which packages, at which version."""

    abi: str  # "6.1.0-56" or "6.12.117+deb12"
    flavour: str  # "cloud-amd64"
    image_package: str
    dbg_package: str
    version: str  # Debian version, same for both packages
    image_size: int
    dbg_size: int

    @property
    def release(self) -> str:
        """The kernel release, as ``uname -r`` prints it."""
        return f"{self.abi}-{self.flavour}"

    @property
    def arch(self) -> str:
        """The Debian architecture the packages are built for ("amd64", "arm64")."""
        return flavour_architecture(self.flavour)


@dataclass(frozen=True)
class KernelFiles:
    """The extracted files of one cached kernel."""

    release: str
    vmlinuz: Path
    config: Path
    vmlinux: Path
    system_map: Path
    version: str  # Debian package version


def _abi_key(abi: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", abi))


def show(state: AptState, package: str) -> dict[str, str] | None:
    """The candidate version's fields from ``apt-cache show``, None if unknown."""
    proc = _apt(*state.argv("apt-cache", "show", "--no-all-versions", package))
    if proc.returncode != 0 or not proc.stdout.strip():
        return None
    fields: dict[str, str] = {}
    for line in proc.stdout.split("\n\n", 1)[0].splitlines():
        key, sep, value = line.partition(":")
        if sep and not key.startswith(" "):
            fields[key] = value.strip()
    return fields


def _versions(state: AptState, package: str) -> set[str]:
    """All versions of a package apt knows (``apt-cache madison``)."""
    proc = _apt(*state.argv("apt-cache", "madison", package))
    return {parts[1].strip() for line in proc.stdout.splitlines() if len(parts := line.split("|")) >= 3}


def _in_series(abi: str, series: str | None) -> bool:
    return series is None or abi_in_series(abi, series)


def _candidate_abis(state: AptState, flavour: str, series: str | None = None) -> list[str]:
    """ABIs to try, best first: the metapackage's, then every one apt lists."""
    found: list[str] = []
    metas = ([f"linux-image-{series}-{flavour}"] if series else []) + [f"linux-image-{flavour}"]
    pattern = re.compile(rf"Depends:\s*linux-image-({ABI_PATTERN})-{re.escape(flavour)}(?:-unsigned)?\s*$")
    for meta in metas:
        depends = _apt(*state.argv("apt-cache", "depends", meta))
        for line in depends.stdout.splitlines():
            m = pattern.search(line)
            if m and m.group(1) not in found and _in_series(m.group(1), series):
                found.append(m.group(1))
        if found:
            break
    # flavour is [a-z0-9-]+ (checked by the manifest): nothing to escape for apt's regex.
    pattern_dbg = f"^linux-image-[0-9.]+(-[0-9]+|\\+deb[0-9]+)-{flavour}-dbg$"
    search = _apt(*state.argv("apt-cache", "search", "--names-only", pattern_dbg))
    listed = re.findall(rf"^linux-image-({ABI_PATTERN})-{re.escape(flavour)}-dbg ", search.stdout, re.M)
    found.sort(key=_abi_key, reverse=True)
    listed = [abi for abi in listed if _in_series(abi, series)]
    found += [abi for abi in sorted(set(listed), key=_abi_key, reverse=True) if abi not in found]
    return found


def resolve(flavour: str, abi: str | None = None, series: str | None = None) -> DebianKernel:
    """Ask apt which kernel of ``flavour`` to use (``abi`` pins one, ``series`` narrows)."""
    state = apt_state(flavour_architecture(flavour))
    fetched = refresh(state)
    try:
        return _resolve(state, flavour, abi, series)
    except ImageError:
        if state.root is None or fetched:
            raise
    # A private state's lists may predate a kernel the archive has published since.
    refresh(state, force=True)
    return _resolve(state, flavour, abi, series)


def _resolve(state: AptState, flavour: str, abi: str | None, series: str | None) -> DebianKernel:
    abis = [abi] if abi else _candidate_abis(state, flavour, series)
    if not abis:
        what = f"linux-image-{series}.*-{flavour}" if series else f"linux-image-*-{flavour}"
        raise ImageError(
            f"apt knows no {what} package: run 'apt-get update' "
            "(Debian's main archive, and for newer kernels its security or backports archive, must be in apt's sources)"
        )
    for candidate in abis:
        release = f"{candidate}-{flavour}"
        dbg = show(state, f"linux-image-{release}-dbg")
        if dbg is None:
            continue
        version = dbg.get("Version", "")
        for name in (f"linux-image-{release}-unsigned", f"linux-image-{release}"):
            info = show(state, name)
            if info is None:
                continue
            if info.get("Version") != version and version not in _versions(state, name):
                continue
            size = int(info.get("Size", "0")) if info.get("Version") == version else 0
            return DebianKernel(
                abi=candidate,
                flavour=flavour,
                image_package=name,
                dbg_package=f"linux-image-{release}-dbg",
                version=version,
                image_size=size,
                dbg_size=int(dbg.get("Size", "0")),
            )
    tried = ", ".join(f"{a}-{flavour}" for a in abis)
    raise ImageError(
        f"no kernel of flavour {flavour} has both its image and -dbg package in apt (tried {tried}); "
        "run 'apt-get update'"
    )


def deb_name(package: str, version: str, arch: str) -> str:
    """The file ``apt-get download`` names: <package>_<version with ':' as %3a>_<arch>.deb."""
    return f"{package}_{version.replace(':', '%3a')}_{arch}.deb"


def download(state: AptState, package: str, version: str, size: int, debs: Path, reporter: Reporter) -> Path:
    """``apt-get download package=version`` of ``state``'s architecture into ``debs`` (atomically; reused if there)."""
    dest = debs / deb_name(package, version, state.arch)
    if dest.exists():
        return dest
    tmp = Path(tempfile.mkdtemp(prefix=f"{cache.TMP_PREFIX}{package}.", dir=debs))
    try:
        with reporter.transfer(f"downloading {package}", size or None) as update:
            proc = subprocess.Popen(
                state.argv("apt-get", "download", "-q", f"{package}={version}"),
                cwd=tmp,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                encoding="utf-8",
                errors="replace",
            )
            out: list[str] = []
            reader = threading.Thread(target=lambda: out.append(proc.communicate()[1]), daemon=True)
            reader.start()
            while proc.poll() is None:
                update(sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file()), None)
                time.sleep(0.2)
            reader.join()
            update(size, None)
        if proc.returncode != 0:
            errors = [line for line in "".join(out).splitlines() if line.startswith("E:")]
            detail = errors[-1] if errors else f"exit status {proc.returncode}"
            raise ImageError(f"apt-get download {package}={version} failed: {detail}")
        got = [f for f in tmp.glob("*.deb")]
        if len(got) != 1:
            raise ImageError(f"apt-get download {package}={version} produced no .deb file")
        got[0].replace(dest)
        return dest
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def extract(deb: Path, members: dict[str, Path], reporter: Reporter) -> None:
    """Copy the named members of a .deb's data archive to the given paths.

    The data tar is streamed from ``dpkg-deb --fsys-tarfile`` and read only
    until every wanted member was seen, so the 590 MB vmlinux is the only
    large thing written. Member names are given without the leading "./".
    """
    if shutil.which("dpkg-deb") is None:
        raise ImageError("dpkg-deb not found: install the dpkg package")
    wanted = dict(members)
    proc = subprocess.Popen(["dpkg-deb", "--fsys-tarfile", str(deb)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    stopped_early = False
    tar_error: tarfile.TarError | None = None
    try:
        with tarfile.open(fileobj=proc.stdout, mode="r|") as tar:
            for member in tar:
                name = member.name.removeprefix("./")
                if name not in wanted:
                    continue
                if not member.isfile():
                    raise ImageError(f"{deb.name}: {name} is not a regular file; delete it and fetch again")
                src = tar.extractfile(member)
                assert src is not None
                dest = wanted.pop(name)
                label = f"extracting {Path(name).name}"
                with reporter.transfer(label, member.size) as update, dest.open("wb") as out:
                    done = 0
                    while chunk := src.read(_CHUNK):
                        out.write(chunk)
                        done += len(chunk)
                        update(done, None)
                if not wanted:
                    stopped_early = True
                    break
    except tarfile.TarError as exc:
        tar_error = exc
    finally:
        proc.stdout.close()
        if proc.poll() is None:
            proc.terminate()
        proc.wait()
        stderr = proc.stderr.read().decode(errors="replace").strip()
        proc.stderr.close()
    if stopped_early:
        return
    if proc.returncode != 0 or tar_error is not None:
        detail = stderr.splitlines()[-1] if stderr else str(tar_error)
        raise ImageError(f"cannot read {deb}: {detail}")
    raise ImageError(f"{deb.name} has no {', '.join(wanted)}; it is not the expected kernel package")


def _extract_or_discard(deb: Path, members: dict[str, Path], reporter: Reporter) -> None:
    """``extract``, deleting a .deb that turns out unreadable so the next fetch replaces it."""
    try:
        extract(deb, members, reporter)
    except ImageError as exc:
        deb.unlink(missing_ok=True)
        raise ImageError(f"{exc} (deleted it: fetch again)") from exc


def _kernels_dir() -> Path:
    return cache.subdir("kernels")


def _files(directory: Path, release: str) -> KernelFiles | None:
    stamp = directory / _STAMP
    files = KernelFiles(
        release=release,
        vmlinuz=directory / f"vmlinuz-{release}",
        config=directory / f"config-{release}",
        vmlinux=directory / f"vmlinux-{release}",
        system_map=directory / f"System.map-{release}",
        version="",
    )
    if not stamp.exists() or not all(
        p.exists() for p in (files.vmlinuz, files.config, files.vmlinux, files.system_map)
    ):
        return None
    # What qprobe boots and trusts is read from the cache itself, never through a link planted there.
    for path in (directory, stamp, files.vmlinuz, files.config, files.vmlinux, files.system_map):
        check_owned(path)
    try:
        version = json.loads(stamp.read_text()).get("version", "")
    except (OSError, ValueError):
        return None
    return replace(files, version=version)


def cached_kernel(flavour: str, abi: str | None = None, series: str | None = None) -> KernelFiles | None:
    """The newest complete cached kernel of ``flavour`` (of ``abi``, of ``series``), if any."""
    root = cache.cache_dir() / "kernels"
    if not root.is_dir():
        return None
    pattern = re.compile(rf"^({ABI_PATTERN})-{re.escape(flavour)}$")
    found = []
    for d in root.iterdir():
        m = pattern.match(d.name)
        if (
            m
            and (abi is None or m.group(1) == abi)
            and _in_series(m.group(1), series)
            and (files := _files(d, d.name)) is not None
        ):
            found.append((_abi_key(m.group(1)), files))
    if not found:
        return None
    return max(found, key=lambda item: item[0])[1]


def kernel_state(flavour: str, abi: str | None = None, series: str | None = None) -> tuple[str, str | None]:
    """("ready" | "partial" | "not fetched", release) without touching the network."""
    files = cached_kernel(flavour, abi, series)
    if files is not None:
        return "ready", files.release
    root = cache.cache_dir()
    tag = f"{abi or (series + '.*' if series else '*')}-{flavour}"
    leftovers = list((root / "debs").glob(f"linux-image-{tag}[_-]*.deb"))
    leftovers += [p for p in (root / "kernels").glob(f"*{tag}*") if not p.name.startswith(".lock-")]
    return ("partial" if leftovers else "not fetched"), None


def fetch_kernel(flavour: str, abi: str | None, reporter: Reporter, series: str | None = None) -> KernelFiles:
    """A complete cached kernel of ``flavour``, downloading it if needed."""
    kernels = _kernels_dir()
    with cache.locked(kernels, flavour):
        files = cached_kernel(flavour, abi, series)
        if files is not None:
            return files
        kernel = resolve(flavour, abi, series)
        cache.remove_leftovers(kernels, kernel.release)
        debs = cache.subdir("debs")
        missing = [
            size
            for package, size in (
                (kernel.image_package, kernel.image_size),
                (kernel.dbg_package, kernel.dbg_size),
            )
            if not (debs / deb_name(package, kernel.version, kernel.arch)).exists()
        ]
        todo = f": {human(sum(missing))} to download" if missing else ""
        reporter.note(f"fetching Debian kernel {kernel.release} ({kernel.version}){todo}")
        with cache.locked(debs, "download"):
            cache.remove_leftovers(debs)
            state = apt_state(kernel.arch)
            image_deb = download(state, kernel.image_package, kernel.version, kernel.image_size, debs, reporter)
            dbg_deb = download(state, kernel.dbg_package, kernel.version, kernel.dbg_size, debs, reporter)
        release = kernel.release
        dest = kernels / release
        with cache.atomic_dir(dest) as tmp:
            _extract_or_discard(
                image_deb,
                {
                    f"boot/vmlinuz-{release}": tmp / f"vmlinuz-{release}",
                    f"boot/config-{release}": tmp / f"config-{release}",
                },
                reporter,
            )
            _extract_or_discard(
                dbg_deb,
                {
                    f"usr/lib/debug/boot/vmlinux-{release}": tmp / f"vmlinux-{release}",
                    f"usr/lib/debug/boot/System.map-{release}": tmp / f"System.map-{release}",
                },
                reporter,
            )
            check_kernel(tmp / f"vmlinuz-{release}")
            check_vmlinux(tmp / f"vmlinux-{release}")
            check_config(tmp / f"config-{release}")
            stamp = {
                "release": release,
                "version": kernel.version,
                "packages": [kernel.image_package, kernel.dbg_package],
            }
            (tmp / _STAMP).write_text(json.dumps(stamp, indent=2) + "\n")
            tmp.chmod(0o755)
        # The .debs are only a means to the extracted files: 300 MB-1 GB to free.
        image_deb.unlink(missing_ok=True)
        dbg_deb.unlink(missing_ok=True)
        files = _files(dest, release)
        if files is None:
            raise ImageError(f"kernel {release} was extracted but {dest} is incomplete; delete it and retry")
        return files
