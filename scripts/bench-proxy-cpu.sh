#!/usr/bin/env bash
# Proxy cost per request against nginx, in one run on one machine: CPU time per request (the proxy process's
# utime + stime over a wrk run, divided by the requests answered) and user-space instructions per request
# (valgrind callgrind over a fixed number of sequential requests), for nginx forwarding and for idem's cases.
# On 2 cores shared with wrk and the upstream, throughput says little about the proxy; CPU per request and
# instruction counts do.
#
#   scripts/bench-proxy-cpu.sh                 # 10 s per wrk run, callgrind on, Redis case when it answers
#   DURATION=20 CALLGRIND=0 scripts/bench-proxy-cpu.sh
#
# Environment: DURATION (seconds per wrk run, default 10), CONNECTIONS (default 64), LATENCY_CONNECTIONS (the
# added-latency run, default 16), CALLGRIND (1: instruction counts, default 1), REDIS_URL (default
# redis://127.0.0.1:6379; the Redis case is skipped with a line when it does not answer), CASES (a subset of
# "nginx nokey first replay redis"; nginx is the yardstick of every ratio), CARGO_TARGET_DIR.
# Installs nginx-light, wrk and valgrind with apt-get when missing. Talks to 127.0.0.1 only.
set -euo pipefail

DURATION=${DURATION:-10}
CONNECTIONS=${CONNECTIONS:-64}
LATENCY_CONNECTIONS=${LATENCY_CONNECTIONS:-16}
CALLGRIND=${CALLGRIND:-1}
REDIS_URL=${REDIS_URL:-redis://127.0.0.1:6379}
readonly THREADS=2 REPLAY_KEYS=1000 CG_SHORT=300 CG_LONG=1300
script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$script_dir/.." && pwd)
lua="$script_dir/wrk/orders.lua"
log() { printf '[bench-proxy-cpu %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

missing=()
command -v wrk >/dev/null || missing+=(wrk)
[[ -x /usr/sbin/nginx ]] || missing+=(nginx-light)
command -v valgrind >/dev/null || missing+=(valgrind)
if ((${#missing[@]})); then
  log "installing ${missing[*]} (apt-get)"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi

export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/idem-target}
log "building idem and the example upstream (release)"
(cd "$repo" && cargo build --release -q -p idem --bin idem --example upstream)
idem="$CARGO_TARGET_DIR/release/idem"
upstream_bin="$CARGO_TARGET_DIR/release/examples/upstream"

work=$(mktemp -d /tmp/idem-bench-proxy-cpu.XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf -- "$work"
}
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_port() { for _ in $(seq 600); do (echo >"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.05; done; log "port $1 never opened"; exit 1; }
# CPU seconds (user + system, all threads) a process has used so far.
cpu_of() { awk -v hz="$(getconf CLK_TCK)" '{ printf "%.4f", ($14 + $15) / hz }' "/proc/$1/stat"; }
field() { sed -n "s/.* $2=\([^ ]*\).*/\1/p" <<<"$1"; }

up_port=$(free_port)
"$upstream_bin" --listen "127.0.0.1:$up_port" >"$work/upstream.log" 2>&1 &
pids+=($!)
wait_port "$up_port"

nginx_conf() { # port
  cat <<CONF
daemon off;
master_process off;
worker_processes 1;
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

# Starts the proxy of case $1 on port $2 (in the foreground of a subshell: prints its pid).
start_proxy() { # case port [wrapper...]
  local case=$1 port=$2 dir
  shift 2
  dir=$(mktemp -d "$work/$case.XXXX")
  case $case in
    nginx)
      nginx_conf "$port" >"$dir/nginx.conf"
      "$@" /usr/sbin/nginx -c "$dir/nginx.conf" -e "$work/nginx-error.log" >"$dir/log" 2>&1 &
      ;;
    redis)
      IDEM_LOG=warn "$@" "$idem" serve --listen "127.0.0.1:$port" --admin-listen "127.0.0.1:$(free_port)" \
        --upstream "http://127.0.0.1:$up_port" --store "$REDIS_URL" --namespace "bench$RANDOM$RANDOM" >"$dir/log" 2>&1 &
      ;;
    *)
      IDEM_LOG=warn "$@" "$idem" serve --listen "127.0.0.1:$port" --admin-listen "127.0.0.1:$(free_port)" \
        --upstream "http://127.0.0.1:$up_port" --store "sqlite:$dir/idem.db" >"$dir/log" 2>&1 &
      ;;
  esac
  echo $!
}

mode_of() { case $1 in nginx | nokey) echo nokey ;; first | redis) echo unique ;; replay) echo replay ;; esac; }

# One wrk run against case $1: prints "rps p50 p99 cpu_us_per_request".
measure() { # case connections
  local case=$1 conns=$2 port pid mode tag out line before after requests
  port=$(free_port)
  pid=$(start_proxy "$case" "$port")
  pids+=("$pid")
  wait_port "$port"
  mode=$(mode_of "$case")
  tag="c$RANDOM"
  if [[ $mode == replay ]]; then
    wrk -t$THREADS -c"$conns" -d3s -s "$lua" "http://127.0.0.1:$port" -- replay $REPLAY_KEYS "$tag" >/dev/null
  else # warm the connection pools and the store the same way
    wrk -t$THREADS -c"$conns" -d2s -s "$lua" "http://127.0.0.1:$port" -- "$mode" $REPLAY_KEYS "w$tag" >/dev/null
  fi
  before=$(cpu_of "$pid")
  out=$(wrk -t$THREADS -c"$conns" -d"${DURATION}s" --timeout 10s --latency -s "$lua" "http://127.0.0.1:$port" -- "$mode" $REPLAY_KEYS "$tag")
  after=$(cpu_of "$pid")
  line=$(grep '^WRK_RESULT' <<<"$out")
  requests=$(field "$line" requests)
  if [[ $(field "$line" non2xx) != 0 || $(field "$line" errors) != 0 ]]; then log "$case: $line $(grep WRK_SAMPLE <<<"$out" || true)"; fi
  kill "$pid"
  while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
  awk -v r="$(field "$line" ok_rps)" -v p50="$(field "$line" p50_ms)" -v p99="$(field "$line" p99_ms)" \
    -v cpu="$(awk -v a="$before" -v b="$after" 'BEGIN { print b - a }')" -v n="$requests" \
    'BEGIN { printf "%.0f %.2f %.2f %.1f\n", r, p50, p99, cpu * 1e6 / n }'
}

# Instructions per request: callgrind over CG_SHORT and over CG_LONG sequential keep-alive requests; the
# difference divided by the difference in requests leaves start-up and shut-down out.
instructions() { # case
  local case=$1 total=() n port pid out
  for n in $CG_SHORT $CG_LONG; do
    port=$(free_port)
    out="$work/callgrind.$case.$n"
    pid=$(start_proxy "$case" "$port" valgrind --tool=callgrind --callgrind-out-file="$out" -q)
    pids+=("$pid")
    wait_port "$port"
    python3 - "$port" "$n" "$(mode_of "$case")" "cg$RANDOM" <<'PY'
import http.client, json, sys
port, n, mode, tag = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
def send(i, key):
    headers = {"Content-Type": "application/json"}
    if key: headers["Idempotency-Key"] = key
    conn.request("POST", "/orders", body=json.dumps({"sku": f"{tag}-{i}", "qty": 1}), headers=headers)
    r = conn.getresponse(); r.read()
    assert 200 <= r.status < 300, r.status
if mode == "replay":
    for k in range(50): send(k, f"{tag}-k{k}")   # executed once each, then every request replays
for i in range(n):
    key = None if mode == "nokey" else (f"{tag}-{i}" if mode == "unique" else f"{tag}-k{i % 50}")
    send(i if mode != "replay" else i % 50, key)
PY
    kill -TERM "$pid"
    # Not a child of this shell (started in a command substitution): poll until callgrind has written its file.
    while kill -0 "$pid" 2>/dev/null; do sleep 0.2; done
    total+=("$(awk '/^summary:|^totals:/ { print $2; exit }' "$out")")
  done
  awk -v a="${total[0]}" -v b="${total[1]}" -v d=$((CG_LONG - CG_SHORT)) 'BEGIN { printf "%.0f", (b - a) / d }'
}

read -ra cases <<<"${CASES:-nginx nokey first replay redis}"
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
label() { case $1 in nginx) echo "nginx $(/usr/sbin/nginx -v 2>&1 | sed 's/.*nginx\///'), worker_processes 1, upstream keepalive" ;; nokey) echo "idem, no key (plain forwarding)" ;; first) echo "idem, first executions, embedded store" ;; replay) echo "idem, replays ($REPLAY_KEYS keys), embedded store" ;; redis) echo "idem, first executions, --store redis://" ;; esac; }
cat <<REPORT

== bench-proxy-cpu: $CONNECTIONS connections, $THREADS wrk threads, ${DURATION}s per run, $(nproc) cores, rev $(git -C "$repo" rev-parse --short HEAD)
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
