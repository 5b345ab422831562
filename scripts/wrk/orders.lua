-- wrk script: POST /orders with an Idempotency-Key, for scripts/bench-proxy.sh.
--
--   wrk -t2 -c64 -d15s -s scripts/wrk/orders.lua http://127.0.0.1:PORT -- MODE [KEYS] [TAG]
--
-- MODE   unique  ->  every request carries a key no other request carried (TAG-<thread>-<counter>): first
--                    executions through the proxy
--        nokey   ->  no Idempotency-Key at all: plain forwarding through the proxy, the cost of the extra hop
--        replay  ->  keys cycle over KEYS keys (TAG-k<0..KEYS-1>) with the same body per key: after a warm-up
--                    that executed each once, every request through the proxy is a replay
--        webhook ->  Standard Webhooks deliveries presigned in FILE (lines "id timestamp signature", the body
--                    {"sku":"<id>","qty":1}; thread t sends lines t, t+THREADS, ...), each once: first
--                    deliveries through a signed route; a thread that runs out starts over (replays: the
--                    script checks that the requests answered did not outnumber the deliveries)
-- KEYS   number of distinct keys in replay mode (default 1000)
-- FILE   webhook mode: the presigned deliveries (scripts/bench-proxy.sh writes them with Python's hmac)
--
-- done() prints one machine-readable line:
--   WRK_RESULT mode=.. requests=.. ok=.. non2xx=.. errors=.. ok_rps=.. p50_ms=.. p99_ms=.. max_ms=..

local threads = {}
local next_tid = 0

function setup(thread)
  thread:set("tid", next_tid)
  next_tid = next_tid + 1
  table.insert(threads, thread)
end

function init(args)
  mode = args[1] or "unique"
  nkeys = tonumber(args[2] or "1000")
  tag = args[3] or "bench"
  counter = 0
  ok = 0
  non2xx = 0
  sample = ""
  if mode == "webhook" then
    deliveries = {}
    local i, nthreads = 0, tonumber(args[5] or "2")
    for line in io.lines(args[4]) do
      if i % nthreads == tid then table.insert(deliveries, line) end
      i = i + 1
    end
  end
end

function request()
  counter = counter + 1
  local key, body
  if mode == "webhook" then
    local line = deliveries[(counter - 1) % #deliveries + 1]
    local id, ts, sig = line:match("^(%S+) (%S+) (%S+)$")
    body = '{"sku":"' .. id .. '","qty":1}'
    return wrk.format("POST", "/orders", {
      ["Content-Type"] = "application/json", ["webhook-id"] = id, ["webhook-timestamp"] = ts,
      ["webhook-signature"] = sig }, body)
  elseif mode == "nokey" then
    body = '{"sku":"' .. tag .. '-' .. tid .. '-' .. counter .. '","qty":1}'
    return wrk.format("POST", "/orders", { ["Content-Type"] = "application/json" }, body)
  elseif mode == "unique" then
    key = tag .. "-" .. tid .. "-" .. counter
    body = '{"sku":"' .. key .. '","qty":1}'
  else
    local k = (counter * 7 + tid * 131) % nkeys
    key = tag .. "-k" .. k
    body = '{"sku":"' .. key .. '","qty":1}'
  end
  return wrk.format("POST", "/orders", { ["Content-Type"] = "application/json", ["Idempotency-Key"] = key }, body)
end

function response(status, hdrs, body)
  if status >= 200 and status < 300 then
    ok = ok + 1
  else
    non2xx = non2xx + 1
    if sample == "" and body then sample = status .. " " .. body:sub(1, 200) end
  end
end

function done(summary, latency, requests)
  local total_ok, total_non2xx, s = 0, 0, ""
  local m = threads[1] and threads[1]:get("mode") or "?"
  for _, t in ipairs(threads) do
    total_ok = total_ok + t:get("ok")
    total_non2xx = total_non2xx + t:get("non2xx")
    if s == "" then s = t:get("sample") end
  end
  local e = summary.errors
  local secs = summary.duration / 1e6
  io.write(string.format(
    "WRK_RESULT mode=%s requests=%d ok=%d non2xx=%d errors=%d ok_rps=%.1f p50_ms=%.3f p99_ms=%.3f max_ms=%.3f\n",
    m, summary.requests, total_ok, total_non2xx, e.connect + e.read + e.write + e.timeout, total_ok / secs,
    latency:percentile(50) / 1000, latency:percentile(99) / 1000, latency.max / 1000))
  if total_non2xx > 0 then io.write("WRK_SAMPLE " .. s:gsub("%s+", " ") .. "\n") end
end
