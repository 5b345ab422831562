-- wrk script: durable PUTs on DISTINCT keys, for idem's KV API or etcd's v3 JSON gateway.
--
--   wrk -t2 -c64 -d15s -s scripts/wrk/put.lua http://127.0.0.1:PORT -- MODE [VALUE_BYTES] [TAG]
--
-- MODE        idem  ->  PUT /v1/kv/<percent-encoded key>, raw value as body
--             etcd  ->  POST /v3/kv/put, {"key":"<base64>","value":"<base64>"}   (etcd >= 3.4 gateway path)
-- VALUE_BYTES size of every value (default 128)
-- TAG         first key segment (default "bench"); keys are TAG/<thread id>/<counter>, so every request
--             in one run writes a key no other request wrote.
--
-- Note: wrk calls request() once on thread 0 before the run, to check the script; that request is never
-- sent, so key TAG/0/1 is never written, and "generated" (request() calls) counts it.
--
-- Only 2xx responses count as successes. done() prints one machine-readable line:
--   WRK_RESULT mode=.. requests=.. ok=.. non2xx=.. ... ok_rps=.. p50_ms=.. p99_ms=..
-- and, when any response was not 2xx, a WRK_NON2XX line with the status counts and one sample body.

local threads = {}
local next_tid = 0

-- Runs once per thread, in the main Lua state, before the threads start.
function setup(thread)
  thread:set("tid", next_tid)
  next_tid = next_tid + 1
  table.insert(threads, thread)
end

local B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"

-- Standard base64 (RFC 4648 §4, with padding); LuaJIT has no builtin. Plain arithmetic, no bit library.
local function b64(s)
  local out = {}
  for i = 1, #s, 3 do
    local a, b, c = s:byte(i, i + 2)
    local n = a * 65536 + (b or 0) * 256 + (c or 0)
    local c1 = math.floor(n / 262144) % 64
    local c2 = math.floor(n / 4096) % 64
    local c3 = math.floor(n / 64) % 64
    local c4 = n % 64
    out[#out + 1] = B64:sub(c1 + 1, c1 + 1) .. B64:sub(c2 + 1, c2 + 1)
      .. (b and B64:sub(c3 + 1, c3 + 1) or "=") .. (c and B64:sub(c4 + 1, c4 + 1) or "=")
  end
  return table.concat(out)
end

-- Runs in each thread's own Lua state.
function init(args)
  mode = args[1] or "idem"
  if mode ~= "idem" and mode ~= "etcd" then
    error("put.lua: MODE must be idem or etcd, got " .. tostring(mode))
  end
  local nbytes = tonumber(args[2] or "128")
  tag = args[3] or "bench"
  -- A deterministic printable value of exactly nbytes bytes.
  local pattern = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
  local value = string.rep(pattern, math.ceil(nbytes / #pattern)):sub(1, nbytes)
  assert(#value == nbytes)
  raw_value = value
  value_b64 = b64(value)
  counter = 0
  ok = 0
  non2xx = 0
  status_counts = {}
  sample_body = ""
  if mode == "idem" then
    headers = { ["Content-Type"] = "application/octet-stream" }
  else
    headers = { ["Content-Type"] = "application/json" }
  end
end

function request()
  counter = counter + 1
  if mode == "idem" then
    -- key TAG/<tid>/<n>; "/" percent-encoded as the KV contract asks (TAG is expected to be unreserved chars)
    local path = "/v1/kv/" .. tag .. "%2F" .. tid .. "%2F" .. counter
    return wrk.format("PUT", path, headers, raw_value)
  else
    local key = tag .. "/" .. tid .. "/" .. counter
    local body = '{"key":"' .. b64(key) .. '","value":"' .. value_b64 .. '"}'
    return wrk.format("POST", "/v3/kv/put", headers, body)
  end
end

function response(status, hdrs, body)
  if status >= 200 and status < 300 then
    ok = ok + 1
  else
    non2xx = non2xx + 1
    status_counts[status] = (status_counts[status] or 0) + 1
    if sample_body == "" and body then
      sample_body = body:sub(1, 300)
    end
  end
end

-- Runs once, in the main Lua state, after all threads stopped.
function done(summary, latency, requests)
  local total_ok, total_non2xx, sent = 0, 0, 0
  local statuses, sample = {}, ""
  local m = "?"
  for _, t in ipairs(threads) do
    total_ok = total_ok + t:get("ok")
    total_non2xx = total_non2xx + t:get("non2xx")
    sent = sent + t:get("counter")
    m = t:get("mode")
    local sc = t:get("status_counts")
    for k, v in pairs(sc) do
      statuses[k] = (statuses[k] or 0) + v
    end
    if sample == "" then sample = t:get("sample_body") end
  end
  local secs = summary.duration / 1e6
  local e = summary.errors
  io.write(string.format(
    "WRK_RESULT mode=%s requests=%d ok=%d non2xx=%d generated=%d err_connect=%d err_read=%d err_write=%d "
      .. "err_timeout=%d duration_s=%.3f ok_rps=%.1f mean_ms=%.3f p50_ms=%.3f p90_ms=%.3f p99_ms=%.3f "
      .. "p999_ms=%.3f max_ms=%.3f\n",
    m, summary.requests, total_ok, total_non2xx, sent, e.connect, e.read, e.write, e.timeout, secs,
    total_ok / secs, latency.mean / 1000, latency:percentile(50) / 1000, latency:percentile(90) / 1000,
    latency:percentile(99) / 1000, latency:percentile(99.9) / 1000, latency.max / 1000))
  if total_non2xx > 0 then
    local parts = {}
    for k, v in pairs(statuses) do parts[#parts + 1] = k .. ":" .. v end
    table.sort(parts)
    io.write("WRK_NON2XX statuses=" .. table.concat(parts, ",") .. " sample_body=" .. sample:gsub("%s+", " ") .. "\n")
  end
end
