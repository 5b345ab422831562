#!/usr/bin/env bash
# KV PUTs over TLS with keep-alive against the same load in plain HTTP, in one run, and TLS handshakes per
# second on new connections. One `idem serve --store memory:` per mode (no fsync, so the HTTP and TLS work is
# what is measured), wrk on the same 2 cores, rounds alternating plain/TLS so machine noise hits both.
#
#   scripts/bench-tls.sh                     # idem from PATH, 10 s per round, 2 rounds
#   IDEM=target/release/idem DURATION=15 ROUNDS=3 scripts/bench-tls.sh
#
# Prints, per round and mode: requests/s (2xx only), server CPU seconds and CPU microseconds per request; then
# the TLS/plain ratios, and handshakes/s (wrk with `Connection: close`: one full handshake per request).
# Needs wrk and openssl (apt-get install wrk openssl). Only talks to 127.0.0.1.
set -euo pipefail
IDEM=${IDEM:-idem}
DURATION=${DURATION:-10}
ROUNDS=${ROUNDS:-2}
CONNECTIONS=${CONNECTIONS:-32}
lua="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/wrk/put.lua"
dir=$(mktemp -d)
trap 'kill $plain_pid $tls_pid 2>/dev/null || true; rm -rf "$dir"' EXIT
cd "$dir"
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 -subj /CN=localhost \
  -addext subjectAltName=IP:127.0.0.1 -keyout key.pem -out cert.pem 2>/dev/null
"$IDEM" serve --listen 127.0.0.1:18480 --store memory: >/dev/null 2>&1 & plain_pid=$!
"$IDEM" serve --listen 127.0.0.1:18443 --store memory: --tls-cert cert.pem --tls-key key.pem >/dev/null 2>&1 & tls_pid=$!
until curl -sf http://127.0.0.1:18480/healthz >/dev/null && curl -sfk https://127.0.0.1:18443/healthz >/dev/null; do
  sleep 0.1
done
cpu() { awk '{print $14 + $15}' "/proc/$1/stat"; }   # utime + stime, clock ticks
hz=$(getconf CLK_TCK)
run() { # mode pid url tag [wrk args...]
  local mode=$1 pid=$2 url=$3 tag=$4; shift 4
  local before after out ok
  before=$(cpu "$pid")
  out=$(wrk -t2 -c"$CONNECTIONS" -d"${DURATION}s" "$@" -s "$lua" "$url" -- idem 128 "$tag" 2>&1)
  after=$(cpu "$pid")
  ok=$(grep -o 'ok=[0-9]*' <<<"$out" | head -1 | cut -d= -f2)
  local rps cpu_s us
  rps=$(awk -v ok="$ok" -v d="$DURATION" 'BEGIN{printf "%.0f", ok/d}')
  cpu_s=$(awk -v a="$after" -v b="$before" -v hz="$hz" 'BEGIN{printf "%.2f", (a-b)/hz}')
  us=$(awk -v c="$cpu_s" -v ok="$ok" 'BEGIN{printf "%.1f", c*1e6/ok}')
  grep -q 'non2xx=0' <<<"$out" || { echo "$mode: non-2xx answers: $out" >&2; exit 3; }
  printf '%-16s %8s req/s  server CPU %6s s  %6s us/request\n' "$mode" "$rps" "$cpu_s" "$us"
  echo "$mode $rps $us" >>results
}
for r in $(seq "$ROUNDS"); do
  run "plain keep-alive" "$plain_pid" http://127.0.0.1:18480 "p$r"
  run "TLS keep-alive" "$tls_pid" https://127.0.0.1:18443 "t$r"
done
awk '$1=="plain"{p+=$3; pu+=$4} $1=="TLS"{t+=$3; tu+=$4}
     END{printf "TLS/plain throughput: %.2f   CPU per request TLS/plain: %.2f\n", t/p, tu/pu}' results
# Handshakes: GET /healthz with `Connection: close`, so every request is a new connection and a full TLS 1.3
# handshake (wrk does not resume sessions).
before=$(cpu "$tls_pid")
out=$(wrk -t2 -c"$CONNECTIONS" -d"${DURATION}s" -H 'Connection: close' https://127.0.0.1:18443/healthz 2>&1)
after=$(cpu "$tls_pid")
n=$(awk '/requests in/{print $1}' <<<"$out")
grep -q 'Non-2xx' <<<"$out" && { echo "handshakes: non-2xx answers: $out" >&2; exit 3; }
awk -v n="$n" -v d="$DURATION" -v a="$after" -v b="$before" -v hz="$hz" \
  'BEGIN{printf "TLS handshakes/s (new connection per request): %.0f, server CPU %.0f us per connection\n", n/d, (a-b)/hz*1e6/n}'
grep -i 'socket errors' <<<"$out" || true
