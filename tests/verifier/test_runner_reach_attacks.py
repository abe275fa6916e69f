"""What the programs the tests run can do to the runner, in every mode: as the caller
(root in CI), in the fake root and as an ordinary user; shared and separate verifier
environments. Each case fails without its guard (the test shell's namespaces below it,
the runner's Pythons not dumpable, imports the runner must provide never from the
agent's folders)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from fakeroot import attack_env, unavailable  # noqa: F401 - attack_env is a fixture
from paths import EXAMPLES

_REASON = unavailable()

# The harness: tasks made here, the results emitted (a dict of case -> what was seen).
SCRIPT = r'''
import pathlib, tempfile
from sequester.environments.local.episode import Episode

PROBE = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
parent = os.getppid()
seen = {"parent": parent}
if libc.ptrace(16, parent, None, None) == 0:
    seen["attach"] = "attached"
    os.waitpid(parent, 0x40000000)
    libc.ptrace(17, parent, None, None)
else:
    seen["attach"] = os.strerror(ctypes.get_errno())
try:
    open(f"/proc/{parent}/mem", "rb").close()
    seen["mem"] = "opened"
except OSError as exc:
    seen["mem"] = exc.strerror
seen["shell"] = [p for p in os.listdir("/proc") if p.isdigit()
                 and b"/tests/test.sh" in open(f"/proc/{p}/cmdline", "rb").read()]
with open("/logs/verifier/probe.txt", "w") as f:
    f.write(repr(seen))
"""
PLANTED = "open('/logs/verifier/planted.txt', 'w').write('ran')\nraise SystemExit(0)\n"
FIFO = """
import os, time
if os.fork() == 0:
    os.setsid()
    d = "/logs/verifier"
    try:
        os.mkfifo(d + "/reward.txt")
        os.link(d + "/reward.txt", d + "/.q")
        time.sleep(1.0)
        with open(d + "/.r", "w") as f:
            f.write("1")
        os.rename(d + "/.r", d + "/reward.txt")
        os.open(d + "/.q", os.O_RDONLY | os.O_NONBLOCK)
        time.sleep(3)
    except OSError:
        pass
    os._exit(0)
"""

REWRITE = "open('/logs/verifier/reward.txt', 'w').write('1')\n"
AFTER_END = r"""
import os
if os.fork():
    os._exit(0)
os.setsid()
fd = os.open("/logs/verifier/reward.txt", os.O_RDWR | os.O_CREAT, 0o666)
os.write(1, b"up"); os.close(1)
while os.pread(fd, 2, 0) != b"0\n":
    pass
os.pwrite(fd, b"1\n", 0); os.ftruncate(fd, 2)
"""
SCORER = "open('/logs/verifier/reward.txt', 'w').write('1')\n"
# A program signals its own process group, which holds the script's shell: the shell
# stops before its own write (red team).
SIGNAL = """
import os, signal
open('/logs/verifier/reward.txt', 'w').write('1\\n')
signal.signal(signal.SIGINT, signal.SIG_DFL)
os.kill(0, signal.SIGINT)
"""
# Run inside a compound command whose output is the reward file (red team): it writes
# into the shell's own descriptor before the shell's 0.
COMPOUND = "import os, sys\nos.write(1, b'1e')\nsys.exit(1)\n"
JSON = "open('/logs/verifier/reward.json', 'w').write('{\"reward\": 1}')\n"
# A program writes a .pth into every Python environment of the runner's it can find (each
# later Python start there exits 0 at once: a later pytest "passes"), and points the
# runner's uvx index at a pytest of its own that exits 0.
POISON = """
import os, sys
seen = []
top = "/opt/sequester-verifier/run"
for root, dirs, _ in os.walk(top):
    if root.endswith("site-packages"):
        dirs[:] = []
        try:
            with open(os.path.join(root, "zz_sequester_poison.pth"), "w") as f:
                f.write("import os; os._exit(0)\\n")
            seen.append("wrote " + root)
        except OSError as exc:
            seen.append(exc.strerror)
try:  # (red team: a pip environment planted where the runner once made one as the script ran)
    d = top + "/scratch/pip/bin"
    os.makedirs(d, exist_ok=True)
    for name in ("python", "pytest"):
        with open(f"{d}/{name}", "w") as f:
            f.write("#!/bin/sh\\nexit 0\\n")
        os.chmod(f"{d}/{name}", 0o755)
    seen.append("scratch")
except OSError as exc:
    seen.append("scratch: " + exc.strerror)
try:
    os.makedirs("/tmp/fake/bin", exist_ok=True)
    with open("/tmp/fake/bin/pytest", "w") as f:
        f.write("#!/bin/sh\\nexit 0\\n")
    os.chmod("/tmp/fake/bin/pytest", 0o755)
    with open(top + "/uvx-tools", "a") as f:
        f.write("/tmp/fake/bin\\tpytest\\t-w\\x1fpytest==8.4.1\\x1fpytest\\n")
    seen.append("index")
except OSError as exc:
    seen.append("index: " + exc.strerror)
with open("/logs/verifier/poison-" + sys.argv[1] + ".txt", "w") as f:
    f.write(repr(seen))
"""
# The tests' own first file runs the program (as a test would run the agent's), the second fails.
CALLS_POISON = ("import subprocess\n"
                "def test_a():\n    subprocess.run(['python3', '/app/poison.py', 'pytest'], check=True)\n")
UVX = "uvx -w pytest==8.4.1 pytest"
# Imported by uv's interpreter query (packaging's optional _manylinux) through the image's
# ENV PYTHONPATH=/app (red team, round 2): a writer left behind that makes every pytest of
# the runner's folder exit 0.
MANYLINUX = """
import os, time
open("/logs/verifier/manylinux-ran.txt", "a").write("ran\\n")
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        end = time.time() + 30
        while time.time() < end:
            for root, dirs, files in os.walk("/opt/sequester-verifier/run"):
                if "/scratch" not in root and root.endswith("/bin") and "pytest" in files:
                    try:
                        with open(root + "/pytest", "w") as f:
                            f.write("#!/bin/sh\\nexit 0\\n")
                    except OSError:
                        pass
            time.sleep(0.01)
    os._exit(0)
"""
# Programs of the agent's where a runner's install might look them up on PATH while the
# runner's folder is still writable (red team: uv ran the agent's printenv there, which
# named its own pytest's folder as the tool's). Each says it ran, and poisons.
PLANTED_TOOL = (
    "#!/bin/sh\n"
    "echo ran >> /logs/verifier/planted-tool.txt\n"
    "for sp in /opt/sequester-verifier/run/cache/*/*/lib/python3*/site-packages; do\n"
    "  echo 'import os; os._exit(0)' > $sp/zz_planted.pth\n"
    "done\n"
    "mkdir -p /tmp/evil && printf '#!/bin/sh\\nexit 0\\n' > /tmp/evil/pytest && chmod +x /tmp/evil/pytest\n"
    "echo \"PATH=/tmp/evil:$PATH\"; echo /tmp/evil\n"
)


def task(root, test_sh, files):
    t = pathlib.Path(tempfile.mkdtemp(dir=root))
    for sub in ("tests", "environment", "solution"):
        (t / sub).mkdir()
    (t / "instruction.md").write_text("Do the thing.\n")
    (t / "task.toml").write_text('version = "1.0"\n[verifier]\ntimeout_sec = 60\n')
    (t / "environment" / "Dockerfile").write_text(
        "FROM debian:12\nWORKDIR /app\n" + "".join(f"COPY {n} /app/{n}\n" for n in files))
    for name, text in files.items():
        (t / "environment" / name).write_text(text)
    (t / "tests" / "test.sh").write_text(test_sh)
    (t / "tests" / "test_x.py").write_text("def test_x():\n    assert False\n")
    (t / "solution" / "solve.sh").write_text("true\n")
    return t


out = {}
probe = task(WORK, "python3 -c \"import subprocess, sys; sys.exit(subprocess.call([sys.executable, '/app/probe.py']))\"\n"
                   "echo 1 > /logs/verifier/reward.txt\n", {"probe.py": PROBE})
shadow = task(WORK, "cd /app\npython3 -m pytest /tests/test_x.py\n"
                    "if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi\n",
              {"pytest.py": PLANTED})
for mode in ("shared", "separate"):
    with Episode(settings()) as ep:
        ep.reset(probe)
        try:
            r = ep.evaluate(verifier_env=mode)
            out["probe-" + mode] = {"error": None, "probe": r.files.get("probe.txt", b"").decode()}
        except Exception as exc:
            out["probe-" + mode] = {"error": f"{type(exc).__name__}: {exc}", "probe": ""}
with Episode(settings()) as ep:
    ep.reset(shadow)
    r = verdict(ep)
    out["shadow"] = {**r, "planted": "planted.txt" in (r.get("files") or [])}
fifo = task(WORK, "python3 /app/evil.py\necho 0 > /logs/verifier/reward.txt\n", {"evil.py": FIFO})
with Episode(settings()) as ep:
    ep.reset(fifo)
    out["fifo"] = verdict(ep)
# A program the tests run after the script's own write rewrites the reward (in sequence);
# a writer one leaves behind rewrites it between the script's last write and its exit.
rewrite = task(WORK, "echo 0 > /logs/verifier/reward.txt\npython3 /app/rw.py\n", {"rw.py": REWRITE})
later = task(WORK, 'test "$(python3 /app/w.py)" = up || exit 3\necho 0 > /logs/verifier/reward.txt\nsleep 0.3\n',
             {"w.py": AFTER_END})
scorer = task(WORK, "python3 /app/score.py\n", {"score.py": SCORER})
signalled = task(WORK, "python3 /app/sig.py\nif [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; "
                       "else echo 0 > /logs/verifier/reward.txt; fi\n", {"sig.py": SIGNAL})
compound = task(WORK, "if python3 /app/c.py; then echo 1; else echo 0; fi > /logs/verifier/reward.txt\n",
                {"c.py": COMPOUND})
braced = task(WORK, "{ python3 /app/score.py; } > /logs/verifier/reward.txt\n", {"score.py": "print(1)\n"})
beside = task(WORK, "rm -f /logs/verifier/reward.json\npython3 /app/j.py\necho 0 > /logs/verifier/reward.txt\n",
              {"j.py": JSON})
# A program the script runs before its uvx pytest (the agent's make), and one pytest runs
# before the script's second uvx pytest: both poison the runner for the later step.
direct = task(WORK, f"python3 /app/poison.py direct\n{UVX} /tests/test_x.py\n"
                    "if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi\n",
              {"poison.py": POISON})
(direct / "tests" / "test_x.py").write_text("def test_x():\n    assert False\n")
within = task(WORK, f"{UVX} /tests/test_a.py\n{UVX} /tests/test_x.py\n"
                    "if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi\n",
              {"poison.py": POISON})
(within / "tests" / "test_a.py").write_text(CALLS_POISON)
planted = task(WORK, f"{UVX} /tests/test_x.py\n"
                     "if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi\n",
               {"tool": PLANTED_TOOL})
# Red team, round 3: the agent makes the install ahead fail (jemalloc's abort_conf, read by
# the runner's uv from the view's /etc), then a program the script runs first waits for
# the tool to be made as the script runs and puts a .pth into it.
SCRATCH_WATCH = """
import os, time
try:
    os.unlink("/etc/_rjem_malloc.conf")
except OSError:
    pass
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        end = time.time() + 40
        while time.time() < end:
            for root, dirs, files in os.walk("/opt/sequester-verifier/run/scratch"):
                if root.endswith("site-packages"):
                    try:
                        with open(root + "/aaa_poison.pth", "w") as f:
                            f.write("import sys, os; any('pytest' in a for a in sys.orig_argv) and os._exit(0)\\n")
                    except OSError:
                        pass
            time.sleep(0.005)
    os._exit(0)
"""
aborted = task(WORK, f"python3 /app/watch.py\n{UVX} /tests/test_x.py\n"
                     "if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi\n",
               {"watch.py": SCRATCH_WATCH})
manylinux = task(WORK, f"{UVX} /tests/test_x.py\n"
                       "if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi\n",
                 {"_manylinux.py": MANYLINUX})
with open(manylinux / "environment" / "Dockerfile", "a") as f:
    f.write("ENV PYTHONPATH=/app\n")
pip = task(WORK, "pip install pytest==8.4.1\npython3 /app/poison.py pip\npytest /tests/test_x.py\n"
                 "if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi\n",
           {"poison.py": POISON})
for mode, kw in (("shared", {}), ("frozen", {"freeze": True}), ("separate", {"verifier_env": "separate"})):
    for name, t in (("poison-direct", direct), ("poison-within", within), ("poison-pip", pip),
                    ("poison-planted", planted), ("poison-manylinux", manylinux), ("poison-aborted", aborted)):
        with Episode(settings()) as ep:
            ep.reset(t)
            if name == "poison-aborted":
                ep.exec("ln -sf 'abort_conf:true,x:1' /etc/_rjem_malloc.conf")
            if name == "poison-planted":
                ep.exec("for n in env printenv python python3 uv uvx pip pytest; do cp /app/tool /usr/local/bin/$n; "
                        "chmod +x /usr/local/bin/$n; done")
            try:
                r = ep.evaluate(**kw)
                out[f"{name}-{mode}"] = {"reward": r.reward, "notes": list(r.notes), "output": r.output[-3000:],
                                         "seen": {k: v.decode(errors="replace") for k, v in r.files.items()
                                                  if k.startswith(("poison", "planted", "manylinux"))}}
            except Exception as exc:
                out[f"{name}-{mode}"] = {"reward": None, "error": f"{type(exc).__name__}: {exc}", "seen": {},
                                         "output": str(getattr(exc, "output", ""))[-3000:]}
for mode, kw in (("shared", {}), ("frozen", {"freeze": True}), ("separate", {"verifier_env": "separate"})):
    for name, t in (("rewrite", rewrite), ("later", later), ("scorer", scorer), ("signal", signalled),
                    ("compound", compound), ("beside", beside), ("braced", braced)):
        with Episode(settings()) as ep:
            ep.reset(t)
            out[f"{name}-{mode}"] = verdict(ep, **kw)
emit(out)
'''

MODES = ["caller", "fake-root", "user"]


def _run(mode: str, env) -> dict:
    if mode == "caller":
        import json
        import tempfile

        from fakeroot import PRELUDE

        with tempfile.TemporaryDirectory() as work:
            result = os.path.join(work, "result.json")
            state = os.path.join(work, "state")
            os.mkdir(state)
            from sequester.environments.settings import EpisodeSettings

            environ = {**os.environ, "SEQ_EXAMPLES": str(EXAMPLES.parent), "SEQ_WORK": work, "SEQ_STATE": state,
                       "SEQ_TOOLCHAIN": str(EpisodeSettings().toolchain_dir),
                       "SEQ_RESULT": result, "PYTHONPATH": os.pathsep.join(sys.path)}
            done = subprocess.run([sys.executable, "-c", PRELUDE + SCRIPT], env=environ, capture_output=True,
                                  text=True, timeout=900)
            assert done.returncode == 0, done.stderr[-3000:]
            with open(result) as f:
                return json.load(f)
    return env.run_in_fake_root(SCRIPT) if mode == "fake-root" else env.run_as_user(SCRIPT)


@pytest.fixture(scope="module", params=MODES)
def seen(request):
    if request.param != "caller" and _REASON is not None:
        pytest.skip(_REASON)
    env = request.getfixturevalue("attack_env") if request.param != "caller" else None
    return _run(request.param, env)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["shared", "separate"])
def test_the_tests_programs_cannot_see_the_shell_nor_trace_or_read_the_runner(seen, mode):
    case = seen[f"probe-{mode}"]
    assert case.get("error") is None and case["probe"], case
    assert "attached" not in case["probe"] and "opened" not in case["probe"], case["probe"]
    assert "'shell': []" in case["probe"], case["probe"]


@pytest.mark.slow
def test_a_module_the_runner_provides_is_never_the_agents(seen):
    """`python3 -m pytest` with a pytest.py in the working folder: the runner's pytest runs
    the tests (which fail: 0), the agent's module never runs."""
    case = seen["shadow"]
    assert not case["planted"] and case["reward"] == 0.0, case


@pytest.mark.slow
def test_a_fifo_at_the_reward_file_cannot_block_the_scripts_write(seen):
    """The script's own last write of reward.txt wins: no FIFO can be made there (Landlock)."""
    assert seen["fifo"]["reward"] == 0.0, seen["fifo"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["shared", "frozen", "separate"])
def test_a_program_the_tests_run_cannot_rewrite_the_scripts_reward(seen, mode):
    """The script writes 0, then a program it runs writes 1 over it: the script's own
    write is the verdict (captured from its shell), and the notes say the file changed."""
    case = seen[f"rewrite-{mode}"]
    assert case["reward"] == 0.0, case
    assert any("differs from what the test script's shell wrote" in n for n in case["notes"]), case


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["shared", "frozen", "separate"])
def test_a_writer_left_behind_cannot_rewrite_the_verdict_before_the_shell_ends(seen, mode):
    """A writer a program under test left running spins until the script has written 0
    and writes 1 while the script still runs (it sleeps after its write)."""
    case = seen[f"later-{mode}"]
    assert case["reward"] == 0.0 and case["exit_code"] == 0, case


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["shared", "frozen", "separate"])
def test_a_reward_a_program_of_the_tests_writes_still_counts_and_is_named(seen, mode):
    """Fidelity: a scorer the script runs writes the reward (no write of the shell's own):
    it counts, as under Docker, and the notes say who wrote it."""
    case = seen[f"scorer-{mode}"]
    assert case["reward"] == 1.0, case
    assert any("not by the script's shell" in n for n in case["notes"]), case


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["shared", "frozen", "separate"])
def test_a_program_that_signals_the_scripts_shell_gets_no_reward_it_wrote(seen, mode):
    """It writes 1, then signals its own process group (the shell's): the shell stops
    before its own write, and the reward the program wrote does not count (red team:
    1.0 before, in every mode)."""
    case = seen[f"signal-{mode}"]
    assert case["reward"] == 0.0, case
    assert any("stopped by a signal" in n for n in case["notes"]), case


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["shared", "frozen", "separate"])
def test_a_program_writing_into_the_scripts_reward_descriptor_writes_nothing_that_counts(seen, mode):
    """`if prog; then echo 1; else echo 0; fi > reward.txt`: prog's output is the shell's
    reward descriptor; its "1e" before the shell's "0" made "1e0" (1.0; red team)."""
    case = seen[f"compound-{mode}"]
    assert case["reward"] == 0.0, case
    assert any("wrote into the script's own" in n for n in case["notes"]), case


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["shared", "frozen", "separate"])
def test_a_programs_reward_json_beside_the_scripts_reward_txt_does_not_count(seen, mode):
    """The tests name reward.json (so it would count); a program writes it with 1, the
    script writes reward.txt 0 itself: the script's own is the verdict (red team: 1.0)."""
    case = seen[f"beside-{mode}"]
    assert case["reward"] == 0.0, case
    assert any("beside the script's own" in n for n in case["notes"]), case


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["shared", "frozen", "separate"])
def test_a_scorer_the_script_runs_with_its_reward_file_as_output_still_counts(seen, mode):
    """Fidelity: `{ scorer; } > reward.txt` (the shell opens the file, only the scorer
    writes): the scorer's 1 counts, as under Docker (red team: 0 before), and the notes
    say who wrote it."""
    case = seen[f"braced-{mode}"]
    assert case["reward"] == 1.0, case
    assert any("it counts, as under Docker" in n for n in case["notes"]), case


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["shared", "frozen", "separate"])
@pytest.mark.parametrize("where", ["direct", "within", "pip"])
def test_no_program_the_script_runs_can_change_the_test_runner_of_a_later_step(seen, where, mode):
    """A program the script runs before its `uvx pytest` (`direct`: the agent's make), or
    one that pytest runs before the script's second `uvx pytest` (`within`), writes a .pth
    that ends every later Python start with status 0 into each of the runner's Python
    environments, and adds a pytest of its own to the runner's uvx index: the later
    pytest still runs the failing test (0). The runner's environments were installed
    before the script ran and are read-only to all it starts. (`pip`: the script's
    `pip install` then `pytest`, the program run between them; it also plants a pip
    environment in the runner's scratch folder, which a red team's run made the runner
    use: 1.0 in every mode.)"""
    case = seen[f"poison-{where}-{mode}"]
    assert case["reward"] == 0.0, case
    poison = case["seen"].get(f"poison-{where if where != 'within' else 'pytest'}.txt", "")
    assert "Read-only file system" in poison and "wrote " not in poison, case
    assert "'index'" not in poison, case


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["shared", "frozen", "separate"])
def test_no_program_of_the_agents_runs_while_the_runner_installs_ahead(seen, mode):
    """The agent puts its own env, printenv, python, uv, pip, pytest first on the image's
    PATH; each writes a .pth into the runner's tool environments and names a pytest of its
    own as the tool's folder (red team: uv ran the agent's printenv while the runner's
    folder was writable: 1.0 in shared and frozen mode). None of them runs before the
    folder is sealed (the install runs with the runner's bin as its PATH): the 0 stands."""
    case = seen[f"poison-planted-{mode}"]
    assert case["reward"] == 0.0, case
    assert "planted-tool.txt" not in case["seen"], case


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["shared", "frozen", "separate"])
def test_the_images_environment_runs_nothing_of_the_agents_in_the_runners_installs(seen, mode):
    """The image's ENV PYTHONPATH=/app and the agent's /app/_manylinux.py, which uv's
    interpreter query tries: it ran while the runner installed ahead and left a writer
    that made the runner's pytest exit 0 (red team: 1.0 in every mode). The installs get
    none of the image's environment, and the runner's Pythons never take uv's probed
    names from the agent's folders."""
    case = seen[f"poison-manylinux-{mode}"]
    assert case["reward"] == 0.0, case
    assert "manylinux-ran.txt" not in case["seen"], case


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["shared", "frozen", "separate"])
def test_an_install_ahead_the_agent_made_fail_is_never_made_where_its_programs_write(seen, mode):
    """The agent makes the runner's uv abort while it installs ahead (jemalloc's
    abort_conf in the view's /etc), then a program the script runs first waits to put a
    .pth into the tool when it is made as the script runs, in the writable scratch folder
    (red team, round 3: 1.0 in shared and frozen mode). A tool whose install ahead failed
    is a set-up failure: the pristine re-run installs it, the tests fail there too, and
    it is the agent's 0."""
    case = seen[f"poison-aborted-{mode}"]
    assert case["reward"] == 0.0, case
