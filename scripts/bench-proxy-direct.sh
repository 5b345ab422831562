#!/usr/bin/env bash
# Idempotency-Key proxy overhead: the same wrk load (64 connections, 2 threads, POST /orders with JSON bodies)
# straight at the example upstream and through `idem serve --upstream` on the embedded SQLite store, in one
# run on one machine. Reports throughput ratios and p50/p99 for first executions (a new key per request) and
# for replays (keys already completed), for two upstreams: the example as it is (in memory, nearly free per
# request) and the example persisting each order durably (--sqlite, like a real write API); then drives a
# proxy to a million requests and reads its memory.
#
#   scripts/bench-proxy-direct.sh                    # 15 s per measured run, then the million-request phase
#   DURATION=30 MILLION=0 scripts/bench-proxy-direct.sh
#
# Environment: DURATION (seconds per run, default 15), MILLION (1: run up to 1,000,000 proxied requests and
# report RSS, default 1), CARGO_TARGET_DIR (default $HOME/.cache/idem-target), BENCH_TMPDIR (parent of the
# data directory, default /tmp). Installs wrk with apt-get if missing. Talks to 127.0.0.1 only.
set -euo pipefail

readonly CONNECTIONS=64 THREADS=2 REPLAY_KEYS=1000
DURATION=${DURATION:-15}
MILLION=${MILLION:-1}
script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$script_dir/.." && pwd)
lua="$script_dir/wrk/orders.lua"
log() { printf '[bench-proxy-direct %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

if ! command -v wrk >/dev/null; then
  log "installing wrk (apt-get)"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk
fi

export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/idem-target}
log "building idem and the example upstream (release)"
(cd "$repo" && cargo build --release -q -p idem --bin idem --example upstream)
idem="$CARGO_TARGET_DIR/release/idem"
upstream_bin="$CARGO_TARGET_DIR/release/examples/upstream"

work=$(mktemp -d "${BENCH_TMPDIR:-/tmp}/idem-bench-proxy-direct.XXXXXX")
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  pkill -f -- "$work" 2>/dev/null || true
  wait 2>/dev/null || true
  rm -rf -- "$work"
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

run() { # name url mode seconds tag -> prints the WRK_RESULT line
  local name=$1 url=$2 mode=$3 secs=$4 tag=$5 out line
  out=$(wrk -t$THREADS -c$CONNECTIONS -d"${secs}s" --timeout 10s --latency -s "$lua" "$url" -- "$mode" "$REPLAY_KEYS" "$tag")
  line=$(grep '^WRK_RESULT' <<<"$out")
  grep '^WRK_SAMPLE' <<<"$out" >&2 || true
  log "$name: $line"
  echo "$line"
}
field() { sed -n "s/.* $2=\([^ ]*\).*/\1/p" <<<"$1"; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", a / b }'; }
added() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", a - b }'; }
row() { # label direct-line proxy-line
  echo "| $1 | $(field "$2" ok_rps) | $(field "$3" ok_rps) | $(ratio "$(field "$3" ok_rps)" "$(field "$2" ok_rps)") | $(field "$2" p50_ms) / $(field "$2" p99_ms) | $(field "$3" p50_ms) / $(field "$3" p99_ms) | $(added "$(field "$3" p99_ms)" "$(field "$2" p99_ms)") | $(field "$2" non2xx) / $(field "$3" non2xx) |"
}

# Starts a fresh upstream (extra args: $@) and a fresh proxy on a fresh database; sets up_port, proxy_port,
# admin_port, proxy_pid.
start_pair() {
  local dir
  dir=$(mktemp -d "$work/pair.XXXX")
  up_port=$(free_port) proxy_port=$(free_port) admin_port=$(free_port)
  "$upstream_bin" --listen "127.0.0.1:$up_port" "$@" >"$dir/upstream.log" 2>&1 &
  up_pid=$!
  pids+=("$up_pid")
  IDEM_LOG=warn "$idem" serve --listen "127.0.0.1:$proxy_port" --admin-listen "127.0.0.1:$admin_port" \
    --upstream "http://127.0.0.1:$up_port" --store "sqlite:$dir/idem.db" >"$dir/idem.log" 2>&1 &
  proxy_pid=$!
  pids+=("$proxy_pid")
  for _ in $(seq 100); do
    curl -sf "http://127.0.0.1:$admin_port/healthz" >/dev/null 2>&1 && curl -sf "http://127.0.0.1:$up_port/executions" >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  log "servers did not start: $(cat "$dir"/*.log)"
  exit 1
}

# One upstream flavour: first executions and replays, direct and proxied. Prints two table rows.
measure() { # label upstream-args...
  local label=$1
  shift
  start_pair "$@"
  local direct="http://127.0.0.1:$up_port" proxied="http://127.0.0.1:$proxy_port" tag="t$RANDOM"
  local d_first p_first d_replay p_replay d_plain p_plain
  d_plain=$(run "$label direct-nokey" "$direct" nokey "$DURATION" "n$tag")
  p_plain=$(run "$label proxy-nokey" "$proxied" nokey "$DURATION" "n$tag")
  d_first=$(run "$label direct-first" "$direct" unique "$DURATION" "d$tag")
  p_first=$(run "$label proxy-first" "$proxied" unique "$DURATION" "p$tag")
  run "$label warm-up (each replay key executed once)" "$proxied" replay 3 "r$tag" >/dev/null
  d_replay=$(run "$label direct-replay" "$direct" replay "$DURATION" "r$tag")
  p_replay=$(run "$label proxy-replay" "$proxied" replay "$DURATION" "r$tag")
  row "$label, no key (plain forwarding)" "$d_plain" "$p_plain"
  row "$label, first executions (new key each)" "$d_first" "$p_first"
  row "$label, replays ($REPLAY_KEYS keys)" "$d_replay" "$p_replay"
  log "$label upstream counts: $(curl -s "$direct/executions")"
  # measure runs in a command substitution: its servers are not in the parent's pid list.
  kill "$up_pid" "$proxy_pid" 2>/dev/null || true
  wait "$up_pid" "$proxy_pid" 2>/dev/null || true
}

log "data under $work ($(df -PT "$work" | awk 'NR==2{print $2}'))"
memory_rows=$(measure "in-memory upstream")
durable_rows=$(measure "durable upstream (--sqlite)" --sqlite "$work/orders.db")
cat <<REPORT

== bench-proxy-direct: $CONNECTIONS connections, $THREADS wrk threads, ${DURATION}s per run, $(nproc) cores, rev $(git -C "$repo" rev-parse --short HEAD), load before: $load_before
| load | direct req/s | proxy req/s | ratio | direct p50 / p99 ms | proxy p50 / p99 ms | added p99 ms | non-2xx direct / proxy |
|---|---|---|---|---|---|---|---|
$memory_rows
$durable_rows
REPORT

if [[ $MILLION == 1 ]]; then
  start_pair
  proxied="http://127.0.0.1:$proxy_port"
  proxied_total() {
    curl -s "http://127.0.0.1:$admin_port/metrics" | awk '/^idem_http_requests_total\{/ && /route="proxy"/ {s += $NF} END {printf "%d", s}'
  }
  round=0
  while (($(proxied_total) < 1000000)); do
    round=$((round + 1))
    if ((round % 2)); then run "million-$round" "$proxied" unique 20 "m$round" >/dev/null; else run "million-$round" "$proxied" replay 20 r >/dev/null; fi
  done
  rss=$(awk '/^VmRSS/ {printf "%.1f MiB", $2 / 1024}' "/proc/$proxy_pid/status")
  hwm=$(awk '/^VmHWM/ {printf "%.1f MiB", $2 / 1024}' "/proc/$proxy_pid/status")
  echo "after $(proxied_total) proxied requests (alternating 20 s of new keys and 20 s of replays, in-memory upstream): proxy RSS $rss, peak $hwm; databases $(du -sh "$work" | cut -f1)"
fi
