#!/usr/bin/env bash
# The full table: every store side by side against its raw driver, on private
# servers this script starts on free loopback ports and stops afterwards (a
# PostgreSQL cluster, a MariaDB, a redis-server, DynamoDB Local), or on
# servers you give:
#
#   bench/all-stores.sh [extra dedupe bench arguments...]
#   PG_URL=postgres://... MYSQL_URL=mysql://... REDIS_URL=redis://... DYNAMO_ENDPOINT=http://... bench/all-stores.sh
#   PG_DATA_PARENT=/dev/shm bench/all-stores.sh   # the private cluster's data on tmpfs
#   DEDUPE_BIN=/path/to/dedupe bench/all-stores.sh  # a binary built elsewhere
#
# PG_DATA_PARENT puts the private PostgreSQL cluster's data directory under
# that directory: on tmpfs a commit's fsync costs nothing, so store/raw shows
# what the store adds in CPU and round trips rather than the disk of the day.
#
# Run scripts/test once first on a fresh machine: it installs the servers and
# unpacks DynamoDB Local.
set -euo pipefail
cd "$(dirname "$0")/.."

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
work="$(mktemp -d)"
chmod 755 "$work"
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  if [ -n "${pg_data:-}" ] && [ -f "$pg_data/postmaster.pid" ]; then
    runuser -u postgres -- "$pg_bin/pg_ctl" -D "$pg_data" -m immediate stop >/dev/null 2>&1 || true
  fi
  [ -n "${pg_data:-}" ] && [ "$pg_data" != "$work/pg" ] && rm -rf "$(dirname "$pg_data")"
  [ -n "${my_pid:-}" ] && { kill -9 "$my_pid" 2>/dev/null || true; wait "$my_pid" 2>/dev/null || true; }
  rm -rf "$work"
}
trap cleanup EXIT

if [ -z "${PG_URL:-}" ]; then
  pg_bin="$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)"
  port="$(free_port)"
  as_pg=()
  [ "$(id -u)" = 0 ] && as_pg=(runuser -u postgres --)
  pg_data="$work/pg"
  if [ -n "${PG_DATA_PARENT:-}" ]; then
    pg_data="$(mktemp -d -p "$PG_DATA_PARENT")/pg"
    chmod 755 "$(dirname "$pg_data")"
  fi
  mkdir -p "$pg_data" && chown postgres "$pg_data" 2>/dev/null || true
  "${as_pg[@]}" "$pg_bin/initdb" -D "$pg_data" -U postgres -A trust >/dev/null
  "${as_pg[@]}" "$pg_bin/pg_ctl" -D "$pg_data" -o "-p $port -k $pg_data -c listen_addresses=127.0.0.1 -c max_connections=300" -w start >/dev/null
  PG_URL="postgres://postgres@127.0.0.1:$port/postgres"
fi
if [ -z "${MYSQL_URL:-}" ]; then
  # The same durable settings as the tests' private servers
  # (innodb_flush_log_at_trx_commit=1: a commit is on disk when answered).
  port="$(free_port)"
  my_opts=(--innodb-log-file-size=64M --innodb-buffer-pool-size=256M
           --innodb-flush-log-at-trx-commit=1 --max-connections=500)
  mkdir -p "$work/my/tmp"
  mariadb-install-db --no-defaults --datadir="$work/my/data" --tmpdir="$work/my/tmp" \
    --user=root --auth-root-authentication-method=normal --skip-test-db "${my_opts[@]}" >/dev/null
  mariadbd="$(command -v mariadbd || echo /usr/sbin/mariadbd)"
  "$mariadbd" --no-defaults --datadir="$work/my/data" --tmpdir="$work/my/tmp" --user=root \
    --port="$port" --bind-address=127.0.0.1 --socket="$work/my/sock" --skip-name-resolve \
    --pid-file="$work/my/pid" --log-error="$work/my/log" "${my_opts[@]}" >/dev/null 2>&1 &
  my_pid=$!
  for _ in $(seq 200); do
    mariadb -uroot -h127.0.0.1 -P"$port" -e 'CREATE DATABASE IF NOT EXISTS test' 2>/dev/null && break
    sleep 0.1
  done
  MYSQL_URL="mysql://root@127.0.0.1:$port/test"
fi
if [ -z "${REDIS_URL:-}" ]; then
  port="$(free_port)"
  redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no >/dev/null &
  pids+=($!)
  for _ in $(seq 100); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.05; done
  REDIS_URL="redis://127.0.0.1:$port/0"
fi
if [ -z "${DYNAMO_ENDPOINT:-}" ]; then
  home="${DEDUPE_DYNAMODB_LOCAL_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/dedupe/dynamodb-local}"
  if [ ! -f "$home/DynamoDBLocal.jar" ]; then
    echo "no DynamoDB Local in $home: run scripts/test once (it unpacks it), or set DYNAMO_ENDPOINT" >&2
    exit 1
  fi
  port="$(free_port)"
  (cd "$work" && exec java -Xmx512m -XX:+UseSerialGC -Djava.library.path="$home/DynamoDBLocal_lib" \
    -jar "$home/DynamoDBLocal.jar" -inMemory -port "$port" >/dev/null 2>&1) &
  pids+=($!)
  for _ in $(seq 200); do
    curl -s -o /dev/null -X POST -H 'X-Amz-Target: DynamoDB_20120810.ListTables' \
      -H 'Content-Type: application/x-amz-json-1.0' \
      -H 'Authorization: AWS4-HMAC-SHA256 Credential=a/20260101/us-east-1/dynamodb/aws4_request, SignedHeaders=host, Signature=0' \
      -d '{}' "http://127.0.0.1:$port/" && break
    sleep 0.1
  done
  DYNAMO_ENDPOINT="http://127.0.0.1:$port"
fi

# DEDUPE_BIN runs a dedupe binary you built (another commit's, for a
# before/after table) instead of this checkout's release build.
bench=(cargo run --quiet --release -p dedupe-cli --)
[ -n "${DEDUPE_BIN:-}" ] && bench=("$DEDUPE_BIN")
# memory last: its rows leave millions of keys to free, which
# stalls whatever row runs next.
"${bench[@]}" bench \
  --store sqlite: --store "$PG_URL" --store "$MYSQL_URL" --store "$REDIS_URL" \
  --store "dynamodb://dedupe_bench?endpoint=$DYNAMO_ENDPOINT" --store memory: "$@"
