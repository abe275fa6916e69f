#!/bin/bash
# Oracle solution for http-kv-server: writes /app/server.py, starts it detached
# (nohup + setsid, so it outlives the agent's shell) and waits until it answers.
set -euo pipefail

cat > /app/server.py <<'PY'
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

KEY = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
STORE = {}
LOCK = threading.Lock()


class Handler(BaseHTTPRequestHandler):
    def reply(self, status, body=b"", ctype="text/plain"):
        self.send_response(status)
        if status != 204:
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if status != 204:
            self.wfile.write(body)

    def key(self):
        """Return (handled, key): key for /kv/<key>, or answer 400/404 here."""
        if not self.path.startswith("/kv/"):
            self.reply(404, b"not found")
            return None
        key = self.path[len("/kv/"):]
        if not KEY.match(key):
            self.reply(400, b"bad key")
            return None
        return key

    def do_GET(self):
        if self.path == "/health":
            return self.reply(200, b"ok")
        if self.path == "/kv":
            with LOCK:
                keys = sorted(STORE)
            return self.reply(200, json.dumps({"keys": keys}).encode(), "application/json")
        key = self.key()
        if key is None:
            return
        with LOCK:
            value = STORE.get(key)
        if value is None:
            return self.reply(404, b"not found")
        self.reply(200, value, "application/octet-stream")

    def do_PUT(self):
        key = self.key()
        if key is None:
            return
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        with LOCK:
            existed = key in STORE
            STORE[key] = body
        self.reply(200 if existed else 201, b"stored")

    def do_DELETE(self):
        key = self.key()
        if key is None:
            return
        with LOCK:
            existed = STORE.pop(key, None) is not None
        self.reply(204 if existed else 404, b"" if existed else b"not found")

    def log_message(self, fmt, *args):
        pass


if __name__ == "__main__":
    ThreadingHTTPServer.daemon_threads = True
    ThreadingHTTPServer.request_queue_size = 64
    ThreadingHTTPServer(("127.0.0.1", 8000), Handler).serve_forever()
PY

nohup setsid python3 /app/server.py > /app/server.log 2>&1 < /dev/null &

for _ in $(seq 1 100); do
  if curl -fsS http://127.0.0.1:8000/health >/dev/null 2>&1; then
    echo "server is up"
    exit 0
  fi
  sleep 0.1
done
echo "server did not come up" >&2
cat /app/server.log >&2
exit 1
