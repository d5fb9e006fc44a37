"""The Lua scripts of the fleet's budget (`RedisLedger`), each one atomic step against the one
hash every replica spends from: INIT creates it, RESERVE checks and takes calls, SETTLE
applies a numbered settlement once, CANCEL releases a reservation whose reply was lost, REAP
finds the replicas that stopped with reservations open."""

from __future__ import annotations

# The budget hash: budget_id (made when the budget was created), upstream, committed_calls /
# committed_spend (billed, reserved and unsettled: what the budget counts) and billed_calls /
# billed_spend. Only INIT creates it, and only where the replica's record knows of no budget:
# a hash that is gone is reported ('missing') by every other script, never refilled.
BUDGET_PRELUDE = """
local function check(key, id)
  local v = redis.call('HMGET', key, 'budget_id', 'committed_calls', 'committed_spend',
                       'billed_calls', 'billed_spend')
  if not v[1] then
    if redis.call('EXISTS', key) == 0 then return 'missing' end
    return 'damaged budget_id'
  end
  if v[1] ~= id then return 'other ' .. v[1] end
  local names = {'committed_calls', 'committed_spend', 'billed_calls', 'billed_spend'}
  for i = 2, 5 do
    local n = tonumber(v[i])
    if n == nil or n ~= n or n < 0 or n == math.huge
       or ((i == 2 or i == 4) and not string.match(v[i], '^%d+$')) then
      return 'damaged ' .. names[i - 1]
    end
  end
  return nil
end
local function totals(key)
  return redis.call('HMGET', key, 'committed_calls', 'committed_spend', 'billed_calls',
                    'billed_spend')
end
"""
# KEYS: budget, its key before upstream identities were normalised; ARGV: a new id, the
# upstream (shown), the id this replica's record knows ('': none) -> the budget's id, or nil
# when the record knows one and the hash is gone (lost)
INIT = """
if KEYS[2] ~= KEYS[1] and redis.call('EXISTS', KEYS[1]) == 0
   and redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('RENAME', KEYS[2], KEYS[1])
end
local id = redis.call('HGET', KEYS[1], 'budget_id')
if id then return id end
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('HSET', KEYS[1], 'budget_id', ARGV[1])
  return ARGV[1]
end
if ARGV[3] ~= '' then return false end
redis.call('HSET', KEYS[1], 'budget_id', ARGV[1], 'upstream', ARGV[2], 'committed_calls', 0,
           'committed_spend', 0, 'billed_calls', 0, 'billed_spend', 0)
return ARGV[1]
"""
# KEYS: budget, this replica's open reservations, its liveness, the budget's replicas; ARGV:
# budget id, calls, price, max_calls (-1: none), max_spend (-1: none), the reservation's
# number, this replica's token, liveness expiry (ms) -> {1 or 0 (refused), totals...}, or
# {problem}
RESERVE = (
    BUDGET_PRELUDE
    + """
local problem = check(KEYS[1], ARGV[1])
if problem then return {problem} end
local t = totals(KEYS[1])
local calls, price = tonumber(ARGV[2]), tonumber(ARGV[3])
local max_calls, max_spend = tonumber(ARGV[4]), tonumber(ARGV[5])
local ok = 1
if max_calls >= 0 and tonumber(t[1]) + calls > max_calls then ok = 0 end
if ok == 1 and max_spend >= 0 and price > 0
   and calls > math.floor((max_spend - tonumber(t[2])) / price + 1e-9) then ok = 0 end
if ok == 1 then
  redis.call('HINCRBY', KEYS[1], 'committed_calls', calls)
  redis.call('HINCRBYFLOAT', KEYS[1], 'committed_spend', calls * price)
  redis.call('HSET', KEYS[2], ARGV[6], calls)
  redis.call('SET', KEYS[3], '1', 'PX', ARGV[8])
  redis.call('SADD', KEYS[4], ARGV[7])
  t = totals(KEYS[1])
end
return {ok, t[1], t[2], t[3], t[4]}
"""
)
# KEYS: budget, this replica's last applied settlement number, its open reservations; ARGV:
# budget id, reserved (in Redis), billed, price, how long the number is kept (s), the
# settlement's number (a replica settles in order, one at a time), then pairs (reservation
# number, calls of it still open) -> {1, totals...}, or {problem} (not applied)
SETTLE = (
    BUDGET_PRELUDE
    + """
local problem = check(KEYS[1], ARGV[1])
if problem then return {problem} end
local reserved, billed, price = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
if tonumber(ARGV[6]) > tonumber(redis.call('GET', KEYS[2]) or '0') then
  redis.call('SET', KEYS[2], ARGV[6], 'EX', ARGV[5])
  if billed ~= reserved then
    redis.call('HINCRBY', KEYS[1], 'committed_calls', billed - reserved)
    redis.call('HINCRBYFLOAT', KEYS[1], 'committed_spend', (billed - reserved) * price)
  end
  if billed > 0 then
    redis.call('HINCRBY', KEYS[1], 'billed_calls', billed)
    redis.call('HINCRBYFLOAT', KEYS[1], 'billed_spend', billed * price)
  end
  for i = 7, #ARGV, 2 do
    if tonumber(ARGV[i + 1]) > 0 then
      redis.call('HSET', KEYS[3], ARGV[i], ARGV[i + 1])
    else
      redis.call('HDEL', KEYS[3], ARGV[i])
    end
  end
end
local t = totals(KEYS[1])
return {1, t[1], t[2], t[3], t[4]}
"""
)


# KEYS: budget, this replica's open reservations; ARGV: budget id, a reservation's number,
# price -> {1, totals...}, or {problem}. Releases a reservation whose reply was lost, if it
# was made (once: its record goes with it)
CANCEL = (
    BUDGET_PRELUDE
    + """
local problem = check(KEYS[1], ARGV[1])
if problem then return {problem} end
local calls = tonumber(redis.call('HGET', KEYS[2], ARGV[2]) or '0')
if calls > 0 then
  redis.call('HINCRBY', KEYS[1], 'committed_calls', -calls)
  redis.call('HINCRBYFLOAT', KEYS[1], 'committed_spend', -calls * tonumber(ARGV[3]))
  redis.call('HDEL', KEYS[2], ARGV[2])
end
local t = totals(KEYS[1])
return {1, t[1], t[2], t[3], t[4]}
"""
)
# KEYS: budget, the budget's replicas; ARGV: the prefix of a replica's keys (PREFIX..'open:'..
# token, PREFIX..'alive:'..token) -> {token, calls, ...} of the replicas whose liveness
# expired with reservations open: those stay committed (the upstream may have billed them),
# are added to unsettled_calls, and their records go
REAP = """
local out = {}
for _, token in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  if redis.call('EXISTS', ARGV[1] .. 'alive:' .. token) == 0 then
    local open = ARGV[1] .. 'open:' .. token
    local calls = 0
    for _, value in ipairs(redis.call('HVALS', open)) do calls = calls + tonumber(value) end
    redis.call('DEL', open)
    redis.call('SREM', KEYS[2], token)
    if calls > 0 and redis.call('EXISTS', KEYS[1]) == 1 then
      redis.call('HINCRBY', KEYS[1], 'unsettled_calls', calls)
      out[#out + 1] = token
      out[#out + 1] = calls
    end
  end
end
return out
"""
