-- Shared by put.lua and delete.lua (prepended by store.rs): does the precondition `kind` (any|absent|present|gen,
-- with `expected` for gen) fail against `cur`, the live generation or nil?
local function precondition_fails(cur, kind, expected)
  return (kind == 'absent' and cur) or (kind == 'present' and not cur)
    or (kind == 'gen' and (not cur or tonumber(cur) ~= tonumber(expected)))
end
