"""``qprobe images add``: a new entry in the user's image manifest, checked before it is written."""

from __future__ import annotations

import json
import re
from pathlib import Path

from qprobe.errors import ImageError
from qprobe.images import buildroot
from qprobe.images.image import disk_interface_of
from qprobe.images.manifest import load_manifest, load_specs, parse_spec, user_manifest_path

__all__ = ["add_buildroot_image"]


def _toml_string(text: str) -> str:
    """A TOML basic string: JSON's escapes are TOML's, and DEL, which JSON leaves as is, is escaped too."""
    return json.dumps(text).replace("\x7f", "\\u007f")


def add_buildroot_image(name: str, output: Path, description: str = "") -> tuple[Path, str]:
    """Add ``[images.NAME]`` with ``buildroot = OUTPUT`` to the user's manifest; (the manifest, a summary).

    The output directory is resolved as a boot would resolve it, so that a wrong path is said now.
    """
    manifest = user_manifest_path()
    output = output.expanduser().resolve()
    if name in load_specs():
        raise ImageError(f"an image called {name!r} exists already (see `qprobe images`); choose another name")
    table: dict[str, object] = {"buildroot": str(output)}
    if description:
        table["description"] = description
    spec = buildroot.resolve(parse_spec(name, table, manifest))
    interface = ""
    if "disk" in spec.files:
        interface = spec.disk_interface or disk_interface_of(spec.files.get("config"))
    key = name if re.fullmatch(r"[A-Za-z0-9_-]+", name) else _toml_string(name)  # TOML's bare keys
    entry = f"[images.{key}]\n" + "".join(f"{k} = {_toml_string(str(v))}\n" for k, v in table.items())
    try:
        manifest.parent.mkdir(parents=True, exist_ok=True)
        old = manifest.read_text() if manifest.exists() else ""
        gap = "" if not old else "\n" if old.endswith("\n") else "\n\n"  # a blank line between tables
        manifest.write_text(old + gap + entry)
    except OSError as exc:
        raise ImageError(f"cannot write {manifest}: {exc.strerror}") from None
    load_manifest(manifest, required=True)  # what was written reads back
    found = "".join(f"\n  {key:10} {path}" for key, path in spec.files.items())
    attached = f"\n  the disk is attached as {interface}" if interface else ""
    return manifest, f"{found}{attached}"
