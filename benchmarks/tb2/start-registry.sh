#!/bin/sh
# (Re)start the loopback registry that serves the TB2 stand-in base images.
# Idempotent: if a registry from this folder already answers on the port, nothing happens;
# a stale one (pid file, no answer) is stopped first. Plain HTTP, loopback only.
#
#   benchmarks/tb2/start-registry.sh          # start if needed
#   benchmarks/tb2/start-registry.sh restart  # stop the one started from here, then start
#   benchmarks/tb2/start-registry.sh stop
set -eu
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=${TB2_REGISTRY_ROOT:-$HERE/registry}
ADDR=${TB2_REGISTRY_ADDR:-127.0.0.1:5055}
PIDFILE=$ROOT/registry.pid
LOG=$ROOT/registry.log
mkdir -p "$ROOT/storage"

answers() { curl -fsS -o /dev/null --max-time 2 "http://$ADDR/v2/" 2>/dev/null; }

stop() {
    if [ -f "$PIDFILE" ]; then
        pid=$(cat "$PIDFILE")
        # only the registry this script started (its command line names our config)
        if [ -r "/proc/$pid/cmdline" ] && tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q "$ROOT/config.yml"; then
            kill "$pid" 2>/dev/null || true
            i=0; while [ -d "/proc/$pid" ] && [ $i -lt 50 ]; do sleep 0.1; i=$((i+1)); done
            [ -d "/proc/$pid" ] && kill -9 "$pid" 2>/dev/null || true
        fi
        rm -f "$PIDFILE"
    fi
}

case "${1:-start}" in
    stop) stop; exit 0 ;;
    restart) stop ;;
    start) ;;
    *) echo "usage: $0 [start|restart|stop]" >&2; exit 2 ;;
esac

if answers; then
    if [ -f "$PIDFILE" ] && [ -d "/proc/$(cat "$PIDFILE")" ]; then
        echo "registry already running on $ADDR (pid $(cat "$PIDFILE"), storage $ROOT/storage)"; exit 0
    fi
    echo "something else answers on $ADDR (not started from $ROOT); refusing to start a second one" >&2; exit 1
fi
stop  # a pid file without an answering registry: stale

# YAML is a superset of JSON. No health section: the storage health check stays off.
cat >"$ROOT/config.yml" <<EOF
{"version": 0.1,
 "log": {"level": "error"},
 "storage": {"filesystem": {"rootdirectory": "$ROOT/storage"}, "delete": {"enabled": true}},
 "http": {"addr": "$ADDR"}}
EOF
nohup /usr/bin/docker-registry serve "$ROOT/config.yml" >>"$LOG" 2>&1 </dev/null &
echo $! >"$PIDFILE"
i=0
until answers; do
    i=$((i+1))
    if [ $i -gt 100 ] || ! [ -d "/proc/$(cat "$PIDFILE")" ]; then
        echo "registry did not come up on $ADDR; tail of $LOG:" >&2; tail -20 "$LOG" >&2; exit 1
    fi
    sleep 0.1
done
echo "registry running on $ADDR (pid $(cat "$PIDFILE"), storage $ROOT/storage, log $LOG)"
