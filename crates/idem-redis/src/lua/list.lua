-- KEYS: key index. ARGV: value-hash name prefix, lex start ("[prefix" or "(cursor"), how many, key prefix.
-- Returns a flat {key, generation, expiry ms or -1, ...}. Index members whose value has expired are dropped.
local out = {}
local want = tonumber(ARGV[3])
local prefix = ARGV[4]
local start = ARGV[2]
local found = 0
while found < want do
  local batch = redis.call('ZRANGEBYLEX', KEYS[1], start, '+', 'LIMIT', 0, 256)
  if #batch == 0 then
    return out
  end
  for _, k in ipairs(batch) do
    if string.sub(k, 1, #prefix) ~= prefix then
      return out
    end
    local h = ARGV[1] .. k
    local g = redis.call('HGET', h, 'g')
    if g then
      out[#out + 1] = k
      out[#out + 1] = tonumber(g)
      out[#out + 1] = redis.call('PEXPIRETIME', h)
      found = found + 1
      if found >= want then
        return out
      end
    else
      redis.call('ZREM', KEYS[1], k)
    end
  end
  start = '(' .. batch[#batch]
end
return out
