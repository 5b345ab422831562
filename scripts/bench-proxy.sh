#!/usr/bin/env bash
# Idempotency-Key proxy overhead: the same wrk load (64 connections, 2 threads, POST /orders with JSON bodies)
# straight at the example upstream and through `idem serve --upstream` on the embedded SQLite store, in one
# run on one machine. Reports throughput ratios and p50/p99 for first executions (a new key per request) and
# for replays (keys already completed), then drives the proxy to a million requests and reads its memory.
#
#   scripts/bench-proxy.sh                    # 15 s per measured run, then the million-request phase
#   DURATION=30 MILLION=0 scripts/bench-proxy.sh
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
log() { printf '[bench-proxy %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

if ! command -v wrk >/dev/null; then
  log "installing wrk (apt-get)"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk
fi

export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/idem-target}
log "building idem and the example upstream (release)"
(cd "$repo" && cargo build --release -q -p idem --bin idem --example upstream)
idem="$CARGO_TARGET_DIR/release/idem"
upstream_bin="$CARGO_TARGET_DIR/release/examples/upstream"

work=$(mktemp -d "${BENCH_TMPDIR:-/tmp}/idem-bench-proxy.XXXXXX")
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf -- "$work"
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
up_port=$(free_port)
proxy_port=$(free_port)
admin_port=$(free_port)
"$upstream_bin" --listen "127.0.0.1:$up_port" >"$work/upstream.log" 2>&1 &
pids+=($!)
IDEM_LOG=warn "$idem" serve --listen "127.0.0.1:$proxy_port" --admin-listen "127.0.0.1:$admin_port" \
  --upstream "http://127.0.0.1:$up_port" --store "sqlite:$work/idem.db" >"$work/idem.log" 2>&1 &
proxy_pid=$!
pids+=("$proxy_pid")
for _ in $(seq 100); do
  curl -sf "http://127.0.0.1:$admin_port/healthz" >/dev/null 2>&1 && curl -sf "http://127.0.0.1:$up_port/executions" >/dev/null 2>&1 && break
  sleep 0.1
done
log "upstream :$up_port, proxy :$proxy_port (admin :$admin_port), data in $work ($(df -PT "$work" | awk 'NR==2{print $2}'))"

run() { # name url mode seconds [tag] -> prints the WRK_RESULT line
  local name=$1 url=$2 mode=$3 secs=$4 tag=${5:-$1}
  local out
  out=$(wrk -t$THREADS -c$CONNECTIONS -d"${secs}s" --timeout 10s --latency -s "$lua" "$url" -- "$mode" "$REPLAY_KEYS" "$tag")
  local line
  line=$(grep '^WRK_RESULT' <<<"$out")
  grep '^WRK_SAMPLE' <<<"$out" >&2 || true
  log "$name: $line"
  echo "$line"
}
field() { sed -n "s/.* $2=\([^ ]*\).*/\1/p" <<<"$1"; }

direct="http://127.0.0.1:$up_port"
proxied="http://127.0.0.1:$proxy_port"
d_first=$(run direct-first "$direct" unique "$DURATION" d)
p_first=$(run proxy-first "$proxied" unique "$DURATION" p)
log "warming up the replay keys (each executed once)"
run warm "$proxied" replay 3 r >/dev/null
d_replay=$(run direct-replay "$direct" replay "$DURATION" r)
p_replay=$(run proxy-replay "$proxied" replay "$DURATION" r)

ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", a / b }'; }
added() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", a - b }'; }
exec_count=$(curl -s "http://127.0.0.1:$up_port/executions")
cat <<REPORT

== bench-proxy: $CONNECTIONS connections, $THREADS wrk threads, ${DURATION}s per run, $(nproc) cores, rev $(git -C "$repo" rev-parse --short HEAD)
| load | direct req/s | proxy req/s | ratio | direct p50 / p99 ms | proxy p50 / p99 ms | added p99 ms |
|---|---|---|---|---|---|---|
| first executions (new key each) | $(field "$d_first" ok_rps) | $(field "$p_first" ok_rps) | $(ratio "$(field "$p_first" ok_rps)" "$(field "$d_first" ok_rps)") | $(field "$d_first" p50_ms) / $(field "$d_first" p99_ms) | $(field "$p_first" p50_ms) / $(field "$p_first" p99_ms) | $(added "$(field "$p_first" p99_ms)" "$(field "$d_first" p99_ms)") |
| replays ($REPLAY_KEYS keys) | $(field "$d_replay" ok_rps) | $(field "$p_replay" ok_rps) | $(ratio "$(field "$p_replay" ok_rps)" "$(field "$d_replay" ok_rps)") | $(field "$d_replay" p50_ms) / $(field "$d_replay" p99_ms) | $(field "$p_replay" p50_ms) / $(field "$p_replay" p99_ms) | $(added "$(field "$p_replay" p99_ms)" "$(field "$d_replay" p99_ms)") |
non-2xx: direct $(field "$d_first" non2xx)+$(field "$d_replay" non2xx), proxy $(field "$p_first" non2xx)+$(field "$p_replay" non2xx); upstream counts: $exec_count
REPORT

if [[ $MILLION == 1 ]]; then
  proxied_total() {
    curl -s "http://127.0.0.1:$admin_port/metrics" | awk '/^idem_http_requests_total\{/ && /route="proxy"/ {s += $NF} END {printf "%d", s}'
  }
  round=0
  while (($(proxied_total) < 1000000)); do
    round=$((round + 1))
    if ((round % 2)); then run "million-$round" "$proxied" unique 20 "m$round" >/dev/null; else run "million-$round" "$proxied" replay 20 r >/dev/null; fi
  done
  rss=$(awk '/^VmRSS/ {print $2 / 1024 " MiB"}' "/proc/$proxy_pid/status")
  hwm=$(awk '/^VmHWM/ {print $2 / 1024 " MiB"}' "/proc/$proxy_pid/status")
  echo "after $(proxied_total) proxied requests (half new keys, half replays): proxy RSS $rss, peak $hwm; database $(du -sh "$work" | cut -f1)"
fi
