"""One cache and one budget for a fleet of `hdr serve` replicas, on Redis (`cache.backend: redis`).

Each replica keeps its own cache (`retrieval_server.serving.cache.ResultCache`) in front;
behind it, in one Redis (a single server, or a primary with its replicas; not Redis Cluster,
whose keys of one script must share a slot):

- answers, `NS:answer:FINGERPRINT:SHA256(key)`: the answer's bytes, written by the replica that
  computed (or paid for) it, with an expiry (`cache.ttl_s`, else `cache.redis_ttl_s`), so a miss
  of one replica is a hit on every other, byte for byte. An answer read from Redis is checked
  (a list of documents, with scores where asked) before it is served or cached; anything else
  is computed again and written over. FINGERPRINT is the replica's own (its
  index and the settings that decide answers, or its upstream's description), so replicas of
  different indexes never share an answer;
- locks, `NS:lock:FINGERPRINT:SHA256(key)`: set if absent (with an expiry, `cache.redis_lock_s`,
  renewed while the holder lives), in the same step that finds no answer (CLAIM), by the
  replica that computes a query, and deleted by that holder alone when it writes the answer or
  gives up. A replica that finds a query locked waits for
  its answer (polling, 2 ms growing to 50 ms); when the lock goes without an answer (its
  holder failed, or died and the lock expired) it takes the query over. So identical queries
  in flight on several replicas are computed once;
- the budget of proxy mode, `NS:budget:SHA256(upstream identity)`: `RedisLedger`, one hash for
  the fleet, checked and spent in one step. The identity is the URL normalised
  (`upstream_identity`: host case, default port, `localhost` and `127.0.0.1` alike), so
  replicas that spell one upstream differently share one budget. It carries the id it was
  created with, which each replica keeps in its record (`upstream.spend_path`): a budget
  that Redis loses (restarted empty, flushed, evicted) is never refilled from what a replica
  last saw or from zero; reservations are refused in one line until Redis's data is
  restored.

Every check-and-change is a Lua script (redis-py's `register_script`), so it is atomic. Redis
commands are not retried by the client: a reservation sent twice would spend twice.

Redis unreachable (a refused connection, or no answer within `cache.redis_timeout_s`): the
replica says so in one log line and in /health, serves from its own cache and its own searches
(as `cache.backend: memory` would; what it computes meanwhile is written to Redis once Redis is
back, as far as its own cache still holds it: the answers waiting stay inside
`cache.max_bytes`), and tries Redis again after `cache.redis_retry_s`. A budget
kept in Redis fails closed meanwhile: reservations are refused (misses answered 503, cached
queries still served), and the settlements of calls already sent wait in memory, each
numbered so that it counts once, until Redis is back. A budget is only kept in a Redis that
persists (append-only file on) and never evicts it (`maxmemory-policy` volatile-*: answers
expire and are evicted, the budget does not; or noeviction without a `maxmemory`, which would
fill with answers and then refuse the budget's updates): `hdr serve` refuses any other at
start. An error reply (out of memory, a read-only replica) is not an outage: Redis is
reachable, the command did nothing; the replica says so in one log line for each new reply,
an answer it could not write stays in its own cache, and a reservation it could not make is
a 503 naming the reply. A replica's settlements are numbered, and Redis keeps one key per
replica with the last number applied, so a settlement resent after a lost reply counts once.
Each reservation is numbered too and kept open under its replica until settled
(`NS:replica:DIGEST:open:TOKEN`): one whose reply was lost (a timeout after Redis ran it) is
released once Redis answers again, and a replica whose liveness key (`...:alive:TOKEN`,
renewed while it runs, expiring after `cache.redis_lock_s`) is gone with reservations open is
found by the next replica that starts or renews: one log line, and its calls stay counted as
spent (the upstream may have billed them), as a spend file counts a crashed server's.

The modules: `link.py` (the client and whether Redis answers), `cache.py` (the answers and
locks), `ledger.py` with `budget_scripts.py` (the budget and its Lua scripts).
"""
