"""The verdict, whatever ran the tests: its errors, the strict reading of ``reward.json`` /
``reward.txt``, and who is to blame when there is no verdict.

Every backend runs the task's pristine tests its own way (the local backend through the
namespace helper, :mod:`sequester.environments.local.evaluation`; the docker backend in a
container, :mod:`sequester.environments.docker.verify`) and hands :func:`judge` an
:class:`Evaluation`:

============================================  ==========================================
what happened                                  result
============================================  ==========================================
the tests wrote a valid reward                 that reward
the verifier ran over ``timeout_sec``          0 for the agent (its programs were under test)
no reward file, or an invalid one              0 for the agent (its programs can kill or
                                               overwrite the test script's; a task whose
                                               own script never writes one shows up as 0
                                               for the oracle too)
``uvx`` started but pytest never did           :class:`VerifierCouldNotRun`: the runner's
                                               bootstrap failed (a Python or pinned package
                                               the runner lacks); the agent cannot cause it
the runner could not stage or start            :class:`VerifierCouldNotRun` (the harness)
============================================  ==========================================

Every :class:`VerifierCouldNotRun` is checked once more by running the same tests in the
task's pristine environment (:meth:`sequester.environments.local.episode.Episode.evaluate`):
if the runner works there, the failure was the agent's doing (a view that breaks the
verifier's set-up, a forged report of the runner's) and is its 0. An error is the
harness's or the task's, never the agent's doing: trainers drop errored trials, so
nothing an agent does may turn its failing trial into one.
"""

from __future__ import annotations

import base64
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from sequester.errors import SequesterError
from sequester.tasks import Task
from sequester.verifier.invocation import tests_mention

__all__ = [
    "BootstrapFailed",
    "DEFAULT_REWARD_RANGE",
    "Evaluation",
    "FROZEN_TIMEOUT_NOTE",
    "FROZEN_ZERO_NOTE",
    "RewardFileMissing",
    "RewardInvalid",
    "VerifierCouldNotRun",
    "VerifierError",
    "VerifierResult",
    "VerifierTimeout",
    "frozen_evaluation_note",
    "judge",
    "parse_rewards",
    "primary_reward",
    "runner_works",
    "zero_result",
]


class VerifierError(SequesterError):
    """The verifier produced no verdict. What it did produce is kept for the host: what it
    printed (``output``), the files it left (``files``), and the tampering found before it
    ran (``tampering``)."""

    def __init__(
        self,
        message: str,
        *,
        output: str = "",
        exit_code: int | None = None,
        duration: float = 0.0,
        files: dict[str, bytes] | None = None,
        tampering: tuple[str, ...] = (),
    ):
        super().__init__(message)
        self.output, self.exit_code, self.duration = output, exit_code, duration
        self.files, self.tampering = dict(files or {}), tuple(tampering)


class VerifierCouldNotRun(VerifierError):
    """The tests did not run: staging failed, the script could not start, or its bootstrap
    (a download, a Python or package it needs) failed."""


class VerifierTimeout(VerifierError):
    """The verifier ran over ``[verifier] timeout_sec`` and was killed."""


class RewardFileMissing(VerifierError):
    """The script finished but wrote neither reward.json nor reward.txt."""


class RewardInvalid(VerifierError):
    """A reward file is unparseable, not finite, or outside [0, 1]."""


@dataclass(frozen=True)
class VerifierResult:
    rewards: dict[str, float]
    output: str
    exit_code: int | None
    duration: float
    files: dict[str, bytes] = field(default_factory=dict)
    tampering: tuple[str, ...] = ()
    frozen: str | None = None  # how the agent was frozen during the run, if it was
    # Why the reward is 0 without the tests saying so: the agent caused the verifier to
    # end without a valid verdict (a timeout, no reward file, an invalid one). Trainers
    # drop errored trials, so such an end is the agent's 0, never an error.
    zero_reason: str | None = None
    notes: tuple[str, ...] = ()

    @property
    def reward(self) -> float:
        return primary_reward(self.rewards)


DEFAULT_REWARD_RANGE = (0.0, 1.0)


def _number(value: Any, where: str, reward_range: tuple[float, float] | None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RewardInvalid(f"{where}: {str(value)[:50]!r} is not a number")
    try:
        number = float(value)
    except OverflowError:  # an integer of hundreds of digits
        raise RewardInvalid(f"{where}: {str(value)[:50]}... is not a finite number") from None
    if not math.isfinite(number):
        raise RewardInvalid(f"{where}: {value!r} is not finite")
    if reward_range is not None and not reward_range[0] <= number <= reward_range[1]:
        raise RewardInvalid(f"{where}: {value!r} is outside [{reward_range[0]:g}, {reward_range[1]:g}]")
    return number


def parse_rewards(
    files: dict[str, bytes], reward_range: tuple[float, float] | None = DEFAULT_REWARD_RANGE
) -> dict[str, float]:
    """The verdict: ``reward.json`` (a flat object of numbers) if present, else
    ``reward.txt`` (one number). Strict: anything else is :class:`RewardInvalid`. Every
    number must be finite, and within ``reward_range`` unless that is ``None`` (Harbor
    accepts any finite number)."""
    if "reward.json" in files:
        data = _flat_json(files["reward.json"])
        if not isinstance(data, dict) or not data:
            raise RewardInvalid("reward.json is not a non-empty flat object")
        rewards = {str(k): _number(v, f"reward.json[{k!r}]", reward_range) for k, v in data.items()}
        primary_reward(rewards)
        return rewards
    if "reward.txt" in files:
        text = files["reward.txt"].decode("utf-8", "replace").strip()
        try:
            value = float(text)
        except ValueError:
            raise RewardInvalid(f"reward.txt: {text[:50]!r} is not a number") from None
        return {"reward": _number(value, "reward.txt", reward_range)}
    raise RewardFileMissing("the verifier wrote neither /logs/verifier/reward.json nor reward.txt")


_JSON_SPECIAL = re.compile(rb'["{\[\\]')


def _nests(raw: bytes) -> bool:
    """Whether JSON text ``raw`` opens more than one object or array outside its strings.
    One pass over its quote, bracket and backslash characters (found by the regex engine,
    which never backtracks on a one-character class): linear in the file's size."""
    in_string, escaped, opened = False, -1, 0
    for found in _JSON_SPECIAL.finditer(raw):
        at = found.start()
        if at == escaped:
            continue
        char = raw[at]
        if in_string:
            if char == 0x5C:  # a backslash escapes the next character
                escaped = at + 1
            elif char == 0x22:
                in_string = False
        elif char == 0x22:
            in_string = True
        elif char in (0x7B, 0x5B):
            opened += 1
            if opened > 1:
                return True
    return False


def _flat_json(raw: bytes) -> Any:
    """``raw`` as JSON, refused (:class:`RewardInvalid`) before it is parsed when it nests
    anything (a reward file is a flat object: one ``{``, no ``[``, outside its strings), so
    no file a program under test writes reaches the parser's recursion; and whatever else
    goes wrong while reading it is :class:`RewardInvalid` too (the agent's 0)."""
    if _nests(raw):
        raise RewardInvalid("reward.json is not a flat object (it nests objects or arrays)")
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError) as exc:
        raise RewardInvalid(f"reward.json is not valid JSON: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - bounded above; whatever is left is the file's fault
        raise RewardInvalid(f"reward.json could not be read: {type(exc).__name__}") from None


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a valid reward")


def primary_reward(rewards: dict[str, float]) -> float:
    if "reward" in rewards:
        return rewards["reward"]
    if len(rewards) == 1:
        return next(iter(rewards.values()))
    raise RewardInvalid(f"reward.json has several values ({', '.join(sorted(rewards))}) and no 'reward'")


class BootstrapFailed(VerifierCouldNotRun):
    """uvx started, pytest never did. Whether that is the runner's failing or the agent's
    doing is decided by running the same tests in the task's pristine environment (see
    :meth:`sequester.environments.local.episode.Episode.evaluate`): the runner's own report could
    have been forged there by a program of the agent's, in the pristine one it cannot."""


@dataclass(frozen=True)
class Evaluation:
    """What one run of the verifier produced, as the host read it."""

    report: dict[str, Any] | None  # None: it ran over its time and was killed
    output: bytes  # head and tail, at most the configured cap
    runner_said: tuple[str, ...]  # how far the runner got: "uvx", "pytest"
    duration: float


def judge(
    task: Task,
    ev: Evaluation,
    *,
    tampering: tuple[str, ...],
    frozen: str | None,
    notes: tuple[str, ...] = (),
    reward_range: tuple[float, float] | None = DEFAULT_REWARD_RANGE,
) -> VerifierResult:
    """The verdict of one evaluation (see the table above), or :class:`VerifierCouldNotRun`."""
    text = ev.output.decode(errors="replace")
    seen: dict[str, Any] = {"output": text, "duration": ev.duration, "tampering": tampering}
    notes = (*notes, *(ev.report or {}).get("notes", ()))

    def zero(reason: str, exit_code: int | None = None, files: dict[str, bytes] | None = None) -> VerifierResult:
        return zero_result(
            ev, reason, tampering=tampering, frozen=frozen, notes=notes, exit_code=exit_code, files=files
        )

    if ev.report is None:
        return zero(f"the verifier ran over its {task.config.verifier.timeout_sec:g} s and was killed")
    if "error" in ev.report:
        raise VerifierCouldNotRun(f"the verifier could not run: {ev.report['error']}", **seen)
    exit_code = ev.report.get("exit_code")
    files = {name: base64.b64decode(data) for name, data in ev.report.get("files", {}).items()}
    seen.update(exit_code=exit_code, files=files)
    uvx_only = "uvx" in ev.runner_said and "pytest" not in ev.runner_said

    def bootstrap() -> BootstrapFailed:
        return BootstrapFailed(
            "the verifier could not run: uvx never started pytest (the runner lacks the Python or a package the "
            f"test script asks for; the script exited {exit_code})",
            **seen,
        )

    lacks = runner_lacks(ev)
    setup = setup_failures(ev)
    imported = [m.partition(":")[2] for m in ev.runner_said if m.startswith("agent-import:")]
    skipped = [m.partition(":")[2] for m in ev.runner_said if m.startswith("pth-skipped:")]
    if skipped:
        notes = (
            *notes,
            "the verifier's Python did not run the import lines of the image's .pth files (start-up code the "
            f"agent could write; a package that needs one to be found is not found): {', '.join(skipped[:8])}",
        )
    unsealed = [m.partition(":")[2] for m in ev.runner_said if m.startswith("runner-unsealed:")]
    if unsealed:
        notes = (
            *notes,
            "the test script installed with "
            f"{', '.join(f'`{u}`' for u in dict.fromkeys(unsealed))} what could not be read from its text ahead "
            "(a word the shell expands, uv itself): that environment was made as the script ran, in a folder the "
            "programs it ran before could write (every one installed ahead is read-only to them)",
        )
    if imported:
        shown = ", ".join(imported[:8]) + (f" and {len(imported) - 8} more" if len(imported) > 8 else "")
        notes = (
            *notes,
            f"the tests imported modules from the agent's folders (they run with the tests' rights): {shown}",
        )
    preloaded = list(dict.fromkeys(m.partition(":")[2] for m in ev.runner_said if m.startswith("agent-preload:")))
    if preloaded:
        notes = (
            *notes,
            f"the verifier's Python started with {', '.join(preloaded[:4])} (the test script's own export): the "
            "loader put that library into it before anything of the runner's ran, as under Docker; it runs with "
            "the tests' rights and can change their outcome",
        )
    native = list(dict.fromkeys(m.partition(":")[2] for m in ev.runner_said if m.startswith("agent-native:")))
    if native:
        shown = ", ".join(native[:8]) + (f" and {len(native) - 8} more" if len(native) > 8 else "")
        notes = (
            *notes,
            "the verifier's Python ran native code from outside the runner's folders (the agent's system, loaded "
            f"by what the tests imported or preloaded; it runs with the tests' rights): {shown}",
        )

    def lacking() -> BootstrapFailed:
        said = []
        if lacks:
            said.append(
                f"the tests import {', '.join(lacks)}, which the verifier's Python lacks (a module of that name "
                "in the agent's folders is never imported in its place)"
            )
        if setup:
            said.append(f"the test script's set-up failed: {'; '.join(setup)}")
        return BootstrapFailed(f"the verifier could not run: {'; '.join(said)} (the script exited {exit_code})", **seen)

    if "reward.json" in files and not tests_mention(task, b"reward.json"):
        # Attack: a program the tests ran (the agent's) writing reward.json, which wins over
        # the reward.txt the script writes. A task whose tests never name reward.json gets
        # its verdict from reward.txt only.
        files = {k: val for k, val in files.items() if k != "reward.json"}
        notes = (*notes, "reward.json ignored: none of the task's tests write it (a program they ran did)")
    # The runner falling short (uvx that never got to pytest, a module or a set-up step it
    # lacked) without a pass is not a verdict: the pristine run decides whose it is. A pass
    # stands (what fell short was not needed: a uvx of something else, an optional import).
    try:
        rewards = parse_rewards(files, reward_range)
    except VerifierError as exc:
        if lacks or setup:
            raise lacking() from None
        if uvx_only:
            raise bootstrap() from None
        return zero(f"{exc} (the script exited {exit_code})", exit_code, files)
    if primary_reward(rewards) <= 0 and (lacks or setup):
        raise lacking()
    if primary_reward(rewards) <= 0 and uvx_only:
        raise bootstrap()
    return VerifierResult(rewards, text, exit_code, ev.duration, files, tampering, frozen, notes=notes)


_DEV_FD = re.compile(r"/tests/test\.sh: line \d+: (/dev/(?:stdin|stdout|stderr|fd/\d+)): No such file or directory")


def setup_failures(ev: Evaluation) -> list[str]:
    """What of the test script's own set-up failed, as the runner saw it: an install its
    tools refused or could not make (``setup-failed:``), and a command the script asked to
    install that was then not found (``installs:`` then ``not-found:`` of the same name)."""
    failed, installs, missing = [], set(), []
    for mark in ev.runner_said:
        kind, _, what = mark.partition(":")
        if kind == "setup-failed":
            step, _, item = what.partition(":")
            if step == "uv-python":
                failed.append(f"the script asks uv for Python {item}, which the runner does not have")
                continue
            if step == "uvx-ahead":
                failed.append("a uvx tool of the script's could not be installed before it ran")
                continue
            if (step, item) == ("pip-install", "not-read-ahead"):
                failed.append(
                    "a `pip install` was not read from the script ahead (a word the shell expands): the runner "
                    "installs only the pip lines it reads from the script's text, before it runs"
                )
                continue
            failed.append(f"{step.replace('apt-get-', 'apt-get ')} {item}".strip() + " failed")
        elif kind == "installs":
            installs.add(what)
        elif kind == "not-found":
            missing.append(what)
    failed += [f"{name} (which it installs) was then not found" for name in dict.fromkeys(missing) if name in installs]
    if any(f.startswith("the script asks uv for Python") for f in failed):  # (the reason its tool was not installed)
        failed = [f for f in failed if f != "a uvx tool of the script's could not be installed before it ran"]
    # The test shell's own /dev/stdout, /dev/stderr and /dev/fd (process substitution) lead
    # into a /proc of the tests' namespace, which the shell is not in (see the namespace
    # helper's _nest_the_tests): none of TB2's scripts uses them; one that does fails here,
    # which is the runner's shortfall, never the agent's 0.
    shown = ev.output.decode(errors="replace")
    failed += [f"the test shell could not open {m[1]} (the runner's shell has none)" for m in _DEV_FD.finditer(shown)]
    return failed[:8]


def runner_lacks(ev: Evaluation) -> list[str]:
    """The modules the tests imported that the runner must provide and lacks (the
    standard library's, the test tools'), and the C extensions that could not load a
    system library the runner does not carry."""
    return [m.partition(":")[2] for m in ev.runner_said if m.startswith("runner-lacks:")] + [
        f"a system library of {m.partition(':')[2]}'s C extension"
        for m in ev.runner_said
        if m.startswith("runner-lacks-library:")
    ]


def runner_works(ev: Evaluation) -> bool:
    """Whether the runner got as far as the tests in ``ev``: it was set up, and if uvx
    started, pytest did too (a timeout counts: the tests were running)."""
    if ev.report is None:
        return True
    if "error" in ev.report:
        return False
    if runner_lacks(ev) or setup_failures(ev):
        return False
    return not ("uvx" in ev.runner_said and "pytest" not in ev.runner_said)


def zero_result(
    ev: Evaluation,
    reason: str,
    *,
    tampering: tuple[str, ...],
    frozen: str | None,
    notes: tuple[str, ...],
    exit_code: int | None = None,
    files: dict[str, bytes] | None = None,
) -> VerifierResult:
    """The agent's 0 for an evaluation without a valid verdict, with the reason."""
    return VerifierResult(
        {"reward": 0.0},
        ev.output.decode(errors="replace"),
        exit_code,
        ev.duration,
        dict(files or {}),
        tampering,
        frozen,
        zero_reason=reason,
        notes=notes,
    )


FROZEN_TIMEOUT_NOTE = (
    "the agent's processes were frozen while the tests ran (freeze_agent / --freeze-agent), and the tests ran "
    "out of time: a task scored on a live service the agent started (a server the tests connect to) needs "
    "freeze_agent = false"
)
FROZEN_ZERO_NOTE = (
    "the agent's processes were frozen while the tests ran (freeze_agent / --freeze-agent): if this task is "
    "scored on a live service the agent started, the service could not answer; such a task needs "
    "freeze_agent = false"
)


def frozen_evaluation_note(frozen: str | None, *, timed_out: bool, reward: float | None = None) -> str | None:
    """The note a trial needs when a frozen evaluation ends badly, else None.

    ``frozen``: how the agent was frozen (``VerifierResult.frozen``; None: it was not);
    ``timed_out``: the verifier ran over its ``timeout_sec``; ``reward``: the verdict's
    reward. A frozen (or, as a fallback, killed) agent cannot answer the tests: a service
    it started hangs them until the timeout, or refuses them, and the trial shows only a
    timeout or a 0 without saying why.
    """
    if not frozen:
        return None
    if timed_out:
        return FROZEN_TIMEOUT_NOTE
    if reward is not None and reward == 0:
        return FROZEN_ZERO_NOTE
    return None
