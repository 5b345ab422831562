-- KEYS: value hash, generation counter, key index, dedupe record. ARGV: delta, dedupe id or "", retention ms,
-- the key. Returns {-1} wrong type, {-2} overflow, {applied 0|1, value as a string, generation}.
if ARGV[2] ~= '' then
  local seen = redis.call('HMGET', KEYS[4], 'v', 'g')
  if seen[1] then
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
  redis.call('HSET', KEYS[4], 'v', value, 'g', g)
  redis.call('PEXPIRE', KEYS[4], ARGV[3])
end
return {1, value, g}
