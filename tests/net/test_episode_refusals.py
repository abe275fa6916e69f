"""What an episode's network never reaches, tried by its agent with real sockets, against
listeners bound on those very addresses in a network namespace of the test's own (see
tests/helpers/netns_harness.py): no packet of these tests can leave this machine, even with
a guard removed. As root, and as an ordinary user (the namespace made by root, the rest
run as ``seqtest``).

Each refusal was seen to fail with its guard removed: the router's ``ip daddr @refused``
rule (private, CGNAT, metadata, the raw datagram), the host's own networks in the refused
set (198.51.100.7), the responder's check of answers (rebinding), slirp4netns'
``--disable-host-loopback`` together with the refused rule (10.0.3.2), the agent's lack of
CAP_NET_ADMIN (``nft flush ruleset``, ``ip route add``), and the verifier phase's withdrawal
of the operator's hosts.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
from netns_harness import ADDRESSES, run_in_private_netns
from tasks import make_task

import sequester

pytestmark = [
    pytest.mark.slow,  # an episode each (the ordinary user's first one builds its runner: about a minute)
    pytest.mark.skipif(os.geteuid() != 0, reason="a network namespace of the test's own needs root (CI runs as root)"),
    pytest.mark.skipif(not shutil.which("slirp4netns") or not os.path.exists("/dev/net/tun"),
                       reason="needs slirp4netns and /dev/net/tun"),
    pytest.mark.skipif(not shutil.which("unshare") or not shutil.which("setpriv"), reason="needs util-linux"),
]

PORT = 8080
ZONE = {"rebind.test": ADDRESSES["private10"], "meta.test": ADDRESSES["metadata"], "own.test": ADDRESSES["own"],
        "public.test": "203.0.113.99"}
TCP = [(a, PORT) for a in ADDRESSES.values()] + [("127.0.0.1", PORT), ("127.0.0.1", 8090), (ADDRESSES["private10"], 8081)]
PROBES = [
    *(["tcp", a, PORT] for a in ADDRESSES.values()),
    ["tcp", "10.0.2.2", PORT],  # the gateway (the router itself)
    ["tcp", "10.0.3.2", PORT],  # the stack's gateway: slirp4netns' way to the host's loopback (off)
    ["tcp", "10.0.3.3", 53],  # the stack's own DNS forwarder (off)
    ["resolve", "rebind.test"],
    ["resolve", "meta.test"],
    ["resolve", "own.test"],
    ["resolve", "public.test"],
    ["raw", ADDRESSES["private10"], 9999],
    ["unix", "seqtest-host"],
]
SHELL = [
    "nft flush ruleset",
    "ip route add 10.1.2.0/24 dev eth0",
    "ip addr add 10.0.2.3/24 dev eth0",
    "python3 /tmp/probe.py tcp 10.1.2.3 8080",  # after the attempts above
    "ls /proc/*/exe -l 2>/dev/null | grep -c slirp4netns",
]


def _task(root: Path, test_sh: str = "echo 1 > /logs/verifier/reward.txt\n") -> Path:
    return make_task(root, "net", test_sh, toml="[environment]\nallow_internet = true\n")


def _config(root: Path, task: Path, **kw) -> dict:
    state = root / "state"
    state.mkdir(exist_ok=True)
    return {"task": str(task), "state_dir": str(state), "tcp": TCP, "udp": [(ADDRESSES["private10"], 9999)],
            "zone": ZONE, "probes": PROBES, "shell": SHELL, **kw}


def _src() -> str:
    return str(Path(sequester.__file__).parent.parent)


@pytest.fixture(scope="module")
def as_root(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("netns-root")
    return run_in_private_netns(_config(root, _task(root)), pythonpath=_src())


@pytest.fixture(scope="module")
def as_user(user_site) -> dict:
    entry, home, _data, site = user_site
    root = Path(tempfile.mkdtemp(prefix="netns-user-", dir="/var/tmp"))
    try:
        os.chmod(root, 0o755)
        config = _config(root, _task(root))
        for path in [root, *root.rglob("*")]:
            os.chown(path, entry.pw_uid, entry.pw_gid)
        return run_in_private_netns(config, python="/usr/bin/python3", pythonpath=str(site),
                                    user=(entry.pw_uid, entry.pw_gid), home=str(home), cwd=str(site))
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(params=["root", "user"])
def report(request) -> dict:
    return request.getfixturevalue("as_root" if request.param == "root" else "as_user")


def _probe(report: dict, *probe) -> object:
    return next(p["result"] for p in report["probes"] if p["probe"] == list(probe))


def _listener_hits(report: dict) -> list[dict]:
    return [h for h in report["hits"] if h["where"] != "dns"]


def test_the_episode_has_its_network(report):
    assert report["network"]["mode"] == "public" and report["network"]["decided_by"] == "task"
    assert _probe(report, "resolve", "public.test") == ["203.0.113.99"]  # the responder asks the test's DNS


@pytest.mark.parametrize("name", list(ADDRESSES))
def test_private_metadata_cgnat_and_the_hosts_own_addresses_are_refused(report, name):
    assert _probe(report, "tcp", ADDRESSES[name], PORT) != "connected"
    assert not [h for h in _listener_hits(report) if h["where"] == f"tcp {ADDRESSES[name]}:{PORT}"], report["hits"]


def test_the_hosts_loopback_is_not_reached_through_any_gateway(report):
    for probe in (["tcp", "10.0.2.2", PORT], ["tcp", "10.0.3.2", PORT], ["tcp", "10.0.3.3", 53]):
        assert _probe(report, *probe) != "connected", probe
    assert not [h for h in _listener_hits(report) if h["where"].startswith("tcp 127.0.0.1")], report["hits"]


def test_dns_answers_pointing_at_refused_addresses_are_refused(report):
    for name in ("rebind.test", "meta.test", "own.test"):
        assert isinstance(_probe(report, "resolve", name), str), name  # a gaierror, no address
    refusals = {r["name"] for r in report["network"]["dns"]["refusals"]}
    assert {"rebind.test", "meta.test", "own.test"} <= refusals


def test_a_raw_datagram_to_a_refused_address_reaches_nothing(report):
    assert _probe(report, "raw", ADDRESSES["private10"], 9999) == "sent"  # raw sockets work, as in Docker
    assert not [h for h in report["hits"] if h["where"].startswith("udp")], report["hits"]


def test_the_hosts_abstract_unix_sockets_are_out_of_reach(report):
    assert _probe(report, "unix", "seqtest-host") == "ECONNREFUSED"
    assert not [h for h in report["hits"] if h["where"].startswith("unix")]


def test_the_agent_cannot_flush_the_rules_add_routes_or_see_the_stack(report):
    flush, route, address, after, stack = report["shell"]
    assert flush["exit"] != 0 and "Operation not permitted" in flush["output"], flush
    assert route["exit"] != 0 and "Operation not permitted" in route["output"], route
    assert address["exit"] != 0, address
    assert '"connected"' not in after["output"], after
    assert stack["output"].strip() == "0", stack  # no process of the stack (nor any control of it) in view


def test_refused_destinations_are_counted_in_the_record(report):
    traffic = report["network"]["traffic"]
    refused = {(r["address"], r["port"]) for r in traffic["refused"]}
    assert (ADDRESSES["private10"], PORT) in refused and traffic["refused_packets"] > 0


@pytest.fixture(scope="module")
def operator_hosts(tmp_path_factory) -> dict:
    """--allow-host 10.1.2.3:8080 and localhost:8090 for the agent's phase; the verifier's
    test script then tries both and scores 1 only if neither is reached."""
    root = tmp_path_factory.mktemp("netns-operator")
    # (The relay's socket keeps listening in the verifier's phase and closes what it
    # accepts: the host's listener counts what reached it, below.)
    test_sh = ("a=$(python3 /tmp/probe.py tcp 10.1.2.3 8080); b=$(python3 /tmp/probe.py tcp 127.0.0.1 8090); "
               "echo \"$a $b\" > /logs/verifier/seen; "
               "if [ \"$a\" != '\"connected\"' ]; then echo 1; else echo 0; fi "
               "> /logs/verifier/reward.txt\n")
    # Red team: an agent process took the relay's port while it did not listen (SO_REUSEADDR)
    # and answered the verifier itself; a listening socket's port cannot be taken.
    # A squatter keeps trying through the verifier's phase; had it won, the agent's phase
    # after it would reach the squatter, not the host (the listener's hits, below).
    squat = ("nohup python3 -c \"import socket, time\nfor _ in range(400):\n s = socket.socket(); "
             "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n try:\n  s.bind(('127.0.0.1', 8090)); "
             "s.listen(); print('squatted', flush=True); time.sleep(60)\n except OSError as e:\n  s.close(); "
             "time.sleep(0.05)\n\" > /tmp/squat.log 2>&1 & sleep 0.5; cat /tmp/squat.log; echo tried")
    config = _config(root, _task(root, test_sh), allowed_hosts=["10.1.2.3:8080", "localhost:8090"], evaluate=True,
                     probes=[["tcp", "10.1.2.3", 8080], ["tcp", "10.1.2.3", 8081], ["tcp", "127.0.0.1", 8090],
                             ["tcp", "127.0.0.1", 8080], ["tcp", "172.16.5.5", 8080]], shell=[squat],
                     after=[["tcp", "10.1.2.3", 8080], ["tcp", "127.0.0.1", 8090]])
    return run_in_private_netns(config, pythonpath=_src())


def test_the_operators_hosts_are_the_agents_only(operator_hosts):
    r = operator_hosts
    assert _probe(r, "tcp", "10.1.2.3", 8080) == "connected"
    assert _probe(r, "tcp", "127.0.0.1", 8090) == "connected"  # relayed to the host's loopback port
    assert "squatted" not in r["shell"][0]["output"] and "tried" in r["shell"][0]["output"], r["shell"]
    for probe in (["tcp", "10.1.2.3", 8081], ["tcp", "127.0.0.1", 8080], ["tcp", "172.16.5.5", 8080]):
        assert _probe(r, *probe) != "connected", probe
    assert r["reward"] == 1.0, r["verifier_files"]  # the verifier reached neither
    assert [a["result"] for a in r["after"]] == ['"connected"', '"connected"']  # the agent's phase is back
    reached = sorted(h["where"] for h in _listener_hits(r))
    assert reached == ["tcp 10.1.2.3:8080", "tcp 10.1.2.3:8080", "tcp 127.0.0.1:8090", "tcp 127.0.0.1:8090"], r["hits"]
    assert r["network"]["agent_hosts"] == ["10.1.2.3:8080", "localhost:8090"]

