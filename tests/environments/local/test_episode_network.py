"""An episode's network end to end, over the real network: the only destinations these
tests reach off this machine are PyPI (pypi.org) and Debian's archive (deb.debian.org).
Public, allowlist and none, as root and as an ordinary user; the policy in the trial's
record. What is refused is tested without leaving the machine in
tests/net/test_episode_refusals.py.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
from nobody_site import run_as_user
from tasks import make_task

from sequester.environments.local.episode import Episode
from sequester.environments.settings import EpisodeSettings

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not shutil.which("slirp4netns") or not os.path.exists("/dev/net/tun"),
                       reason="needs slirp4netns and /dev/net/tun"),
]

GET = ("python3 -c \"import sys,urllib.request as u;"
       "r=u.urlopen(u.Request(sys.argv[1], method='HEAD'),timeout=30);print(r.status)\" {} 2>&1 | tail -1")
PYPI = "https://pypi.org/simple/six/"
DEBIAN = "https://deb.debian.org/debian/dists/bookworm/Release"


def _task(root, toml: str):
    return make_task(root, "net", "echo 1 > /logs/verifier/reward.txt\n", toml="[environment]\n" + toml)


def _reach(ep: Episode) -> dict:
    return {
        "pypi": ep.exec(GET.format(PYPI), timeout=90).stdout.strip(),
        "debian": ep.exec(GET.format(DEBIAN), timeout=90).stdout.strip(),
        "eth0": ep.exec("cat /sys/class/net/eth0/address 2>/dev/null || echo none").stdout.strip() != "none",
        "lookup": ep.exec("getent hosts deb.debian.org >/dev/null && echo found || echo no").stdout.strip(),
    }


def test_public_reaches_pypi_and_debian(tmp_path):
    with Episode() as ep:
        ep.reset(_task(tmp_path, "allow_internet = true\n"), image=None)
        seen = _reach(ep)
        record = ep.network
    assert seen["pypi"] == "200" and seen["debian"] == "200", seen
    names = {n for d in record["traffic"]["destinations"] for n in d["names"]}
    assert {"pypi.org", "deb.debian.org"} <= names and record["traffic"]["bytes_in"] > 0, record


def test_allowlist_reaches_only_its_hosts(tmp_path):
    toml = 'network_mode = "allowlist"\nallowed_hosts = ["pypi.org"]\n'
    with Episode() as ep:
        ep.reset(_task(tmp_path, toml), image=None)
        seen = _reach(ep)
        # the archive's address, looked up on the host, is refused too (not only its name)
        import socket

        address = socket.gethostbyname("deb.debian.org")
        direct = ep.exec(f"python3 -c \"import socket;socket.create_connection(('{address}',443),timeout=5)\" "
                         "2>&1 | tail -1").stdout
    assert seen["pypi"] == "200" and seen["lookup"] == "no", seen
    assert "200" not in seen["debian"], seen
    if address != socket.gethostbyname("pypi.org"):  # (an intercepting proxy may answer both names)
        assert "Error" in direct, direct
    assert ep.network["mode"] == "allowlist"


def test_the_operator_narrows_a_public_task_to_an_allowlist(tmp_path):
    settings = EpisodeSettings(network="allowlist", allowed_hosts=("pypi.org",))
    with Episode(settings) as ep:
        ep.reset(_task(tmp_path, "allow_internet = true\n"), image=None)
        seen = _reach(ep)
    assert seen["pypi"] == "200" and seen["lookup"] == "no", seen
    assert ep.network["mode"] == "allowlist" and ep.network["decided_by"] == "operator (--network allowlist)"
    assert ep.network["agent_hosts"] == ["pypi.org"]


@pytest.mark.parametrize("how", ["task", "operator"])
def test_none_has_no_network_and_pays_nothing(tmp_path, how):
    toml = "allow_internet = false\n" if how == "task" else "allow_internet = true\n"
    with Episode(EpisodeSettings(network="none" if how == "operator" else "task")) as ep:
        ep.reset(_task(tmp_path, toml), image=None)
        assert ep._running().network is None  # no router, no stack
        seen = _reach(ep)
        assert ep.exec("cat /etc/resolv.conf | grep -c 10.0.2.3").stdout.strip() == "0"
    assert not seen["eth0"] and seen["lookup"] == "no" and "200" not in seen["pypi"], seen
    assert ep.network["mode"] == "none"


def test_an_ordinary_users_episode_reaches_pypi(user_site):
    entry, _home, _data, site = user_site
    task = site / "public-task"
    if not task.exists():
        shutil.copytree(site / "task", task)
        toml = (task / "task.toml").read_text().replace("allow_internet = false", "allow_internet = true")
        (task / "task.toml").write_text(toml)
        for path in [task, *task.rglob("*")]:
            os.chmod(path, 0o755 if path.is_dir() else 0o644)
    script = site / "network_as_user.py"
    script.write_text(f"""
import json
from sequester.environments.local.episode import Episode
GET = {GET!r}
with Episode() as ep:
    ep.reset({str(task)!r}, image=None)
    out = {{"pypi": ep.exec(GET.format({PYPI!r}), timeout=90).stdout.strip(),
           "flush": ep.exec("nft flush ruleset 2>&1; echo $?").stdout.strip(),
           "uid": ep.exec("id -u").stdout.strip()}}
out["network"] = ep.network
print(json.dumps(out))
""")
    script.chmod(0o644)
    out = run_as_user(user_site, script.name)
    if out["network"].get("unavailable"):  # (the episode's note says so too)
        pytest.skip(f"an ordinary user's episode gets no network on this machine: {out['network']['unavailable']}")
    assert out["pypi"] == "200", out
    assert out["flush"].endswith("1") and "Operation not permitted" in out["flush"], out
    assert out["network"]["traffic"]["bytes_in"] > 0 and out["network"]["mode"] == "public"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a socket in /opt, a folder the view shows)")
def test_the_hosts_path_unix_sockets_are_out_of_reach(tmp_path):
    """A socket of the host's in a folder the view shows (an overlay of it): connecting
    from the agent reaches nothing (the overlay's inode is not the socket's)."""
    import socket
    import threading

    path = f"/opt/seqtest-{os.getpid()}.sock"
    hits = []
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen(4)

    def accept():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            hits.append(1)
            conn.close()

    threading.Thread(target=accept, daemon=True).start()
    try:
        with Episode() as ep:
            ep.reset(_task(tmp_path, "allow_internet = true\n"), image=None)
            said = ep.exec(f"python3 -c \"import socket;s=socket.socket(socket.AF_UNIX);s.connect('{path}');"
                           "print('connected')\" 2>&1 | tail -1").stdout
    finally:
        server.close()
        os.unlink(path)
    assert "connected" not in said.replace("Connection", "") and not hits, said


def test_a_reset_interrupted_while_its_network_links_leaves_nothing_running(tmp_path, monkeypatch):
    """An exception that lands in reset while the link (a thread of its own) is still at
    work (^C, a caller's timeout): the network the thread finishes afterwards is closed by
    the thread, not left with its stack, router and DNS responder running."""
    import signal
    import threading
    import time

    from sequester.net.episode.session import EpisodeNetwork
    from sequester.sandbox.procs import descendants

    real_link = EpisodeNetwork.link

    def slow_link(self, *args, **kwargs):
        time.sleep(0.6)
        return real_link(self, *args, **kwargs)

    monkeypatch.setattr(EpisodeNetwork, "link", slow_link)

    def interrupt(*_):
        raise TimeoutError("the caller's own timeout")

    before = set(descendants(os.getpid()))
    old = signal.signal(signal.SIGALRM, interrupt)
    ep = Episode()
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(TimeoutError):
            ep.reset(_task(tmp_path, "allow_internet = true\n"), image=None)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        ep.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stacks = [p for p in set(descendants(os.getpid())) - before if b"slirp4netns" in _cmdline(p)]
        threads = [t.name for t in threading.enumerate() if t.name.startswith("sequester-dns")]
        if not stacks and not threads:
            break
        time.sleep(0.1)
    assert not stacks and not threads, (stacks, threads)


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""
