-- KEYS: value hash, generation counter, key index, set dedupe record (any name when there is no id).
-- ARGV: max value bytes, the key, dedupe id or "", the change's fingerprint, retention ms, number of adds,
-- adds..., removes... Returns {-1} wrong type, {-2} too large, {-3} dedupe id used before with another change,
-- else {generation or -1, members, added, removed, applied 0|1}.
local dedupe = ARGV[3] ~= ''
if dedupe then
  local seen = redis.call('HMGET', KEYS[4], 'f', 'g', 'm', 'a', 'r')
  if seen[1] then
    if seen[1] ~= ARGV[4] then
      return {-3}
    end
    return {tonumber(seen[2]), tonumber(seen[3]), tonumber(seen[4]), tonumber(seen[5]), 0}
  end
end
-- Remembers the outcome under the dedupe id (if any) and returns it.
local function done(g, size, added, removed)
  if dedupe then
    redis.call('HSET', KEYS[4], 'f', ARGV[4], 'g', g, 'm', size, 'a', added, 'r', removed)
    redis.call('PEXPIRE', KEYS[4], ARGV[5])
  end
  return {g, size, added, removed, 1}
end
local cur = redis.call('HMGET', KEYS[1], 'v', 'g')
local set = {}
local size = 0
if cur[1] then
  if string.sub(cur[1], 1, 1) ~= '[' then
    return {-1}
  end
  local ok, arr = pcall(cjson.decode, cur[1])
  if not ok or type(arr) ~= 'table' then
    return {-1}
  end
  for _, m in ipairs(arr) do
    if type(m) ~= 'string' then
      return {-1}
    end
    if not set[m] then
      set[m] = true
      size = size + 1
    end
  end
end
local nadd = tonumber(ARGV[6])
local added, removed = 0, 0
for i = 7, 6 + nadd do
  if not set[ARGV[i]] then
    set[ARGV[i]] = true
    size = size + 1
    added = added + 1
  end
end
for i = 7 + nadd, #ARGV do
  if set[ARGV[i]] then
    set[ARGV[i]] = nil
    size = size - 1
    removed = removed + 1
  end
end
local g = cur[2] and tonumber(cur[2]) or -1
if added == 0 and removed == 0 then
  return done(g, size, 0, 0)
end
if size == 0 then
  redis.call('DEL', KEYS[1])
  redis.call('ZREM', KEYS[3], ARGV[2])
  return done(-1, 0, added, removed)
end
local list = {}
for m in pairs(set) do
  list[#list + 1] = m
end
table.sort(list)
local parts = {}
for i, m in ipairs(list) do
  parts[i] = cjson.encode(m)
end
local value = '[' .. table.concat(parts, ',') .. ']'
if #value > tonumber(ARGV[1]) then
  return {-2}
end
g = redis.call('INCR', KEYS[2])
redis.call('HSET', KEYS[1], 'v', value, 'g', g)
redis.call('ZADD', KEYS[3], 0, ARGV[2])
return done(g, size, added, removed)
