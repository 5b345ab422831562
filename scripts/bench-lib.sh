# Shared by the benchmark scripts that start servers on loopback (scripts/bench-guard.sh, scripts/bench-page.sh):
# sourced, not run. `bench_setup NAME` makes a work directory ($work, /tmp/idem-bench-NAME.XXXXXX) and, on exit,
# kills the processes whose pids the script added to $pids and removes it; `free_port` prints a free loopback
# port; `wait_port PORT` waits up to 30 s for something to listen there, else exits 2. The script defines `log`.

bench_setup() {
  work=$(mktemp -d "/tmp/idem-bench-$1.XXXXXX")
  pids=()
  trap bench_cleanup EXIT
}

bench_cleanup() {
  local p
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf -- "$work"
}

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

wait_port() {
  local _
  for _ in $(seq 600); do (echo >"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.05; done
  log "port $1 never opened"
  exit 2
}
