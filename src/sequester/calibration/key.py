"""The key a calibration is kept under: everything that can change how a task scores.
Pure.

The task's checksum (every file of its folder), the system its episodes run on (the
image's digest, or the host), sequester's version, the verifier's settings (mode, freeze,
reward range, output cap), the run's network policy and the operator's hosts, the
process limit and the backend. A change of any of them is a new key: a record is never
reused for a task, image, version or setting it was not made with.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

__all__ = ["CalibrationKey", "calibration_key", "settings_fields"]


@dataclass(frozen=True)
class CalibrationKey:
    digest: str  # sha256 of the fields, as JSON with sorted keys
    fields: dict[str, Any]


def calibration_key(
    *, task_checksum: str, system: dict[str, Any] | None, settings: dict[str, Any], version: str
) -> CalibrationKey:
    """``system``: the episode's system ({"mode": "image", "digest": ...} or {"mode": "host"};
    None: the backend chooses its own, e.g. a Docker engine); ``settings``: the run's
    :class:`~sequester.environments.settings.EpisodeSettings` as plain data."""
    fields = {
        "task_checksum": task_checksum,
        "system": {k: (system or {}).get(k) for k in ("mode", "digest")} if system else None,
        "sequester_version": version,
        "verifier": {k: settings.get(k) for k in ("verifier_env", "freeze_agent", "reward_range", "output_bytes")},
        "network": {"run": settings.get("network"), "allowed_hosts": list(settings.get("allowed_hosts") or ())},
        "limits": {"max_processes": settings.get("max_processes")},
        "backend": settings.get("backend"),
    }
    text = json.dumps(fields, sort_keys=True, default=str)
    return CalibrationKey(hashlib.sha256(text.encode()).hexdigest(), fields)


SETTINGS_FIELDS = (
    "verifier_env",
    "freeze_agent",
    "reward_range",
    "output_bytes",
    "network",
    "allowed_hosts",
    "max_processes",
    "backend",
    "agent_timeout_multiplier",
    "verifier_timeout_multiplier",
)


def settings_fields(settings: object) -> dict[str, Any]:
    """What of the run's settings (an ``EpisodeSettings``) the key takes, as plain data."""
    out = {}
    for name in SETTINGS_FIELDS:
        value = getattr(settings, name, None)
        out[name] = list(value) if isinstance(value, tuple) else value
    return out
