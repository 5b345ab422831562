#!/usr/bin/env bash
# Builds idem (with the test-only feature planted-bugs) and the verification harness, and runs
# it: random concurrent clients against real idem processes under injected faults, their histories checked for
# linearizability (KV), exactly-once (proxy, runner) and each cron slot run once (once). See RELIABILITY.md.
#
#   scripts/verify.sh [--long] [--backend sqlite|postgres|redis|all|postgres-ha|redis-sentinel|redis-cluster|ha]
#                     [--workload kv|proxy|runner|once|all] [--seed N]
#                     [-- other idem-verify flags, e.g. --planted-bug kv-precondition, --no-durable]
#
# Default: every backend and workload for 20 s each (about 6 minutes); --long: 30 minutes in all, shared out.
# The highly available backends (ha: all three; a primary and two replicas or standbys) run one fault of theirs
# instead of the others, drawn from the seed and the workload (or -- --ha-fault K): failover (primary killed,
# a replica promoted), switchover (SENTINEL FAILOVER / CLUSTER FAILOVER [FORCE|TAKEOVER] / pg_ctl promote with
# the old primary alive, stopped 1-3 s later), replica-lag (a replica frozen, then a failover), replica-stop
# (a replica stopped, then a switchover), partition (old primary and one replica cut off from the other
# replica and the Sentinels, or on redis-cluster the other masters, while idem reaches them; the other
# promoted, healed).
# Durable setting by default (wait_replicas=all; PostgreSQL ANY 2 with synchronous_standbys=all: 0 anomalies
# expected); -- --no-durable [one|none] (wait_replicas=1 / FIRST 1 '*', or none / asynchronous) counts what
# the faults lose. The once workload (idem once: a few cron jobs invoked by concurrent processes, with pauses,
# triggers, backfills, clock skew through libfaketime on PostgreSQL and Redis) is described in
# docs/design/verification.md.
# Exit status: 0 nothing found, 1 an anomaly was found (the failure page's path is printed), 2 bad usage or a
# run that could not be set up (or checked nothing). The harness's own flags: scripts/verify.sh -- --help.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target}"
backend=all workload=all seed="" long=0 extra=()
usage() { sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'; }
# Bad usage is exit 2 (1 means an anomaly was found), so `${2:?}` (exit 1) is not used.
value() { [ $# -ge 2 ] && [ -n "$2" ] || { echo "verify.sh: $1 needs a value" >&2; exit 2; }; }
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --long) long=1 ;;
    --backend) value "$@"; backend="$2"; shift ;;
    --workload) value "$@"; workload="$2"; shift ;;
    --seed) value "$@"; seed="$2"; shift ;;
    --) shift; extra=("$@"); break ;;
    *) echo "verify.sh: unknown argument $1 (see the comment at the top of $0)" >&2; exit 2 ;;
  esac
  shift
done
args=()
count_b=3 count_w=4
case "$backend" in
  all) ;;
  sqlite|postgres|redis|postgres-ha|redis-sentinel|redis-cluster) args+=(--backend "$backend"); count_b=1 ;;
  ha) args+=(--backend postgres-ha --backend redis-sentinel --backend redis-cluster) ;;
  *) echo "verify.sh: --backend is sqlite, postgres, redis, all, postgres-ha, redis-sentinel, redis-cluster or ha, not $backend" >&2; exit 2 ;;
esac
case "$workload" in
  all) ;;
  kv|proxy|runner|once) args+=(--workload "$workload"); count_w=1 ;;
  *) echo "verify.sh: --workload is kv, proxy, runner, once or all, not $workload" >&2; exit 2 ;;
esac
[ -n "$seed" ] && args+=(--seed "$seed")
if [ "$long" = 1 ]; then
  args+=(--duration "$((1800 / (count_b * count_w)))s")
fi
cargo build -p idem --bin idem --features idem/planted-bugs -p idem-verify --bin idem-verify
exec "$CARGO_TARGET_DIR/debug/idem-verify" "${args[@]}" "${extra[@]}"
