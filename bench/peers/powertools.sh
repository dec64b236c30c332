#!/usr/bin/env bash
# The side by side against Powertools for AWS Lambda (Python) idempotency, on
# the same Redis server, the same work (claim, no-op, store the result) and the
# same concurrency. One command:
#
#   bench/peers/powertools.sh [REDIS_URL]
#
# Without a URL it starts a private redis-server on a free loopback port and
# stops it afterwards. Powertools is installed from PyPI into a virtualenv under
# target/peers/. DURATION (seconds, default 5) and CONCURRENCY (default 1,16,64)
# can be set in the environment.
set -euo pipefail
cd "$(dirname "$0")/../.."
duration="${DURATION:-5}"
concurrency="${CONCURRENCY:-1,16,64}"

venv=target/peers/powertools-venv
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet 'aws-lambda-powertools[redis]==3.*' boto3
fi

url="${1:-}"
server_pid=""
if [ -z "$url" ]; then
  port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
  redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no --daemonize no >/dev/null &
  server_pid=$!
  trap 'kill "$server_pid" 2>/dev/null || true' EXIT
  for _ in $(seq 100); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.05; done
  url="redis://127.0.0.1:$port/0"
fi

echo "== Powertools for AWS Lambda (Python), CachePersistenceLayer on Redis, $url"
"$venv/bin/python" bench/peers/powertools_redis.py "$url" "$duration" "$concurrency"
echo "== dedupe (Rust), the same work: bench --workload cycle"
cargo run --quiet --release -p dedupe-cli -- bench --store "$url" --workload cycle \
  --concurrency "$concurrency" --duration "${duration}s"
