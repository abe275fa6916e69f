"""Episodes run in a network namespace of the test's own, so that no packet of theirs can
leave this machine, whatever guard is removed to see a test fail.

The namespace (made by root with ``unshare --net``) has loopback and one veth pair (its peer in the namespace too) holding
the addresses an episode must never reach: private (10.1.2.3, 172.16.5.5, 192.168.7.7),
CGNAT (100.64.1.1), metadata (169.254.169.254) and an address of "the host's own"
(198.51.100.7/24, which is in no refused range: only its being the host's refuses it). A
default route leads onto the veth pair (its peer in the namespace too): nothing leaves it. The harness (:data:`SCRIPT`,
run there as root or as an ordinary user) listens on those addresses and on loopback, runs
a DNS server of its own on loopback for the episode's responder (``rebind.test`` ->
10.1.2.3, ``meta.test`` -> 169.254.169.254, ``own.test`` -> 198.51.100.7, ``public.test``
-> 203.0.113.99), starts an episode whose host side lives in the namespace (its namespace
helper, so its user-mode stack and its upstream sockets), runs the agent's probes and
reports every connection and datagram its listeners got.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

__all__ = ["SCRIPT", "SETUP", "ADDRESSES", "PROBE", "run_in_private_netns"]

ADDRESSES = {
    "private10": "10.1.2.3",
    "private172": "172.16.5.5",
    "private192": "192.168.7.7",
    "cgnat": "100.64.1.1",
    "metadata": "169.254.169.254",
    "own": "198.51.100.7",
}

SETUP = " && ".join(
    [
        "ip link set lo up",
        "ip link add seqt0 type veth peer name seqt1",
        "ip link set seqt1 up",
        "ip link set seqt0 up",
        "ip addr add 198.51.100.7/24 dev seqt0",
        *(f"ip addr add {a}/32 dev seqt0" for k, a in ADDRESSES.items() if k != "own"),
        "ip route add default dev seqt0",
    ]
)

# The agent's probes (a file in its view): each prints one JSON line.
PROBE = r'''
import errno, json, socket, struct, sys

def tcp(address, port):
    s = socket.socket()
    s.settimeout(3)
    try:
        s.connect((address, port))
        s.sendall(b"agent was here")
        return "connected"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e))
    finally:
        s.close()

def resolve(name):
    try:
        return sorted({a[4][0] for a in socket.getaddrinfo(name, 80, socket.AF_INET)})
    except socket.gaierror as e:
        return "gaierror %s" % e.errno

def raw_udp(address, port):
    """A UDP datagram built by hand, sent through a raw socket (IP_HDRINCL)."""
    src = socket.inet_aton("10.0.2.100")
    dst = socket.inet_aton(address)
    payload = b"raw agent datagram"
    udp = struct.pack("!HHHH", 40000, port, 8 + len(payload), 0) + payload
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 1, 0, 64, 17, 0, src, dst)
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
        s.sendto(ip + udp, (address, 0))
        return "sent"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e))

def unix_abstract(name):
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect("\0" + name)
        return "connected"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e))

kind, *args = sys.argv[1:]
if kind == "tcp":
    print(json.dumps(tcp(args[0], int(args[1]))))
elif kind == "resolve":
    print(json.dumps(resolve(args[0])))
elif kind == "raw":
    print(json.dumps(raw_udp(args[0], int(args[1]))))
elif kind == "unix":
    print(json.dumps(unix_abstract(args[0])))
'''

SCRIPT = r'''
import json, os, socket, struct, sys, threading, time
from sequester.environments.local.episode import Episode
from sequester.environments.settings import EpisodeSettings

config = json.loads(sys.argv[1])
hits = []
lock = threading.Lock()

def serve_tcp(sock, where):
    while True:
        try:
            conn, peer = sock.accept()
        except OSError:
            return
        conn.settimeout(2)
        try:
            data = conn.recv(100)
        except OSError:
            data = b""
        with lock:
            hits.append({"where": where, "peer": peer[0], "data": data.decode(errors="replace")})
        conn.close()

def serve_udp(sock, where):
    while True:
        data, peer = sock.recvfrom(2048)
        with lock:
            hits.append({"where": where, "peer": peer[0], "data": data.decode(errors="replace")})

for address, port in config["tcp"]:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((address, port))
    s.listen(16)
    threading.Thread(target=serve_tcp, args=(s, f"tcp {address}:{port}"), daemon=True).start()
for address, port in config["udp"]:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((address, port))
    threading.Thread(target=serve_udp, args=(s, f"udp {address}:{port}"), daemon=True).start()
abstract = socket.socket(socket.AF_UNIX)
abstract.bind("\0seqtest-host")
abstract.listen(4)
threading.Thread(target=serve_tcp, args=(abstract, "unix @seqtest-host"), daemon=True).start()

# The DNS server the episode's responder asks (the "host's resolver").
ZONE = config["zone"]
dns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
dns.bind(("127.0.0.1", 5353))

def serve_dns():
    while True:
        data, peer = dns.recvfrom(2048)
        ident, flags, qd = struct.unpack("!HHH", data[:6])
        i, labels = 12, []
        while data[i]:
            labels.append(data[i + 1 : i + 1 + data[i]].decode())
            i += 1 + data[i]
        qtype = struct.unpack("!H", data[i + 1 : i + 3])[0]
        question = data[12 : i + 5]
        name = ".".join(labels).lower()
        with lock:
            hits.append({"where": "dns", "name": name, "type": qtype})
        address = ZONE.get(name)
        if address is None:
            reply = struct.pack("!HHHHHH", ident, 0x8183, 1, 0, 0, 0) + question
        elif qtype != 1:
            reply = struct.pack("!HHHHHH", ident, 0x8180, 1, 0, 0, 0) + question
        else:
            answer = struct.pack("!HHHIH", 0xC00C, 1, 1, 300, 4) + socket.inet_aton(address)
            reply = struct.pack("!HHHHHH", ident, 0x8180, 1, 1, 0, 0) + question + answer
        dns.sendto(reply, peer)

threading.Thread(target=serve_dns, daemon=True).start()

settings = EpisodeSettings(
    state_dir=config["state_dir"],
    **({"toolchain_dir": config["toolchain_dir"]} if config.get("toolchain_dir") else {}),
    network=config.get("network", "task"),
    allowed_hosts=tuple(config.get("allowed_hosts", ())),
    dns_servers=("127.0.0.1:5353",),
)
out = {"probes": [], "shell": []}
with Episode(settings) as ep:
    ep.reset(config["task"], image=None)
    ep.write_file("/tmp/probe.py", config["probe"])
    for probe in config["probes"]:
        r = ep.exec("python3 /tmp/probe.py " + " ".join(str(x) for x in probe), timeout=30)
        out["probes"].append({"probe": probe, "result": json.loads(r.stdout.strip().splitlines()[-1]) if r.stdout.strip() else r.stderr})
    for command in config.get("shell", []):
        r = ep.exec(command, timeout=30)
        out["shell"].append({"command": command, "exit": r.exit_code, "output": (r.stdout + r.stderr)[-2000:]})
    if config.get("evaluate"):
        v = ep.evaluate()
        out["reward"] = v.reward
        out["verifier_files"] = {k: bytes(f)[:2000].decode(errors="replace") for k, f in v.files.items()}
        out["after"] = []  # the agent's phase again, after the verifier's
        for probe in config.get("after", []):
            r = ep.exec("python3 /tmp/probe.py " + " ".join(str(x) for x in probe), timeout=30)
            out["after"].append({"probe": probe, "result": r.stdout.strip()})
    out["notes"] = ep.notes
time.sleep(0.5)
out["network"] = ep.network
with lock:
    out["hits"] = list(hits)
print(json.dumps(out))
'''


def run_in_private_netns(
    config: dict, *, python: str = sys.executable, pythonpath: str, user: tuple[int, int] | None = None,
    home: str | None = None, cwd: str | None = None, timeout: float = 240,
) -> dict:
    """:data:`SCRIPT` with ``config`` in a fresh network namespace (:data:`SETUP`), as root,
    or as ``user`` (uid, gid) once the namespace is made; its report."""
    config = {"probe": PROBE, **config}
    folder = Path(config["state_dir"]).parent
    script = folder / "netns_harness_script.py"
    script.write_text(SCRIPT)
    script.chmod(0o644)
    run = [python, "-B", str(script), json.dumps(config)]
    if user is not None:
        run = ["setpriv", f"--reuid={user[0]}", f"--regid={user[1]}", "--clear-groups", *run]
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "PYTHONPATH": pythonpath, "LANG": "C.UTF-8",
           "HOME": home or os.environ.get("HOME", "/root")}
    proc = subprocess.run(["unshare", "--net", "--", "sh", "-c", f'{SETUP} && exec "$@"', "sh", *run],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd or str(folder))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
