-- KEYS: value hash, key index. ARGV: precondition kind, expected generation, the key itself.
-- Returns {0, current or -1} when the precondition fails, {1, deleted generation or -1}.
local cur = redis.call('HGET', KEYS[1], 'g')
local kind = ARGV[1]
if precondition_fails(cur, kind, ARGV[2]) then
  return {0, cur and tonumber(cur) or -1}
end
if cur then
  redis.call('DEL', KEYS[1])
end
redis.call('ZREM', KEYS[2], ARGV[3])
return {1, cur and tonumber(cur) or -1}
