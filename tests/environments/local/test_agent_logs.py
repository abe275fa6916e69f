"""``/logs/agent`` and ``/logs/artifacts`` are the agent's to write, as Harbor has them; the
rest of ``/logs`` and ``/tests`` stay read-only and empty; what the agent left there is read
out as a tar (``read_dir``) and kept with the trial."""

from __future__ import annotations

import io
import tarfile

import pytest
from paths import EXAMPLES

from sequester.errors import EpisodeError

TASK = EXAMPLES / "c-word-count"


def names(data: bytes) -> list[str]:
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return sorted(tar.getnames())


def test_the_agents_log_folders_are_writable_by_any_user_and_nothing_else_of_logs(episode):
    episode.start(TASK)
    r = episode.exec("echo hi > /logs/agent/a.txt && mkdir -p /logs/artifacts/out && echo 2 > /logs/artifacts/out/b && "
                     "stat -c %a /logs/agent /logs/artifacts")
    assert r.exit_code == 0 and r.stdout.split() == ["777", "777"], r.output
    for attempt in ("mkdir /logs/verifier", "touch /logs/reward.txt", "rm -rf /logs/agent", "mv /logs/agent /logs/x",
                    "ln -sfn /tmp /logs/agent && test -L /logs/agent", "touch /tests/test.sh"):
        r = episode.exec(attempt)
        assert r.exit_code != 0, attempt
    r = episode.exec("test -d /logs/agent && ! test -L /logs/agent && findmnt -n -o TARGET /logs/agent")
    assert r.stdout.strip() == "/logs/agent", r.output  # still the folder of the episode's state (rm emptied it)
    episode.exec("rm -f /logs/agent/tmp; echo hi > /logs/agent/a.txt")  # (the ln -sfn made a link inside)
    assert names(episode.read_dir("/logs/agent")) == ["a.txt"]
    assert names(episode.read_dir("/logs/artifacts")) == ["out", "out/b"]


def test_a_user_of_the_image_writes_there_too(episode):
    episode.start(TASK)
    r = episode.exec("setpriv --reuid=65534 --regid=65534 --clear-groups -- sh -c 'echo x > /logs/agent/n && id -u'")
    assert r.exit_code == 0 and r.stdout.strip() == "65534", r.output


def test_read_dir_keeps_links_as_links_and_names_what_is_missing(episode):
    episode.start(TASK)
    episode.exec("ln -s /etc/passwd /logs/agent/link && mkdir /app2")
    with tarfile.open(fileobj=io.BytesIO(episode.read_dir("/logs/agent"))) as tar:
        (member,) = tar.getmembers()
        assert member.issym() and member.linkname == "/etc/passwd"
    with pytest.raises(EpisodeError, match="no such folder"):
        episode.read_dir("/logs/none")


def test_each_episode_starts_with_empty_log_folders(episode):
    episode.start(TASK)
    episode.exec("echo 1 > /logs/agent/left")
    episode.reset(TASK)
    assert names(episode.read_dir("/logs/agent")) == []


def test_a_file_swapped_with_a_fifo_while_it_is_read_does_not_hold_the_copy(episode):
    """Red team: the copy checked an entry, then opened it by path; a process of the agent's
    swapping a file and a fifo between the two made the open wait until the copy's timeout.
    Entries are now opened without blocking and checked on what was opened."""
    import time

    episode.start(TASK)
    episode.exec("cd /logs/artifacts && mkfifo p && echo data > f && "
                 "(setsid sh -c 'while :; do mv f t; mv p f; mv f p; mv t f; done' >/dev/null 2>&1 &)")
    for _ in range(20):
        started = time.monotonic()
        names(episode.read_dir("/logs/artifacts"))
        assert time.monotonic() - started < 10
