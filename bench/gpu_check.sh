#!/usr/bin/env bash
# One run of Fulmen's GPU check on a lent machine (at most 8.5 minutes), or its dry run here on the CPU:
#
#   bash bench/gpu_check.sh --out DIR [--wheels .whl] [--dry-run] [--only b,c]
#
# Installs the wheels of deploy/gpu-wheels.sh (not on a dry run: .venv is used), then runs each step,
# time-boxed by `timeout` and independent of the others (a failure is recorded with its last lines
# and the next step runs): b (the trainer's step: 0.5B full and LoRA, 7B LoRA), c (torchrun, every
# codec under DDP, and FSDP), d (the proxy's torch engine against HF generate), a (the device tests),
# f (the weight group: a 0.5B version over gloo into GPU weights; vLLM is not in the image), e (the
# demo through `fulmen dev`). The steps are bench/gpu_check/step_<x>.py. Into DIR:
# gpu_check.json (one line), gpu_check.md (a table) and steps.log (every step's output), rewritten
# after each step; the last stdout line is the summary JSON object. A dry run runs the same steps on
# tiny shapes (gloo, device cpu) and must end with every step "ok". --only runs the steps named
# (b: its three parts; b_lora7b: that part), e.g. to rerun what failed.
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT="" WHEELS="$ROOT/.whl" DRY=0 ONLY=""
while (($#)); do
    case $1 in
        --out) OUT=$2; shift 2 ;;
        --wheels) WHEELS=$2; shift 2 ;;
        --dry-run) DRY=1; shift ;;
        --only) ONLY=",$2,"; shift 2 ;;
        *) echo "usage: bash bench/gpu_check.sh --out DIR [--wheels DIR] [--dry-run] [--only b,c]" >&2; exit 2 ;;
    esac
done
[[ -n $OUT ]] || { echo "error: --out DIR is required" >&2; exit 2; }
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
RESULTS=$(mktemp -d)
WORK=$(mktemp -d)
trap 'rm -rf "$RESULTS" "$WORK"' EXIT
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
STARTED=$(date +%s)
TOTAL_S=510  # 8.5 minutes, the install included
: >"$OUT/steps.log"

report() {
    "$PY" "$ROOT/bench/gpu_check/report.py" "$OUT" "$RESULTS" "$DRY" "$(($(date +%s) - STARTED))"
}

# step NAME BUDGET_S COMMAND...: run it under timeout, append its output to steps.log, record its result
step() {
    local name=$1 budget=$2 left
    shift 2
    if [[ -n $ONLY && $name != install && $ONLY != *",$name,"* && $ONLY != *",${name%%_*},"* ]]; then
        return
    fi
    left=$((TOTAL_S - ($(date +%s) - STARTED) - 5))
    ((DRY)) || ((budget <= left)) || budget=$left
    if ((budget < 10)); then
        echo "{\"status\": \"skipped\", \"error\": \"no time left of the ${TOTAL_S} s\"}" >"$RESULTS/$name.json"
        report >/dev/null
        return
    fi
    echo "=== step $name (budget ${budget}s) $(date -u +%H:%M:%S)" | tee -a "$OUT/steps.log" >&2
    local begin=$SECONDS raw="$WORK/$name.out"
    timeout -k 10 "$budget" "$@" >"$raw" 2>&1
    local rc=$? seconds=$((SECONDS - begin))
    cat "$raw" >>"$OUT/steps.log"
    echo "=== step $name: rc=$rc in ${seconds}s" | tee -a "$OUT/steps.log" >&2
    RC=$rc SECONDS_TAKEN=$seconds "$PY" - "$raw" "$RESULTS/$name.json" <<'EOF'
import json, os, sys
raw, dest = open(sys.argv[1], errors="replace").read(), sys.argv[2]
rc, seconds = int(os.environ["RC"]), int(os.environ["SECONDS_TAKEN"])
result = None
for line in reversed(raw.strip().splitlines()):
    if line.startswith("{"):
        try:
            result = json.loads(line)
            break
        except ValueError:
            pass
tail = "\n".join(raw.strip().splitlines()[-15:])
if rc in (124, 137):
    entry = {"status": "timeout", "error": f"killed at its time budget (rc {rc})\n{tail}"}
elif rc != 0 or result is None:
    entry = {"status": "failed", "error": f"rc {rc}\n{tail}"}
elif result.get("error"):
    entry = {"status": "failed", "error": str(result["error"])[-2500:]}
else:
    entry = {"status": "ok"}
entry.update({"seconds": seconds, "result": result or {}})
json.dump(entry, open(dest, "w"), default=str)
EOF
    report >/dev/null
}

if ((DRY)); then
    PY=${GPU_CHECK_PYTHON:-$ROOT/.venv/bin/python}  # a Python with Fulmen installed (.venv)
    [[ -x $PY ]] || PY=python3
    export PATH="$(dirname "$PY"):$PATH"
    FLAG=(--dry-run)
    export GPU_CHECK_E_CAP_S=${GPU_CHECK_E_CAP_S:-240}
    B=(150 150 150) C=300 D=150 A=240 F=120 E=270
else
    PY=python3
    FLAG=()
    # The wheels (deploy/gpu-wheels.sh) into /tmp/site: Fulmen itself and what the image lacks. Then
    # Fulmen's packages there point at this tree (pyproject's package-dir), so a wheel built before
    # the last edit still runs today's code; its console script and entry points stay the wheel's.
    SITE=/tmp/site
    step install 60 bash -c "python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target $SITE '$WHEELS'/*.whl && python3 - '$ROOT' $SITE <<'EOF'
import json, shutil, sys, tomllib
from pathlib import Path
root, site = Path(sys.argv[1]), Path(sys.argv[2])
mapping = tomllib.loads((root / 'pyproject.toml').read_text())['tool']['setuptools']['package-dir']
for package, source in mapping.items():
    target = site / package
    if target.is_dir() and not target.is_symlink():
        shutil.rmtree(target)
    target.unlink(missing_ok=True)
    target.symlink_to(root / source)
print(json.dumps({'wheels': len(list(Path(sys.argv[2]).glob('*.dist-info'))), 'linked': sorted(mapping)}))
EOF"
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH"
    export GPU_CHECK_E_CAP_S=${GPU_CHECK_E_CAP_S:-140}
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >>"$OUT/steps.log" 2>&1
    B=(50 45 90) C=90 D=60 A=75 F=30 E=$((GPU_CHECK_E_CAP_S + 20))
fi
export PYTHONPATH="$ROOT/bench/gpu_check${PYTHONPATH:+:$PYTHONPATH}"
S="$ROOT/bench/gpu_check"
step b_full "${B[0]}" "$PY" "$S/step_b.py" --config full --work "$WORK/b" "${FLAG[@]}"
step b_lora "${B[1]}" "$PY" "$S/step_b.py" --config lora --work "$WORK/b" "${FLAG[@]}"
step b_lora7b "${B[2]}" "$PY" "$S/step_b.py" --config lora7b --work "$WORK/b" "${FLAG[@]}"
step c "$C" "$PY" "$S/step_c.py" --work "$WORK/c" "${FLAG[@]}"
step d "$D" "$PY" "$S/step_d.py" --work "$WORK/d" "${FLAG[@]}"
step a "$A" "$PY" "$S/step_a.py" --work "$WORK/a" "${FLAG[@]}"
step f "$F" "$PY" "$S/step_f.py" --work "$WORK/f" "${FLAG[@]}"
# the demo's cap: what is left of the run, less the time to stop it and to start Python
LEFT=$((TOTAL_S - ($(date +%s) - STARTED) - 35))
((DRY || LEFT >= GPU_CHECK_E_CAP_S)) || GPU_CHECK_E_CAP_S=$LEFT
step e "$E" "$PY" "$S/step_e.py" --work "$WORK/e" "${FLAG[@]}"
report
