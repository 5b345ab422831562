-- KEYS: value hash. Returns {} when absent, else {value, generation, expiry ms since epoch or -1}.
local r = redis.call('HMGET', KEYS[1], 'v', 'g')
if not r[1] then
  return {}
end
return {r[1], tonumber(r[2]), redis.call('PEXPIRETIME', KEYS[1])}
