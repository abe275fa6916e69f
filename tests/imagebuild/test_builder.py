"""Building Dockerfiles without a daemon (:mod:`sequester.imagebuild.builder`): a corpus built for real, layer by layer.

The base image is Debian trixie served by a real registry on loopback (pulled through
``[images] mirrors``) when the trixie image can be made (root), else the busybox image
(an ordinary user); every Dockerfile below runs on both. Each RUN runs in its own
sandbox; the results are checked in the layers and in episodes on the built images.
"""

from __future__ import annotations

import os
import socket
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from images import busybox_rootfs, is_root, trixie_image
from many_fds import descriptors_above
from registry import running_registry, skip_unless_tools

from sequester.imagebuild import BuildError, BuildOptions, build_image
from sequester.images import ImageSettings, ImageStore
from sequester.images.stack import image_path_kind, read_image_file
from sequester.net.build.network import BuildNetwork

BASE = "test/base:1"


# Every test builds on the module's base image (pulled from a registry, or busybox imported):
# slow, whichever test pays for it.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def base_store(tmp_path_factory) -> Iterator[ImageStore]:
    """A store whose ``test/base:1`` is Debian from a loopback registry (root) or busybox."""
    skip_unless_tools("skopeo")
    root = tmp_path_factory.mktemp("build-store")
    if is_root():
        skip_unless_tools("umoci", "docker-registry")
        with running_registry(root / "registry") as registry:
            registry.push(trixie_image(), "test/base:1")
            settings = ImageSettings(store_dir=root / "store", insecure=(registry.host,),
                                     aliases={BASE: f"{registry.host}/test/base:1"})
            store = ImageStore(settings)
            store.pull(BASE)
            yield store
    else:
        store = ImageStore(ImageSettings(store_dir=root / "store"))
        store.import_source(str(busybox_rootfs()), BASE)
        yield store


def _build(store: ImageStore, runner: Path, folder: Path, dockerfile: str, files: dict[str, str] | None = None,
           **options):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "Dockerfile").write_text(dockerfile)
    for name, content in (files or {}).items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(content)
    options.setdefault("network", BuildNetwork("none"))
    return build_image(store, folder / "Dockerfile", folder, name=f"localhost/t/{folder.name}:1", runner=runner,
                       options=BuildOptions(**options))


def _layers(store: ImageStore, record) -> tuple[Path, ...]:
    lease = store.lease(record)
    lease.release()
    return lease.layers


def _file(store: ImageStore, record, path: str) -> str | None:
    data = read_image_file(_layers(store, record), path)
    return None if data is None else data.decode()


def test_multi_stage_copy_from_stage_and_unused_stage_not_built(base_store, runner, tmp_path):
    result = _build(base_store, runner, tmp_path / "ms", f"""\
FROM {BASE} AS builder
RUN mkdir -p /out && echo generated > /out/answer.txt && echo secret > /tmp/original_documents
FROM {BASE} AS unused
RUN exit 7
FROM {BASE}
COPY --from=builder /out/answer.txt /app/answer.txt
COPY --from=0 /out /copied/
""")
    assert _file(base_store, result.record, "/app/answer.txt") == "generated\n"
    assert _file(base_store, result.record, "/copied/answer.txt") == "generated\n"
    # The build stage's own files are not in the result (the multi-stage answer leak).
    assert image_path_kind(_layers(base_store, result.record), "/tmp/original_documents") == "none"
    assert all(step.stage != "unused" for step in result.steps)


def test_copy_from_an_image(base_store, runner, tmp_path):
    other = _build(base_store, runner, tmp_path / "other", f"FROM {BASE}\nRUN echo from-image > /marker\n")
    result = _build(base_store, runner, tmp_path / "user", f"FROM {BASE}\nCOPY --from={other.record.names[0]} "
                                                           "/marker /got/marker\n")
    assert _file(base_store, result.record, "/got/marker") == "from-image\n"


def test_arg_and_env_expand_over_the_base_images_env(base_store, runner, tmp_path):
    result = _build(base_store, runner, tmp_path / "env", f"""\
ARG WHERE=/opt/tool
FROM {BASE}
ARG WHERE
ARG LEVEL=3
ENV PATH=$WHERE/bin:$PATH PYTHONPATH=/app:$PYTHONPATH LEVEL=${{LEVEL}}
RUN echo "$PATH|$PYTHONPATH|$LEVEL|$WHERE" > /seen
""", build_args={"LEVEL": "9"})
    env = result.record.config.env_map()
    assert env["PATH"].startswith("/opt/tool/bin:/usr/local/") and env["PYTHONPATH"] == "/app:"
    assert env["LEVEL"] == "9" and "WHERE" not in env  # a build argument is not in the image's config
    assert _file(base_store, result.record, "/seen") == f"{env['PATH']}|/app:|9|/opt/tool\n"


def test_user_runs_later_steps_as_that_user(base_store, runner, tmp_path):
    result = _build(base_store, runner, tmp_path / "user", f"""\
FROM {BASE}
RUN echo 'app:x:1234:1234::/home/app:/bin/sh' >> /etc/passwd && mkdir -p /home/app /data && chown app /data
USER app
RUN id -u > /tmp/uid && echo "$HOME" > /tmp/home
""")
    assert _file(base_store, result.record, "/tmp/uid") == "1234\n"
    assert _file(base_store, result.record, "/tmp/home") == "/home/app\n"
    assert result.record.config.user == "app"


def test_run_useradd_su_and_chown_are_real_under_the_episodes_map(base_store, runner, tmp_path):
    """RUN steps map the ids episodes map: another user exists, su works, and the files it
    owns keep their owner in the built layer (the host id of 1234 in the map)."""
    from sequester.sandbox.idmap import caller_id_map

    ids, why = caller_id_map()
    if ids is None:
        pytest.skip(f"no id range here: {why}")
    result = _build(base_store, runner, tmp_path / "owners", f"""\
FROM {BASE}
RUN (useradd -u 1234 -U app || (echo 'app:x:1234:1234::/:/bin/sh' >> /etc/passwd && echo 'app:x:1234:' >> /etc/group)) && \\
    mkdir -p /data && chown app:app /data && su app -c 'touch /data/by-app'
""", ids=ids)
    layer = _layers(base_store, result.record)[-1]
    st = os.lstat(layer / "data" / "by-app")
    assert (st.st_uid, st.st_gid) == (ids.host_uid(1234), ids.host_gid(1234))


def test_run_rm_becomes_a_whiteout(base_store, runner, tmp_path):
    result = _build(base_store, runner, tmp_path / "rm", f"FROM {BASE}\nRUN rm -rf /etc/passwd- /usr/share/doc "
                                                         "/bin/ls && test ! -e /bin/ls\n")
    layers = _layers(base_store, result.record)
    real = "usr/bin/ls" if image_path_kind(layers, "/bin") == "other" else "bin/ls"  # Debian: /bin -> usr/bin
    assert image_path_kind(layers[:-1], real) == "other" and image_path_kind(layers, real) == "none"
    top = layers[-1]
    whiteout = os.lstat(top / real)
    assert stat.S_ISCHR(whiteout.st_mode) and whiteout.st_rdev == 0
    # The step's own mount points are not part of its layer.
    assert not any(os.path.lexists(top / name) for name in ("proc", "dev", "opt/sequester-verifier"))


def test_run_steps_build_with_descriptors_above_select_bound(base_store, runner, tmp_path):
    """The step's sandbox, its end and its build proxy's listener (the public network: the
    step reaches nothing) waited on with descriptors numbered above 1024, which select
    refused (a build started by a server with many episodes open)."""
    with descriptors_above():
        result = _build(base_store, runner, tmp_path / "many", f"FROM {BASE}\nRUN echo built > /built\n",
                        network=BuildNetwork("public"))
        with pytest.raises(BuildError, match="exit status 3"):
            _build(base_store, runner, tmp_path / "many-fail", f"FROM {BASE}\nRUN exit 3\n")
    assert _file(base_store, result.record, "/built") == "built\n"


def test_failing_run_names_the_line_status_and_output(base_store, runner, tmp_path):
    with pytest.raises(BuildError) as caught:
        _build(base_store, runner, tmp_path / "fail", f"FROM {BASE}\nWORKDIR /app\n"
                                                      "RUN echo about to fail >&2 && exit 3\n")
    message = str(caught.value)
    assert f"{tmp_path / 'fail' / 'Dockerfile'}:3:" in message and "exit status 3" in message
    assert "about to fail" in message


def test_unsupported_instruction_is_an_error_naming_file_and_line(base_store, runner, tmp_path):
    with pytest.raises(BuildError, match=r"Dockerfile:3: .*ONBUILD"):
        _build(base_store, runner, tmp_path / "onbuild", f"FROM {BASE}\nWORKDIR /app\nONBUILD RUN true\n")


def test_rebuild_is_a_cache_hit_and_a_changed_file_rebuilds_from_its_step(base_store, runner, tmp_path):
    dockerfile = f"FROM {BASE}\nRUN echo one > /one\nCOPY data.txt /app/data.txt\nRUN cat /app/data.txt > /two\n"
    first = _build(base_store, runner, tmp_path / "cache", dockerfile, {"data.txt": "v1\n"})
    assert not first.cached
    again = _build(base_store, runner, tmp_path / "cache", dockerfile, {"data.txt": "v1\n"})
    assert again.cached and again.record.id == first.record.id
    changed = _build(base_store, runner, tmp_path / "cache", dockerfile, {"data.txt": "v2\n"})
    assert [s.cached for s in changed.steps] == [True, False, False]
    assert _file(base_store, changed.record, "/two") == "v2\n"
    fresh = _build(base_store, runner, tmp_path / "cache", dockerfile, {"data.txt": "v2\n"}, no_cache=True)
    assert not any(s.cached for s in fresh.steps) and _file(base_store, fresh.record, "/two") == "v2\n"
    # prune drops the build cache, but a layer an image still uses is still its step's result
    base_store.prune()
    assert _build(base_store, runner, tmp_path / "cache", dockerfile, {"data.txt": "v2\n"}).cached
    # with the images gone too, the next build runs its steps again
    for record in base_store.records():
        if record.source == f"dockerfile:{tmp_path / 'cache' / 'Dockerfile'}":
            base_store.remove(record.id)
    base_store.prune()
    assert not any(s.cached for s in _build(base_store, runner, tmp_path / "cache", dockerfile,
                                            {"data.txt": "v2\n"}).steps if s.text.startswith("RUN cat"))


def test_copy_chmod_workdir_and_add_of_a_local_archive(base_store, runner, tmp_path):
    import tarfile
    folder = tmp_path / "copy"
    folder.mkdir()
    (folder / "src").mkdir()
    (folder / "src" / "tool.sh").write_text("#!/bin/sh\necho tool\n")
    with tarfile.open(folder / "bundle.tar.gz", "w:gz") as tar:
        tar.add(folder / "src" / "tool.sh", arcname="pkg/tool.sh")
    result = _build(base_store, runner, folder, f"""\
FROM {BASE}
WORKDIR /work/deep
COPY --chmod=750 src/ ./bin/
ADD bundle.tar.gz /opt/
""")
    layers = _layers(base_store, result.record)
    assert image_path_kind(layers, "/work/deep") == "dir"
    assert read_image_file(layers, "/work/deep/bin/tool.sh") == b"#!/bin/sh\necho tool\n"
    tool = next(layer / "work/deep/bin/tool.sh" for layer in reversed(layers)
                if (layer / "work/deep/bin/tool.sh").exists())
    assert stat.S_IMODE(tool.stat().st_mode) == 0o750
    assert read_image_file(layers, "/opt/pkg/tool.sh") == b"#!/bin/sh\necho tool\n"
    assert result.record.config.workdir == "/work/deep"


def test_run_cannot_reach_a_loopback_service_on_the_host(base_store, runner, tmp_path):
    """Neither directly (the step's network namespace has no route out) nor through the
    build proxy (loopback and the host's own addresses are never allowed)."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    accepted: list[object] = []
    server.settimeout(0.2)

    def serve() -> None:
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except OSError:
                pass

    stop = threading.Event()
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    probe = f"""\
url=http://127.0.0.1:{port}/
if command -v wget >/dev/null; then
    fetch() {{ wget -q -O- "$1"; }}  # (-T segfaults in Debian's static busybox)
else
    fetch() {{ python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)' "$1"; }}
fi
fetch "$url" && {{ echo REACHED; exit 0; }}
no_proxy= NO_PROXY= fetch "$url" && {{ echo REACHED-THROUGH-PROXY; exit 0; }}
echo refused
exit 9
"""
    try:
        with pytest.raises(BuildError) as caught:
            _build(base_store, runner, tmp_path / "loop", f"FROM {BASE}\nCOPY probe.sh /probe.sh\nRUN sh /probe.sh\n",
                   {"probe.sh": probe}, network=BuildNetwork("public"))
    finally:
        stop.set()
        thread.join(2)
        server.close()
    message = str(caught.value)
    assert "exit status 9" in message and "REACHED" not in message
    assert f"127.0.0.1:{port}" in message  # the proxy's refusal is in the error
    assert accepted == []


def test_apt_get_and_pip_install_through_the_build_proxy_from_the_package_indexes(base_store, runner, tmp_path):
    """apt from Debian's index (plain HTTP, absolute-form requests) and pip from PyPI (TLS,
    CONNECT), both through the build proxy, never directly (the step has no route out).
    This machine's TLS is intercepted by a CA only the host trusts, so the Dockerfile adds
    the host's bundle for pip, as an operator behind such a proxy must for docker build."""
    if not is_root():
        pytest.skip("needs the Debian base image (made from the trixie rootfs, which needs root to pack)")
    bundle = Path("/etc/ssl/certs/ca-certificates.crt")
    if not bundle.is_file():
        pytest.skip("no host CA bundle")
    result = _build(base_store, runner, tmp_path / "pip", f"""\
FROM {BASE}
RUN apt-get update && apt-get install -y --no-install-recommends python3-pip && rm -rf /var/lib/apt/lists/*
COPY host-ca.crt /etc/ssl/host-ca.crt
ENV PIP_CERT=/etc/ssl/host-ca.crt PIP_DISABLE_PIP_VERSION_CHECK=1
RUN pip install --break-system-packages --no-cache-dir six==1.17.0 && python3 -c "import six; print(six.__version__)" > /six
""", {"host-ca.crt": bundle.read_text()}, network=BuildNetwork("public"))
    assert _file(base_store, result.record, "/six") == "1.17.0\n"


def test_a_layer_built_with_the_network_does_not_serve_a_build_without_it(base_store, runner, tmp_path):
    dockerfile = f"FROM {BASE}\nRUN echo fetched > /got\nRUN --network=none echo offline > /off\n"
    public = _build(base_store, runner, tmp_path / "net", dockerfile, network=BuildNetwork("public"))
    assert not public.cached
    again = _build(base_store, runner, tmp_path / "net", dockerfile, network=BuildNetwork("public"))
    assert again.cached
    closed = _build(base_store, runner, tmp_path / "net", dockerfile, network=BuildNetwork("none"))
    assert [s.cached for s in closed.steps] == [False, False]  # the first RUN could reach the network
    offline_only = _build(base_store, runner, tmp_path / "net2", f"FROM {BASE}\nRUN --network=none echo x > /x\n",
                          network=BuildNetwork("public"))
    assert _build(base_store, runner, tmp_path / "net2", f"FROM {BASE}\nRUN --network=none echo x > /x\n",
                  network=BuildNetwork("none")).cached and not offline_only.cached
