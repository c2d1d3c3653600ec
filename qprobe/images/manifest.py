"""The image manifests: ``kernels/images.toml`` and the user's own file.

Both use one schema, a table per image under ``[images.NAME]``:

* a Debian kernel: ``flavour = "cloud-amd64"`` (the package
  ``linux-image-<abi>-<flavour>`` and its ``-dbg``); optional ``series``
  ("6.12") takes the kernel of that upstream series (the metapackage
  ``linux-image-<series>-<flavour>`` where the release has one, as bookworm
  has for its 6.12 backport); optional ``abi`` pins the ABI in any of
  Debian's namings ("6.1.0-56", "6.12.117+deb12") instead of taking what apt
  offers;
* a kernel built from a Debian source package: ``source = "build"``,
  ``package = "linux-source-6.12"`` and ``fragment``, a file of CONFIG_
  lines merged over ``make tinyconfig`` (scripts/build-minimal-kernel.sh);
* a kernel given by files: ``kernel`` (bzImage) and ``vmlinux``, optional
  ``system_map`` and ``config``, and ``initrd`` *or* ``disk``. Relative
  paths are taken from the manifest's directory, ``~`` is expanded;
* a buildroot output directory: ``buildroot = "PATH/output"``, whose files
  (and images/start-qemu.sh) stand for the keys above
  (qprobe.images.buildroot); a key given as well wins.

Common keys: ``description``, ``cmdline`` (extra kernel arguments),
``rootfs`` ("initramfs" default, or "disk": which qprobe-built root to use
when no ``initrd``/``disk`` file is given; "buildroot-ext2" and
"buildroot-cpio" are qprobe's buildroot-style roots, for its tests:
qprobe.images.brstyle) and ``disk_interface`` ("nvme" or "virtio"; unset,
a kernel given by files gets the one its config builds in, others "nvme").

Unknown keys are errors: a typo ("vmlinx") must not silently drop a file.
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path

from qprobe.errors import ImageError
from qprobe.images.image import DISK_INTERFACES

__all__ = [
    "ABI_PATTERN",
    "DEFAULT_IMAGE",
    "ImageSpec",
    "abi_in_series",
    "builtin_manifest_path",
    "load_manifest",
    "load_specs",
    "user_manifest_path",
]

DEFAULT_IMAGE = "debian-cloud"

# Debian's kernel ABI names: "6.1.0-56" (bookworm's own kernel: version, ABI
# number), "6.12.117+deb12" (its 6.12 backport and trixie: the full upstream
# version with the release tag).
ABI_PATTERN = r"\d+\.\d+\.\d+(?:-\d+|\+deb\d+)"

_COMMON = {"description", "cmdline", "rootfs", "disk_interface", "source"}
_DEBIAN = _COMMON | {"flavour", "abi", "series"}
_BUILD = _COMMON | {"package", "fragment"}
_FILES = _COMMON | {"kernel", "vmlinux", "initrd", "disk", "system_map", "config", "buildroot"}
_FILE_KEYS = ("kernel", "vmlinux", "initrd", "disk", "system_map", "config")
_ROOTFS = ("initramfs", "disk", "buildroot-ext2", "buildroot-cpio")


@dataclass(frozen=True)
class ImageSpec:
    """One image as a manifest describes it (nothing fetched or checked yet)."""

    name: str
    source: str  # "debian", "build" or "files"
    description: str = ""
    origin: Path | None = None  # the manifest it came from
    flavour: str | None = None
    abi: str | None = None
    series: str | None = None  # "6.12": only kernels of that upstream series
    package: str | None = None  # source = "build": "linux-source-6.12"
    fragment: Path | None = None  # source = "build": the config fragment
    files: dict[str, Path] = field(default_factory=dict)
    cmdline: str | None = None
    rootfs: str = "initramfs"  # which root filesystem when no initrd/disk file is given
    disk_interface: str | None = None  # None: not given (nvme, or what a files kernel's config builds in)
    buildroot: Path | None = None  # a buildroot output/ directory whose files stand for the keys not given

    @property
    def form(self) -> str:
        """ "initramfs" or "disk": how the guest's root filesystem is supplied."""
        if "disk" in self.files or self.rootfs == "buildroot-ext2":
            return "disk"
        if "initrd" in self.files or self.rootfs == "buildroot-cpio":
            return "initramfs"
        return self.rootfs


def abi_in_series(abi: str, series: str) -> bool:
    """Whether a Debian ABI ("6.12.117+deb12") is of an upstream series ("6.12")."""
    return abi.startswith(series + ".")


def expand_user(text: str, where: str) -> Path:
    """``~`` and ``~user`` expanded; an unknown user is an ImageError naming ``where``, not a RuntimeError."""
    try:
        return Path(text).expanduser()
    except RuntimeError:
        raise ImageError(f"{where}: {text!r} names a user or home directory that does not exist") from None


def builtin_manifest_path() -> Path:
    """``kernels/images.toml`` of this checkout (``$QPROBE_MANIFEST`` overrides)."""
    env = os.environ.get("QPROBE_MANIFEST")
    if env:
        return expand_user(env, "QPROBE_MANIFEST")
    return Path(__file__).resolve().parents[2] / "kernels" / "images.toml"


def user_manifest_path() -> Path:
    """``$QPROBE_IMAGES``, else ``$XDG_CONFIG_HOME/qprobe/images.toml`` (~/.config)."""
    env = os.environ.get("QPROBE_IMAGES")
    if env:
        return expand_user(env, "QPROBE_IMAGES")
    config_home = os.environ.get("XDG_CONFIG_HOME") or "~/.config"
    return expand_user(config_home, "XDG_CONFIG_HOME") / "qprobe" / "images.toml"


def _string(table: dict[str, object], key: str, where: str) -> str | None:
    value = table.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise ImageError(f"{where}: '{key}' must be a string, not {type(value).__name__}")
    return value


def parse_spec(name: str, table: object, origin: Path | None) -> ImageSpec:
    """Check one ``[images.NAME]`` table and turn it into an ImageSpec."""
    where = f"{origin or '<manifest>'}: image '{name}'"
    if not isinstance(table, dict):
        raise ImageError(f"{where} must be a table ([images.{name}])")
    if not name or any(c.isspace() or c == "/" for c in name):
        raise ImageError(f"{where}: an image name must be non-empty, without spaces or '/'")
    source = _string(table, "source", where)
    if source is None:
        source = "debian" if "flavour" in table else "files"
    if source not in ("debian", "build", "files"):
        raise ImageError(f"{where}: source must be 'debian', 'build' or 'files', not {source!r}")
    allowed = {"debian": _DEBIAN, "build": _BUILD, "files": _FILES}[source]
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise ImageError(f"{where}: unknown key(s) {', '.join(unknown)} (allowed: {', '.join(sorted(allowed))})")

    rootfs = _string(table, "rootfs", where) or "initramfs"
    if rootfs not in _ROOTFS:
        raise ImageError(f"{where}: rootfs must be one of {', '.join(_ROOTFS)}, not {rootfs!r}")
    iface = _string(table, "disk_interface", where)
    if iface is not None and iface not in DISK_INTERFACES:
        raise ImageError(f"{where}: disk_interface must be 'nvme' or 'virtio', not {iface!r}")
    common = ImageSpec(
        name=name,
        source=source,
        description=_string(table, "description", where) or "",
        origin=origin,
        cmdline=_string(table, "cmdline", where),
        rootfs=rootfs,
        disk_interface=iface,
    )
    if source == "debian":
        flavour = _string(table, "flavour", where)
        if not flavour:
            raise ImageError(f"{where}: a Debian image needs 'flavour' (e.g. \"cloud-amd64\")")
        if not re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", flavour):
            raise ImageError(f'{where}: flavour {flavour!r} is not a Debian kernel flavour like "cloud-amd64"')
        abi = _string(table, "abi", where)
        if abi is not None and not re.fullmatch(ABI_PATTERN, abi):
            raise ImageError(f'{where}: abi {abi!r} must look like "6.1.0-56" or "6.12.117+deb12"')
        series = _string(table, "series", where)
        if series is not None and not re.fullmatch(r"\d+\.\d+", series):
            raise ImageError(f'{where}: series {series!r} must look like "6.12"')
        if abi is not None and series is not None and not abi_in_series(abi, series):
            raise ImageError(f"{where}: abi {abi!r} is not of series {series!r}")
        return replace(common, flavour=flavour, abi=abi, series=series)

    base = origin.parent if origin is not None else Path.cwd()
    if source == "build":
        package = _string(table, "package", where)
        if not package or not re.fullmatch(r"linux-source-\d+\.\d+", package):
            raise ImageError(f"{where}: a built image needs 'package' like \"linux-source-6.12\"")
        value = _string(table, "fragment", where)
        if not value:
            raise ImageError(f"{where}: a built image needs 'fragment', a file of CONFIG_ lines")
        fragment = expand_user(value, f"{where}: fragment")
        return replace(common, package=package, fragment=fragment if fragment.is_absolute() else base / fragment)

    files: dict[str, Path] = {}
    for key in (*_FILE_KEYS, "buildroot"):
        value = _string(table, key, where)
        if value:
            path = expand_user(value, f"{where}: {key}")
            files[key] = path if path.is_absolute() else base / path
    buildroot = files.pop("buildroot", None)
    for key in ("kernel", "vmlinux"):
        if key not in files and buildroot is None:
            raise ImageError(f"{where}: '{key}' is required for an image given by files (or give buildroot = "
                             f'"PATH/output")')  # fmt: skip
    if "initrd" in files and "disk" in files:
        raise ImageError(f"{where}: give either 'initrd' or 'disk', not both")
    return replace(common, files=files, buildroot=buildroot)


def load_manifest(path: Path, *, required: bool) -> dict[str, ImageSpec]:
    """The images of one manifest file, in file order.

    A missing optional file (the user's) gives no images; a missing required
    one (the built-in) or a malformed one is an ImageError.
    """
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError as exc:
        if not required:
            return {}
        raise ImageError(f"image manifest {path} not found; set QPROBE_MANIFEST to its location") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ImageError(f"image manifest {path} is not valid TOML: {exc}") from exc
    except UnicodeDecodeError as exc:  # tomllib decodes the file as UTF-8 before it parses
        raise ImageError(f"image manifest {path} is not UTF-8 (byte {exc.start}): TOML files are UTF-8") from None
    except RecursionError:
        raise ImageError(f"image manifest {path} nests arrays or tables too deep to read") from None
    except OSError as exc:
        raise ImageError(f"cannot read image manifest {path}: {exc.strerror}") from exc
    unknown = sorted(set(data) - {"images"})
    if unknown:
        raise ImageError(f"{path}: unknown top-level key(s) {', '.join(unknown)}; images go in [images.NAME]")
    images = data.get("images", {})
    if not isinstance(images, dict):
        raise ImageError(f"{path}: 'images' must be a table of [images.NAME] tables")
    return {name: parse_spec(name, table, path) for name, table in images.items()}


def load_specs() -> dict[str, ImageSpec]:
    """Built-in images followed by the user's; a user image may not reuse a built-in name."""
    builtin_path = builtin_manifest_path()
    specs = load_manifest(builtin_path, required=True)
    user_path = user_manifest_path()
    for name, spec in load_manifest(user_path, required=False).items():
        if name in specs:
            raise ImageError(f"{user_path}: image '{name}' clashes with a built-in image; rename it")
        specs[name] = spec
    return specs
