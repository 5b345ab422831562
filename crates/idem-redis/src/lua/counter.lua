-- KEYS: value hash, generation counter, key index, dedupe record. ARGV: delta, dedupe id or "", retention ms,
-- the key. Returns {-1} wrong type, {-2} overflow, {-3} dedupe id used before with another delta,
-- {applied 0|1, value as a string, generation}.
if ARGV[2] ~= '' then
  local seen = redis.call('HMGET', KEYS[4], 'v', 'g', 'd')
  if seen[1] then
    -- A record without 'd' was written before records kept the delta: it matches any delta, as the code that
    -- wrote it answered (such records are gone when their retention ends).
    if seen[3] and seen[3] ~= ARGV[1] then
      return {-3}
    end
    return {0, seen[1], tonumber(seen[2])}
  end
end
-- HINCRBY does exact 64-bit arithmetic and refuses non-integers and overflow; Lua numbers could not.
local r = redis.pcall('HINCRBY', KEYS[1], 'v', ARGV[1])
if type(r) == 'table' and r.err then
  if string.find(r.err, 'overflow') then
    return {-2}
  end
  return {-1}
end
local g = redis.call('INCR', KEYS[2])
redis.call('HSET', KEYS[1], 'g', g)
redis.call('ZADD', KEYS[3], 0, ARGV[4])
local value = redis.call('HGET', KEYS[1], 'v')
if ARGV[2] ~= '' then
  -- The delta as the caller formatted it (decimal i64, no sign for positives), compared as a string.
  redis.call('HSET', KEYS[4], 'v', value, 'g', g, 'd', ARGV[1])
  redis.call('PEXPIRE', KEYS[4], ARGV[3])
end
return {1, value, g}
