"""The Python peer: Powertools for AWS Lambda idempotency on Redis.

Drives `idempotent_function` with the Redis CachePersistenceLayer: every call
claims the event's key (SET NX of an INPROGRESS record), runs a no-op, and
stores the result (COMPLETED): the same work as `dedupe bench --workload
cycle`. N threads, each with its own Redis connection and persistence layer,
call it with new event ids for DURATION seconds; prints one line per
concurrency: `powertools cycle conc=N ops/s=X`.

usage: powertools_redis.py REDIS_URL DURATION_S CONC[,CONC...]
"""

import sys
import threading
import time
import uuid
import warnings

import redis
from aws_lambda_powertools.utilities.idempotency import IdempotencyConfig, idempotent_function
from aws_lambda_powertools.utilities.idempotency.persistence.redis import CachePersistenceLayer


def worker(url, stop_at, counts, index, run):
    client = redis.Redis.from_url(url)
    layer = CachePersistenceLayer(client=client)
    config = IdempotencyConfig(event_key_jmespath="id", expires_after_seconds=3600)

    @idempotent_function(data_keyword_argument="event", persistence_store=layer, config=config)
    def handle(event):
        return {"ok": True}

    n = 0
    while time.monotonic() < stop_at:
        handle(event={"id": f"{run}-{index}-{n}"})
        n += 1
    counts[index] = n


def main():
    # Outside Lambda there is no remaining-time context (Powertools warns on
    # every call), and the Redis layer warns of its coming rename.
    warnings.simplefilter("ignore")
    url, duration, concurrencies = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    for conc in [int(c) for c in concurrencies.split(",")]:
        run = uuid.uuid4().hex[:8]
        counts = [0] * conc
        start = time.monotonic()
        stop_at = start + duration
        threads = [
            threading.Thread(target=worker, args=(url, stop_at, counts, i, run)) for i in range(conc)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - start
        print(f"powertools cycle conc={conc} ops/s={sum(counts) / elapsed:.0f}", flush=True)


if __name__ == "__main__":
    main()
