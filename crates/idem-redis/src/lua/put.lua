-- KEYS: value hash, generation counter, key index. ARGV: value, precondition kind (any|absent|present|gen),
-- expected generation, ttl kind (keep|clear|after), ttl ms, the key itself.
-- Returns {0, current generation or -1} when the precondition fails, {1, generation, created 0|1} on success.
local cur = redis.call('HGET', KEYS[1], 'g')
local kind = ARGV[2]
if precondition_fails(cur, kind, ARGV[3]) then
  return {0, cur and tonumber(cur) or -1}
end
local g = redis.call('INCR', KEYS[2])
-- HSET keeps an existing key's expiry, which is exactly Ttl::Keep; a new key starts without one.
redis.call('HSET', KEYS[1], 'v', ARGV[1], 'g', g)
if ARGV[4] == 'clear' then
  redis.call('PERSIST', KEYS[1])
elseif ARGV[4] == 'after' then
  local t = redis.call('TIME')
  redis.call('PEXPIREAT', KEYS[1], tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[5]))
end
redis.call('ZADD', KEYS[3], 0, ARGV[6])
return {1, g, cur and 0 or 1}
