#!/usr/bin/env python3
"""Where an inbox row's time goes on the server: each `dedupe bench` row run
alone, the server's own per-command statistics reset before it and read
after it, so a row's operations per second sit beside what each of them cost
the server.

    bench/profile-inbox.py --bin target/release/dedupe \
        --store redis://127.0.0.1:PORT --store postgres://postgres@127.0.0.1:PORT/db \
        --workload claim,cycle,accept,work,ordered --concurrency 16,64

Redis: `CONFIG RESETSTAT`, then `INFO commandstats` (microseconds of
execution per call, per command; the store's scripts are `evalsha`, the raw
driver's plain commands). Postgres: `pg_stat_statements` (the server needs
`shared_preload_libraries=pg_stat_statements`; the script creates the
extension), mean execution time and calls per statement, the store's and the
raw driver's statements told apart by their text. Each row prints ops/s
(store and raw, from the bench's JSON), then the statements that took most of
the server's time, with calls per store operation.
"""

import argparse
import json
import subprocess
import sys
from urllib.parse import urlparse


def redis_cli(url, *args):
    u = urlparse(url)
    out = subprocess.run(
        ["redis-cli", "-h", u.hostname, "-p", str(u.port), *args],
        check=True,
        capture_output=True,
        text=True,
    )
    return out.stdout


def psql(url, sql):
    out = subprocess.run(
        ["psql", url, "-At", "-F", "\t", "-c", sql],
        check=True,
        capture_output=True,
        text=True,
    )
    return [line.split("\t") for line in out.stdout.splitlines() if line]


def reset(url):
    if url.startswith("redis"):
        redis_cli(url, "CONFIG", "RESETSTAT")
    else:
        psql(url, "CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        psql(url, "SELECT pg_stat_statements_reset()")


def server_stats(url):
    """(name, calls, total µs) per command or statement, most time first."""
    rows = []
    if url.startswith("redis"):
        for line in redis_cli(url, "INFO", "commandstats").splitlines():
            if not line.startswith("cmdstat_"):
                continue
            name, fields = line[len("cmdstat_"):].split(":", 1)
            kv = dict(f.split("=") for f in fields.split(","))
            if name in ("config", "info"):
                continue
            rows.append((name, int(kv["calls"]), float(kv["usec"])))
    else:
        for query, calls, total_ms in psql(
            url,
            "SELECT regexp_replace(left(query, 110), '\\s+', ' ', 'g'), calls, total_exec_time "
            "FROM pg_stat_statements WHERE query NOT LIKE '%pg_stat_statements%' "
            "ORDER BY total_exec_time DESC LIMIT 8",
        ):
            rows.append((query, int(calls), float(total_ms) * 1000.0))
    rows.sort(key=lambda r: -r[2])
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bin", default="target/release/dedupe")
    p.add_argument("--store", action="append", required=True)
    p.add_argument("--workload", default="claim,cycle,accept,work,ordered")
    p.add_argument("--concurrency", default="16,64")
    p.add_argument("--duration", default="3s")
    p.add_argument("--warmup", default="1s")
    a = p.parse_args()
    for store in a.store:
        for workload in a.workload.split(","):
            for conc in a.concurrency.split(","):
                reset(store)
                out = subprocess.run(
                    [a.bin, "bench", "--store", store, "--workload", workload,
                     "--concurrency", conc, "--duration", a.duration,
                     "--warmup", a.warmup, "--json"],
                    check=True, capture_output=True, text=True,
                )
                row = json.loads(out.stdout)["rows"][0]
                stats = server_stats(store)
                # The counts cover the warm-up, the store's run and the raw
                # driver's: compare µs a call, and calls between workloads.
                raw = row.get("raw_ops_per_sec") or 0
                print(f"## {urlparse(store).scheme} {workload} x{conc}: "
                      f"{row['ops_per_sec']:.0f} ops/s, raw {raw:.0f}, "
                      f"p50 {row['p50_us']} µs, p99 {row['p99_us']} µs")
                for name, calls, usec in stats[:8]:
                    print(f"   {calls:>9} calls  {usec / max(calls, 1):8.1f} µs/call  "
                          f"{usec / 1e6:7.3f} s  {name}")
                sys.stdout.flush()


if __name__ == "__main__":
    main()
