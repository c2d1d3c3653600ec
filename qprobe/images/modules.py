"""A Debian kernel's loadable modules (``.ko``), to put into the guest and ``insmod`` there.

qprobe's own initramfs has no modules.  A test or a user who wants one
(``binfmt_misc``, ``dummy``...) asks for its file; the kernel's image package
is downloaded again (its modules tree was left out of the first extraction)
and its ``lib/modules/<release>`` tree kept next to the kernel in the cache.
"""

from __future__ import annotations

import gzip
import json
import lzma
import shutil
import subprocess
import tarfile
from pathlib import Path

from qprobe.errors import ImageError
from qprobe.images import cache, debian
from qprobe.images.apt import apt_state, flavour_architecture
from qprobe.images.image import Image
from qprobe.images.progress import Reporter

__all__ = ["module_file"]

_STAMP = "source.json"


def _extract_tree(deb: Path, prefix: str, dest: Path) -> int:
    """Copy every regular file under ``prefix`` of the .deb's data archive into ``dest``; how many."""
    if shutil.which("dpkg-deb") is None:
        raise ImageError("dpkg-deb not found: install the dpkg package")
    proc = subprocess.Popen(["dpkg-deb", "--fsys-tarfile", str(deb)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    count = 0
    try:
        with tarfile.open(fileobj=proc.stdout, mode="r|") as tar:
            for member in tar:
                name = member.name.removeprefix("./")
                if not name.startswith(prefix) or not member.isfile() or ".." in Path(name).parts:
                    continue
                out = dest / name.removeprefix(prefix)
                out.parent.mkdir(parents=True, exist_ok=True)
                src = tar.extractfile(member)
                assert src is not None
                with out.open("wb") as f:
                    shutil.copyfileobj(src, f)
                count += 1
    except tarfile.TarError as exc:
        raise ImageError(f"cannot read {deb}: {exc}") from None
    finally:
        proc.stdout.close()
        proc.wait()
    return count


def modules_tree(kernel_dir: Path, reporter: Reporter) -> Path:
    """``lib/modules/<release>`` of a cached Debian kernel, extracted from its image package on first use."""
    try:
        stamp = json.loads((kernel_dir / _STAMP).read_text())
        release, version, package = stamp["release"], stamp["version"], stamp["packages"][0]
    except (OSError, ValueError, KeyError, IndexError):
        raise ImageError(f"{kernel_dir} is not a Debian kernel qprobe fetched: it has no modules to give") from None
    dest = kernel_dir / "modules"
    with cache.locked(kernel_dir.parent, f"modules-{release}"):
        if dest.is_dir():
            return dest
        reporter.note(f"fetching the modules of {release} ({package})")
        debs = cache.subdir("debs")
        with cache.locked(debs, "download"):
            # A release ends in its flavour's architecture ("6.1.0-57-cloud-arm64"), as a flavour does.
            state = apt_state(flavour_architecture(release))
            deb = debian.download(state, package, version, 0, debs, reporter)
        try:
            with cache.atomic_dir(dest) as tmp:
                if not _extract_tree(deb, f"lib/modules/{release}/", tmp):
                    raise ImageError(f"{deb.name} has no lib/modules/{release}: not the expected kernel package")
                tmp.chmod(0o755)
        finally:
            deb.unlink(missing_ok=True)
    return dest


# Compressed modules (CONFIG_MODULE_COMPRESS_*: Debian's 6.12 packages ship .ko.xz), which
# busybox insmod cannot load: they are decompressed next to the tree once.
_DECOMPRESS = {".xz": lzma.decompress, ".gz": gzip.decompress}


def module_file(image: Image, name: str, reporter: Reporter | None = None) -> Path:
    """The ``.ko`` of module ``name`` (``-`` and ``_`` alike, as modprobe takes them) of ``image``'s kernel."""
    tree = modules_tree(image.kernel.parent, reporter or Reporter(enabled=False))
    wanted = {f"{name.replace('-', '_')}.ko", f"{name.replace('_', '-')}.ko"}
    found = sorted(p for p in tree.rglob("*.ko*") if p.name in wanted or (p.stem in wanted and p.suffix in _DECOMPRESS))
    if not found:
        raise ImageError(f"{image.name}: its kernel has no module {name} (a built-in or a missing driver)")
    if found[0].suffix == ".ko":
        return found[0]
    out = tree.parent / "modules-decompressed" / found[0].stem
    if not out.exists():
        out.parent.mkdir(exist_ok=True)
        try:
            data = _DECOMPRESS[found[0].suffix](found[0].read_bytes())
        except (lzma.LZMAError, OSError, EOFError) as exc:
            raise ImageError(f"cannot decompress {found[0]}: {exc}") from None
        tmp = out.with_suffix(".tmp")
        tmp.write_bytes(data)
        tmp.replace(out)
    return out
