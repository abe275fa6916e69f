"""Fixtures of the local episodes' tests: image stores made by real tools."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from images import busybox_rootfs
from registry import skip_unless_tools

from sequester.images import ImageSettings, ImageStore


@pytest.fixture(scope="module")
def busybox_store(tmp_path_factory) -> Iterator[tuple[ImageSettings, str]]:
    """A store holding busybox (a shell-only image: no bash, no Python) as test/busybox:1."""
    skip_unless_tools("skopeo")
    root = tmp_path_factory.mktemp("busybox-store")
    settings = ImageSettings(store_dir=root / "store", source="prebuilt")
    record = ImageStore(settings).import_source(str(busybox_rootfs()), "test/busybox:1")
    assert record.names == ("docker.io/test/busybox:1",)
    yield settings, "test/busybox:1"
