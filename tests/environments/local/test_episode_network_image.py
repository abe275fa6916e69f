"""An episode on an image gets the task's network like a host-mode one: its
``/etc/resolv.conf`` is a regular file in the writable layer, over the image's own (here a
link to an absolute path of the host, which a bind or a write would have followed), and
the image's layers and the host's file stay as they were. Reaches Debian's archive only.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from images import busybox_rootfs, oci_from_rootfs
from registry import skip_unless_tools
from tasks import make_task

from sequester.environments.local.episode import Episode
from sequester.environments.settings import EpisodeSettings
from sequester.images import ImageSettings, ImageStore

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not shutil.which("slirp4netns") or not os.path.exists("/dev/net/tun"),
                       reason="needs slirp4netns and /dev/net/tun"),
]

HOST_TARGET = Path("/var/tmp/sequester-test-resolv-target")


@pytest.fixture(scope="module")
def linked_store(tmp_path_factory) -> Iterator[tuple[ImageSettings, str, Path]]:
    """busybox whose /etc/resolv.conf is a link to a file of the host's."""
    skip_unless_tools("skopeo", "umoci")
    root = tmp_path_factory.mktemp("netbox")
    rootfs = root / "rootfs"
    shutil.copytree(busybox_rootfs(), rootfs, symlinks=True)
    (rootfs / "etc" / "resolv.conf").symlink_to(HOST_TARGET)
    ref = oci_from_rootfs(rootfs, root / "layout", "netbox")
    settings = ImageSettings(store_dir=root / "store", source="prebuilt")
    ImageStore(settings).import_source(ref, "test/netbox:1")
    HOST_TARGET.write_text("nameserver 192.0.2.99 # the host's file\n")
    try:
        yield settings, "test/netbox:1", root
    finally:
        HOST_TARGET.unlink(missing_ok=True)


def test_image_episode_has_the_network_and_the_images_link_is_not_followed(tmp_path, linked_store):
    settings, ref, _ = linked_store
    task = make_task(tmp_path, "t", "echo 1 > /logs/verifier/reward.txt\n",
                     toml=f'[environment]\ndocker_image = "{ref}"\nallow_internet = true\n', dockerfile="FROM scratch\n")
    store = ImageStore(settings)
    lease = store.lease(store.find(ref))
    lease.release()
    layer_link = [p / "etc" / "resolv.conf" for p in lease.layers if os.path.lexists(p / "etc" / "resolv.conf")][-1]
    with Episode(EpisodeSettings(images=settings)) as ep:
        ep.reset(task)
        assert ep.system["mode"] == "image"
        shown = ep.exec("cat /etc/resolv.conf; ls -l /etc/resolv.conf").stdout
        fetched = ep.exec("wget -q -O- http://deb.debian.org/debian/dists/bookworm/Release 2>&1 | head -1").stdout
        assert ep.evaluate().reward == 1.0
        tampering = ep.tampering()
    assert "nameserver 10.0.2.3" in shown and shown.count("->") == 0, shown  # a file, not the link
    assert fetched.startswith("Origin: Debian"), fetched
    assert HOST_TARGET.read_text() == "nameserver 192.0.2.99 # the host's file\n"
    assert os.readlink(layer_link) == str(HOST_TARGET)  # the image's layer is as it was
    assert not [t for t in tampering if "resolv.conf" in t], tampering
    assert ep.network["mode"] == "public"
