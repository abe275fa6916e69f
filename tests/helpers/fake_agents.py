"""Agents for the environment-interface tests (``--agent fake_agents:Name``)."""

from __future__ import annotations


class WritesDone:
    name = "writes-done"

    def run(self, instruction, episode):
        episode.write_file("/app/done", "yes")


class Overreaches:
    """Tries every call an agent must not make; records what each did. (An agent class is
    the operator's code in the operator's process: the proxy keeps it to its API, it is
    not a boundary against hostile Python; the model's commands are what the sandbox holds.)"""

    name = "overreaches"
    seen: dict[str, str] = {}

    def run(self, instruction, episode):
        for name, call in (("start", lambda: episode.start(episode.task)), ("reset", lambda: episode.reset()),
                           ("evaluate", lambda: episode.evaluate()), ("close", lambda: episode.close()),
                           ("abort", lambda: episode.abort()),
                           ("init_pid", lambda: episode.init_pid), ("calls", lambda: episode.calls)):
            try:
                call()
                Overreaches.seen[name] = "allowed"
            except Exception as exc:  # noqa: BLE001 - what the proxy said is the finding
                Overreaches.seen[name] = type(exc).__name__
        episode.write_file("/app/done", "yes")
