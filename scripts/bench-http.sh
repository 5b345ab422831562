#!/usr/bin/env bash
# Durable PUT throughput over HTTP: `idem serve` (embedded SQLite) against a single-member etcd (its v3 JSON
# gateway), both with their default durability, both with their data on the same filesystem, both driven by
# the same wrk load: 64 connections, 2 threads, DURATION seconds, PUTs of 128-byte values on distinct keys.
#
#   scripts/bench-http.sh                 # 15 s per server
#   DURATION=30 scripts/bench-http.sh     # 30 s per server
#
# Environment:
#   DURATION          seconds of load per server (default 15; "15s" also accepted)
#   CARGO_TARGET_DIR  where the release build goes (default $HOME/.cache/idem-target)
#   BENCH_TMPDIR      parent of the temporary data directory (default /tmp, or the current directory when
#                     /tmp is a RAM filesystem, which would make a durability comparison meaningless)
#   VERIFY            1 (default): after each run, count the keys the server holds and compare with the
#                     2xx count; 0 skips it
#
# Installs wrk, etcd-server (and curl/jq if missing) with apt-get when they are not on PATH.
# Only talks to 127.0.0.1. Exit status: 0 when both runs finished with only 2xx responses (whether or not the
# throughput target was met), 1 when something broke, 3 when a run saw non-2xx responses or the key counts
# did not match.
set -euo pipefail

readonly CONNECTIONS=64
readonly THREADS=2
readonly VALUE_BYTES=128
readonly TARGET_RATIO=4
readonly KEY_TAG=bench

DURATION=${DURATION:-15}
DURATION=${DURATION%s}
if ! [[ $DURATION =~ ^[1-9][0-9]*$ ]]; then
  echo "bench-http: DURATION must be a whole number of seconds, got '${DURATION}'" >&2
  exit 1
fi
VERIFY=${VERIFY:-1}

script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$script_dir/.." && pwd)
lua="$script_dir/wrk/put.lua"
[[ -f $lua ]] || { echo "bench-http: missing $lua" >&2; exit 1; }

log() { printf '[bench-http %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
loud() {
  printf '\n' >&2
  printf '!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!\n' >&2
  printf '!!! %s\n' "$@" >&2
  printf '!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!\n\n' >&2
}

# ---------------------------------------------------------------- 1. tools
need_pkgs=()
command -v wrk >/dev/null 2>&1 || need_pkgs+=(wrk)
command -v etcd >/dev/null 2>&1 || need_pkgs+=(etcd-server)
command -v curl >/dev/null 2>&1 || need_pkgs+=(curl)
command -v jq >/dev/null 2>&1 || need_pkgs+=(jq)
if ((${#need_pkgs[@]})); then
  sudo=()
  if ((EUID != 0)); then
    command -v sudo >/dev/null 2>&1 || die "need root or sudo to install: ${need_pkgs[*]}"
    sudo=(sudo)
  fi
  log "installing ${need_pkgs[*]} (apt-get)"
  "${sudo[@]}" apt-get update
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y "${need_pkgs[@]}"
fi
etcd_version=$(etcd --version | sed -n 's/^etcd Version: //p')
etcd_pkg=$(dpkg-query -W -f='${Version}' etcd-server 2>/dev/null || echo "not from a package")
wrk_version=$( (wrk -v 2>&1 || true) | head -n1 | sed 's/ Copyright.*//')
[[ -n $etcd_version ]] || die "cannot read etcd's version from 'etcd --version'"
# The JSON gateway lives under /v3/ from etcd 3.4 on (3.3 used /v3beta/, 3.2 /v3alpha/).
IFS=. read -r etcd_major etcd_minor _ <<<"$etcd_version"
if ((etcd_major < 3 || (etcd_major == 3 && etcd_minor < 4))); then
  die "etcd $etcd_version: its JSON gateway is not at /v3/kv/put (needs etcd >= 3.4)"
fi

# ---------------------------------------------------------------- 2. build idem
CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/idem-target}
[[ $CARGO_TARGET_DIR == /* ]] || CARGO_TARGET_DIR="$PWD/$CARGO_TARGET_DIR"
export CARGO_TARGET_DIR
log "building idem (release) into $CARGO_TARGET_DIR"
(cd "$repo" && cargo build --release -p idem)
idem_bin="$CARGO_TARGET_DIR/release/idem"
[[ -x $idem_bin ]] || die "no binary at $idem_bin after the build"
idem_version=$("$idem_bin" --version 2>/dev/null || echo "idem (unknown version)")
git_rev=$(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown)
git -C "$repo" diff --quiet HEAD -- crates Cargo.toml Cargo.lock 2>/dev/null || git_rev="$git_rev+uncommitted changes"

# ---------------------------------------------------------------- 3. scratch space, cleanup
if [[ -n ${BENCH_TMPDIR:-} ]]; then
  parent=$BENCH_TMPDIR
else
  parent=/tmp
  case $(df -PT /tmp 2>/dev/null | awk 'NR == 2 {print $2}') in
    tmpfs | ramfs) parent=$PWD ;;
  esac
fi
work=$(mktemp -d "$parent/idem-bench-http.XXXXXX")
idem_pid=""
etcd_pid=""
wrk_pid=""
cpu_idem="?"
cpu_etcd="?"
# shellcheck disable=SC2034  # read through ${!other_var} in the summary
cpu_other_idem=0 cpu_other_etcd=0

stop_pid() { # pid name: SIGTERM, up to 15 s for a graceful stop, then SIGKILL
  local pid=$1 name=$2 i
  [[ -n $pid ]] || return 0
  kill -0 "$pid" 2>/dev/null || return 0
  kill -TERM "$pid" 2>/dev/null || true
  for ((i = 0; i < 150; i++)); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  if kill -0 "$pid" 2>/dev/null; then
    log "$name (pid $pid) ignored SIGTERM for 15 s; killing it"
    kill -KILL "$pid" 2>/dev/null || true
  fi
  wait "$pid" 2>/dev/null || true
}
# shellcheck disable=SC2317  # invoked by the EXIT trap
cleanup() {
  local rc=$?
  [[ -z ${wrk_pid:-} ]] || kill -TERM "$wrk_pid" 2>/dev/null || true
  stop_pid "$idem_pid" idem
  stop_pid "$etcd_pid" etcd
  [[ -n ${work:-} && -d $work ]] && rm -rf -- "$work"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# df -T names the mounted type (ext4, xfs, tmpfs, ...); stat -f cannot tell ext2/3/4 apart.
fs_type=$(df -PT "$work" | awk 'NR == 2 {print $2}')
fs_dev=$(df -PT "$work" | awk 'NR == 2 {print $1 " mounted on " $7}')
fs_line="$work ($fs_type, $fs_dev)"
log "data of both servers under $fs_line"
case $fs_type in
  tmpfs | ramfs) loud "the data directory is on $fs_type: fsync is free there, so this is no durability benchmark" ;;
esac
mkdir -p "$work/idem"
mkdir -m 700 "$work/etcd" # the permission etcd asks for

port_in_use() {
  if command -v ss >/dev/null 2>&1; then
    [[ -n $(ss -Htan "( sport = :$1 )" 2>/dev/null) ]]
  else
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
  fi
}
free_port() {
  local p i
  for ((i = 0; i < 200; i++)); do
    p=$((20000 + RANDOM % 40000))
    port_in_use "$p" || { echo "$p"; return 0; }
  done
  return 1
}

vm_field() { awk -v f="$2:" '$1 == f {print $2 " " $3}' "/proc/$1/status"; }

# CPU accounting, so that a run disturbed by other work on the machine shows. From /proc/stat: jiffies in
# processes (user+nice+system), in interrupts (irq+softirq: much of it is the loopback traffic itself) and
# stolen by the hypervisor; from /proc/PID/stat: the server's jiffies and every other process's; from `times`:
# the seconds of this shell's reaped children (wrk).
clk_tck=$(getconf CLK_TCK)
cpu_fields() { awk '$1 == "cpu" {print $2 + $3 + $4, $7 + $8, $9; exit}' /proc/stat; }
proc_cpu() { sed 's/.*) //' "/proc/$1/stat" | awk '{print $12 + $13}'; }
snap_procs() { # "pid comm jiffies" for every process, into $1
  { cat /proc/[0-9]*/stat 2>/dev/null || true; } | awk '{
    l = $0; pid = l + 0; c = l; sub(/^[^(]*\(/, "", c); sub(/\) [^)]*$/, "", c); gsub(/[^A-Za-z0-9_.:\/-]/, "_", c)
    r = l; sub(/^.*\) /, "", r); split(r, f, " "); print pid, c, f[12] + f[13] }' >"$1"
}
children_cpu() { # into $1; `times` must run in this shell (a $(...) subshell would see its own children)
  times >"$work/times"
  printf -v "$1" '%s' "$(awk 'NR == 2 {
    s = 0; for (i = 1; i <= 2; i++) { split($i, a, /[ms]/); s += a[1] * 60 + a[2] } printf "%.2f", s }' "$work/times")"
}

# wrk with the shared Lua script; prints wrk's report, keeps the WRK_RESULT line in $4, sets cpu_<mode> to
# a description of where the machine's CPU time went during the run and cpu_other_<mode> to the seconds
# that neither the server nor wrk used (other processes plus steal).
run_wrk() { # mode url server-pid result-file
  local mode=$1 url=$2 spid=$3 out=$4 rc=0 f0 f1 srv0 srv1 kids0 kids1 top
  log "wrk -t$THREADS -c$CONNECTIONS -d${DURATION}s --latency against $mode at $url"
  f0=$(cpu_fields) srv0=$(proc_cpu "$spid")
  snap_procs "$work/procs0"
  children_cpu kids0
  # In the background and waited for, so that a signal to this script runs the cleanup at once.
  wrk -t"$THREADS" -c"$CONNECTIONS" -d"${DURATION}s" --timeout 10s --latency -s "$lua" "$url" \
    -- "$mode" "$VALUE_BYTES" "$KEY_TAG" >"$out" 2>&1 &
  wrk_pid=$!
  wait "$wrk_pid" || rc=$?
  wrk_pid=""
  f1=$(cpu_fields) srv1=$(proc_cpu "$spid")
  snap_procs "$work/procs1"
  children_cpu kids1
  # The three busiest other processes (by CPU used during the run), e.g. "rustc 6.1 s, cargo 0.4 s".
  # Keyed by pid alone: a kernel worker renames itself after its current work queue.
  top=$(awk -v skip="$spid" 'NR == FNR {a[$1] = $3; next}
      $1 != skip { d = $3 - a[$1]; if (d > 0) printf "%d %s\n", d, $2 }' "$work/procs0" "$work/procs1" |
    awk -v hz="$clk_tck" '{t[$2] += $1} END {for (c in t) if (t[c] * 10 >= hz) print t[c], c}' | sort -rn | head -n 3 |
    awk -v hz="$clk_tck" '{printf "%s%s %.1f s", (NR > 1 ? ", " : ""), $2, $1 / hz}')
  read -r p0 i0 st0 <<<"$f0"
  read -r p1 i1 st1 <<<"$f1"
  local desc
  desc=$(awk -v p="$((p1 - p0))" -v i="$((i1 - i0))" -v st="$((st1 - st0))" -v s="$((srv1 - srv0))" \
    -v k0="$kids0" -v k1="$kids1" -v hz="$clk_tck" -v n="$(nproc)" -v d="$DURATION" 'BEGIN {
      p /= hz; i /= hz; st /= hz; s /= hz; w = k1 - k0; o = p - s - w; if (o < 0) o = 0
      printf "%.1f|server %.1f s, wrk %.1f s, other processes %.1f s, interrupts %.1f s, steal %.1f s (of %d s on %d CPUs)",
        o + st, s, w, o, i, st, n * d, n }')
  printf -v "cpu_other_$mode" '%s' "${desc%%|*}"
  printf -v "cpu_$mode" '%s' "${desc#*|}${top:+
                             busiest other processes: $top}"
  sed 's/^/    /' "$out" >&2
  ((rc == 0)) || die "wrk against $mode exited with status $rc"
  grep -q '^WRK_RESULT ' "$out" || die "wrk against $mode printed no WRK_RESULT line"
}
# The value put.lua writes: its pattern repeated and cut to VALUE_BYTES.
value_pattern=0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ
expected_value=""
while ((${#expected_value} < VALUE_BYTES)); do expected_value+=$value_pattern; done
expected_value=${expected_value:0:VALUE_BYTES}
field() { grep '^WRK_RESULT ' "$1" | tr ' ' '\n' | sed -n "s/^$2=//p"; }

# ---------------------------------------------------------------- 4a. etcd
# First, because its check afterwards is quick: the two runs then follow each other closely.
etcd_client_port=$(free_port) || die "no free loopback port for etcd"
etcd_peer_port=$(free_port) || die "no free loopback port for etcd"
[[ $etcd_peer_port != "$etcd_client_port" ]] || etcd_peer_port=$(free_port)
etcd_url="http://127.0.0.1:$etcd_client_port"
peer_url="http://127.0.0.1:$etcd_peer_port"
log "starting etcd $etcd_version: client $etcd_url, peer $peer_url, data $work/etcd"
etcd --name idem-bench --data-dir "$work/etcd" \
  --listen-client-urls "$etcd_url" --advertise-client-urls "$etcd_url" \
  --listen-peer-urls "$peer_url" --initial-advertise-peer-urls "$peer_url" \
  --initial-cluster "idem-bench=$peer_url" --initial-cluster-state new \
  --logger zap --log-outputs stderr --log-level warn \
  >"$work/etcd.out" 2>"$work/etcd.err" &
etcd_pid=$!
healthy=0
for ((i = 0; i < 300; i++)); do
  if curl -sS --max-time 2 "$etcd_url/health" 2>/dev/null | grep -q '"health":"true"'; then
    healthy=1
    break
  fi
  kill -0 "$etcd_pid" 2>/dev/null || { tail -n 30 "$work/etcd.err" >&2; die "etcd exited before becoming healthy"; }
  sleep 0.1
done
((healthy)) || { tail -n 30 "$work/etcd.err" >&2; die "etcd was not healthy within 30 s"; }
b64() { printf '%s' "$1" | base64 -w0; }
probe=$(curl -sS --max-time 5 -o /dev/null -w '%{http_code}' -X POST -H 'Content-Type: application/json' \
  -d "{\"key\":\"$(b64 probe/1)\",\"value\":\"$(b64 probe)\"}" "$etcd_url/v3/kv/put")
[[ $probe == 2?? ]] || die "etcd: probe POST /v3/kv/put answered $probe"
log "etcd (pid $etcd_pid) healthy at $etcd_url"

run_wrk etcd "$etcd_url" "$etcd_pid" "$work/wrk-etcd.txt"
etcd_hwm=$(vm_field "$etcd_pid" VmHWM)
etcd_stored="skipped"
if [[ $VERIFY == 1 ]]; then
  body=$(curl -sS --fail --max-time 30 -X POST -H 'Content-Type: application/json' \
    -d "{\"key\":\"$(b64 "$KEY_TAG/")\",\"range_end\":\"$(b64 "$KEY_TAG"0)\",\"count_only\":true}" \
    "$etcd_url/v3/kv/range") || die "etcd: counting keys failed"
  etcd_stored=$(jq -r '.count // "0"' <<<"$body")
  body=$(curl -sS --fail --max-time 5 -X POST -H 'Content-Type: application/json' \
    -d "{\"key\":\"$(b64 "$KEY_TAG/0/2")\"}" "$etcd_url/v3/kv/range") || die "etcd: reading a key back failed"
  got=$(jq -r '.kvs[0].value // ""' <<<"$body" | base64 -d)
  [[ $got == "$expected_value" ]] || loud "etcd: $KEY_TAG/0/2 holds '$got', expected '$expected_value'"
fi
stop_pid "$etcd_pid" etcd
etcd_pid=""
etcd_db_size=$(du -sh "$work/etcd" | cut -f1)

# ---------------------------------------------------------------- 4b. idem
log "starting idem: $idem_bin serve --listen 127.0.0.1:0 --store sqlite:$work/idem/idem.db"
# Created here, not only by the redirect below: the background child may open it after the first poll.
: >"$work/idem.out"
IDEM_LOG=warn "$idem_bin" serve --listen 127.0.0.1:0 --store "sqlite:$work/idem/idem.db" \
  >"$work/idem.out" 2>"$work/idem.err" &
idem_pid=$!
idem_addr=""
for ((i = 0; i < 300; i++)); do
  idem_addr=$(sed -n 's|^idem listening on http://\([^ ]*\).*|\1|p' "$work/idem.out" | head -n1)
  [[ -n $idem_addr ]] && break
  kill -0 "$idem_pid" 2>/dev/null || { cat "$work/idem.err" >&2; die "idem exited before listening"; }
  sleep 0.1
done
[[ -n $idem_addr ]] || { cat "$work/idem.err" >&2; die "idem printed no 'idem listening on' line within 30 s"; }
idem_url="http://$idem_addr"
[[ $(curl -sS --max-time 5 "$idem_url/healthz") == ok ]] || die "idem: GET /healthz did not answer ok"
probe=$(curl -sS --max-time 5 -o /dev/null -w '%{http_code}' -X PUT --data-binary probe "$idem_url/v1/kv/probe%2F1")
[[ $probe == 2?? ]] || die "idem: probe PUT /v1/kv/probe%2F1 answered $probe"
log "idem (pid $idem_pid) listening on $idem_url"

run_wrk idem "$idem_url" "$idem_pid" "$work/wrk-idem.txt"
idem_hwm=$(vm_field "$idem_pid" VmHWM)
idem_rss="$(vm_field "$idem_pid" VmRSS): anonymous $(vm_field "$idem_pid" RssAnon), file-backed $(vm_field "$idem_pid" RssFile)"
idem_stored="skipped"
if [[ $VERIFY == 1 ]]; then
  # Count keys under "bench/" page by page (1000 a page, bounded by the number of 2xx + a margin).
  idem_stored=0
  cursor=""
  max_pages=$(($(field "$work/wrk-idem.txt" ok) / 1000 + 10))
  for ((page = 0; page < max_pages; page++)); do
    args=(--data-urlencode "prefix=$KEY_TAG/" --data-urlencode "limit=1000")
    [[ -n $cursor ]] && args+=(--data-urlencode "cursor=$cursor")
    body=$(curl -sS --fail --max-time 30 -G "${args[@]}" "$idem_url/v1/kv") || die "idem: listing keys failed"
    idem_stored=$((idem_stored + $(jq '.items | length' <<<"$body")))
    cursor=$(jq -r '.next_cursor // empty' <<<"$body")
    [[ -n $cursor ]] || break
  done
  [[ -z $cursor ]] || idem_stored="$idem_stored+ (stopped after $max_pages pages)"
  # One value read back. Key <tag>/0/2, not /0/1: wrk calls request() once on thread 0 before the run to
  # check the script, and that first request is never sent.
  got=$(curl -sS --fail --max-time 5 "$idem_url/v1/kv/$KEY_TAG%2F0%2F2") || got="(request failed)"
  [[ $got == "$expected_value" ]] || loud "idem: GET $KEY_TAG/0/2 returned '$got', expected '$expected_value'"
fi
idem_stop_start=$(date +%s.%N)
stop_pid "$idem_pid" idem
idem_stop_s=$(awk -v a="$idem_stop_start" -v b="$(date +%s.%N)" 'BEGIN {printf "%.1f", b - a}')
idem_pid=""
idem_db_size=$(du -sh "$work/idem" | cut -f1)

# ---------------------------------------------------------------- 5. summary
status=0
for mode in idem etcd; do
  f="$work/wrk-$mode.txt"
  non2xx=$(field "$f" non2xx)
  ok=$(field "$f" ok)
  if ((non2xx > 0)); then
    loud "$mode answered $non2xx NON-2xx responses: these runs do not measure what they claim" \
      "$(grep '^WRK_NON2XX' "$f" || true)"
    status=3
  fi
  if ((ok == 0)); then
    loud "$mode answered no 2xx response at all"
    status=3
  fi
  other_var="cpu_other_$mode"
  if awk -v o="${!other_var}" -v lim="$(awk -v n="$(nproc)" -v d="$DURATION" 'BEGIN {print 0.1 * n * d}')" \
    'BEGIN { exit !(o > lim) }'; then
    loud "$mode's run shared the machine: other processes used ${!other_var} CPU-seconds during it" \
      "(with steal; more than 10% of the $(nproc) x ${DURATION} s available): its numbers are low, the ratio skewed"
  fi
  errs=$(($(field "$f" err_connect) + $(field "$f" err_read) + $(field "$f" err_write) + $(field "$f" err_timeout)))
  ((errs == 0)) || loud "$mode: wrk counted $errs socket errors (connect/read/write/timeout): see its report above"
done
idem_ok=$(field "$work/wrk-idem.txt" ok)
etcd_ok=$(field "$work/wrk-etcd.txt" ok)
# Every 2xx must be a stored key. A few more may be stored: the requests still in flight when wrk stopped
# (at most one per connection) were committed but never counted.
if [[ $VERIFY == 1 ]]; then
  for pair in "idem $idem_stored $idem_ok" "etcd $etcd_stored $etcd_ok"; do
    read -r m stored ok <<<"$pair"
    if ! [[ $stored =~ ^[0-9]+$ ]] || ((stored < ok || stored > ok + CONNECTIONS)); then
      loud "$m holds $stored keys under $KEY_TAG/ but answered 2xx $ok times (expected $ok..$((ok + CONNECTIONS)))"
      status=3
    fi
  done
fi

idem_rps=$(field "$work/wrk-idem.txt" ok_rps)
etcd_rps=$(field "$work/wrk-etcd.txt" ok_rps)
ratio=$(awk -v a="$idem_rps" -v b="$etcd_rps" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "inf" }')
met=$(awk -v r="$ratio" -v t="$TARGET_RATIO" 'BEGIN { print (r == "inf" || r + 0 >= t) ? "MET" : "NOT MET" }')

row() { # mode file stored hwm db
  local f=$2
  printf '%-5s %12s %9s %9s %9s %9s %9s %7s %11s %8s %s\n' "$1" "$(field "$f" ok_rps)" \
    "$(field "$f" ok)" "$(field "$f" non2xx)" "$(field "$f" p50_ms)" "$(field "$f" p90_ms)" \
    "$(field "$f" p99_ms)" "$(field "$f" duration_s)" "$3" "$5" "$4"
}

cat <<EOF

==================== bench-http summary ====================
load        wrk, $THREADS threads, $CONNECTIONS connections, ${DURATION} s per server, one run each (etcd first),
            PUTs of $VALUE_BYTES-byte values on distinct keys ($KEY_TAG/<thread>/<n>); only 2xx counted as success
idem        $idem_version, git $git_rev, release build $idem_bin
            idem serve --store sqlite:... (WAL, synchronous=FULL); PUT /v1/kv/{key}
etcd        etcd $etcd_version (Debian package etcd-server $etcd_pkg), single member, default durability
            (fsync on every commit), JSON gateway POST /v3/kv/put
wrk         $wrk_version
data dir    both under $fs_line
machine     $(nproc) CPUs, $(uname -sr); wrk runs on the same machine and competes for its CPUs
cpu time    during idem's run: $cpu_idem
            during etcd's run: $cpu_etcd
            ("other processes" or "steal" well above 1 s: other work on the machine disturbed the run)

server  ok puts/s   2xx      non-2xx   p50 ms    p90 ms    p99 ms    secs    keys stored  disk     peak RSS (VmHWM)
$(row idem "$work/wrk-idem.txt" "$idem_stored" "$idem_hwm" "$idem_db_size")
$(row etcd "$work/wrk-etcd.txt" "$etcd_stored" "$etcd_hwm" "$etcd_db_size")

idem VmHWM (peak RSS) after its run: $idem_hwm (VmRSS then $idem_rss)
idem stopped ${idem_stop_s} s after SIGTERM
ratio idem/etcd (successful puts/s): $ratio   target >= ${TARGET_RATIO}x: $met
============================================================
EOF
((status == 0)) || loud "bench-http: finished with problems (exit status $status); see the warnings above"
exit "$status"
