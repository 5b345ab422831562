#!/usr/bin/env bash
# `idem run` from a queue against a plain consumer on the same broker, the same items from a file and from a
# pipe, and GNU parallel fed the same ids on a pipe; messages (items) per second and CPU per message.
#   AMQP_URL (default amqp://guest:guest@127.0.0.1:5672/%2f) and NATS_URL (default nats://127.0.0.1:4222) name
#   the brokers; N (default 5000) the messages; ROUNDS (default 3) how often each is run, back to back;
#   IDEM and QUEUE the release binaries of idem and of the example `queue` (built when unset).
# Every run uses `--jobs 8` and the same trivial command, one `sh` per item writing one small JSON file. The
# plain consumer (crates/idem/examples/queue.rs `consume`) runs that command for each message and acknowledges
# it, with the same prefetch (16) and no ledger. CPU is the user + system time of the consumer and everything
# it ran (GNU time), divided by the messages; the broker's own CPU is not counted.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/idem-target}"
if ! command -v parallel >/dev/null; then
  apt-get update && apt-get install -y parallel
fi
# IDEM and QUEUE name binaries built already (release); otherwise they are built now.
if [ -z "${IDEM:-}" ] || [ -z "${QUEUE:-}" ]; then
  cargo build --release -p idem --bin idem --example queue >/dev/null
fi
idem="${IDEM:-$CARGO_TARGET_DIR/release/idem}"
queue="${QUEUE:-$CARGO_TARGET_DIR/release/examples/queue}"
amqp="${AMQP_URL:-amqp://guest:guest@127.0.0.1:5672/%2f}"
nats="${NATS_URL:-nats://127.0.0.1:4222}"
n="${N:-5000}"
mkdir -p idem-bench
work=$(mktemp -d "$PWD/idem-bench/queue.XXXXXX")
trap 'rm -rf "$work"' EXIT
seq 1 "$n" >"$work/ids.txt"

# measure NAME COMMAND…: runs it under GNU time; prints messages/s and CPU ms per message over $n.
measure() {
  local name=$1
  shift
  sync
  /usr/bin/time -f '%e %U %S' -o "$work/time" "$@" >/dev/null 2>"$work/err" || {
    cat "$work/err" >&2
    return 1
  }
  read -r wall user sys <"$work/time"
  printf '%-28s %8.1f msg/s  %5.2f ms CPU/msg  (%ss)\n' "$name" "$(echo "$n / $wall" | bc -l)" \
    "$(echo "($user + $sys) * 1000 / $n" | bc -l)" "$wall"
}

snippet='echo "{\"n\": $1}" > "$2"'
for round in $(seq 1 "${ROUNDS:-3}"); do
  echo "== round $round: $n messages, --jobs 8"
  d="$work/r$round"
  mkdir -p "$d/plain" "$d/par" "$d/nplain"
  q="$amqp?queue=idem-bench-$round-$$"
  "$queue" declare "$q" && "$queue" publish "$q" <"$work/ids.txt"
  measure "idem run, RabbitMQ" "$idem" run --items "$q" --until-empty --output "$d/amqp/{id}.json" --jobs 8 \
    --quiet -- sh -c "$snippet" sh '{id}' '{out}'
  "$queue" publish "$q" <"$work/ids.txt"
  measure "plain consumer, RabbitMQ" "$queue" consume "$q" --jobs 8 -- sh -c "$snippet" sh '{}' "$d/plain/{}.json"
  "$queue" delete "$q"
  s="$nats?stream=IDEMBENCH$round$$&consumer=bench"
  "$queue" declare "$s" && "$queue" publish "$s" <"$work/ids.txt"
  measure "idem run, NATS JetStream" "$idem" run --items "$s" --until-empty --output "$d/nats/{id}.json" \
    --jobs 8 --quiet -- sh -c "$snippet" sh '{id}' '{out}'
  "$queue" delete "$s"
  s="$nats?stream=IDEMBENCHP$round$$&consumer=plain"
  "$queue" declare "$s" && "$queue" publish "$s" <"$work/ids.txt"
  measure "plain consumer, NATS" "$queue" consume "$s" --jobs 8 -- sh -c "$snippet" sh '{}' "$d/nplain/{}.json"
  "$queue" delete "$s"
  measure "idem run, file" "$idem" run --items "$work/ids.txt" --output "$d/file/{id}.json" --jobs 8 --quiet \
    -- sh -c "$snippet" sh '{id}' '{out}'
  measure "idem run, pipe" sh -c "cat '$work/ids.txt' | '$idem' run --items - --output '$d/pipe/{id}.json' \
    --jobs 8 --quiet -- sh -c '$snippet' sh '{id}' '{out}'"
  measure "GNU parallel, pipe" sh -c "cat '$work/ids.txt' | PARALLEL_SHELL=/bin/sh parallel --jobs 8 \
    \"echo '{\\\"n\\\": {}}' > $d/par/{}.json\""
  for dir in amqp nats plain nplain file pipe par; do
    got=$(find "$d/$dir" -name '*.json' | wc -l)
    [ "$got" -eq "$n" ] || { echo "$dir: $got outputs, not $n" >&2; exit 1; }
  done
done
