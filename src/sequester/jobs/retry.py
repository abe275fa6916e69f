"""Which errored trials a job runs again: Harbor's retry policy (``harbor run -r N
--retry-include T --retry-exclude T``), as plain data. Pure.

A trial that ended with an exception is run again, up to ``max_retries`` times, when its
exception is retryable: not in ``exclude`` (by default Harbor 0.26's own list of errors a
new attempt does not change: an agent's time running out, a refusal, a bad request, a
verifier's timeout, ...), in ``include`` when that is given, and never one that sequester
says a retry does not change (a task not calibrated here, a malformed task, a bad
setting: ``should_retry`` false in :mod:`.harbor`'s policies). Names match as sequester
writes them and as Harbor reads them (``VerifierCouldNotRun`` is ``AddTestsDirError``).
The failed attempt's folder is removed and the trial runs again under the same name, as
Harbor does; attempts run in rounds, after a pause growing from ``min_wait`` seconds.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from sequester.errors import PolicyError
from sequester.jobs.harbor import harbor_exception

__all__ = ["RetryPolicy", "HARBOR_DEFAULT_EXCLUSIONS"]

# harbor.models.trial.error_policy.default_retry_exclusions() of Harbor 0.26 (tests/harbor/
# compares it with the installed Harbor's).
HARBOR_DEFAULT_EXCLUSIONS = frozenset(
    {
        "APIResponseValidationError",
        "AgentAuthenticationError",
        "AgentSafetyRefusalError",
        "AgentTimeoutError",
        "ApiProviderResourceNotFoundError",
        "AuthenticationError",
        "BadRequestError",
        "BudgetExceededError",
        "CancelledError",
        "ContentPolicyViolationError",
        "ContextLengthExceededError",
        "ContextWindowExceededError",
        "DspyImportError",
        "MissingExtraError",
        "ModelNotFoundError",
        "NonZeroAgentExitCodeError",
        "NotFoundError",
        "OutputLengthExceededError",
        "OutputTokenExceededError",
        "PermissionDeniedError",
        "RegradeError",
        "RewardFileEmptyError",
        "RewardFileNotFoundError",
        "ServiceOperationsUnsupportedError",
        "UnprocessableEntityError",
        "UnsupportedModelParametersError",
        "UnsupportedParamsError",
        "VercelScopeError",
        "VerifierOutputParseError",
        "VerifierTimeoutError",
    }
)


@dataclass(frozen=True)
class RetryPolicy:
    max_retries: int = 0
    include: frozenset[str] | None = None  # None: every type not excluded
    exclude: frozenset[str] = field(default=HARBOR_DEFAULT_EXCLUSIONS)
    min_wait: float = 1.0
    max_wait: float = 60.0

    @classmethod
    def of(cls, max_retries: int, include: Iterable[str] = (), exclude: Iterable[str] | None = None) -> RetryPolicy:
        """From the flags (``exclude`` None: Harbor's default list)."""
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise PolicyError(f"--max-retries {max_retries!r} is not a whole number >= 0")
        inc = frozenset(include) or None
        exc = HARBOR_DEFAULT_EXCLUSIONS if exclude is None else frozenset(exclude)
        return cls(max_retries, inc, exc)

    def retryable(self, exception_type: str, message: str = "") -> bool:
        """Whether a trial that ended with this exception runs again (attempts left aside)."""
        harbor_name, override = harbor_exception(exception_type, message)
        if override is not None and not override.get("should_retry", True):
            return False
        names = {exception_type, harbor_name}
        if names & self.exclude:
            return False
        return self.include is None or bool(names & self.include)

    def wait(self, attempt: int) -> float:
        """Seconds before retry round ``attempt`` (1, 2, ...): doubling from ``min_wait``."""
        return min(self.max_wait, self.min_wait * 2 ** (attempt - 1))

    def to_dict(self) -> dict[str, object]:
        """Harbor's ``RetryConfig`` fields, for the job's ``config.json``."""
        return {
            "max_retries": self.max_retries,
            "include_exceptions": sorted(self.include) if self.include is not None else None,
            "exclude_exceptions": sorted(self.exclude),
            "wait_multiplier": 1.0,
            "min_wait_sec": self.min_wait,
            "max_wait_sec": self.max_wait,
        }
