#!/usr/bin/env bash
# The cost of an `idem once` invocation that finds its slot done (what every invocation but the first in a
# slot does: cron calling it every minute for a daily job), on the default SQLite store, against two
# baselines measured in the same hyperfine run: `idem --version` (the process's start and exit alone) and
# `flock -n FILE true` (the one-host tool teams use today, which knows nothing of slots). Then `idem once list`
# over JOBS jobs (default 1,000) in one store, against `idem once status` of one of them in the same run.
#
#   scripts/bench-once.sh                 # builds the release binary first
#   IDEM_BIN=path/to/idem scripts/bench-once.sh
#
# Installs hyperfine with apt-get when missing. Writes only under a mktemp -d directory.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v hyperfine >/dev/null; then
  echo "installing hyperfine (apt-get)" >&2
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq hyperfine
fi
if [ -z "${IDEM_BIN:-}" ]; then
  cargo build --release -p idem --bin idem >&2
  IDEM_BIN="$(realpath "${CARGO_TARGET_DIR:-target}/release/idem")"
fi
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
export XDG_STATE_HOME="$dir/state"
job="$IDEM_BIN once --name bench --every 366d"
$job -- true 2>/dev/null          # the first invocation runs the slot; every one after finds it done
$job -- true 2>&1 | grep -q 'done already' || { echo "the slot is not done" >&2; exit 1; }
hyperfine --warmup 20 --runs "${RUNS:-300}" -N --export-markdown "$dir/result.md" \
  -n 'idem once (slot done, SQLite)' "$job --quiet -- true" \
  -n 'idem --version (process start)' "$IDEM_BIN --version" \
  -n 'flock -n FILE true' "flock -n $dir/lock true" >&2
cat "$dir/result.md"
# JOBS jobs in one store (each made by its first invocation), then `list` against one job's `status`.
jobs="${JOBS:-1000}"
export IDEM_ONCE_STORE="sqlite:$dir/many.db"
for i in $(seq 1 "$jobs"); do echo "--name j$i --every 366d -- true"; done \
  | xargs -P 4 -L 1 "$IDEM_BIN" once --quiet 2>/dev/null
hyperfine --warmup 3 --runs "${LIST_RUNS:-30}" -N --export-markdown "$dir/list.md" \
  -n "idem once list ($jobs jobs)" "$IDEM_BIN once list" \
  -n 'idem once status (one job)' "$IDEM_BIN once status --name j1" >&2
"$IDEM_BIN" once list | tail -n +2 | wc -l | xargs echo "jobs listed:"
cat "$dir/list.md"
