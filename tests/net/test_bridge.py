"""A kernel's network (:mod:`sequester.net.bridge` inside, the broker on the host) against
real host services: duplicate endpoints, ports below 1024, and the per-sandbox channel
limit."""

import socket

from conditions import requires_root
from probes import probe
from services import free_low_port, greeter

from sequester import Kernel, Policy
from sequester.net.broker import MAX_CHANNELS


GRAB = '''
import json, socket
def grab(host, port):
    try:
        with socket.create_connection((host, port), timeout=5) as s:
            return s.recv(1).decode() or "closed"
    except OSError as e:
        return type(e).__name__
'''


def test_localhost_and_127_0_0_1_on_the_same_port_both_allowed():
    with greeter(b"L") as port:
        with Kernel(Policy(allow=(f"localhost:{port}", f"127.0.0.1:{port}"))) as k:
            seen = probe(k, GRAB + f"print(json.dumps([grab('localhost', {port}), grab('127.0.0.1', {port})]))")
    assert seen == ["L", "L"]


@requires_root
def test_an_allowed_service_below_1024_is_reachable():
    port = free_low_port()
    with greeter(b"P", port):
        with socket.create_connection(("127.0.0.1", port)) as s:  # control: the host reaches it
            assert s.recv(1) == b"P"
        with Kernel(Policy(allow=(f"127.0.0.1:{port}", "https://svc.sequester.test"))) as k:
            seen = probe(k, GRAB + f"print(json.dumps([grab('127.0.0.1', {port}), grab('svc.sequester.test', 443), "
                                   "grab('127.0.0.1', 444)]))")
    # 443 has a listener (the broker then fails to reach the name and closes); 444 has none.
    assert seen == ["P", "closed", "ConnectionRefusedError"]


HOLD = GRAB + '''
held, seen = [], []
for _ in range({n}):
    s = socket.create_connection(("127.0.0.1", {port}), timeout=5)
    held.append(s)
    seen.append(s.recv(1).decode() or "closed")
print(json.dumps(seen))
'''


def test_channels_beyond_the_limit_are_refused_and_the_rest_keep_working():
    with greeter(b"C") as port:
        policy = Policy(allow=(f"127.0.0.1:{port}",))
        with Kernel(policy) as k, Kernel(policy) as other:
            seen = probe(k, HOLD.format(n=MAX_CHANNELS + 6, port=port))
            assert seen.count("C") == MAX_CHANNELS and seen[MAX_CHANNELS:] == ["closed"] * 6
            # Another sandbox is not affected; neither is this one's next connection once some close.
            assert probe(other, GRAB + f"print(json.dumps(grab('127.0.0.1', {port})))") == "C"
            assert probe(k, GRAB + f"for s in held[:10]: s.close()\nimport time; time.sleep(0.5)\n"
                                   f"print(json.dumps(grab('127.0.0.1', {port})))") == "C"
            assert k.process.broker.stats.n_over_limit == 6
