#!/usr/bin/env bash
# What the operator's pages cost the proxy's request path: first executions through `idem serve --upstream`
# (SQLite store, wrk with 64 connections) with and without a browser's worth of page loads on the admin
# listener (the overview and the records list, each loaded every PAGE_EVERY seconds: default 5, an operator
# clicking through; 0.5 for someone holding F5), alternating in one run, so both
# halves of a round meet the same machine. Prints requests/s and the proxy's CPU time per request (utime +
# stime from /proc, the page loads' own cost included) for each, and the per-round ratios with/without.
#
#   scripts/bench-page.sh            # 4 rounds of 8 s each
#   ROUNDS=6 DURATION=10 PAGE_EVERY=0.5 IDEM_BIN=target/release/idem scripts/bench-page.sh
#
# Needs wrk (installed with apt-get when missing) and curl. Talks to 127.0.0.1 only.
set -euo pipefail
ROUNDS=${ROUNDS:-4}
DURATION=${DURATION:-8}
PAGE_EVERY=${PAGE_EVERY:-5}
script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$script_dir/.." && pwd)
log() { printf '[bench-page %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
command -v wrk >/dev/null || { log "installing wrk"; apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk; }
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/idem-target}
if [[ -n ${IDEM_BIN:-} ]]; then
  (cd "$repo" && cargo build --release -q -p idem --example upstream)
else
  (cd "$repo" && cargo build --release -q -p idem --bin idem --example upstream)
fi
idem=${IDEM_BIN:-$CARGO_TARGET_DIR/release/idem}
# shellcheck source=scripts/bench-lib.sh
source "$script_dir/bench-lib.sh"
bench_setup page
cpu_of() { awk -v hz="$(getconf CLK_TCK)" '{ printf "%.4f", ($14 + $15) / hz }' "/proc/$1/stat"; }
field() { sed -n "s/.* $2=\([^ ]*\).*/\1/p" <<<"$1"; }

up=$(free_port) port=$(free_port) admin=$(free_port)
"$CARGO_TARGET_DIR/release/examples/upstream" --listen "127.0.0.1:$up" >"$work/upstream.log" 2>&1 &
pids+=($!)
IDEM_LOG=warn "$idem" serve --listen "127.0.0.1:$port" --admin-listen "127.0.0.1:$admin" \
  --upstream "http://127.0.0.1:$up" --store "sqlite:$work/idem.db" >"$work/idem.log" 2>&1 &
proxy=$!
pids+=("$proxy")
wait_port "$up"
wait_port "$port"
wait_port "$admin"
lua="$script_dir/wrk/orders.lua"
log "warming up (3 s)"
wrk -t2 -c64 -d3s -s "$lua" "http://127.0.0.1:$port" -- unique 1000 warm >/dev/null
curl -sf -o /dev/null "http://127.0.0.1:$admin/ui/records" || { log "the records page does not answer"; exit 1; }

# One wrk run; with "page", a reader loads the overview and the records list every PAGE_EVERY seconds meanwhile.
run() { # tag page|none
  local reader=0 before after out line requests
  if [[ $2 == page ]]; then
    (while :; do
      curl -s -o /dev/null "http://127.0.0.1:$admin/ui/"
      curl -s -o /dev/null "http://127.0.0.1:$admin/ui/records"
      sleep "$PAGE_EVERY"
    done) &
    reader=$!
  fi
  before=$(cpu_of "$proxy")
  out=$(wrk -t2 -c64 -d"${DURATION}s" -s "$lua" "http://127.0.0.1:$port" -- unique 1000 "$1")
  after=$(cpu_of "$proxy")
  if ((reader)); then kill "$reader"; wait "$reader" 2>/dev/null || true; fi
  line=$(grep '^WRK_RESULT' <<<"$out")
  requests=$(field "$line" requests)
  awk -v r="$(field "$line" ok_rps)" -v c="$(awk -v a="$before" -v b="$after" 'BEGIN { print b - a }')" -v n="$requests" \
    'BEGIN { printf "%.0f %.1f\n", r, c * 1e6 / n }'
}
printf '| round | without the page: req/s, CPU µs/req | with it: req/s, CPU µs/req | req/s with/without | CPU with/without |\n|---|---|---|---:|---:|\n'
for r in $(seq 1 "$ROUNDS"); do
  if ((r % 2)); then a=$(run "n$r" none); b=$(run "p$r" page); else b=$(run "p$r" page); a=$(run "n$r" none); fi
  read -r ra ca <<<"$a"
  read -r rb cb <<<"$b"
  printf '| %s | %s, %s | %s, %s | %s | %s |\n' "$r" "$ra" "$ca" "$rb" "$cb" \
    "$(awk -v a="$rb" -v b="$ra" 'BEGIN { printf "%.3f", a / b }')" "$(awk -v a="$cb" -v b="$ca" 'BEGIN { printf "%.3f", a / b }')"
done
