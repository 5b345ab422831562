#!/usr/bin/env bash
# Highly available Redis against one Redis node, in one run on one machine: KV PUTs (new key each) and proxy
# first executions (`idem serve --upstream`, a new Idempotency-Key each) with the store on
#   single   one redis-server (no replica)
#   cluster  a Redis Cluster of 3 masters + 3 replicas (redis+cluster://)
#   wait0    one primary with one replica, no WAIT (redis://)
#   wait1    the same primary and replica, wait_replicas=1 (WAIT 1 after every write)
#   all1     a primary with one replica under a Sentinel, wait_replicas=all (the durable setting: WAIT 1)
#   all2     a primary with two replicas under a Sentinel, wait_replicas=all (WAIT 2)
# Reports, per case, requests/s and CPU per request (idem plus every redis-server of the case, utime + stime
# from /proc, the figure that does not move with the load of other jobs), and the ratios cluster/single,
# wait1/wait0 and all2/all1 (the cost of the durable setting with two replicas against one). Rounds alternate
# the cases so machine noise hits all of them.
#
#   scripts/bench-ha.sh                                  # builds idem and the example upstream (release)
#   IDEM=target/release/idem UPSTREAM=target/release/examples/upstream DURATION=10 ROUNDS=3 scripts/bench-ha.sh
#
# Needs redis-server and redis-cli; installs wrk with apt-get when missing. Talks to 127.0.0.1 only; every
# server it starts is killed on exit.
set -euo pipefail
DURATION=${DURATION:-10}
ROUNDS=${ROUNDS:-2}
CONNECTIONS=${CONNECTIONS:-32}
script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$script_dir/.." && pwd)
log() { printf '[bench-ha %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

if ! command -v wrk >/dev/null; then
  log "installing wrk (apt-get)"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk
fi

if [[ -z ${IDEM:-} || -z ${UPSTREAM:-} ]]; then
  export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/idem-target}
  log "building idem and the example upstream (release)"
  (cd "$repo" && cargo build --release -q -p idem --bin idem --example upstream)
  IDEM=${IDEM:-$CARGO_TARGET_DIR/release/idem}
  UPSTREAM=${UPSTREAM:-$CARGO_TARGET_DIR/release/examples/upstream}
fi

work=$(mktemp -d /tmp/idem-bench-ha.XXXXXX)
pids=()
# Redis servers are started inside command substitutions (subshells), whose additions to `pids` the EXIT trap
# never sees: each also writes its pid here.
cleanup() {
  for p in "${pids[@]}" $(cat "$work/pids" 2>/dev/null); do kill -9 "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf -- "$work"
}
trap cleanup EXIT

# A free port whose cluster bus port (+10000) is free too (a Cluster node listens on both).
free_port() {
  python3 -c '
import socket
while True:
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]
    if p > 55535: continue
    t = socket.socket()
    try: t.bind(("127.0.0.1", p + 10000))
    except OSError: continue
    print(p); break'
}

# redis-server on $1 with the rest as arguments, nothing saved; prints its pid (for the case's CPU count) and
# records it for the cleanup.
redis_node() {
  local port=$1
  shift
  redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --dir "$work" \
    --dbfilename "dump-$port.rdb" "$@" >"$work/redis-$port.log" 2>&1 &
  echo $! >>"$work/pids"
  echo $!
  until redis-cli -p "$port" ping >/dev/null 2>&1; do sleep 0.05; done
}

log "starting one node, a primary with a replica, two Sentinel sets (one and two replicas), and a 6-node Cluster"
single_port=$(free_port)
single_pids=$(redis_node "$single_port")
primary_port=$(free_port)
replica_port=$(free_port)
repl_pids="$(redis_node "$primary_port") $(redis_node "$replica_port" --replicaof 127.0.0.1 "$primary_port")"
until redis-cli -p "$replica_port" info replication | grep -q master_link_status:up; do sleep 0.1; done
cluster_ports=()
cluster_pids=""
for _ in 1 2 3 4 5 6; do
  p=$(free_port)
  cluster_ports+=("$p")
  cluster_pids="$cluster_pids $(redis_node "$p" --cluster-enabled yes --cluster-config-file "$work/nodes-$p.conf" --cluster-node-timeout 2000)"
done
redis-cli --cluster create $(printf '127.0.0.1:%s ' "${cluster_ports[@]}") --cluster-replicas 1 --cluster-yes >"$work/cluster-create.log"
for p in "${cluster_ports[@]}"; do
  until redis-cli -p "$p" cluster info | grep -q cluster_state:ok; do sleep 0.1; done
done
# A primary with $2 replicas and one Sentinel (quorum 1: nothing fails over here, it only names the master and
# lists the replicas) under master name $1; prints "sentinel-port pids".
sentinel_set() {
  local name=$1 replicas=$2 primary sentinel p set_pids
  primary=$(free_port)
  set_pids=$(redis_node "$primary")
  for _ in $(seq "$replicas"); do
    p=$(free_port)
    set_pids="$set_pids $(redis_node "$p" --replicaof 127.0.0.1 "$primary")"
    until redis-cli -p "$p" info replication | grep -q master_link_status:up; do sleep 0.1; done
  done
  sentinel=$(free_port)
  printf 'port %s\nbind 127.0.0.1\ndir %s\nsentinel monitor %s 127.0.0.1 %s 1\n' "$sentinel" "$work" "$name" "$primary" \
    >"$work/sentinel-$name.conf"
  redis-server "$work/sentinel-$name.conf" --sentinel >"$work/sentinel-$name.log" 2>&1 &
  echo $! >>"$work/pids"
  until [[ $(redis-cli -p "$sentinel" sentinel replicas "$name" 2>/dev/null | grep -c '^name$') == "$replicas" ]]; do sleep 0.1; done
  echo "$sentinel $set_pids"
}
read -r all1_sentinel all1_pids <<<"$(sentinel_set one 1)"
read -r all2_sentinel all2_pids <<<"$(sentinel_set two 2)"
cluster_url="redis+cluster://$(printf '127.0.0.1:%s,' "${cluster_ports[@]}")"
cluster_url=${cluster_url%,}

declare -A url redis_pids
url[single]="redis://127.0.0.1:$single_port"
url[cluster]=$cluster_url
url[wait0]="redis://127.0.0.1:$primary_port"
url[wait1]="redis://127.0.0.1:$primary_port?wait_replicas=1&wait_timeout_ms=1000"
url[all1]="redis+sentinel://127.0.0.1:$all1_sentinel/one?wait_replicas=all&wait_timeout_ms=1000"
url[all2]="redis+sentinel://127.0.0.1:$all2_sentinel/two?wait_replicas=all&wait_timeout_ms=1000"
redis_pids[single]=$single_pids
redis_pids[cluster]=$cluster_pids
redis_pids[wait0]=$repl_pids
redis_pids[wait1]=$repl_pids
redis_pids[all1]=$all1_pids
redis_pids[all2]=$all2_pids
cases=(single cluster wait0 wait1 all1 all2)

up_port=$(free_port)
"$UPSTREAM" --listen "127.0.0.1:$up_port" >"$work/upstream.log" 2>&1 &
pids+=($!)

cpu_ticks() { local s=0 p; for p in "$@"; do s=$((s + $(awk '{print $14 + $15}' "/proc/$p/stat"))); done; echo $s; }
hz=$(getconf CLK_TCK)

# One measured run: case, workload (kv|first), round. Appends "case workload rps us_per_request" to results.
measure() {
  local case=$1 workload=$2 round=$3 port admin idem_pid out ok before after lua args
  port=$(free_port)
  admin=$(free_port)
  if [[ $workload == kv ]]; then
    # Without --upstream the KV API and /healthz are on --listen.
    admin=$port
    IDEM_LOG=warn "$IDEM" serve --listen "127.0.0.1:$port" \
      --store "${url[$case]}" --namespace "b$round$workload" >"$work/idem-$case.log" 2>&1 &
    lua=$script_dir/wrk/put.lua args=(idem 128 "$case$round")
  else
    IDEM_LOG=warn "$IDEM" serve --listen "127.0.0.1:$port" --admin-listen "127.0.0.1:$admin" \
      --upstream "http://127.0.0.1:$up_port" --store "${url[$case]}" --namespace "b$round$workload" \
      >"$work/idem-$case.log" 2>&1 &
    lua=$script_dir/wrk/orders.lua args=(unique 1000 "$case$round")
  fi
  idem_pid=$!
  pids+=("$idem_pid")
  until curl -sf "http://127.0.0.1:$admin/healthz" >/dev/null 2>&1; do sleep 0.05; done
  # shellcheck disable=SC2086 # the pid lists are space-separated on purpose
  before=$(cpu_ticks "$idem_pid" ${redis_pids[$case]})
  out=$(wrk -t2 -c"$CONNECTIONS" -d"${DURATION}s" --timeout 10s -s "$lua" "http://127.0.0.1:$port" -- "${args[@]}" 2>&1)
  # shellcheck disable=SC2086
  after=$(cpu_ticks "$idem_pid" ${redis_pids[$case]})
  kill "$idem_pid"
  wait "$idem_pid" 2>/dev/null || true
  ok=$(grep -o ' ok=[0-9]*' <<<"$out" | head -1 | cut -d= -f2)
  grep -q 'non2xx=0' <<<"$out" || { log "$case $workload: non-2xx answers: $out"; exit 3; }
  awk -v c="$case" -v w="$workload" -v ok="$ok" -v d="$DURATION" -v a="$after" -v b="$before" -v hz="$hz" \
    'BEGIN { printf "%s %s %.0f %.1f\n", c, w, ok / d, (a - b) / hz * 1e6 / ok }' >>"$work/results"
  log "$case $workload round $round: $(tail -1 "$work/results")"
}

for round in $(seq "$ROUNDS"); do
  for workload in kv first; do
    for case in "${cases[@]}"; do measure "$case" "$workload" "$round"; done
  done
done

avg() { awk -v c="$1" -v w="$2" -v f="$3" '$1 == c && $2 == w { s += $f; n++ } END { printf "%.1f", s / n }' "$work/results"; }
echo
echo "== bench-ha: $CONNECTIONS connections, ${DURATION}s x $ROUNDS rounds, $(nproc) cores, rev $(git -C "$repo" rev-parse --short HEAD), $(redis-server --version | awk '{print $3}')"
echo "| workload | case | req/s | CPU us/request (idem + redis) |"
echo "|---|---|---:|---:|"
for workload in kv first; do
  for case in "${cases[@]}"; do
    echo "| $workload | $case | $(avg "$case" "$workload" 3) | $(avg "$case" "$workload" 4) |"
  done
done
echo
echo "| workload | cluster / single req/s | cluster / single CPU per request | wait1 / wait0 req/s | wait1 / wait0 CPU per request | all2 / all1 req/s | all2 / all1 CPU per request |"
echo "|---|---:|---:|---:|---:|---:|---:|"
for workload in kv first; do
  r() { awk -v a="$(avg "$1" "$workload" "$3")" -v b="$(avg "$2" "$workload" "$3")" 'BEGIN { printf "%.2f", a / b }'; }
  echo "| $workload | $(r cluster single 3) | $(r cluster single 4) | $(r wait1 wait0 3) | $(r wait1 wait0 4) | $(r all2 all1 3) | $(r all2 all1 4) |"
done
