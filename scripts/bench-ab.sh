#!/usr/bin/env bash
# Two revisions of `idem run` side by side in one run, on the same input files, alternating:
#
#   scripts/bench-ab.sh REV_A REV_B [--items N] [--rounds K] [--bench dry-run|throughput|resume] [--build-only]
#
# Each revision is built (release profile, the repository's own LTO settings) in a git worktree of its own under a
# temporary directory, with CARGO_TARGET_DIR=$HOME/.cache/bench-ab/<commit> (a new one starts as a copy of the last
# one built, so that only what changed is compiled); the binary is kept there, so a commit already built is not
# built again (set CARGO_BUILD_JOBS=1 on a shared machine). The input files are made
# once; then K rounds run A and B in turn (A B, B A, A B, ...: neither always goes first) and the script prints,
# per binary, the median wall time, CPU time (user + system) and peak RSS (GNU time), the median ratio B/A and the
# per-round ratios (the fair figure when the machine's speed drifts: both halves of a round ran under the same
# load), and the load average before and after.
#
# Benches (the commands of scripts/bench-run.sh, BENCHMARKS.md "The work runner"):
#   dry-run     `idem run --items items.txt --output 'D/{id}.json' --dry-run -- false` over N items (default
#               200000); nothing runs, each item is judged against an empty ledger and printed (to /dev/null).
#   throughput  N trivial items (default 10000), --jobs 8, one `sh` per item writing a small JSON file, into a
#               fresh output directory each run (a `sync` before each run).
#   resume      a pass over N done items (default 100000): the outputs and each binary's own ledger are made once
#               (untimed: outputs written by awk, then adopted by one run), then every timed pass finds them done.
# Work files go to ./idem-bench (the repository's disk), removed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD

usage() { sed -n '2,4p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
[ $# -ge 2 ] || usage
rev_a=$1 rev_b=$2
shift 2
items='' rounds=5 bench=dry-run build_only=0
while [ $# -gt 0 ]; do
  case $1 in
    --items) items=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --bench) bench=$2; shift 2 ;;
    --build-only) build_only=1; shift ;;
    *) usage ;;
  esac
done
case $bench in
  dry-run) items=${items:-200000} ;;
  throughput) items=${items:-10000} ;;
  resume) items=${items:-100000} ;;
  *) usage ;;
esac

tmp=$(mktemp -d)
mkdir -p idem-bench
work=$(mktemp -d "$PWD/idem-bench/ab.XXXXXX")
cleanup() {
  rm -rf "$work"
  for w in "$tmp"/src-*; do [ -d "$w" ] && git -C "$repo" worktree remove --force "$w"; done
  rm -rf "$tmp"
}
trap cleanup EXIT

# Prints the path of REV's release binary, building it first unless this commit was built before.
build() {
  local sha target
  sha=$(git -C "$repo" rev-parse --verify "$1^{commit}")
  target="$HOME/.cache/bench-ab/$sha"
  if [ ! -x "$target/idem" ]; then
    # A new commit's target directory starts as a copy of the last one built: the dependencies (most of a cold
    # build) are then not compiled again unless Cargo.lock changed.
    seed=$(ls -td "$HOME"/.cache/bench-ab/*/idem 2>/dev/null | head -1)
    if [ ! -d "$target" ] && [ -n "$seed" ]; then
      cp -a "$(dirname "$seed")" "$target.tmp" && rm "$target.tmp/idem" && mv "$target.tmp" "$target"
    fi
    git -C "$repo" worktree add --detach "$tmp/src-$sha" "$sha" >&2
    (cd "$tmp/src-$sha" && CARGO_TARGET_DIR="$target" cargo build --release -p idem --bin idem >&2)
    # Copied out of release/ so that a build interrupted later never leaves a half-written binary here.
    cp "$target/release/idem" "$target/idem.tmp" && mv "$target/idem.tmp" "$target/idem"
    git -C "$repo" worktree remove --force "$tmp/src-$sha"
  fi
  echo "$target/idem"
}
bin_a=$(build "$rev_a")
bin_b=$(build "$rev_b")
[ "$build_only" = 1 ] && exit 0

seq 1 "$items" >"$work/items.txt"
trivial=(sh -c 'echo "{\"n\": $1}" > "$2"' sh '{id}' '{out}')
if [ "$bench" = resume ]; then
  for side in a b; do
    bin_var=bin_$side
    mkdir -p "$work/$side"
    awk -v d="$work/$side" '{ f = d "/" $1 ".json"; print "{\"n\": " $1 "}" > f; close(f) }' "$work/items.txt"
    "${!bin_var}" run --items "$work/items.txt" --output "$work/$side/{id}.json" --jobs 8 --quiet -- false
  done
fi

# One timed run of SIDE (a or b) in round R; GNU time appends "wall user system maxrss_kib" to SIDE's file.
run_one() {
  local side=$1 r=$2 bin_var=bin_$1 out
  case $bench in
    dry-run)
      out="$work/$side/dry$r"
      set -- "${!bin_var}" run --items "$work/items.txt" --output "$out/{id}.json" --dry-run -- false ;;
    throughput)
      out="$work/$side/tp$r"
      sync
      set -- "${!bin_var}" run --items "$work/items.txt" --output "$out/{id}.json" --jobs 8 --quiet -- "${trivial[@]}" ;;
    resume)
      set -- "${!bin_var}" run --items "$work/items.txt" --output "$work/$side/{id}.json" --jobs 8 --quiet -- false ;;
  esac
  /usr/bin/time -f '%e %U %S %M' -a -o "$work/times.$side" "$@" >/dev/null 2>"$work/stderr.$side" || {
    echo "run $r of $side failed:" >&2; tail -5 "$work/stderr.$side" >&2; exit 1; }
}

echo "bench $bench, $items items, $rounds rounds"
echo "A = $rev_a ($bin_a)"
echo "B = $rev_b ($bin_b)"
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
for r in $(seq 1 "$rounds"); do
  if [ $((r % 2)) = 1 ]; then run_one a "$r"; run_one b "$r"; else run_one b "$r"; run_one a "$r"; fi
done
echo "load average after:  $(cut -d' ' -f1-3 /proc/loadavg)"

median() { sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
for side in a b; do
  f="$work/times.$side"
  printf '%s: median wall %.2f s, CPU %.2f s, peak RSS %.1f MiB; walls: %s\n' "${side^^}" \
    "$(awk '{ print $1 }' "$f" | median)" "$(awk '{ print $2 + $3 }' "$f" | median)" \
    "$(awk '{ print $4 / 1024 }' "$f" | median)" "$(awk '{ printf "%s ", $1 }' "$f")"
done
ratios=$(paste -d' ' "$work/times.a" "$work/times.b" | awk '{ printf "%.3f\n", $5 / $1 }')
printf 'B/A wall: median of per-round ratios %.3f (rounds: %s)\n' "$(echo "$ratios" | median)" "$(echo $ratios)"
printf 'B/A CPU:  median of per-round ratios %.3f\n' \
  "$(paste -d' ' "$work/times.a" "$work/times.b" | awk '{ print ($6 + $7) / ($2 + $3) }' | median)"
