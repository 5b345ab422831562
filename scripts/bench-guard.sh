#!/usr/bin/env bash
# The hot paths' regression guard: user-space instructions (valgrind callgrind) per proxy first execution on
# SQLite and on Redis, per replay, per KV PUT and per `idem run` item, against the figures recorded in
# scripts/guard-baseline.txt. Instruction counts, unlike wall or CPU time, do not move with this machine's
# load: the same build counts the same to within about 1% (see BENCHMARKS.md, "The hot paths' guard").
#
#   scripts/bench-guard.sh              # counts the current build; exit 1 when any path is more than 5% worse
#   scripts/bench-guard.sh --record     # counts it and writes the figures as the new baseline
#
# Environment: IDEM_BIN (a prebuilt idem instead of building one; the example upstream the proxy cases forward
# to is still built, at once when it was built before), CARGO_TARGET_DIR, REDIS_URL (default
# redis://127.0.0.1:6379; it must answer: a guard that skips a path would pass a regression), CASES (a subset
# of "first-sqlite first-redis replay kv-put run-item"), LIMIT (percent, default 5).
# Exit status: 0 every path within the limit (or recorded), 1 a path worse than the limit, 2 a usage error or
# a case that could not be measured. Installs valgrind with apt-get when missing. Talks to 127.0.0.1 only.
set -euo pipefail

readonly KNOWN="first-sqlite first-redis replay kv-put run-item"
LIMIT=${LIMIT:-5}
REDIS_URL=${REDIS_URL:-redis://127.0.0.1:6379}
record=0
case ${1:-} in
  "") ;;
  --record) record=1 ;;
  *)
    echo "bench-guard: unknown argument ${1@Q} (usage: scripts/bench-guard.sh [--record])" >&2
    exit 2
    ;;
esac
read -ra cases <<<"${CASES:-$KNOWN}"
if ((${#cases[@]} == 0)); then
  # A guard that measured nothing would pass anything.
  echo "bench-guard: CASES names no case (known: $KNOWN)" >&2
  exit 2
fi
for c in "${cases[@]}"; do
  if [[ " $KNOWN " != *" $c "* ]]; then
    echo "bench-guard: unknown case ${c@Q} in CASES (known: $KNOWN)" >&2
    exit 2
  fi
done
if ! [[ $LIMIT =~ ^[0-9]+(\.[0-9]+)?$ ]]; then
  echo "bench-guard: LIMIT must be a percentage such as 5, not ${LIMIT@Q}" >&2
  exit 2
fi
script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$script_dir/.." && pwd)
baseline="$script_dir/guard-baseline.txt"
log() { printf '[bench-guard %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

if ! command -v valgrind >/dev/null; then
  log "installing valgrind (apt-get)"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq valgrind
fi
if [[ " ${cases[*]} " == *" first-redis "* ]] && ! redis-cli -u "$REDIS_URL" ping >/dev/null 2>&1; then
  echo "bench-guard: Redis at $REDIS_URL does not answer; start one or leave first-redis out of CASES" >&2
  exit 2
fi
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/idem-target}
if [[ -z ${IDEM_BIN:-} ]]; then
  log "building idem and the example upstream (release)"
  (cd "$repo" && cargo build --release -q -p idem --bin idem --example upstream)
fi
idem=${IDEM_BIN:-$CARGO_TARGET_DIR/release/idem}
# shellcheck source=scripts/bench-lib.sh
source "$script_dir/bench-lib.sh"
bench_setup guard
callgrind=(valgrind --tool=callgrind -q)
total_of() { awk '/^summary:|^totals:/ { print $2; exit }' "$1"; }

# Instructions per KV PUT: `idem serve` on a SQLite file with one worker, collection switched on after 200
# warm-up PUTs, 1,000 unconditional PUTs of a small JSON value to keys of their own, dumped, divided.
kv_put() {
  local port pid out="$work/callgrind.kv"
  port=$(free_port)
  TOKIO_WORKER_THREADS=1 IDEM_LOG=warn "${callgrind[@]}" --instr-atstart=no --callgrind-out-file="$out" \
    "$idem" serve --listen "127.0.0.1:$port" --store "sqlite:$work/kv.db" >"$work/kv.log" 2>&1 &
  pid=$!
  pids+=("$pid")
  wait_port "$port"
  python3 - "$port" "$pid" 200 1000 <<'PY'
import http.client, subprocess, sys
port, pid, warmup, n = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
def put(i):
    conn.request("PUT", f"/v1/kv/orders/{i}", body=b'{"qty":1}', headers={"Content-Type": "application/json"})
    r = conn.getresponse(); r.read()
    assert r.status == 201, r.status
for i in range(warmup): put(i)
subprocess.run(["callgrind_control", "-i", "on", pid], check=True, capture_output=True)
for i in range(warmup, warmup + n): put(i)
subprocess.run(["callgrind_control", "-d", pid], check=True, capture_output=True)
PY
  kill -TERM "$pid"
  wait "$pid" 2>/dev/null || true
  awk -v t="$(total_of "$out.1")" 'BEGIN { printf "%.0f", t / 1000 }'
}

# Instructions per `idem run` item: the difference between runs of 600 and 100 items divided by 500, so the
# start-up (opening the ledger, reading the file twice) cancels out. `--jobs 1` and one tokio worker, each
# item writing its output with one `sh` (a child: not counted; callgrind follows no child).
run_item() {
  local n dir totals=()
  for n in 100 600; do
    dir="$work/run$n"
    mkdir -p "$dir"
    seq 1 "$n" >"$dir/items.txt"
    (cd "$dir" && TOKIO_WORKER_THREADS=1 "${callgrind[@]}" --callgrind-out-file="$dir/cg.out" "$idem" run \
      --items items.txt --output 'out/{id}.txt' --jobs 1 --quiet -- sh -c 'echo x > "$1"' sh '{out}') \
      >"$dir/log" 2>&1 || { log "run-item: idem run over $n items failed: $(tail -3 "$dir/log")"; exit 2; }
    totals+=("$(total_of "$dir/cg.out")")
  done
  awk -v a="${totals[0]}" -v b="${totals[1]}" 'BEGIN { printf "%.0f", (b - a) / 500 }'
}

declare -A now
proxy_cases=()
for c in "${cases[@]}"; do
  case $c in
    first-sqlite) proxy_cases+=(first) ;;
    first-redis) proxy_cases+=(redis) ;;
    replay) proxy_cases+=(replay) ;;
  esac
done
if ((${#proxy_cases[@]})); then
  # One sequential keep-alive client, 200 warm-up requests, 1,000 counted: bench-proxy.sh's own method.
  while read -r c n; do
    case $c in first) now[first-sqlite]=$n ;; redis) now[first-redis]=$n ;; *) now[$c]=$n ;; esac
  done < <(CALLGRIND_ONLY=1 CASES="${proxy_cases[*]}" IDEM_BIN="$idem" REDIS_URL="$REDIS_URL" "$script_dir/bench-proxy.sh")
fi
for c in "${cases[@]}"; do
  case $c in
    kv-put) log "counting the instructions of a KV PUT"; now[kv-put]=$(kv_put) ;;
    run-item) log "counting the instructions of a runner item"; now[run-item]=$(run_item) ;;
  esac
  if [[ -z ${now[$c]:-} || ${now[$c]} == 0 ]]; then
    echo "bench-guard: $c was not measured" >&2
    exit 2
  fi
done

rev=$(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown)
if ((record)); then
  {
    if [[ -n ${IDEM_BIN:-} ]]; then
      built="the binary $IDEM_BIN, the repository at rev $rev"
    else
      built="built from rev $rev$(git -C "$repo" diff --quiet HEAD -- crates Cargo.toml Cargo.lock 2>/dev/null || echo ' with uncommitted changes')"
    fi
    echo "# Instructions per operation, counted by scripts/bench-guard.sh --record ($(date -u +%F); $built)."
    echo "# case instructions"
    for c in "${cases[@]}"; do echo "$c ${now[$c]}"; done
  } >"$baseline"
  log "recorded in $baseline"
  cat "$baseline"
  exit 0
fi
if [[ ! -f $baseline ]]; then
  echo "bench-guard: no baseline at $baseline; record one with --record" >&2
  exit 2
fi
worse=0
printf '| path | baseline | now (rev %s) | change |\n|---|---:|---:|---:|\n' "$rev"
for c in "${cases[@]}"; do
  base=$(awk -v c="$c" '$1 == c { print $2 }' "$baseline")
  if [[ -z $base ]]; then
    echo "bench-guard: $baseline has no figure for $c; record one with --record" >&2
    exit 2
  fi
  change=$(awk -v a="${now[$c]}" -v b="$base" 'BEGIN { printf "%+.1f", (a - b) * 100 / b }')
  verdict=""
  if awk -v ch="$change" -v l="$LIMIT" 'BEGIN { exit !(ch > l) }'; then
    verdict=" **worse than ${LIMIT}%**"
    worse=1
  fi
  printf '| %s | %s | %s | %s%%%s |\n' "$c" "$base" "${now[$c]}" "$change" "$verdict"
done
exit $worse
