"""curl in a real bwrap sandbox with only ``lo``, through a build proxy whose listener is
made inside the sandbox's network namespace (tests/net/test_build_proxy.py; also run by a
harness as an ordinary user, so nothing here imports pytest)."""

from __future__ import annotations

import json
import os
import subprocess
import time

from sequester.net.build.network import Upstream, parse_build_network
from sequester.net.build.proxy import BuildProxy, proxy_env
from sequester.net.netns_listener import open_listener_in
from sequester.sandbox.probe import bwrap_path


def start_sandbox(argv, env, extra=(), pass_fds=()):
    """bwrap held before exec (``--block-fd``); returns (process, info, unblock fd)."""
    info_r, info_w = os.pipe()
    block_r, block_w = os.pipe()
    proc = subprocess.Popen([bwrap_path(), "--unshare-user", *extra, "--unshare-net", "--unshare-pid",
                             "--die-with-parent", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
                             "--info-fd", str(info_w), "--block-fd", str(block_r), "--", *argv],
                            pass_fds=(info_w, block_r, *pass_fds), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    os.close(info_w)
    os.close(block_r)
    with os.fdopen(info_r, "rb") as f:
        info = json.loads(f.read())
    return proc, info, block_w


def curl(url, policy="public", hosts=(), *, direct_loopback=True, extra=(), late=False, **options):
    """curl ``url`` in a sandbox through a fresh proxy: (status, X-Sequester-Reason, proxy).
    ``late``: the listener is made after bwrap set the sandbox up (its user namespace is
    then the nested one of ``--disable-userns``), and curl waits for it on a pipe."""
    env = {"PATH": "/usr/bin:/bin", **proxy_env(3128)}
    if not direct_loopback:  # loopback through the proxy too: the host's, not the sandbox's
        env.pop("no_proxy"), env.pop("NO_PROXY")
    argv = ["curl", "-sS", "-D", "-", "-o", "/dev/null", "--max-time", "30", "-w", "\nstatus %{http_code} "
            "%{http_connect}\n", url]
    go_r, go_w = os.pipe()
    argv = ["sh", "-c", f'read _ < /proc/self/fd/{go_r}; exec "$@"', "sh", *argv] if late else argv
    proc, info, unblock = start_sandbox(argv, env, extra, (go_r,) if late else ())
    os.close(go_r)
    proxy = BuildProxy(parse_build_network(policy, hosts), upstream=Upstream(), **options)
    pid = info["child-pid"]
    try:
        if late:
            before = os.stat(f"/proc/{pid}/ns/user").st_ino
            os.write(unblock, b"1")
            deadline = time.monotonic() + 10
            while os.stat(f"/proc/{pid}/ns/user").st_ino == before and time.monotonic() < deadline:
                time.sleep(0.01)
            assert os.stat(f"/proc/{pid}/ns/user").st_ino != before, "no nested user namespace"
        proxy.serve(open_listener_in(pid, 3128, net_namespace=info["net-namespace"]))
        os.write(go_w if late else unblock, b"1\n")
        out, _ = proc.communicate(timeout=60)
    finally:
        os.close(unblock)
        os.close(go_w)
        proc.kill()
        proc.communicate()
        proxy.close()
    text = out.decode()
    codes = text.rsplit("status ", 1)[1].split()
    reason = next((line.split(":", 1)[1].strip() for line in text.splitlines()
                   if line.lower().startswith("x-sequester-reason:")), None)
    return max(int(c) for c in codes), reason, proxy
