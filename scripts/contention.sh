#!/usr/bin/env bash
# 64 clients x 100 items appended to one key of a fresh `idem serve` (embedded SQLite), with conditional PUTs
# and then with plain PUTs; prints both counts and the server's peak resident memory (VmHWM).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/idem-target}"
cargo build --release -p idem --bins --examples
bin="$CARGO_TARGET_DIR/release"
work=$(mktemp -d)
log="$work/serve.log"
trap 'kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; rm -rf "$work"' EXIT
"$bin/idem" serve --listen 127.0.0.1:0 --store "sqlite:$work/idem.db" >"$log" 2>"$work/serve.err" &
pid=$!
for _ in $(seq 1 100); do grep -q 'listening on' "$log" && break; sleep 0.1; done
url=$(grep -o 'http://[0-9.:]*' "$log" | head -1)
[ -n "$url" ] || { cat "$work/serve.err"; exit 1; }
"$bin/examples/contention" --url "$url" --clients "${CLIENTS:-64}" --items "${ITEMS:-100}"
echo "idem serve peak resident memory: $(awk '/VmHWM/ {printf "%.1f MiB", $2/1024}' /proc/$pid/status)"
