"""The image store, continued: registry credentials, leases, rm and prune, concurrent
pulls, and the ``sequester image`` commands. Real registry, real skopeo, as in
test_image_store.py (whose helpers these tests use)."""

from __future__ import annotations

import base64
import json
import logging
import os
import subprocess
import threading
from pathlib import Path

import pytest
from images import tiny_image_30mb
from registry import Registry, needs_tools, running_registry
from test_image_store import (  # noqa: F401  (busybox, registry: fixtures)
    assert_refused,
    busybox,
    layer_dirs,
    layer_folders,
    make_store,
    registry,
    sharing_images,
    state,
)

from sequester import cli
from sequester.errors import ImageError

pytestmark = needs_tools("skopeo", "umoci")

PASSWORD = "pw-Zq81xv-never-shown"


# -- 7. credentials ----------------------------------------------------------------------------

@pytest.fixture
def no_credentials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A home without credentials, and no other place skopeo or the store would find any."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))  # skopeo's own auth.json lives there
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    for name in ("REGISTRY_AUTH_FILE", "DOCKER_CONFIG", "SEQUESTER_REGISTRY_USERNAME",
                 "SEQUESTER_REGISTRY_PASSWORD", "SEQUESTER_REGISTRY_HOST"):
        monkeypatch.delenv(name, raising=False)
    return home


def _popen_spy(monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[str], dict]]:
    """Every argv started through subprocess.Popen, with the mode and content of the
    ``--authfile``/``--src-authfile`` it names, read while the command runs."""
    calls: list[tuple[list[str], dict]] = []
    real = subprocess.Popen

    class Spy(real):  # type: ignore[misc, valid-type]
        def __init__(self, argv, *args, **kwargs):
            argv = [str(a) for a in argv]
            files = {}
            for flag, value in zip(argv, argv[1:]):
                if flag in ("--authfile", "--src-authfile"):
                    files[value] = (os.stat(value).st_mode & 0o777, Path(value).read_text())
            calls.append((argv, files))
            super().__init__(argv, *args, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", Spy)
    return calls


def test_credentials_from_docker_config_and_environment_never_shown(
        tmp_path: Path, busybox: str, no_credentials: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    secret_forms = (PASSWORD, base64.b64encode(f"u:{PASSWORD}".encode()).decode())
    with running_registry(tmp_path / "registry", auth=("u", PASSWORD)) as served:
        pushed = served.push(busybox, "private/bb:v1")
        ref = f"{served.host}/private/bb:v1"
        calls = _popen_spy(monkeypatch)
        store = make_store(tmp_path, insecure=[served.host])
        anonymous = assert_refused(store, lambda: store.pull(ref), ref)
        assert "authentication required" in str(anonymous) or "unauthorized" in str(anonymous)

        config = served.write_docker_config(no_credentials)
        record = store.pull(ref)
        assert record.source_digest == pushed
        assert any(str(config) in argv for argv, _ in calls), "the user's own file is passed as it is"
        store.remove(ref)

        config.unlink()
        monkeypatch.setenv("SEQUESTER_REGISTRY_USERNAME", "u")
        monkeypatch.setenv("SEQUESTER_REGISTRY_HOST", "elsewhere.example:5000")
        assert_refused(store, lambda: store.pull(ref), ref)  # credentials for another registry
        monkeypatch.setenv("SEQUESTER_REGISTRY_HOST", served.host)
        monkeypatch.setenv("SEQUESTER_REGISTRY_PASSWORD", "wrong-" + PASSWORD)
        wrong = assert_refused(store, lambda: store.pull(ref), ref)
        monkeypatch.setenv("SEQUESTER_REGISTRY_PASSWORD", PASSWORD)
        assert store.pull(ref).source_digest == pushed

    private = {path: mode for _, files in calls for path, (mode, text) in files.items()
               if path != str(config) and secret_forms[1] in text}
    assert private, "the environment's credentials reach skopeo in a file"
    for path, mode in private.items():
        assert mode == 0o600 and not os.path.exists(path), "a private 0600 copy, removed afterwards"
    out, err = capfd.readouterr()
    for shown in (str(anonymous), str(wrong), caplog.text, out, err, *(" ".join(argv) for argv, _ in calls)):
        for secret in secret_forms:
            assert secret not in shown
    assert any(" skopeo: " in f" {r.getMessage()}" for r in caplog.records), "the argv is logged (without secrets)"


# -- 8. leases, rm, prune, concurrency ----------------------------------------------------------

def test_remove_waits_for_the_lease_and_keeps_shared_layers(tmp_path: Path) -> None:
    refs = sharing_images(tmp_path / "shared")
    store = make_store(tmp_path)
    a, b = (store.import_source(refs[t], f"local/{t}:1") for t in ("a", "b"))
    base, own_a, own_b = (layer_dirs(store, a)[0], layer_dirs(store, a)[1], layer_dirs(store, b)[1])
    lease = store.lease(a)
    assert lease.layers == tuple(layer_dirs(store, a))
    with pytest.raises(ImageError, match="local/a:1.*in use"):
        store.remove("local/a:1")
    assert store.find("local/a:1") == a and own_a.is_dir()
    lease.release()
    assert store.remove("local/a:1").id == a.id
    assert store.find("local/a:1") is None and not own_a.exists()
    assert base.is_dir() and own_b.is_dir(), "layers another image uses stay"
    assert not (store.root / "layers" / f"{own_a.name}.json").exists()
    with pytest.raises(ImageError, match="removed"):
        store.lease(a)
    with pytest.raises(ImageError, match="local/a:1.*not in the store"):
        store.remove("local/a:1")
    held = store.lease(b)
    assert all(p.is_dir() for p in held.layers)
    held.release()


def test_prune_removes_leftovers_then_unused_images(tmp_path: Path) -> None:
    refs = sharing_images(tmp_path / "shared")
    store = make_store(tmp_path)
    a, b = (store.import_source(refs[t], f"local/{t}:1") for t in ("a", "b"))
    before = state(store)
    (store.root / "blobs" / "sha256" / ("ab" * 32)).write_bytes(b"x" * 10_000)
    (store.root / "tmp" / "fetch-dead").mkdir()
    (store.root / "tmp" / "fetch-dead" / "f").write_bytes(b"y" * 10_000)
    (store.root / "layers" / ".tmp-dead").mkdir()
    (store.root / "layers" / ("cd" * 32)).mkdir()  # a layer no record names
    removed, freed = store.prune()
    assert removed == [] and freed >= 20_000
    assert state(store) == before and os.listdir(store.root / "tmp") == []
    assert not (store.root / "blobs" / "sha256" / ("ab" * 32)).exists()
    assert {r.id for r in store.records()} == {a.id, b.id}
    store.lease(a).release()  # still whole
    lease = store.lease(b)
    assert store.prune(unused_for=3600)[0] == [], "both were used just now"
    removed, _ = store.prune(unused_for=0)
    assert [r.id for r in removed] == [a.id] and [r.id for r in store.records()] == [b.id]
    assert layer_folders(store) == {layer.diff_id[7:] for layer in b.layers}
    lease.release()
    assert [r.id for r in store.prune(unused_for=0)[0]] == [b.id]
    assert state(store) == {"layers": set(), "images": set()}


@pytest.mark.slow
def test_concurrent_pulls_of_one_image_store_it_once(registry: Registry, tmp_path: Path) -> None:
    refs = sharing_images(tmp_path / "shared", ("a",))
    registry.push(tiny_image_30mb(), "tiny:v1")
    registry.push(refs["a"], "a:v1")
    results: list = []
    phases: list[str] = []

    class Phases:  # what each fetch did: a fetch that waited for another's must not copy again
        def phase(self, description: str, total: int | None) -> None:
            phases.append(description)

        def advance(self, amount: int) -> None: ...
        def note(self, line: str) -> None: ...
        def done(self) -> None: ...

    def pull(ref: str) -> None:
        try:  # a store object per thread, as separate processes would have
            results.append(make_store(tmp_path, insecure=[registry.host]).pull(ref, progress=Phases()))
        except BaseException as exc:  # noqa: BLE001
            results.append(exc)

    for ref in (f"{registry.host}/tiny:v1", f"{registry.host}/a:v1"):
        results.clear()
        phases.clear()
        threads = [threading.Thread(target=pull, args=(ref,)) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
        assert all(not isinstance(r, BaseException) for r in results), results
        assert len(results) == 4 and len({r.id for r in results}) == 1
        # One copy: skopeo rewrites a manifest in place, so concurrent copies of one image
        # let a reader see it half-written (the fetch lock, images/fetch.py).
        assert sum(p.startswith("pulling") for p in phases) == 1, phases
    store = make_store(tmp_path)
    assert len(store.records()) == 2
    layers = {layer.diff_id[7:] for r in store.records() for layer in r.layers}
    assert layer_folders(store) == layers and len(layers) == 3
    assert not [n for n in os.listdir(store.root / "layers") if n.startswith(".tmp-")]
    assert os.listdir(store.root / "tmp") == []


# -- 9. the CLI --------------------------------------------------------------------------------

def _cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = cli.main(["image", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_image_commands(registry: Registry, busybox: str, tmp_path: Path, capsys: pytest.CaptureFixture,
                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    registry.push(busybox, "library/bb:v1")
    config = tmp_path / "conf" / "sequester.toml"
    config.parent.mkdir()
    config.write_text(f'[images]\nstore_dir = "store"\nmirrors = {{ "docker.io" = "{registry.host}" }}\n'
                      f'insecure = ["{registry.host}"]\n')
    conf = ("--config", str(config))
    root = tmp_path / "conf" / "store"

    code, out, err = _cli(capsys, "pull", "bb:v1", *conf)
    assert code == 0, err
    assert "bb:v1" in out and (root / "images").is_dir(), "store_dir is relative to the config file"
    code, out, err = _cli(capsys, "import", str(Path(busybox.split(":")[1])), "--tag", "local/bb:2", *conf)
    assert code == 0 and "local/bb:2" in out, err
    code, out, _ = _cli(capsys, "ls", *conf)
    assert code == 0 and "bb:v1" in out and "local/bb:2" in out
    code, out, _ = _cli(capsys, "ls", "--json", *conf)
    (listed,) = json.loads(out)  # one image (the same manifest) known by both names
    assert set(listed["names"]) == {"docker.io/library/bb:v1", "docker.io/local/bb:2"} and listed["last_used"] > 0

    for argv in (("pull", "nothere:v1"), ("pull", "UPPER:case"), ("import", str(tmp_path / "none"), "--tag", "x"),
                 ("rm", "nothere")):
        code, out, err = _cli(capsys, *argv, *conf)
        assert code == 2 and "error:" in err and "Traceback" not in err + out, (argv, err)
    code, _, err = _cli(capsys, "pull", "nothere:v1", *conf)
    assert "docker.io/library/nothere:v1" in err

    (root / "tmp" / "leftover").mkdir()
    code, out, _ = _cli(capsys, "prune", *conf)
    assert code == 0 and "freed" in out and not (root / "tmp" / "leftover").exists()
    code, out, _ = _cli(capsys, "rm", "bb:v1", *conf)
    assert code == 0 and "removed" in out
    code, out, _ = _cli(capsys, "ls", "--json", *conf)
    assert json.loads(out) == []
    code, out, _ = _cli(capsys, "import", str(Path(busybox.split(":")[1])), "--tag", "local/bb:3", *conf)
    code, out, _ = _cli(capsys, "prune", "--unused-for", "0", *conf)
    assert code == 0 and "local/bb:3" in out and os.listdir(root / "layers") == []


def test_skopeo_never_reads_credentials_from_places_of_its_own(registry: Registry, busybox: str, tmp_path: Path,
                                                              no_credentials: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Left to itself, skopeo also reads $XDG_RUNTIME_DIR/containers/auth.json (or
    /run/containers/UID/auth.json) and fails when that cannot be read (root's podman makes
    /run/containers 0700). The store always hands it a file of its own choosing."""
    registry.push(busybox, "own/bb:v1")
    runtime = tmp_path / "runtime"
    (runtime / "containers" / "auth.json").mkdir(parents=True)  # unreadable as a file, as root too
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    store = make_store(tmp_path, insecure=[registry.host])
    assert store.pull(f"{registry.host}/own/bb:v1").layers
