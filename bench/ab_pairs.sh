#!/usr/bin/env bash
# Before/after pairs of bench scripts, run alternately and back to back (the VM's speed drifts, so
# compare within pairs). Each tree runs its own copy of the script with its own venv (.venv).
#   bench/ab_pairs.sh BEFORE_TREE AFTER_TREE ROUNDS "store_lifecycle runner_overhead ..." [OUT_DIR]
# Odd rounds run before→after, even rounds after→before. Each run's last line (the JSON figures)
# goes to OUT_DIR/<bench>-<before|after>-<round>.out and a line per run to OUT_DIR/log.
set -u
before=$1 after=$2 rounds=$3 benches=$4 out=${5:-bench-pairs}
mkdir -p "$out"
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
