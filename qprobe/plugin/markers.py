"""The markers that skip a test on an image that lacks what it needs: ``qprobe_needs_symbol``,
``qprobe_needs_config``; checked before any fixture, so that such a test boots nothing."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from qprobe.plugin.options import selected_images
from qprobe.plugin.state import _IMAGES, _OUR_SKIP, _SKIPPED_ON, _SYMBOLS, _VMS

if TYPE_CHECKING:
    from qprobe.images import Image
    from qprobe.kernel.symbols import Symbols


def _image(config: pytest.Config, name: str) -> Image:
    cache = config.stash[_IMAGES]
    if name not in cache:
        from qprobe.images import get_image

        cache[name] = get_image(name)  # fetched and built on first use, as boot() would
    return cache[name]


def _symbols(config: pytest.Config, name: str) -> Symbols:
    cache = config.stash[_SYMBOLS]
    if name not in cache:
        for vm in config.stash[_VMS].values():
            if vm.image == name:
                cache[name] = vm.target.symbols
                break
        else:
            from qprobe.kernel.symbols import Symbols

            cache[name] = Symbols.load(_image(config, name).vmlinux)  # cached by build-id: fast
    return cache[name]


def _unmet(config: pytest.Config, image: str, item: pytest.Item) -> str | None:
    """Why ``item`` cannot run on ``image`` (a skip reason naming the image), or None."""
    for marker in item.iter_markers("qprobe_needs_symbol"):
        if not marker.args:
            raise pytest.UsageError(f"{item.nodeid}: qprobe_needs_symbol needs at least one symbol name")
        syms = _symbols(config, image)
        for name in marker.args:
            if name not in syms:
                return f"image {image}: its vmlinux has no symbol {name!r}"
    for marker in item.iter_markers("qprobe_needs_config"):
        if not 1 <= len(marker.args) <= 2:
            raise pytest.UsageError(f"{item.nodeid}: use qprobe_needs_config(option) or (option, value)")
        option = str(marker.args[0])
        option = option if option.startswith("CONFIG_") else f"CONFIG_{option}"
        want = marker.args[1] if len(marker.args) == 2 else None
        img = _image(config, image)
        if img.config is None:
            return f"image {image}: no kernel config to check {option} in"
        have = img.config_option(option)
        if want is None and have is None:
            return f"image {image}: {option} is not set"
        if want is not None and have != str(want):
            return f"image {image}: {option} is {have if have is not None else 'not set'}, the test needs {want}"
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    # Before any fixture: a test that cannot run on this image must not boot it.
    if not any(item.iter_markers("qprobe_needs_symbol")) and not any(item.iter_markers("qprobe_needs_config")):
        return
    callspec = getattr(item, "callspec", None)
    if callspec is not None and "qprobe_image" in callspec.params:
        images = [callspec.params["qprobe_image"]]
    else:
        images = selected_images(item.config)
    for image in images:
        reason = _unmet(item.config, image, item)
        if reason is not None:
            item.stash[_OUR_SKIP] = True  # reported at the test, not here
            item.stash[_SKIPPED_ON] = image
            pytest.skip(reason)
