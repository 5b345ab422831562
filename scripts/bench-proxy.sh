#!/usr/bin/env bash
# Proxy cost per request against nginx, in one run on one machine: requests/s, p50/p99, CPU time per request
# (the proxy's utime + stime over a wrk run, all its threads and processes, divided by the requests answered)
# and user-space instructions per request (valgrind callgrind), for nginx forwarding and for idem's cases, each
# with its ratio to nginx. On 2 cores shared with wrk and the upstream, throughput says little about the proxy;
# CPU per request and instruction counts do.
#
#   scripts/bench-proxy.sh                     # 10 s per wrk run, one worker each, callgrind on
#   WORKERS=2 CALLGRIND=0 scripts/bench-proxy.sh
#
# Environment: DURATION (seconds per wrk run, default 10), CONNECTIONS (default 64), LATENCY_CONNECTIONS (the
# added-latency run, default 16), WORKERS (nginx's worker_processes and idem's tokio worker threads,
# TOKIO_WORKER_THREADS, default 1: the same configuration on both sides), CALLGRIND (1: instruction counts,
# default 1), REDIS_URL (default redis://127.0.0.1:6379; the Redis case is skipped with a line when it does not
# answer), CASES (a subset of "nginx nokey first replay redis webhook"; nginx, the yardstick of every ratio, is
# measured even when left out; an unknown case or WORKERS below 1 is refused with exit status 2),
# IDEM_BIN (a prebuilt idem to measure instead of building one), CARGO_TARGET_DIR, CALLGRIND_ONLY (1: only the
# instruction counts of CASES, printed one "case instructions" line each on stdout, no wrk run and no nginx:
# what scripts/bench-guard.sh reads).
#
# Instructions are counted after 200 warm-up requests over 1,000 sequential keep-alive requests, with one
# worker (thread or process), so the count does not depend on how the scheduler interleaves threads: the
# same build gives the same count to within about 1% whatever else the machine is doing.
# Installs nginx-light, wrk and valgrind with apt-get when missing. Talks to 127.0.0.1 only.
set -euo pipefail

DURATION=${DURATION:-10}
CONNECTIONS=${CONNECTIONS:-64}
LATENCY_CONNECTIONS=${LATENCY_CONNECTIONS:-16}
WORKERS=${WORKERS:-1}
CALLGRIND=${CALLGRIND:-1}
REDIS_URL=${REDIS_URL:-redis://127.0.0.1:6379}
readonly THREADS=2 REPLAY_KEYS=1000 CG_WARMUP=200 CG_REQUESTS=1000
readonly KNOWN_CASES="nginx nokey first replay redis webhook"
if ! [[ $WORKERS =~ ^[1-9][0-9]*$ ]]; then
  echo "bench-proxy: WORKERS must be a whole number of at least 1, not ${WORKERS@Q}" >&2
  exit 2
fi
read -ra cases <<<"${CASES:-$KNOWN_CASES}"
for c in "${cases[@]}"; do
  if [[ " $KNOWN_CASES " != *" $c "* ]]; then
    echo "bench-proxy: unknown case ${c@Q} in CASES (known: $KNOWN_CASES)" >&2
    exit 2
  fi
done
CALLGRIND_ONLY=${CALLGRIND_ONLY:-0}
if [[ $CALLGRIND_ONLY != 1 && " ${cases[*]} " != *" nginx "* ]]; then
  cases=(nginx "${cases[@]}") # the yardstick of every ratio
fi
script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$script_dir/.." && pwd)
lua="$script_dir/wrk/orders.lua"
log() { printf '[bench-proxy %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

missing=()
if [[ $CALLGRIND_ONLY != 1 ]]; then
  command -v wrk >/dev/null || missing+=(wrk)
  [[ -x /usr/sbin/nginx ]] || missing+=(nginx-light)
fi
command -v valgrind >/dev/null || missing+=(valgrind)
if ((${#missing[@]})); then
  log "installing ${missing[*]} (apt-get)"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi

export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/idem-target}
if [[ -n ${IDEM_BIN:-} ]]; then
  log "building the example upstream (release); measuring $IDEM_BIN"
  (cd "$repo" && cargo build --release -q -p idem --example upstream)
else
  log "building idem and the example upstream (release)"
  (cd "$repo" && cargo build --release -q -p idem --bin idem --example upstream)
fi
idem=${IDEM_BIN:-$CARGO_TARGET_DIR/release/idem}
upstream_bin="$CARGO_TARGET_DIR/release/examples/upstream"

work=$(mktemp -d /tmp/idem-bench-proxy.XXXXXX)
pids=()
# Proxies are started inside command substitutions (subshells), whose additions to `pids` the EXIT trap
# never sees: each also writes its pid here.
started="$work/started.pids"
cleanup() {
  local p
  for p in "${pids[@]}" $(cat "$started" 2>/dev/null); do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf -- "$work"
}
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_port() { for _ in $(seq 600); do (echo >"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.05; done; log "port $1 never opened"; exit 1; }
# CPU seconds (user + system, all threads) a process and its children (nginx's workers) have used so far.
cpu_of() {
  local p
  for p in "$1" $(pgrep -P "$1" || true); do cat "/proc/$p/stat"; done |
    awk -v hz="$(getconf CLK_TCK)" '{ s += $14 + $15 } END { printf "%.4f", s / hz }'
}
field() { sed -n "s/.* $2=\([^ ]*\).*/\1/p" <<<"$1"; }

up_port=$(free_port)
"$upstream_bin" --listen "127.0.0.1:$up_port" >"$work/upstream.log" 2>&1 &
pids+=($!)
wait_port "$up_port"

nginx_conf() { # port workers
  cat <<CONF
daemon off;
master_process $([[ $2 == 1 ]] && echo off || echo on);
worker_processes $2;
pid $work/nginx.pid;
error_log $work/nginx-error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path $work/nginx-body;
  proxy_temp_path $work/nginx-proxy;
  upstream app { server 127.0.0.1:$up_port; keepalive 64; }
  server {
    listen 127.0.0.1:$1;
    location / { proxy_pass http://app; proxy_http_version 1.1; proxy_set_header Connection ""; }
  }
}
CONF
}

# Starts the proxy of case $1 on port $2 with $3 workers (in the foreground of a subshell: prints its pid).
start_proxy() { # case port workers [wrapper...]
  local case=$1 port=$2 workers=$3 dir
  shift 3
  dir=$(mktemp -d "$work/$case.XXXX")
  case $case in
    nginx)
      nginx_conf "$port" "$workers" >"$dir/nginx.conf"
      "$@" /usr/sbin/nginx -c "$dir/nginx.conf" -e "$work/nginx-error.log" >"$dir/log" 2>&1 &
      ;;
    redis)
      TOKIO_WORKER_THREADS=$workers IDEM_LOG=warn "$@" "$idem" serve --listen "127.0.0.1:$port" \
        --admin-listen "127.0.0.1:$(free_port)" --upstream "http://127.0.0.1:$up_port" --store "$REDIS_URL" \
        --namespace "bench$RANDOM$RANDOM" >"$dir/log" 2>&1 &
      ;;
    webhook)
      # /orders as a Standard Webhooks route: the signature checked, the key read from webhook-id.
      printf '[[route]]\npath = "/orders"\npreset = "standard-webhooks"\nsecret_file = "%s"\n' "$secret" >"$dir/idem.toml"
      TOKIO_WORKER_THREADS=$workers IDEM_LOG=warn "$@" "$idem" serve --listen "127.0.0.1:$port" \
        --admin-listen "127.0.0.1:$(free_port)" --upstream "http://127.0.0.1:$up_port" \
        --store "sqlite:$dir/idem.db" --config "$dir/idem.toml" >"$dir/log" 2>&1 &
      ;;
    *)
      TOKIO_WORKER_THREADS=$workers IDEM_LOG=warn "$@" "$idem" serve --listen "127.0.0.1:$port" \
        --admin-listen "127.0.0.1:$(free_port)" --upstream "http://127.0.0.1:$up_port" \
        --store "sqlite:$dir/idem.db" >"$dir/log" 2>&1 &
      ;;
  esac
  echo $! >>"$started"
  echo $!
}

mode_of() { case $1 in nginx | nokey) echo nokey ;; first | redis) echo unique ;; replay) echo replay ;; webhook) echo webhook ;; esac; }

# The Standard Webhooks secret of the webhook case, and its deliveries presigned with Python's hmac (wrk's Lua
# has no HMAC): `presign TAG N` writes N lines "id timestamp v1,signature" to $work/TAG.deliveries.
secret="$work/webhook-secret"
echo "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw" >"$secret"
chmod 600 "$secret"
presign() { # tag count
  python3 - "$secret" "$1" "$2" >"$work/$1.deliveries" <<'PY'
import base64, hashlib, hmac, sys, time
secret, tag, n = open(sys.argv[1]).read().strip(), sys.argv[2], int(sys.argv[3])
key = base64.b64decode(secret.removeprefix("whsec_"))
ts = str(int(time.time()))
out = []
for i in range(n):
    id = f"msg_{tag}_{i}"
    body = '{"sku":"%s","qty":1}' % id
    sig = base64.b64encode(hmac.new(key, f"{id}.{ts}.{body}".encode(), hashlib.sha256).digest()).decode()
    out.append(f"{id} {ts} v1,{sig}")
print("\n".join(out))
PY
  echo "$work/$1.deliveries"
}
# Deliveries for one wrk run of `seconds`: more than the fastest case answers on this machine (about 6,000
# requests/s per core for replays).
deliveries_for() { echo $((($1 + 1) * 8000 * $(nproc))); }

# One wrk run against case $1: prints "rps p50 p99 cpu_us_per_request".
measure() { # case connections
  local case=$1 conns=$2 port pid mode tag out line before after requests
  port=$(free_port)
  pid=$(start_proxy "$case" "$port" "$WORKERS")
  pids+=("$pid")
  wait_port "$port"
  mode=$(mode_of "$case")
  tag="c$RANDOM"
  local file=- warm_file=- presigned=0
  if [[ $mode == webhook ]]; then
    presigned=$(deliveries_for "$DURATION")
    warm_file=$(presign "w$tag" "$(deliveries_for 2)")
    file=$(presign "$tag" "$presigned")
  fi
  if [[ $mode == replay ]]; then
    wrk -t$THREADS -c"$conns" -d3s -s "$lua" "http://127.0.0.1:$port" -- replay $REPLAY_KEYS "$tag" >/dev/null
  else # warm the connection pools and the store the same way
    wrk -t$THREADS -c"$conns" -d2s -s "$lua" "http://127.0.0.1:$port" -- "$mode" $REPLAY_KEYS "w$tag" "$warm_file" $THREADS >/dev/null
  fi
  before=$(cpu_of "$pid")
  out=$(wrk -t$THREADS -c"$conns" -d"${DURATION}s" --timeout 10s --latency -s "$lua" "http://127.0.0.1:$port" -- "$mode" $REPLAY_KEYS "$tag" "$file" $THREADS)
  after=$(cpu_of "$pid")
  line=$(grep '^WRK_RESULT' <<<"$out")
  requests=$(field "$line" requests)
  if [[ $mode == webhook ]] && ((requests > presigned)); then
    log "$case: $requests requests outnumbered the $presigned presigned deliveries (some were replays): raise deliveries_for"
    exit 1
  fi
  if [[ $(field "$line" non2xx) != 0 || $(field "$line" errors) != 0 ]]; then log "$case: $line $(grep WRK_SAMPLE <<<"$out" || true)"; fi
  kill "$pid"
  while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
  awk -v r="$(field "$line" ok_rps)" -v p50="$(field "$line" p50_ms)" -v p99="$(field "$line" p99_ms)" \
    -v cpu="$(awk -v a="$before" -v b="$after" 'BEGIN { print b - a }')" -v n="$requests" \
    'BEGIN { printf "%.0f %.2f %.2f %.1f\n", r, p50, p99, cpu * 1e6 / n }'
}

# Instructions per request: callgrind with collection off until CG_WARMUP requests have been answered, then
# on for CG_REQUESTS sequential keep-alive requests, dumped, divided. One worker: a multi-threaded scheduler's
# stealing and parking depend on timing, which valgrind's slowdown and other load change.
instructions() { # case
  local case=$1 port pid out
  port=$(free_port)
  out="$work/callgrind.$case"
  pid=$(start_proxy "$case" "$port" 1 valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$out" -q)
  pids+=("$pid")
  wait_port "$port"
  python3 - "$port" "$(mode_of "$case")" "cg$RANDOM" "$pid" $CG_WARMUP $CG_REQUESTS "$secret" <<'PY'
import base64, hashlib, hmac, http.client, json, subprocess, sys, time
port, mode, tag, pid, warmup, n = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
KEY = base64.b64decode(open(sys.argv[7]).read().strip().removeprefix("whsec_"))
conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
def send(i):
    headers = {"Content-Type": "application/json"}
    if mode == "replay": i = i % 50   # 50 keys: executed once each during the warm-up, then replayed
    body = json.dumps({"sku": f"{tag}-{i}", "qty": 1})
    if mode == "webhook":
        id, ts = f"msg_{tag}_{i}", str(int(time.time()))
        sig = base64.b64encode(hmac.new(KEY, f"{id}.{ts}.{body}".encode(), hashlib.sha256).digest()).decode()
        headers.update({"webhook-id": id, "webhook-timestamp": ts, "webhook-signature": f"v1,{sig}"})
    elif mode != "nokey": headers["Idempotency-Key"] = f"{tag}-{i}"
    conn.request("POST", "/orders", body=body, headers=headers)
    r = conn.getresponse(); r.read()
    assert 200 <= r.status < 300, r.status
for i in range(warmup): send(i)
subprocess.run(["callgrind_control", "-i", "on", pid], check=True, capture_output=True)
for i in range(warmup, warmup + n): send(i)
subprocess.run(["callgrind_control", "-d", pid], check=True, capture_output=True)
PY
  kill -TERM "$pid"
  # Not a child of this shell (started in a command substitution): poll until callgrind has exited.
  while kill -0 "$pid" 2>/dev/null; do sleep 0.2; done
  awk -v n=$CG_REQUESTS '/^summary:|^totals:/ { printf "%.0f", $2 / n; exit }' "$out.1"
}

if [[ $CALLGRIND_ONLY == 1 ]]; then
  for c in "${cases[@]}"; do
    log "counting the instructions of $c"
    echo "$c $(instructions "$c")"
  done
  exit 0
fi
if [[ " ${cases[*]} " == *" redis "* ]] && ! redis-cli -u "$REDIS_URL" ping >/dev/null 2>&1; then
  log "Redis at $REDIS_URL does not answer: its case is skipped"
  read -ra cases <<<"${cases[*]/redis/}"
fi
declare -A result cg
for c in "${cases[@]}"; do
  log "measuring $c ($CONNECTIONS connections, ${DURATION}s)"
  result[$c]=$(measure "$c" "$CONNECTIONS")
  log "$c: ${result[$c]}"
  if [[ $CALLGRIND == 1 ]]; then
    cg[$c]=$(instructions "$c")
    log "$c: ${cg[$c]} instructions per request"
  fi
done
log "added latency at $LATENCY_CONNECTIONS connections: direct, then first executions through idem"
direct16=$(wrk -t$THREADS -c"$LATENCY_CONNECTIONS" -d"${DURATION}s" --latency -s "$lua" "http://127.0.0.1:$up_port" -- unique $REPLAY_KEYS "d$RANDOM" | grep '^WRK_RESULT')
first16=$(measure first "$LATENCY_CONNECTIONS")

nginx_cpu=$(cut -d' ' -f4 <<<"${result[nginx]}")
nginx_ir=${cg[nginx]:-}
label() { case $1 in nginx) echo "nginx $(/usr/sbin/nginx -v 2>&1 | sed 's/.*nginx\///'), upstream keepalive" ;; nokey) echo "idem, no key (plain forwarding)" ;; first) echo "idem, first executions, embedded store" ;; replay) echo "idem, replays ($REPLAY_KEYS keys), embedded store" ;; redis) echo "idem, first executions, --store redis://" ;; webhook) echo "idem, verified webhook, first deliveries, embedded store" ;; esac; }
cat <<REPORT

== bench-proxy: $CONNECTIONS connections, $THREADS wrk threads, ${DURATION}s per run, $WORKERS worker(s) each (nginx worker_processes, idem TOKIO_WORKER_THREADS), $(nproc) cores, $(if [[ -n ${IDEM_BIN:-} ]]; then echo "idem $IDEM_BIN"; else echo "rev $(git -C "$repo" rev-parse --short HEAD)"; fi)
| case | req/s | p50 / p99 ms | CPU µs per request | x nginx | instructions per request | x nginx |
|---|---:|---|---:|---:|---:|---:|
REPORT
for c in "${cases[@]}"; do
  read -r rps p50 p99 cpu <<<"${result[$c]}"
  ir=${cg[$c]:--}
  printf '| %s | %s | %s / %s | %s | %s | %s | %s |\n' "$(label "$c")" "$rps" "$p50" "$p99" "$cpu" \
    "$(awk -v a="$cpu" -v b="$nginx_cpu" 'BEGIN { printf "%.2f", a / b }')" "$ir" \
    "$(if [[ -n $nginx_ir && $ir != - ]]; then awk -v a="$ir" -v b="$nginx_ir" 'BEGIN { printf "%.2f", a / b }'; else echo -; fi)"
done
read -r _ _ p99_first _ <<<"$first16"
echo
echo "p99 at $LATENCY_CONNECTIONS connections: direct $(field "$direct16" p99_ms) ms, first executions through idem $p99_first ms, added $(awk -v a="$p99_first" -v b="$(field "$direct16" p99_ms)" 'BEGIN { printf "%.2f", a - b }') ms"
if [[ -n ${result[webhook]:-} && -n ${result[first]:-} ]]; then
  # Issue 28's target: a verified first delivery costs at most 1.2x a plain keyed first execution.
  ratio_cpu=$(awk -v a="$(cut -d' ' -f4 <<<"${result[webhook]}")" -v b="$(cut -d' ' -f4 <<<"${result[first]}")" 'BEGIN { printf "%.2f", a / b }')
  ratio_ir=-
  if [[ -n ${cg[webhook]:-} && -n ${cg[first]:-} ]]; then
    ratio_ir=$(awk -v a="${cg[webhook]}" -v b="${cg[first]}" 'BEGIN { printf "%.2f", a / b }')
  fi
  echo "verified webhook first delivery vs keyed first execution: CPU per request x$ratio_cpu, instructions x$ratio_ir (target <= 1.2)"
fi
