"""Verifier for http-kv-server (standard library only; exits non-zero on failure).

Queries the server the agent left running on 127.0.0.1:8000.
"""
import http.client
import json
import os
import socket
import threading
import time
import unittest

HOST, PORT = "127.0.0.1", 8000
RUN = os.urandom(4).hex()          # unique key prefix, so state left by the agent does not matter


def request(method, path, body=None):
    conn = http.client.HTTPConnection(HOST, PORT, timeout=10)
    try:
        headers = {} if body is None else {"Content-Length": str(len(body))}
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def wait_for_port(seconds=1.0):
    deadline = time.monotonic() + seconds
    while True:
        try:
            socket.create_connection((HOST, PORT), timeout=1).close()
            return True
        except OSError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)


class KvTest(unittest.TestCase):
    maxDiff = None

    @classmethod
    def setUpClass(cls):
        if not wait_for_port():
            raise AssertionError(f"nothing is listening on {HOST}:{PORT}")

    def key(self, name):
        return f"t{RUN}-{name}"

    def test_health(self):
        self.assertEqual(request("GET", "/health"), (200, b"ok"))

    def test_put_get_replace(self):
        k = self.key("put")
        self.assertEqual(request("GET", f"/kv/{k}")[0], 404)
        self.assertEqual(request("PUT", f"/kv/{k}", b"hello world")[0], 201)
        self.assertEqual(request("GET", f"/kv/{k}"), (200, b"hello world"))
        self.assertEqual(request("PUT", f"/kv/{k}", b"second")[0], 200)
        self.assertEqual(request("GET", f"/kv/{k}"), (200, b"second"))

    def test_binary_empty_and_large_values(self):
        cases = {
            "bin": bytes(range(256)) * 3,
            "empty": b"",
            "big": os.urandom(300_000),
            "json": b'{"not": "parsed"}\r\n',
        }
        for name, value in cases.items():
            k = self.key(name)
            self.assertEqual(request("PUT", f"/kv/{k}", value)[0], 201, name)
            self.assertEqual(request("GET", f"/kv/{k}"), (200, value), name)

    def test_delete(self):
        k = self.key("del")
        self.assertEqual(request("DELETE", f"/kv/{k}")[0], 404)
        self.assertEqual(request("PUT", f"/kv/{k}", b"x")[0], 201)
        self.assertEqual(request("DELETE", f"/kv/{k}"), (204, b""))
        self.assertEqual(request("GET", f"/kv/{k}")[0], 404)
        self.assertEqual(request("DELETE", f"/kv/{k}")[0], 404)
        self.assertEqual(request("PUT", f"/kv/{k}", b"y")[0], 201)

    def test_key_validation(self):
        ok = "A-z_0.9" + "k" * 57                 # 64 characters
        self.assertEqual(len(ok), 64)
        self.assertIn(request("PUT", f"/kv/{ok}", b"v")[0], (200, 201))
        self.assertEqual(request("GET", f"/kv/{ok}"), (200, b"v"))
        for bad in ("k" * 65, "bad%20key", "sl/ash", "caf%C3%A9", "semi;colon", "q?x=1"):
            for method, body in (("PUT", b"v"), ("GET", None), ("DELETE", None)):
                self.assertEqual(request(method, f"/kv/{bad}", body)[0], 400, f"{method} /kv/{bad}")
        self.assertEqual(request("GET", "/kv/")[0], 400)

    def test_list_keys_sorted(self):
        names = ["m", "B", "a", "z-9", "a.b", "_x"]
        for n in names:
            self.assertEqual(request("PUT", f"/kv/{self.key(n)}", n.encode())[0], 201)
        self.assertEqual(request("DELETE", f"/kv/{self.key('m')}")[0], 204)
        status, body = request("GET", "/kv")
        self.assertEqual(status, 200)
        data = json.loads(body)
        self.assertEqual(set(data), {"keys"})
        keys = data["keys"]
        self.assertEqual(keys, sorted(keys))
        self.assertEqual(len(keys), len(set(keys)))
        mine = [k for k in keys if k.startswith(f"t{RUN}-")]
        expected = sorted(self.key(n) for n in names if n != "m")
        for k in expected:
            self.assertIn(k, mine)
        self.assertNotIn(self.key("m"), keys)
        self.assertEqual([k for k in mine if k in expected], expected)

    def test_unknown_paths(self):
        for method, path in (("GET", "/"), ("GET", "/nope"), ("GET", "/kvx/a"), ("PUT", "/store/a")):
            self.assertEqual(request(method, path, b"" if method == "PUT" else None)[0], 404, f"{method} {path}")

    def test_concurrent_clients(self):
        errors = []

        def worker(i):
            try:
                k = self.key(f"c{i}")
                value = f"value-{i}-".encode() * 1000
                for _ in range(5):
                    if request("PUT", f"/kv/{k}", value)[0] not in (200, 201):
                        errors.append((i, "put"))
                    if request("GET", f"/kv/{k}") != (200, value):
                        errors.append((i, "get"))
            except Exception as e:  # noqa: BLE001
                errors.append((i, repr(e)))

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        self.assertEqual(errors, [])


if __name__ == "__main__":
    unittest.main(verbosity=2)
