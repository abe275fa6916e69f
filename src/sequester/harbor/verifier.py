"""Harbor's verifier replaced by sequester's: ``harbor run ... --verifier sequester.harbor:SequesterVerifier``.

Harbor's own verifier copies the task's tests into the agent's container and runs them
there, where anything the agent left can read, rewrite or forge them. This one asks the
episode (:class:`~sequester.harbor.environment.SequesterEnvironment`) for sequester's
verdict instead: the pristine tests, staged where only the verifier sees them, run by the
trusted runner in a namespace of the verifier's own, the reward read with bounds, an
agent-caused failure the agent's 0 (with its reason) and a failure of the task's own
set-up an error (:class:`~sequester.environments.verdict.VerifierCouldNotRun`), never a 0.

What the tests printed and left in ``/logs/verifier`` is kept in the trial's
``verifier/`` folder as Harbor keeps it; ``verifier/sequester.json`` adds what Harbor's
result has no field for: the reason of a 0, the notes, the tampering found, the calibration
state. In Harbor's ``separate`` mode the environment it hands over is a fresh episode with
the task's artifacts copied in, and the tests run there the same way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from harbor.models.verifier.result import VerifierResult
from harbor.verifier.base import BaseVerifier

from sequester.environments.verdict import VerifierError

__all__ = ["SequesterVerifier"]


class SequesterVerifier(BaseVerifier):
    """sequester's verdict as Harbor's ``VerifierResult`` (see the module)."""

    async def verify(self) -> VerifierResult:
        from sequester.harbor.environment import SequesterEnvironment

        env = self.environment
        if not isinstance(env, SequesterEnvironment):
            raise TypeError(
                f"SequesterVerifier scores episodes of sequester.harbor:SequesterEnvironment, "
                f"not a {type(env).__name__}: run with -e sequester.harbor:SequesterEnvironment"
            )
        if self.override_env:
            raise ValueError(
                "SequesterVerifier runs the task's pristine tests with the task's own [verifier] env; "
                f"extra verifier variables ({', '.join(sorted(self.override_env))}) are not passed"
            )
        out = Path(self.trial_paths.verifier_dir)
        out.mkdir(parents=True, exist_ok=True)
        try:
            found = await env.evaluate()
        except VerifierError as exc:
            _keep(out, exc.output, exc.files)
            _record(out, {"error": type(exc).__name__, "message": str(exc), "tampering": list(exc.tampering)}, env)
            raise
        _keep(out, found.output, found.files)
        _record(
            out,
            {
                "rewards": dict(found.rewards),
                "zero_reason": found.zero_reason,
                "notes": list(found.notes),
                "tampering": list(found.tampering),
                "frozen": found.frozen,
            },
            env,
        )
        return VerifierResult(rewards=dict(found.rewards))


def _keep(out: Path, output: str, files: dict[str, bytes]) -> None:
    from sequester.jobs.paths import TEST_STDOUT, check_name

    (out / TEST_STDOUT).write_text(output, encoding="utf-8")
    for name, data in files.items():
        (out / check_name(name, "verifier file")).write_bytes(data)


def _record(out: Path, data: dict[str, Any], env: Any) -> None:
    data["calibration"] = env.calibration
    (out / "sequester.json").write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
