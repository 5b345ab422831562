-- KEYS: key index. ARGV: value-hash name prefix, lex start, batch size.
-- Drops index members whose value expired; returns the next start ("" when the index was walked to its end).
local batch = redis.call('ZRANGEBYLEX', KEYS[1], ARGV[2], '+', 'LIMIT', 0, tonumber(ARGV[3]))
for _, k in ipairs(batch) do
  if redis.call('EXISTS', ARGV[1] .. k) == 0 then
    redis.call('ZREM', KEYS[1], k)
  end
end
if #batch < tonumber(ARGV[3]) then
  return ''
end
return '(' .. batch[#batch]
