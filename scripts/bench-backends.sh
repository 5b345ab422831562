#!/usr/bin/env bash
# Conditional updates/s through idem's PostgreSQL and Redis backends at 1, 16 and 64 writers (distinct keys and
# one hot key), each beside the backend's own baseline measured in the same run:
#   PostgreSQL: pgbench with a single-row `UPDATE ... WHERE id = ...` script (one row per client, or one row for all)
#   Redis:      redis-benchmark SET (random keys, or one key)
# Needs the servers of IDEM_TEST_POSTGRES_URL / IDEM_TEST_REDIS_URL (defaults: the loopback ones).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/idem-target}"
PG_URL="${IDEM_TEST_POSTGRES_URL:-postgres://postgres@127.0.0.1:5432/test}"
REDIS_URL="${IDEM_TEST_REDIS_URL:-redis://127.0.0.1:6379}"
SECS="${SECS:-3}"
WRITERS=(1 16 64)
NS=idem_bench

cargo build --release -p idem --bins >/dev/null
idem="$CARGO_TARGET_DIR/release/idem"
pgbench=$(command -v pgbench || find /usr/lib/postgresql -path '*/bin/pgbench' | sort | tail -1)
work=$(mktemp -d)
cleanup() {
  psql -q "$PG_URL" -c "DROP SCHEMA IF EXISTS $NS CASCADE; DROP TABLE IF EXISTS idem_bench_baseline" >/dev/null 2>&1 || true
  redis-cli -u "$REDIS_URL" --scan --pattern "$NS:*" | xargs -r -n 500 redis-cli -u "$REDIS_URL" del >/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

# idem's figure for (backend, keys, writers) from its Markdown table.
idem_rate() { awk -F'|' -v name="$2" -v w="$3" 'index($2, name) && $3+0 == w {gsub(/ /, "", $4); print $4}' "$1"; }

echo "== idem bench on PostgreSQL ($SECS s per case)"
"$idem" bench --store "$PG_URL" --namespace "$NS" --seconds "$SECS" --writers 1,16,64 | tee "$work/pg.md"
psql -q "$PG_URL" <<'SQL' >/dev/null
DROP TABLE IF EXISTS idem_bench_baseline;
CREATE TABLE idem_bench_baseline (id int PRIMARY KEY, v bytea NOT NULL, generation bigint NOT NULL);
INSERT INTO idem_bench_baseline SELECT g, '\x00', 0 FROM generate_series(1, 64) g;
SQL
# shellcheck disable=SC2016 # $$ is PostgreSQL's dollar quoting, not the shell's
echo 'UPDATE idem_bench_baseline SET v = decode(repeat($$76$$, 128), $$hex$$), generation = generation + 1 WHERE id = :client_id + 1;' >"$work/distinct.sql"
# shellcheck disable=SC2016
echo 'UPDATE idem_bench_baseline SET v = decode(repeat($$76$$, 128), $$hex$$), generation = generation + 1 WHERE id = 1;' >"$work/hot.sql"
pg_tps() { "$pgbench" -n -M prepared -c "$2" -j 2 -T "$SECS" -f "$work/$1.sql" "$PG_URL" 2>/dev/null | awk '/^tps/ {print int($3)}'; }

echo "== redis-benchmark and idem bench on Redis"
"$idem" bench --store "$REDIS_URL" --namespace "$NS" --seconds "$SECS" --writers 1,16,64 | tee "$work/redis.md"
redis_rps() {
  local extra=()
  [ "$1" = distinct ] && extra=(-r 1000000)
  redis-benchmark -u "$REDIS_URL" -t set -c "$2" -n $((20000 * $2 > 300000 ? 300000 : 20000 * $2)) -d 128 "${extra[@]}" --csv 2>/dev/null |
    awk -F'","' '/^"SET"/ {print int($2)}'
}

echo
echo "| backend | keys | writers | idem updates/s | baseline ops/s | idem / baseline |"
echo "|---|---|---:|---:|---:|---:|"
for keys in distinct hot; do
  name="CAS put, distinct keys"; [ "$keys" = hot ] && name="update(), one hot key"
  for w in "${WRITERS[@]}"; do
    i=$(idem_rate "$work/pg.md" "$name" "$w"); b=$(pg_tps "$keys" "$w")
    echo "| PostgreSQL (pgbench UPDATE) | $keys | $w | $i | $b | $(awk -v i="$i" -v b="$b" 'BEGIN {printf "%.2f", i / b}') |"
  done
  for w in "${WRITERS[@]}"; do
    i=$(idem_rate "$work/redis.md" "$name" "$w"); b=$(redis_rps "$keys" "$w")
    echo "| Redis (redis-benchmark SET) | $keys | $w | $i | $b | $(awk -v i="$i" -v b="$b" 'BEGIN {printf "%.2f", i / b}') |"
  done
done
echo
echo "target: idem >= 0.50 x baseline on distinct keys"
echo "versions: $("$pgbench" --version), $(redis-server --version | awk '{print $1, $2, $3}')"
