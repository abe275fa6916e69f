"""Jobs: an agent run on many tasks, one trial (episode) each, with the results kept on disk.

:func:`run_job` runs a list of tasks, several at a time, into ``<jobs_dir>/<job_name>/``;
:func:`run_trial` runs one. Each trial folder holds the trial's ``result.json`` (a
:class:`TrialResult`, in Harbor's layout), the agent's commands and the verifier's output;
:mod:`.paths` names every file. ``sequester run`` is the command-line face of
:func:`run_job`.
"""

from sequester.jobs.cancel import Cancellation, TrialCancelled
from sequester.jobs.job import default_job_name, run_job
from sequester.jobs.paths import JobPaths, TrialPaths
from sequester.jobs.results import ExceptionInfo, JobResult, TimingInfo, TrialResult, VerifierOutcome
from sequester.jobs.trial import new_trial_name, run_trial

__all__ = [
    "run_job",
    "run_trial",
    "default_job_name",
    "new_trial_name",
    "JobPaths",
    "TrialPaths",
    "JobResult",
    "TrialResult",
    "TimingInfo",
    "ExceptionInfo",
    "VerifierOutcome",
    "Cancellation",
    "TrialCancelled",
]
