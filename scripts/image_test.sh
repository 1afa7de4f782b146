#!/usr/bin/env bash
# Build the CPU image and check it from the inside (`make image-test`).
#
#   scripts/image_test.sh            build (scripts/image.sh build cpu), then check
#   SKIP_BUILD=1 scripts/image_test.sh   check an image already built
#
# Checks: the image's config (exec-form ENTRYPOINT `appliance serve`, a numeric non-root USER,
# EXPOSE 8000 and 50051, a HEALTHCHECK on /health, the compile-cache VOLUME); inside it, the
# user is not root, the project imports, `appliance config show` prints the image's config
# with env and --set overrides applied, the default model is already converted, a one-shot
# `appliance generate` answers, and `appliance serve` becomes healthy by the image's own
# HEALTHCHECK command, then drains an in-flight stream on SIGTERM and exits 0.
#
# Runs commands in the image with `docker run`, or `buildah run --isolation chroot` (where
# `podman run` cannot start containers, as on machines without a container runtime's
# privileges), or `podman run`. Environment: IMAGE (default appliance:cpu), as for
# scripts/image.sh. Ends with "N passed, M failed"; exits non-zero on any failure.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export IMAGE=${IMAGE:-appliance:cpu}
IMAGE_SH="$ROOT/scripts/image.sh"
BUILDER=$("$IMAGE_SH" builder)
DRIVER=$("$IMAGE_SH" storage-driver)
ISOLATION=${BUILDAH_ISOLATION:-chroot}
PASSED=0
FAILED=0
T0=$SECONDS

log() { echo "image-test: $*"; }
ok() { PASSED=$((PASSED + 1)); echo "ok - $*"; }
fail() { FAILED=$((FAILED + 1)); echo "FAIL - $*"; }

if [ "${SKIP_BUILD:-0}" != 1 ]; then
    build_start=$SECONDS
    "$IMAGE_SH" build cpu
    log "build took $((SECONDS - build_start)) s"
fi

# --- how to run a command in the image ------------------------------------------------------
WORK_CTR=""
cleanup() {
    if [ -n "$WORK_CTR" ]; then
        buildah --storage-driver "$DRIVER" rm "$WORK_CTR" >/dev/null 2>&1 || true
    fi
}
trap cleanup EXIT

# The docker-format image config (Entrypoint, User, Healthcheck, ...) from any inspect output:
# docker's and podman's (a list; podman keeps Healthcheck beside Config) or buildah's.
image_config() {
    python3 -c '
import json, sys
d = json.load(sys.stdin)
d = d[0] if isinstance(d, list) else d
c = dict(d["Docker"]["config"]) if "Docker" in d else dict(d.get("Config") or {})
if "Healthcheck" not in c and d.get("HealthCheck"):
    c["Healthcheck"] = d["HealthCheck"]
print(json.dumps(c))'
}

case $BUILDER in
    docker)
        CONFIG_JSON=$(docker image inspect "$IMAGE" | image_config)
        run_in() { docker run --rm --network host --entrypoint "$1" "$IMAGE" "${@:2}"; }
        ;;
    buildah)
        CONFIG_JSON=$(buildah --storage-driver "$DRIVER" inspect --type image "$IMAGE" | image_config)
        WORK_CTR=$(buildah --storage-driver "$DRIVER" from --pull-never -q "$IMAGE")
        # chroot isolation shares the host's network: the server below binds 127.0.0.1 only.
        run_in() {
            buildah --storage-driver "$DRIVER" run --isolation "$ISOLATION" "$WORK_CTR" -- "$@"
        }
        ;;
    podman)
        CONFIG_JSON=$(podman --storage-driver "$DRIVER" image inspect "$IMAGE" | image_config)
        run_in() {
            podman --storage-driver "$DRIVER" run --rm --network host --entrypoint "$1" "$IMAGE" "${@:2}"
        }
        ;;
esac
log "checking $IMAGE with $BUILDER"

# --- the image's config -----------------------------------------------------------------------
cfg_check() {
    python3 - "$CONFIG_JSON" <<'EOF'
import json, sys

c = json.loads(sys.argv[1])
errors = []
if c.get("Entrypoint") != ["appliance", "serve"]:
    errors.append(f"ENTRYPOINT is {c.get('Entrypoint')!r}, not ['appliance', 'serve']")
if c.get("Cmd"):
    errors.append(f"CMD {c.get('Cmd')!r} would be appended to `appliance serve`")
user = (c.get("User") or "").split(":")[0]
if not user.isdigit() or int(user) == 0:
    errors.append(f"USER {c.get('User')!r} is not a numeric non-root uid")
ports = set(c.get("ExposedPorts") or {})
for port in ("8000/tcp", "50051/tcp"):
    if port not in ports:
        errors.append(f"{port} not exposed ({sorted(ports)})")
hc = c.get("Healthcheck") or {}
test = hc.get("Test") or []
if not test or test[0] != "CMD" or not any("/health" in t for t in test):
    errors.append(f"HEALTHCHECK is {test!r}, not an exec-form check of /health")
if "/var/cache/appliance" not in (c.get("Volumes") or {}):
    errors.append("no VOLUME /var/cache/appliance")
env = dict(e.split("=", 1) for e in c.get("Env") or [])
if env.get("APPLIANCE_CONFIG") != "/etc/appliance/config.yaml":
    errors.append("APPLIANCE_CONFIG is not /etc/appliance/config.yaml")
print("\n".join(errors))
sys.exit(1 if errors else 0)
EOF
}
if out=$(cfg_check); then
    ok "image config: ENTRYPOINT [appliance serve], numeric non-root USER, EXPOSE 8000 50051, HEALTHCHECK /health, VOLUME"
else
    fail "image config: $out"
fi
HEALTH_JSON=$(python3 -c 'import json,sys; print(json.dumps(json.loads(sys.argv[1])["Healthcheck"]["Test"][1:]))' "$CONFIG_JSON" 2>/dev/null || echo '[]')

# --- inside the image -------------------------------------------------------------------------
if out=$(run_in id -u 2>&1) && [ "$out" != 0 ] && [ "$(run_in id -un 2>&1)" = appliance ]; then
    ok "runs as uid $out (appliance), not root"
else
    fail "user: id -u says '$out'"
fi

if out=$(run_in python -c 'import engine, graphs, appliance, torch; print(torch.__version__)' 2>&1); then
    ok "project imports (torch $out)"
else
    fail "import: $out"
fi

if out=$(run_in appliance config show 2>&1) && grep -q '^  host: 0.0.0.0$' <<<"$out" &&
    grep -q '^  http_port: 8000$' <<<"$out" && grep -q '^  grpc_port: 50051$' <<<"$out"; then
    ok "appliance config show: /etc/appliance/config.yaml, host 0.0.0.0, ports 8000/50051"
else
    fail "appliance config show: $out"
fi

if out=$(run_in env APPLIANCE_SCHEDULER__MAX_NUM_SEQS=7 appliance config show \
    --set cache.block_size=32 2>&1) && grep -q '^  max_num_seqs: 7$' <<<"$out" &&
    grep -q '^  block_size: 32$' <<<"$out"; then
    ok "overrides: APPLIANCE_SCHEDULER__MAX_NUM_SEQS=7 and --set cache.block_size=32 apply"
else
    fail "overrides: $out"
fi

if out=$(run_in python -c '
from engine.worker.models.default_model import default_model_gguf
from engine.worker.models.gguf_loader import converted_dir_for, is_converted
d = converted_dir_for(default_model_gguf())
print(d)
raise SystemExit(0 if is_converted(d) else 1)' 2>&1); then
    ok "default model already converted at build time ($out)"
else
    fail "default model not converted in the image (a start would convert it): $out"
fi

gen_start=$SECONDS
gen_err=$(mktemp)
if out=$(run_in appliance generate "The capital of France is" --max-tokens 16 2>"$gen_err") &&
    [ -n "$(tr -d '[:space:]' <<<"$out")" ]; then
    ok "appliance generate (default model, $((SECONDS - gen_start)) s): $(tr '\n' ' ' <<<"$out")"
else
    fail "appliance generate: $out $(tail -20 "$gen_err")"
fi
rm -f "$gen_err"

# Serve, wait for the image's own HEALTHCHECK command to pass, SIGTERM mid-stream: the stream
# must finish and the server exit 0. The ports are free ones (the network may be the host's).
read -r HTTP_PORT GRPC_PORT < <(python3 -c '
import socket
socks = [socket.socket() for _ in range(2)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))')
SERVE_CHECK=$(
    cat <<'EOF'
import http.client, json, os, signal, subprocess, sys, time

entrypoint, health, port, grpc_port = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3], sys.argv[4]
env = dict(os.environ, APPLIANCE_SERVER__HOST="127.0.0.1", APPLIANCE_SERVER__HTTP_PORT=port,
           APPLIANCE_SERVER__GRPC_PORT=grpc_port)
log = open("/tmp/serve.log", "w+")
t0 = time.monotonic()
server = subprocess.Popen(entrypoint, env=env, stdout=log, stderr=subprocess.STDOUT)

def die(msg):
    server.kill()
    log.seek(0)
    print(msg, "\n--- server log ---\n" + log.read()[-3000:])
    sys.exit(1)

while True:
    if server.poll() is not None:
        die(f"server exited with {server.returncode} before it was healthy")
    if subprocess.run(health, env=env, capture_output=True).returncode == 0:
        break
    if time.monotonic() - t0 > 240:
        die("not healthy after 240 s")
    time.sleep(1)
healthy_s = time.monotonic() - t0

conn = http.client.HTTPConnection("127.0.0.1", int(port), timeout=120)
body = {"prompt": "Once upon a time", "max_tokens": 48, "temperature": 0, "stream": True,
        "ignore_eos": True}
conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
resp = conn.getresponse()
if resp.status != 200:
    die(f"POST /v1/completions: HTTP {resp.status} {resp.read()[:500]!r}")
chunks, finish, done, signalled = 0, None, False, None
for raw in resp:
    line = raw.decode().strip()
    if not line.startswith("data:"):
        continue
    data = line[5:].strip()
    if data == "[DONE]":
        done = True
        break
    choice = json.loads(data)["choices"][0]
    chunks += 1
    finish = choice.get("finish_reason") or finish
    if signalled is None:
        server.send_signal(signal.SIGTERM)  # what `docker stop` sends to PID 1
        signalled = time.monotonic()
try:
    rc = server.wait(timeout=90)
except subprocess.TimeoutExpired:
    die("server still running 90 s after SIGTERM")
log.seek(0)
text = log.read()
if not (done and finish == "length" and rc == 0):
    die(f"drain failed: done={done} finish={finish} chunks={chunks} rc={rc}")
print(f"healthy after {healthy_s:.1f} s; SIGTERM after the first of {chunks} chunks; stream "
      f"finished ({finish}); exit {rc} {time.monotonic() - signalled:.1f} s after SIGTERM")
EOF
)
ENTRY_JSON=$(python3 -c 'import json,sys; print(json.dumps(json.loads(sys.argv[1])["Entrypoint"]))' "$CONFIG_JSON")
if out=$(run_in python -c "$SERVE_CHECK" "$ENTRY_JSON" "$HEALTH_JSON" "$HTTP_PORT" "$GRPC_PORT" 2>&1); then
    ok "serve: $out"
else
    fail "serve: $out"
fi

# --- summary ------------------------------------------------------------------------------------
case $BUILDER in
    docker) size="$(($(docker image inspect --format '{{.Size}}' "$IMAGE") / 1000000)) MB" ;;
    *) size=$(buildah --storage-driver "$DRIVER" images --noheading --format '{{.Size}}' "$IMAGE" 2>/dev/null || echo '?') ;;
esac
log "$IMAGE: $size; image-test took $((SECONDS - T0)) s"
echo "$PASSED passed, $FAILED failed"
[ "$FAILED" = 0 ]
