#!/usr/bin/env bash
# Before/after pairs of the hot-path benchmarks, run alternately and back to back (the VM's speed
# drifts, so compare within pairs), then the ratio table (bench/ab_table.py). Each tree runs its own
# copy of each script with its own venv (.venv).
#   bench/ab_pairs.sh BASE [ROUNDS] ["store_lifecycle runner_overhead ..."] [OUT_DIR]
# BASE is a commit (cloned once from this repository into .fulmen/ab/<sha>, with its own venv: torch
# 2.13.0 then `pip install -e '.[dev]'`, a few minutes) or a folder that has its own .venv. "After" is
# this tree (AFTER_TREE=folder for another). Defaults: 3 rounds, the four benchmarks, OUT_DIR
# .fulmen/ab/pairs-<time>. Odd rounds run before→after, even rounds after→before; each run's output
# goes to OUT_DIR/<bench>-<before|after>-<round>.out, a line per run to OUT_DIR/log (and stdout).
# Run it on a quiet machine; the table ends with its machine's load average.
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
if [ $# -lt 1 ] || [ "$1" = -h ] || [ "$1" = --help ]; then sed -n '2,11p' "$0" | cut -c3-; exit 2; fi
base=$1 rounds=${2:-3} benches=${3:-"store_lifecycle runner_overhead proxy_overhead adapter_throughput"}
out=${4:-$root/.fulmen/ab/pairs-$(date +%Y%m%d-%H%M%S)}
after=${AFTER_TREE:-$root}
[ -x "$after/.venv/bin/python" ] || { echo "ab_pairs: $after has no .venv (deploy/install.sh dev makes it)" >&2; exit 2; }

if [ -d "$base" ]; then
  before=$(cd "$base" && pwd)
else
  sha=$(git -C "$root" rev-parse --verify -q "$base^{commit}") || { echo "ab_pairs: $base is neither a folder nor a commit of $root" >&2; exit 2; }
  before=$root/.fulmen/ab/$sha
  if [ ! -x "$before/.venv/bin/python" ]; then
    echo "ab_pairs: building $before (a clone at $base with its own venv; once)" >&2
    rm -rf "$before" && git clone -q "$root" "$before" && git -C "$before" checkout -q "$sha" || exit 1
    ( cd "$before" && python3 -m venv .venv && . .venv/bin/activate && pip install -q torch==2.13.0 \
        && pip install -q -e '.[dev]' ) > "$before.install.log" 2>&1 \
      || { tail -n 20 "$before.install.log" >&2; rm -rf "$before/.venv"; exit 1; }
  fi
fi
[ -x "$before/.venv/bin/python" ] || { echo "ab_pairs: $before has no .venv" >&2; exit 2; }

mkdir -p "$out"
echo "before: $before ($(git -C "$before" rev-parse --short HEAD 2>/dev/null)), after: $after ($(git -C "$after" rev-parse --short HEAD 2>/dev/null)), load: $(cut -d' ' -f1-3 /proc/loadavg)" | tee "$out/log"
run() {  # which bench round
  local which=$1 bench=$2 round=$3 tree
  if [ "$which" = before ]; then tree=$before; else tree=$after; fi
  local file=$out/$bench-$which-$round
  ( cd "$tree" && . .venv/bin/activate && timeout 900 python "bench/$bench.py" > "$file.out" 2> "$file.err" )
  echo "$(date +%H:%M:%S) $bench $which r$round rc=$? $(tail -n 1 "$file.out" | cut -c1-200)" | tee -a "$out/log"
}
for r in $(seq 1 "$rounds"); do
  for b in $benches; do
    if [ $((r % 2)) = 1 ]; then run before "$b" "$r"; run after "$b" "$r"; else run after "$b" "$r"; run before "$b" "$r"; fi
  done
done
echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$out/log"
"$after/.venv/bin/python" "$root/bench/ab_table.py" "$out"
