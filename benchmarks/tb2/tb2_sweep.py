#!/usr/bin/env python3
"""Sweep real Terminal-Bench 2 tasks through sequester: build, oracle, nop; name every failure.

For each task (a folder with task.toml, environment/Dockerfile, solution/, tests/):

1. ``sequester build TASK --config CONFIG`` (built / failed with the error's last lines);
2. ``sequester run TASK --agent oracle`` (expected reward 1.0);
3. ``sequester run TASK --agent nop`` (expected reward 0.0);

each under a wall-clock cap (``--cap`` seconds per command; on overrun the command's whole
process group is killed and the step is recorded as "timeout"). Each trial's
``result.json`` (Harbor's job layout: ``JOBS/<job>/<task>__<id>/result.json``) gives the
reward, the exception and sequester's notes (a zero_reason shows as a note "reward 0 for
the agent: ..."); the verifier's output (``verifier/test-stdout.txt``) and the oracle's own
output (``agent/command-*/stdout.txt``) are read too. A table of regexes (:data:`RULES`)
names the cause of every non-passing task; what no rule names is printed with an excerpt,
for a human to name (and to add a rule for).

Two flags are kept apart from the cause, because they are about the harness under test:

* **silent zero**: the oracle got reward 0 as a verdict (no exception), sequester gave no
  zero_reason, and nothing in the outputs explains it (no failed test, no known error);
* **infra zero**: the oracle got reward 0 as a verdict while the verifier itself could not
  run (its uv/Python/apt bootstrap failed): an infrastructure failure scored as the agent's 0.

Writes to ``--out``: ``results.md`` (task | base | built | oracle | nop | seconds | cause),
``results.json`` (the raw data), ``tasks/<task>/`` (each command's output, build logs),
``jobs/`` (sequester's job folders). Both results files are rewritten after every task, so
a long sweep can be watched; ``--resume`` skips tasks already done in ``--out``.

Stdlib only. Sends no traffic itself; what the commands reach is the config's business
(``[images]`` mirrors on loopback, ``build_network = "allowlist"``).

    python3 tb2_sweep.py --sequester /path/.venv/bin/sequester --tasks TB2/tasks \\
        --config config.toml --out OUT [--only a,b] [--cap 900] [--jobs 1]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

# --------------------------------------------------------------------------------------
# The cause table. Each rule: (where, regex, label, kind).
#   where: "build" (the build's error and log), "agent" (the oracle's own output),
#          "verifier" (test-stdout.txt), "exception" (the trial's exception message),
#          "notes" (sequester's notes in result.json)
#   label: may use {1}, {2}... for the regex's groups
#   kind:  "infra" (the environment/harness could not do its part: network, missing
#          tools, missing files), "task" (the task/stand-in differs: package names, pins),
#          "test" (the tests ran and failed)
# First matching rule of the phase wins; order matters (specific before generic).
# --------------------------------------------------------------------------------------

Rule = tuple[str, str, str, str]

RULES: list[Rule] = [
    # --- build ---------------------------------------------------------------------
    ("build", r"network refused: [^\n]*?\b((?:[\w-]+\.)*github(?:usercontent)?\.(?:com|io))", "download from {1} (unreachable host)", "infra"),
    ("build", r"network refused: [^\n]*?\b((?:[\w-]+\.)*(?:huggingface\.co|hf\.co))", "download from {1} (unreachable host)", "infra"),
    ("build", r"network refused: [^\n]*?([\w.-]+\.[a-z]{2,})(?::\d+)?", "download from {1} (not in the build allowlist)", "infra"),
    ("build", r"Could not resolve host:? '?([\w.-]+)", "download from {1} (unreachable host)", "infra"),
    ("build", r"(?:unable to resolve host address|Name or service not known|Temporary failure in name resolution)[^\n]*?([\w-]+(?:\.[\w-]+)+)?", "name resolution failed ({1})", "infra"),
    ("build", r"Failed to connect to ([\w.-]+) port", "download from {1} (unreachable host)", "infra"),
    ("build", r"fatal: unable to access '(?:https?://)?([^/']+)", "git clone from {1} (unreachable host)", "infra"),
    ("build", r"E: Version '([^']+)' for '([^']+)' was not found", "pinned Ubuntu package version {2}={1} (stand-in base is Debian)", "task"),
    ("build", r"E: Unable to locate package ([^\s]+)", "apt package {1} not in Debian (stand-in base)", "task"),
    ("build", r"Package '?([^\s']+)'? has no installation candidate", "apt package {1} has no candidate in Debian (stand-in base)", "task"),
    ("build", r"E: Package '([^']+)' has no installation candidate", "apt package {1} has no candidate in Debian (stand-in base)", "task"),
    ("build", r"No space left on device", "disk full on the host", "infra"),
    ("build", r"invalid peer certificate: UnknownIssuer", "TLS: uv does not trust the intercepting CA (UnknownIssuer: uv uses its own roots)", "infra"),
    ("build", r"Cannot uninstall pip [\d.]+[\s\S]{0,200}no RECORD file", "stand-in base: Debian's pip cannot be upgraded (no RECORD file)", "task"),
    ("build", r"(?:CERTIFICATE_VERIFY_FAILED|certificate verify failed|SSL certificate problem)", "TLS verification failed (intercepting CA not trusted)", "infra"),
    ("build", r"externally-managed-environment", "pip refused: externally managed environment", "task"),
    ("build", r"No matching distribution found for ([^\s]+)", "pip: no distribution of {1} for this Python/platform", "task"),
    ("build", r"Could not find a version that satisfies the requirement ([^\s]+)", "pip: no version of {1} for this Python/platform", "task"),
    ("build", r"Failed (?:to )?build(?:ing wheel for)? ([\w.-]+)", "pip: building {1} from source failed", "task"),
    ("build", r"(?:COPY|ADD)[^\n]*(?:no such file|not found|does not exist|matched no files)", "COPY/ADD source missing", "infra"),
    ("build", r"the build timed out", "a build step timed out (task's build timeout)", "infra"),
    ("build", r"pinging container registry ([\w.-]+)", "image from {1} could not be pulled (unreachable registry)", "infra"),
    ("build", r"could not be had|manifest unknown|(?:pinging|reading) (?:container )?registry", "base image could not be pulled", "infra"),
    ("build", r"error: implicit declaration of function", "stand-in base: GCC 14 (trixie) rejects implicit function declarations (Ubuntu 24.04 has GCC 13)", "task"),
    ("build", r"(?:bash|sh): (?:line \d+: )?([\w.+-]+): (?:command )?not found", "{1}: command not found in the stand-in base", "task"),
    # --- the oracle's own run (solve.sh) ----------------------------------------------
    ("agent", r"E: (?:setgroups|seteuid|setegid) \d+ failed", "apt-get cannot switch to user _apt (setgroups EPERM, seteuid EINVAL: the episode maps one uid)", "infra"),
    ("agent", r"sudo: [^\n]*(?:setresuid|setresgid|unable to open /etc/sudoers)[^\n]*Invalid argument", "sudo fails (setresuid EINVAL: the episode maps one uid)", "infra"),
    ("agent", r"Certificate Common Name: Unknown", "stand-in base: OpenSSL 3.5 prints 'CN=', the solution parses bookworm's 'CN = '", "task"),
    ("agent", r"chown: changing ownership of [^\n]*: Invalid argument", "chown to another user fails (EINVAL: the episode maps one uid)", "infra"),
    ("agent", r"(?:setuid|setgid|setgroups|initgroups)[^\n]*(?:Invalid argument|Operation not permitted)", "switching user fails (the episode maps one uid)", "infra"),
    ("agent", r"(?:apt|apt-get)[^\n]*\n?[^\n]*(?:Temporary failure resolving|Could not resolve|Unable to connect|Failed to fetch)", "apt-get could not reach the network", "infra"),
    ("agent", r"(?:Temporary failure resolving|Failed to fetch http://deb\.debian\.org|Unable to locate package)", "apt-get could not reach the network", "infra"),
    ("agent", r"(?:NewConnectionError|Failed to establish a new connection|No matching distribution found for ([\w.-]+))", "pip could not reach the network ({1})", "infra"),
    ("agent", r"(?:huggingface\.co|hf\.co|HF_HUB|huggingface_hub)[^\n]*(?:Error|error|resolve|connect)", "Hugging Face download (no network)", "infra"),
    ("agent", r"fatal: unable to access '(?:https?://)?([^/']+)", "git could not reach {1}", "infra"),
    ("agent", r"curl: \((?:6|7|28|35)\)[^\n]*?(?:host:? '?([\w.-]+))?", "curl could not reach the network ({1})", "infra"),
    ("agent", r"wget: unable to resolve host address '?([\w.-]+)", "wget could not reach {1}", "infra"),
    ("agent", r"(?:Network is unreachable|Could not resolve host|Name or service not known|getaddrinfo failed|Temporary failure in name resolution)", "the solution needs the network", "infra"),
    ("agent", r"(?:bash|sh): (?:line \d+: )?([\w.+-]+): (?:command )?not found", "solution: {1} not found", "task"),
    ("agent", r"No such file or directory: '(/[^']+)'", "solution: missing file {1}", "infra"),
    # --- the verifier (test.sh and the tests) ----------------------------------------
    ("verifier", r"/opt/sequester-verifier/run/cache/[^\n]*No space left on device", "uv cache out of space (the verifier's run folder is a 2 GB tmpfs, large wheels such as torch)", "infra"),
    ("verifier", r"No space left on device", "disk full", "infra"),
    ("verifier", r"Remote Git fetches are not allowed|failed to clone into: /opt/sequester-verifier", "a test dependency is a git URL (not fetchable offline)", "infra"),
    ("verifier", r"site-packages/(\w+)/[^\n]*\n(?:[^\n]*\n){0,4}?E?\s*ImportError: /: cannot read file data: Is a directory", "{1} C extension fails to load (/: cannot read file data: Is a directory)", "infra"),
    ("verifier", r"(?:error: (?:Failed to|Request failed)[^\n]*(?:download|fetch)|Failed to download|error sending request for url \((https?://[^/)]+))", "uv download failed", "infra"),
    ("verifier", r"No (?:interpreter|download) found for (?:request: )?Python ?([\d.]+)?", "uvx: Python {1} not available", "infra"),
    ("verifier", r"Because ([\w.-]+)[^\n]* was not found in the (?:package registry|provided package locations)", "uv: {1} not available offline (a pin beyond the runner's wheels)", "infra"),
    ("verifier", r"No solution found when resolving[^\n]*\n[^\n]*?([\w.-]+==[\w.]+)?", "uv: could not resolve the test dependencies offline ({1})", "infra"),
    ("verifier", r"error: command '([\w+.-]*(?:gcc|cc|g\+\+|clang))' failed: No such file", "{1} missing in the verifier (test.sh's apt-get install skipped offline)", "infra"),
    ("verifier", r"(?:NewConnectionError|Failed to establish a new connection)[^\n]*\n?[^\n]*?/simple/([\w.-]+)", "pip install of the test dependencies failed (no network, test.sh uses pip, not uvx)", "infra"),
    ("verifier", r"Importing the numpy C-extensions failed[\s\S]{0,4000}?Original error was: (lib[\w+-]+?)(?:\.so[\w.]*)?: cannot open shared object", "numpy C extension fails to load ({1} missing)", "infra"),
    ("verifier", r"Importing the numpy C-extensions failed[\s\S]{0,4000}?Original error was: (?!%s)([^\n]{0,100})", "numpy C extension fails to load ({1})", "infra"),
    ("verifier", r"Error importing numpy: you should not try to import numpy from", "numpy C extension fails to load (message cut off)", "infra"),
    ("verifier", r"from ([\w.]+) import [^\n]*\nE\s+ImportError: /: cannot read file data: Is a directory", "{1} C extension fails to load (/: cannot read file data: Is a directory)", "infra"),
    ("verifier", r"ImportError: /: cannot read file data: Is a directory", "a C extension fails to load (/: cannot read file data: Is a directory)", "infra"),
    ("verifier", r"(lib[\w+.-]+\.so[\w.]*): cannot open shared object file", "{1} missing (import fails)", "infra"),
    ("verifier", r"^E?\s*ImportError: (/?[^\n]{1,100})", "test import fails ({1})", "infra"),
    ("verifier", r"ModuleNotFoundError: No module named '([\w.]+)'", "test import fails: no module {1}", "test"),
    ("verifier", r"tar: ([^\n:]+): Cannot open: No such file", "tar: {1} missing", "infra"),
    ("verifier", r"(?:curl|wget)[^\n]*(?:Could not resolve host|Failed to connect)", "verifier download failed (no network)", "infra"),
    ("verifier", r"(?:Temporary failure resolving|Temporary failure in name resolution|gaierror: \[Errno|Could not resolve host|Network is unreachable)", "tests need the network", "infra"),
    ("verifier", r"ConnectionRefusedError: \[Errno 111\]|Connection refused", "the service under test is not running (connection refused)", "test"),
    ("verifier", r"Timeout >?([\d.]+)s|Failed: Timeout", "a test timed out ({1} s)", "test"),
    # --- sequester's exceptions and notes -------------------------------------------
    ("exception", r"(?:VerifierTimeout|verifier[^\n]*(?:timed out|ran over))", "the verifier ran over its timeout", "infra"),
    ("exception", r"(?:AgentTimeout|agent[^\n]*(?:timed out|ran over))", "the solution ran over the agent timeout", "infra"),
    ("exception", r"(?:no space left|ENOSPC|Errno 28)", "disk full on the host", "infra"),
    ("exception", r"could not fetch the verifier's wheels[\s\S]*?No matching distribution found for ([\w.-]+==[\w.]+)", "the verifier's pinned wheels could not be fetched ({1}: no wheel on PyPI)", "infra"),
    ("exception", r"could not fetch the verifier's wheels[^\n]*?: ([^\n(]{0,120})", "the verifier's pinned wheels could not be fetched ({1})", "infra"),
    ("exception", r"uvx never started pytest", "the verifier could not run (uvx never started pytest)", "infra"),
    ("exception", r"BuildError|failed with exit status", "the image could not be built", "infra"),
    ("notes", r"reward 0 for the agent: ([^\n]{0,160})", "zero_reason: {1}", "infra"),
    ("notes", r"ran over", "a timeout (notes)", "infra"),
]

# Lines of the verifier's output that are expected under sequester and explain nothing:
# its own remarks, and the standard test.sh's uv installer failing (sequester's verifier
# runner provides uv/uvx offline, so the script goes on). Dropped before classifying.
BENIGN = [
    r"^sequester: .*$",
    r"^curl: \(\d+\) [^\n]*astral\.sh.*$",
    r"^[^\n]*\$HOME/\.local/bin/env: No such file or directory$",
    r"^[^\n]*/\.local/bin/env: No such file or directory$",
]
_BENIGN = [re.compile(rx, re.MULTILINE) for rx in BENIGN]


def strip_benign(text: str) -> str:
    for rx in _BENIGN:
        text = rx.sub("", text)
    return text


_COMPILED = [(where, re.compile(rx, re.IGNORECASE | re.MULTILINE), label, kind) for where, rx, label, kind in RULES]

TAIL_LINES = 25
EXCERPT_CHARS = 1500


def classify(where: str, text: str) -> tuple[str, str] | None:
    """The first rule of ``where`` that matches ``text``: (label, kind)."""
    if not text:
        return None
    for w, rx, label, kind in _COMPILED:
        if w != where:
            continue
        m = rx.search(text)
        if m:
            out = label
            for i, g in enumerate(m.groups(), start=1):
                out = out.replace("{%d}" % i, g if g else "?")
            out = re.sub(r"\{\d+\}", "?", out).replace(" (?)", "")
            return out, kind
    return None


# --------------------------------------------------------------------------------------
# Running commands under a cap
# --------------------------------------------------------------------------------------

@dataclass
class Ran:
    rc: int | None          # None: killed at the cap
    seconds: float
    output_path: Path

    @property
    def timed_out(self) -> bool:
        return self.rc is None

    def tail(self, lines: int = TAIL_LINES) -> str:
        return tail_text(self.output_path, lines)


def tail_text(path: Path, lines: int = TAIL_LINES, max_bytes: int = 200_000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(data.rstrip().splitlines()[-lines:])


def read_text(path: Path, max_bytes: int = 2_000_000) -> str:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return ""
    if len(data) > max_bytes:  # keep the head and the tail: errors sit at either end
        data = data[: max_bytes // 4] + b"\n[...]\n" + data[-(max_bytes * 3 // 4):]
    return data.decode(errors="replace")


_live: set[int] = set()  # process groups of running commands (killed on Ctrl-C)
_live_lock = threading.Lock()
_stopping = threading.Event()  # set on SIGINT/SIGTERM: start nothing new


class Stopped(Exception):
    pass


def run_capped(argv: list[str], output: Path, cap: float, env: dict[str, str]) -> Ran:
    """Run ``argv`` in its own session (process group), stdout+stderr to ``output``; on
    overrun, SIGTERM the group, then SIGKILL it 20 s later."""
    if _stopping.is_set():
        raise Stopped()
    output.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with open(output, "wb") as out:
        out.write(("$ " + shlex.join(argv) + "\n").encode())
        out.flush()
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, env=env)
        with _live_lock:
            _live.add(proc.pid)
        try:
            try:
                rc: int | None = proc.wait(timeout=cap)
            except subprocess.TimeoutExpired:
                rc = None
                _kill_group(proc)
        finally:
            with _live_lock:
                _live.discard(proc.pid)
    seconds = time.monotonic() - start
    if rc is None:
        with open(output, "ab") as out:
            out.write(f"\n[tb2_sweep] killed at the cap of {cap:g} s\n".encode())
    return Ran(rc, seconds, output)


def _kill_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=wait)
            # the leader is gone; take the rest of the group too
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return
        except subprocess.TimeoutExpired:
            continue


# --------------------------------------------------------------------------------------
# Reading a task and its trials
# --------------------------------------------------------------------------------------

def task_bases(task: Path) -> list[str]:
    try:
        text = (task / "environment" / "Dockerfile").read_text(errors="replace")
    except OSError:
        return []
    stages: set[str] = set()
    bases = []
    for m in re.finditer(r"^\s*FROM\s+(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?", text, re.I | re.M):
        image = m.group(1)
        if image.lower() not in stages and image not in bases:
            bases.append(image)
        if m.group(2):
            stages.add(m.group(2).lower())
    return bases


def find_trial(job_dir: Path) -> Path | None:
    if not job_dir.is_dir():
        return None
    trials = sorted(p for p in job_dir.iterdir() if p.is_dir() and (p / "result.json").is_file())
    return trials[-1] if trials else None


def agent_output(trial: Path) -> str:
    parts = []
    agent = trial / "agent"
    for cmd in sorted(agent.glob("command-*"), key=lambda p: int(p.name.split("-")[-1]) if p.name.split("-")[-1].isdigit() else 0):
        for name in ("stdout.txt", "stderr.txt"):
            t = read_text(cmd / name, 600_000)
            if t:
                parts.append(t)
        rc = read_text(cmd / "return-code.txt").strip()
        if rc:
            parts.append(f"[return code {rc}]")
    if not parts:
        parts.append(read_text(agent / "agent.log", 600_000))
    return "\n".join(parts)


def agent_return_codes(trial: Path) -> list[str]:
    return [read_text(c / "return-code.txt").strip() for c in sorted((trial / "agent").glob("command-*"))]


PYTEST_SUMMARY = re.compile(r"^=+ (.*\b(?:passed|failed|error|errors|skipped|no tests ran)\b.*) in [\d.]+s.*=+$", re.M)
PYTEST_FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.M)


def pytest_facts(text: str) -> dict:
    summary = PYTEST_SUMMARY.findall(text)
    failed = PYTEST_FAILED.findall(text)
    return {"summary": summary[-1] if summary else None,
            "failed": [f.split("::")[-1] for f in failed][:8], "n_failed": len(failed)}


def read_trial(job_dir: Path) -> dict:
    """What the trial of a one-trial job left: reward, exception, notes, outputs."""
    trial = find_trial(job_dir)
    if trial is None:
        return {"found": False}
    try:
        data = json.loads((trial / "result.json").read_text())
    except (OSError, ValueError) as exc:
        return {"found": False, "error": f"result.json unreadable: {exc}", "trial_dir": str(trial)}
    vr = data.get("verifier_result") or None
    rewards = (vr or {}).get("rewards") or {}
    reward = rewards.get("reward", next(iter(rewards.values()), None)) if rewards else None
    exc = data.get("exception_info") or None
    notes = [str(n) for n in data.get("notes") or []]
    zero = [n.split(":", 1)[1].strip() for n in notes if n.startswith("reward 0 for the agent:")]
    verifier_raw = read_text(trial / "verifier" / "test-stdout.txt")
    verifier_out = strip_benign(verifier_raw)
    return {
        "found": True, "trial_dir": str(trial), "reward": reward, "rewards": rewards,
        "exception_type": (exc or {}).get("sequester_exception_type") or (exc or {}).get("exception_type"),
        "harbor_exception_type": (exc or {}).get("exception_type"),
        "exception_message": (exc or {}).get("exception_message"),
        "notes": notes, "zero_reason": zero[0] if zero else None,
        "tampering": data.get("tampering") or [],
        "system": data.get("system"),
        "verifier_environment_mode": data.get("verifier_environment_mode"),
        "timing": {k: data.get(k) for k in ("environment_setup", "agent_execution", "verifier")},
        "agent_return_codes": agent_return_codes(trial),
        "pytest": pytest_facts(verifier_out),
        "verifier_tail": "\n".join(verifier_raw.rstrip().splitlines()[-TAIL_LINES:]),
        "_verifier_text": verifier_out,
        "_agent_text": agent_output(trial),
    }


# --------------------------------------------------------------------------------------
# One task
# --------------------------------------------------------------------------------------

@dataclass
class Settings:
    sequester: str
    config: Path
    out: Path
    cap: float
    image_source: str
    missing: dict[str, list[str]]
    env: dict[str, str]
    keep_images: bool = False
    min_free_gb: float = 15.0
    watch: tuple[Path, ...] = ()


def build_error_text(output: Path) -> str:
    """The build's error as sequester printed it ('error: TASK: ...' to the end), else the tail."""
    text = read_text(output)
    i = text.rfind("\nerror: ")
    if i < 0:
        i = text.find("error:")
    err = text[i:].strip() if i >= 0 else ""
    # the table rich prints after the error is noise here
    err = re.split(r"\n\s*sequester build \(", err)[0]
    return err or tail_text(output)


def step_status(t: dict) -> str:
    if not t.get("ran"):
        return "not run"
    if t.get("timed_out"):
        return "timeout"
    if not t.get("found"):
        return "no result"
    if t.get("exception_type"):
        return "error"
    r = t.get("reward")
    return "?" if r is None else f"{float(r):.1f}" if float(r) in (0.0, 1.0) else f"{float(r):g}"


def job_dir(s: Settings, task_name: str, agent: str) -> Path:
    return s.out / "jobs" / f"{task_name}.{agent}"


def run_agent(task: Path, agent: str, s: Settings, tdir: Path) -> Ran:
    jd = job_dir(s, task.name, agent)
    if jd.exists():
        subprocess.run(["rm", "-rf", "--one-file-system", str(jd)], check=False)
    argv = [s.sequester, "run", str(task), "--agent", agent, "-n", "1", "-o", str(jd.parent), "--job-name", jd.name,
            "--config", str(s.config), "--image-source", s.image_source]
    return run_capped(argv, tdir / f"{agent}.out", s.cap, s.env)


RUN_FACTS = ("ran", "rc", "seconds", "timed_out")


def do_task(task: Path, s: Settings) -> dict:
    """Run the three commands; record only what running them told (the rest: analyse)."""
    tdir = s.out / "tasks" / task.name
    tdir.mkdir(parents=True, exist_ok=True)
    rec: dict = {"task": task.name, "started_at": now()}
    t0 = time.monotonic()
    argv = [s.sequester, "build", str(task), "--config", str(s.config), "-n", "1",
            "--logs", str(tdir / "build-logs")]
    b = run_capped(argv, tdir / "build.out", s.cap, s.env)
    rec["build"] = {"rc": b.rc, "seconds": round(b.seconds, 1), "timed_out": b.timed_out,
                    "status": "timeout" if b.timed_out else "built" if b.rc == 0 else "failed"}
    for agent in ("oracle", "nop"):
        if rec["build"]["status"] != "built":
            rec[agent] = {"ran": False}
            continue
        ran = run_agent(task, agent, s, tdir)
        rec[agent] = {"ran": True, "rc": ran.rc, "seconds": round(ran.seconds, 1), "timed_out": ran.timed_out}
    rec["seconds"] = round(time.monotonic() - t0, 1)
    rec["finished_at"] = now()
    analyse(rec, task, s)
    if not s.keep_images and rec["build"]["status"] == "built":
        remove_image(task, rec, s, tdir)
    return rec


def remove_image(task: Path, rec: dict, s: Settings, tdir: Path) -> None:
    """Take the task's built image out of the store (its layers with it): a sweep of 89
    tasks would otherwise keep ~50 GB. A later run builds it again."""
    names = {t.get("system", {}).get("image") for t in (rec.get("oracle", {}), rec.get("nop", {}))
             if isinstance(t.get("system"), dict)} - {None}
    names = names or {f"localhost/sequester-build/{task.name.lower()}:latest"}
    for name in sorted(names):
        done = subprocess.run([s.sequester, "image", "rm", "--config", str(s.config), name],
                              capture_output=True, text=True, env=s.env, timeout=600)
        with open(tdir / "image-rm.out", "a") as f:
            f.write(f"$ sequester image rm {name}\n{done.stdout}{done.stderr}")


def low_disk(s: Settings) -> str | None:
    """A message when a watched filesystem has less than --min-free-gb left."""
    seen = set()
    for path in s.watch:
        p = path
        while not p.exists() and p != p.parent:
            p = p.parent
        try:
            st = os.statvfs(p)
        except OSError:
            continue
        if st.f_fsid in seen:
            continue
        seen.add(st.f_fsid)
        free = st.f_bavail * st.f_frsize / 1e9
        if free < s.min_free_gb:
            return f"{free:.1f} GB free on the filesystem of {path} (< --min-free-gb {s.min_free_gb:g})"
    return None


def store_dir_of(config: Path) -> Path:
    """[images] store_dir of a sequester config (relative to the file), else root's default."""
    try:
        import tomllib
        data = tomllib.loads(config.read_text())
        value = data.get("images", {}).get("store_dir")
        if value:
            return (config.parent / value).resolve()
    except Exception:  # noqa: BLE001 - a guess for the disk watch only
        pass
    return Path("/var/lib/sequester/images")


def analyse(rec: dict, task: Path, s: Settings) -> dict:
    """Fill in a record from the files its commands left (also for --reclassify): the
    build's error, each trial's result, the cause. Writes tasks/<task>/record.json."""
    tdir = s.out / "tasks" / task.name
    rec["bases"] = task_bases(task)
    rec["missing_files"] = s.missing.get(task.name, [])
    build = {k: rec["build"][k] for k in ("rc", "seconds", "timed_out", "status") if k in rec["build"]}
    if build["status"] == "failed":
        build["error"] = build_error_text(tdir / "build.out")[-EXCERPT_CHARS * 2:]
        build["log_tail"] = tail_text(tdir / "build-logs" / f"{task.name}.log", 40)
    rec["build"] = build
    for agent in ("oracle", "nop"):
        facts = {k: rec.get(agent, {}).get(k) for k in RUN_FACTS}
        facts["ran"] = bool(facts["ran"])
        t = dict(facts)
        if facts["ran"]:
            t.update(read_trial(job_dir(s, task.name, agent)))
            if not t.get("found"):
                t["run_tail"] = tail_text(tdir / f"{agent}.out", 30)
        t["status"] = step_status(t)
        rec[agent] = t
    explain(rec, s.cap)
    # the big texts served the classifier; keep excerpts only
    for agent in ("oracle", "nop"):
        t = rec[agent]
        agent_text = t.pop("_agent_text", "")
        t.pop("_verifier_text", None)
        if agent_text:
            t["agent_tail"] = "\n".join(agent_text.rstrip().splitlines()[-TAIL_LINES:])
    rec["complete"] = True
    tmp = tdir / "record.json.tmp"
    tmp.write_text(json.dumps(rec, indent=2) + "\n")
    tmp.replace(tdir / "record.json")
    return rec


# --------------------------------------------------------------------------------------
# Naming the cause
# --------------------------------------------------------------------------------------

def explain(rec: dict, cap: float) -> None:
    """Set rec["cause"], rec["cause_kind"], rec["classified"], rec["silent_zero"],
    rec["infra_zero"], rec["excerpt"] (for unclassified ones)."""
    causes: list[str] = []
    kinds: list[str] = []
    unclassified: list[str] = []
    excerpts: list[str] = []
    rec["silent_zero"] = False
    rec["infra_zero"] = False
    missing = rec.get("missing_files") or []
    b = rec["build"]
    if b["status"] == "timeout":
        causes.append(f"build: timeout (harness cap {cap:g} s)")
        kinds.append("infra")
    elif b["status"] == "failed":
        text = (b.get("error") or "") + "\n" + (b.get("log_tail") or "")
        hit = classify("build", text)
        if missing and (hit is None or "COPY" in hit[0]):
            hit = (f"missing file (not in snapshot): {', '.join(missing)}", "infra")
        if hit:
            causes.append(f"build: {hit[0]}")
            kinds.append(hit[1])
        else:
            causes.append("build: unclassified")
            unclassified.append("build")
            excerpts.append("build error:\n" + text.strip()[-EXCERPT_CHARS:])
    else:
        o = rec["oracle"]
        c, k, ex = explain_oracle(o, cap, missing)
        if c:
            causes.append(c)
            kinds.append(k)
            if k == "unclassified":
                unclassified.append("oracle")
            if k in ("unclassified", "silent"):
                excerpts.append(ex)
        if o.get("status") == "0.0" and not o.get("exception_type") and not o.get("zero_reason"):
            if c == "silent zero":
                rec["silent_zero"] = True
            else:
                hit_v = classify("verifier", o.get("_verifier_text", ""))
                rec["infra_zero"] = bool(hit_v and hit_v[1] == "infra")
        n = rec["nop"]
        c, k, ex = explain_nop(n, cap)
        m = re.match(r"nop: 0 only because the verifier could not run \((.*)\)$", c or "")
        if m and m.group(1) in " ".join(causes):
            c = ""  # the oracle's cause says it already
        if c and causes and c.replace("nop error", "oracle error", 1) == causes[-1]:
            causes[-1] += " (nop: the same)"
            c = ""
        if c:
            causes.append(c)
            kinds.append(k)
            if k == "unclassified":
                unclassified.append("nop")
                excerpts.append(ex)
    rec["cause"] = "; ".join(causes)
    rec["cause_kind"] = kinds[0] if kinds else ""
    rec["classified"] = not unclassified
    rec["unclassified"] = unclassified
    if excerpts:
        rec["excerpt"] = "\n\n".join(excerpts)


def explain_oracle(o: dict, cap: float, missing: list[str]) -> tuple[str, str, str]:
    st = o.get("status")
    if st == "1.0":
        return "", "", ""
    if st == "timeout":
        return f"oracle: timeout (harness cap {cap:g} s)", "infra", ""
    if st == "no result":
        tail = o.get("run_tail", "")
        hit = classify("exception", tail) or classify("build", tail)
        if hit:
            return f"oracle: no result.json ({hit[0]})", hit[1], ""
        return "oracle: no result.json", "unclassified", "sequester run output:\n" + tail[-EXCERPT_CHARS:]
    agent_text = o.get("_agent_text", "")
    verifier_text = o.get("_verifier_text", "")
    exc_text = f"{o.get('exception_type') or ''}: {o.get('exception_message') or ''}"
    notes_text = "\n".join(o.get("notes") or [])
    if st == "error":
        hit = classify("exception", exc_text)
        if hit:
            deeper = classify("agent", agent_text) if "solution" in hit[0] else classify("verifier", verifier_text)
            label = hit[0] + (f" ({deeper[0]})" if deeper else "")
            return f"oracle error {o.get('exception_type')}: {label}", hit[1], ""
        hit = classify("verifier", exc_text + "\n" + verifier_text) or classify("build", exc_text)
        if hit:
            return f"oracle error {o.get('exception_type')}: {hit[0]}", hit[1], ""
        first = (o.get("exception_message") or "").strip().splitlines()[:1]
        return (f"oracle error {o.get('exception_type')}: {first[0][:120] if first else ''}", "unclassified",
                "exception:\n" + exc_text[-EXCERPT_CHARS:] + "\n--- verifier tail:\n" + (o.get("verifier_tail") or ""))
    # a verdict that is not 1.0: what the solution hit, and what the verifier hit, both
    fail_codes = [c for c in o.get("agent_return_codes") or [] if c not in ("", "0")]
    if missing:
        return f"missing file (not in snapshot): {', '.join(missing)}", "infra", ""
    parts: list[str] = []
    kinds: list[str] = []
    if o.get("zero_reason"):
        parts.append(f"oracle: zero_reason: {o['zero_reason'][:160]}")
        kinds.append("infra")
    hit_a = classify("agent", agent_text)
    if hit_a:
        parts.append(f"oracle: {hit_a[0]}" + (f" (solve.sh exit {fail_codes[-1]})" if fail_codes else ""))
        kinds.append(hit_a[1])
    hit_v = classify("verifier", verifier_text)
    if hit_v:
        parts.append(f"verifier: {hit_v[0]}")
        kinds.append(hit_v[1])
    if parts:
        return " + ".join(parts), kinds[0], ""
    hit_n = classify("notes", notes_text)
    if hit_n:
        return f"oracle: {hit_n[0]}", hit_n[1], ""
    py = o.get("pytest") or {}
    if py.get("n_failed"):
        names = ", ".join(py["failed"][:4])
        excerpt = ("oracle agent tail:\n" + "\n".join(agent_text.rstrip().splitlines()[-12:]) +
                   "\n--- verifier tail:\n" + (o.get("verifier_tail") or ""))
        return (f"verifier: {py['n_failed']} test(s) failed ({names})"
                + (f" after solve.sh exit {fail_codes[-1]}" if fail_codes else ""), "unclassified", excerpt[-EXCERPT_CHARS * 2:])
    if fail_codes:
        excerpt = "oracle agent tail:\n" + "\n".join(agent_text.rstrip().splitlines()[-20:])
        return f"oracle: solve.sh exit {fail_codes[-1]}", "unclassified", excerpt
    return "silent zero", "silent", ("oracle agent tail:\n" + "\n".join(agent_text.rstrip().splitlines()[-10:]) +
                                     "\n--- verifier tail:\n" + (o.get("verifier_tail") or "(empty)"))


def explain_nop(n: dict, cap: float) -> tuple[str, str, str]:
    st = n.get("status")
    if st == "0.0":
        hit = classify("verifier", n.get("_verifier_text", ""))
        if hit and hit[1] == "infra":  # a 0 that says nothing: the tests never ran
            return f"nop: 0 only because the verifier could not run ({hit[0]})", "infra", ""
        return "", "", ""
    if st == "not run":
        return "", "", ""
    if st == "timeout":
        return f"nop: timeout (harness cap {cap:g} s)", "infra", ""
    if st == "no result":
        return "nop: no result.json", "unclassified", "sequester run output:\n" + n.get("run_tail", "")[-EXCERPT_CHARS:]
    if st == "error":
        exc_text = f"{n.get('exception_type') or ''}: {n.get('exception_message') or ''}"
        hit = classify("exception", exc_text)
        deeper = classify("verifier", n.get("_verifier_text", ""))
        if hit:
            return f"nop error {n.get('exception_type')}: {hit[0]}" + (f" ({deeper[0]})" if deeper else ""), hit[1], ""
        hit = classify("verifier", exc_text + "\n" + n.get("_verifier_text", ""))
        if hit:
            return f"nop error {n.get('exception_type')}: {hit[0]}", hit[1], ""
        first = (n.get("exception_message") or "").strip().splitlines()[:1]
        return (f"nop error {n.get('exception_type')}: {first[0][:120] if first else ''}", "unclassified",
                "nop exception:\n" + exc_text[-EXCERPT_CHARS:])
    return f"nop: reward {st} without doing anything (task passes unsolved)", "task", ""


# --------------------------------------------------------------------------------------
# Reports
# --------------------------------------------------------------------------------------

def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def md_cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def summary_counts(records: list[dict], total: int) -> dict:
    done = [r for r in records if r.get("complete")]
    return {
        "tasks_total": total,
        "tasks_done": len(done),
        "built": sum(r["build"]["status"] == "built" for r in done),
        "build_failed": sum(r["build"]["status"] == "failed" for r in done),
        "build_timeout": sum(r["build"]["status"] == "timeout" for r in done),
        "oracle_1": sum(r["oracle"].get("status") == "1.0" for r in done),
        "nop_0": sum(r["nop"].get("status") == "0.0" for r in done),
        "oracle_1_and_nop_0": sum(r["oracle"].get("status") == "1.0" and r["nop"].get("status") == "0.0" for r in done),
        "silent_zeros": sum(bool(r.get("silent_zero")) for r in done),
        "infra_zeros": sum(bool(r.get("infra_zero")) for r in done),
        "timeouts": sum(any(r[p].get("status") == "timeout" for p in ("oracle", "nop")) or r["build"]["status"] == "timeout"
                        for r in done),
        "unclassified": sum(not r.get("classified", True) for r in done),
        "ran_in_host_mode": sum(any((r[p].get("system") or {}).get("mode") == "host" for p in ("oracle", "nop")) for r in done),
    }


def summary_line(c: dict) -> str:
    return (f"built {c['built']}/{c['tasks_total']} (done {c['tasks_done']}), oracle 1.0 {c['oracle_1']}, "
            f"nop 0.0 {c['nop_0']}, both {c['oracle_1_and_nop_0']}, silent zeros {c['silent_zeros']}, "
            f"infra zeros {c['infra_zeros']}, timeouts {c['timeouts']}, unclassified {c['unclassified']}")


def write_reports(out: Path, meta: dict, records: list[dict], total: int, name: str = "results") -> dict:
    records = sorted(records, key=lambda r: r["task"])
    counts = summary_counts(records, total)
    doc = {"meta": meta, "summary": counts, "tasks": records}
    tmp = out / f"{name}.json.tmp"
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(out / f"{name}.json")
    lines = [f"# TB2 sweep: {meta.get('label') or out.name}", "",
             f"- sequester: `{meta['sequester']}` ({meta.get('sequester_version', '?')})",
             f"- config: `{meta['config']}`; image source `{meta['image_source']}`; cap {meta['cap']:g} s per command; jobs {meta['jobs']}",
             f"- started {meta['started_at']}" + (f", finished {meta['finished_at']}" if meta.get("finished_at") else " (running)"),
             f"- command: `{meta['command']}`",
             *([f"- **stopped early: {meta['stopped']}**"] if meta.get("stopped") else []),
             *[f"- note: {n}" for n in meta.get("notes", [])],
             *[f"- earlier run: started {e.get('started_at')}, finished {e.get('finished_at')}: `{e.get('command')}`"
               for e in meta.get("earlier_runs", [])], "",
             f"**{summary_line(counts)}**", "",
             "| task | base | built | oracle | nop | seconds | cause |", "|---|---|---|---|---|---:|---|"]
    for r in records:
        if not r.get("complete"):
            continue
        flags = []
        if r.get("silent_zero"):
            flags.append("**SILENT ZERO**")
        if r.get("infra_zero"):
            flags.append("**INFRA ZERO**")
        if not r.get("classified", True):
            flags.append("_unclassified_")
        cause = " ".join(flags + [md_cell(r.get("cause", ""))]).strip()
        lines.append(f"| {r['task']} | {md_cell(' + '.join(r.get('bases') or []))} | {r['build']['status']} | "
                     f"{r['oracle'].get('status')} | {r['nop'].get('status')} | {r.get('seconds', 0):.0f} | {cause} |")
    # causes grouped
    groups: dict[str, list[str]] = {}
    for r in records:
        if r.get("complete") and r.get("cause"):
            for part in r["cause"].split("; "):
                phase = part.split(":", 1)[0] if part.startswith(("oracle", "nop")) else ""
                for i, c in enumerate(part.split(" + ")):
                    if i and phase and not c.startswith(("verifier", "oracle", "nop")):
                        c = f"{phase}: {c}"
                    key = re.sub(r"\(solve\.sh exit \d+\)|after solve\.sh exit \d+|\(nop: the same\)", "", c).strip()
                    if r["task"] not in groups.setdefault(key, []):
                        groups[key].append(r["task"])
    if groups:
        lines += ["", "## Causes", "", "| cause | n | tasks |", "|---|---:|---|"]
        for key, tasks in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
            lines.append(f"| {md_cell(key)} | {len(tasks)} | {', '.join(tasks)} |")
    unc = [r for r in records if r.get("complete") and (not r.get("classified", True) or r.get("silent_zero"))]
    if unc:
        lines += ["", "## Unclassified failures and silent zeros (excerpts)", ""]
        for r in unc:
            lines += [f"### {r['task']}: {r.get('cause')}", "", "```", (r.get("excerpt") or "").strip()[-3000:], "```", ""]
    tmp = out / f"{name}.md.tmp"
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(out / f"{name}.md")
    return counts


def parse_missing(path: Path | None) -> dict[str, list[str]]:
    """Task -> missing files, from a MISSING.md table ('| task | `file` | ...')."""
    out: dict[str, list[str]] = {}
    if not path or not path.is_file():
        return out
    for line in path.read_text().splitlines():
        m = re.match(r"^\|\s*([\w.-]+)\s*\|\s*`([^`]+)`", line)
        if m:
            out.setdefault(m.group(1), []).append(m.group(2))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sequester", required=True, help="the sequester program to test")
    p.add_argument("--tasks", required=True, type=Path, help="a folder of task folders")
    p.add_argument("--config", required=True, type=Path, help="sequester config file")
    p.add_argument("--out", required=True, type=Path, help="where results go")
    p.add_argument("--only", default="", help="comma-separated task names")
    p.add_argument("--skip", default="", help="comma-separated task names to leave out")
    p.add_argument("--cap", type=float, default=900.0, help="wall-clock seconds per command (build, oracle, nop)")
    p.add_argument("--jobs", type=int, default=1, help="tasks at a time")
    p.add_argument("--image-source", default="dockerfile", choices=["dockerfile", "auto", "prebuilt", "host"],
                   help="passed to sequester run (default: dockerfile, never host mode)")
    p.add_argument("--missing", type=Path, default=None,
                   help="MISSING.md listing files absent from the task snapshot (default: TASKS/../MISSING.md)")
    p.add_argument("--resume", action="store_true",
                   help="keep the tasks already complete in --out (all of them, in the reports) and run the rest")
    p.add_argument("--redo", default="", help="with --resume: comma-separated tasks to run again anyway")
    p.add_argument("--label", default="", help="a title for results.md")
    p.add_argument("--keep-images", action="store_true",
                   help="keep each task's built image in the store (default: remove it after its runs)")
    p.add_argument("--min-free-gb", type=float, default=15.0,
                   help="start no new task while the store's, --out's, /var/cache's or /var/tmp's filesystem "
                        "has less free space (default 15)")
    p.add_argument("--reclassify", action="store_true",
                   help="run nothing: name the causes again from what --out holds (after editing RULES)")
    p.add_argument("--report-name", default="results",
                   help="--reclassify: write NAME.md and NAME.json (default results; use another name "
                        "while a sweep is still writing results.*)")
    args = p.parse_args(argv)

    tasks_dir = args.tasks.resolve()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    tasks = sorted(d for d in tasks_dir.iterdir() if d.is_dir() and (d / "task.toml").is_file())
    all_tasks = list(tasks)
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = set(wanted) - {t.name for t in tasks}
        if unknown:
            p.error(f"--only: no such task(s): {', '.join(sorted(unknown))}")
        tasks = [t for t in tasks if t.name in wanted]
    if args.skip:
        skip = {n.strip() for n in args.skip.split(",")}
        tasks = [t for t in tasks if t.name not in skip]
    if not tasks:
        p.error("no tasks")
    missing_file = args.missing or (tasks_dir.parent / "MISSING.md")
    env = dict(os.environ, COLUMNS="250", NO_COLOR="1", TERM="dumb", PYTHONUNBUFFERED="1")
    s = Settings(args.sequester, args.config.resolve(), out, args.cap, args.image_source,
                 parse_missing(missing_file), env, args.keep_images, args.min_free_gb,
                 (store_dir_of(args.config.resolve()), out, Path("/var/cache/sequester"), Path("/var/tmp")))
    try:
        version = subprocess.run([args.sequester, "--version"], capture_output=True, text=True, timeout=120,
                                 env=env).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        version = f"? ({exc})"
    meta = {"label": args.label, "sequester": args.sequester, "sequester_version": version,
            "config": str(s.config), "config_text": read_text(s.config), "tasks_dir": str(tasks_dir),
            "image_source": args.image_source, "cap": args.cap, "jobs": args.jobs, "host": socket.gethostname(),
            "started_at": now(), "finished_at": None, "command": shlex.join([sys.executable, *sys.argv]),
            "missing": s.missing, "rules": RULES}

    records: dict[str, dict] = {}
    redo = {n.strip() for n in args.redo.split(",") if n.strip()}
    if args.resume:
        # every task already done in --out, selected or not, so the reports stay whole
        for t in all_tasks:
            f = out / "tasks" / t.name / "record.json"
            if f.is_file() and t.name not in redo:
                try:
                    r = json.loads(f.read_text())
                    if r.get("complete"):
                        records[t.name] = r
                except ValueError:
                    pass
    if args.reclassify:
        old_meta = {}
        try:
            old_meta = json.loads((out / "results.json").read_text()).get("meta", {})
        except (OSError, ValueError):
            pass
        meta.update({k: old_meta[k] for k in ("started_at", "finished_at", "command", "sequester_version", "cap",
                                              "jobs", "image_source", "label", "stopped", "earlier_runs",
                                              "resumed_with", "notes") if k in old_meta})
        meta["reclassified_at"] = now()
        s.cap = float(meta.get("cap", s.cap))
        meta["rules"] = RULES
        done = []
        for t in tasks:
            f = out / "tasks" / t.name / "record.json"
            if f.is_file():
                try:
                    r = json.loads(f.read_text())
                except ValueError:  # being written by a running sweep
                    continue
                if r.get("complete") and "ran" in r.get("oracle", {}):
                    done.append(analyse(r, t, s))
        counts = write_reports(out, meta, done, len(tasks), args.report_name)
        print(f"reclassified {len(done)} task(s)\nSUMMARY: " + summary_line(counts))
        for r in sorted(done, key=lambda r: r["task"]):
            if not r.get("classified", True) or r.get("silent_zero"):
                print(f"  {'SILENT ZERO' if r.get('silent_zero') else 'UNCLASSIFIED'} {r['task']}: {r.get('cause')}")
        return 0
    if args.resume:
        try:
            old_meta = json.loads((out / "results.json").read_text()).get("meta", {})
        except (OSError, ValueError):
            old_meta = {}
        if old_meta:
            meta["earlier_runs"] = old_meta.get("earlier_runs", []) + [
                {k: old_meta.get(k) for k in ("started_at", "finished_at", "command", "sequester_version", "stopped")}]
    todo = [t for t in tasks if t.name not in records]
    total = len({t.name for t in tasks} | set(records))
    meta["resumed_with"] = len(records) if args.resume else 0
    print(f"tb2_sweep: {total} task(s), {len(records)} already done, {len(todo)} to run; "
          f"results in {out}/results.md", flush=True)
    lock = threading.Lock()
    write_reports(out, meta, list(records.values()), total)

    def one(task: Path) -> None:
        if _stopping.is_set():
            return
        with lock:
            low = low_disk(s)
            if low and not _stopping.is_set():
                _stopping.set()
                meta["stopped"] = f"disk low: {low}"
                print(f"[{now()}] STOPPING (no new task starts): disk low: {low}", flush=True)
        if _stopping.is_set():
            return
        print(f"[{now()}] start {task.name}", flush=True)
        try:
            rec = do_task(task, s)
        except Stopped:
            return
        except Exception as exc:  # noqa: BLE001 - a harness bug must not end the sweep
            rec = {"task": task.name, "bases": task_bases(task), "complete": True, "seconds": 0,
                   "build": {"status": "harness error"}, "oracle": {"status": "not run"}, "nop": {"status": "not run"},
                   "cause": f"harness error: {type(exc).__name__}: {exc}", "classified": False,
                   "excerpt": repr(exc)}
        with lock:
            records[task.name] = rec
            counts = write_reports(out, meta, list(records.values()), total)
        flag = " SILENT ZERO" if rec.get("silent_zero") else ""
        flag += " INFRA ZERO" if rec.get("infra_zero") else ""
        print(f"[{now()}] done  {task.name}: build {rec['build']['status']}, oracle {rec['oracle'].get('status')}, "
              f"nop {rec['nop'].get('status')}, {rec.get('seconds', 0):.0f} s{flag}"
              + (f" -- {rec['cause']}" if rec.get("cause") else "") + f"   [{summary_line(counts)}]", flush=True)
        if not rec.get("classified", True) and rec.get("excerpt"):
            print(f"  UNCLASSIFIED {task.name}; excerpt:\n" + "\n".join("    " + l for l in rec["excerpt"].splitlines()[-30:]),
                  flush=True)

    def stop(signum, frame):  # Ctrl-C / SIGTERM: take the running commands down too
        _stopping.set()
        with _live_lock:
            for pgid in list(_live):
                try:
                    os.killpg(pgid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        raise SystemExit(130)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        list(pool.map(one, todo))
    meta["finished_at"] = now()
    if not args.keep_images and not _stopping.is_set():
        # layers that only failed builds' cache steps still hold
        subprocess.run([s.sequester, "image", "prune", "--config", str(s.config)], env=env,
                       capture_output=True, timeout=3600)
    counts = write_reports(out, meta, list(records.values()), total)
    print("\nSUMMARY: " + summary_line(counts), flush=True)
    unc = [r for r in records.values() if not r.get("classified", True)]
    if unc:
        print(f"unclassified ({len(unc)}): " + ", ".join(sorted(r["task"] for r in unc)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
