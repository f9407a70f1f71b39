#!/usr/bin/env bash
# The GPU check (docs/gpu.md): the GPU test tier (pytest -m gpu tests/gpu) and scripts/bench_train.py on
# one GPU, with JSON results, in under 10 minutes. Two halves:
#
#   bash scripts/gpu_check.sh --prepare    # where pip reaches PyPI: the wheels a bare GPU machine lacks
#                                          # (megatron-core, omegaconf, hydra-core, antlr4 runtime, einops)
#                                          # for its Python into .whl/ (git-ignored, at most 64 MiB)
#   bash scripts/gpu_check.sh [--out DIR]  # on the GPU node: installs .whl/ into a temporary target when
#                                          # the Python lacks them, runs the tier and the benchmark, writes
#                                          # DIR/gpu_check.json (+ junit XML, logs, bench JSON); prints a summary
#   bash scripts/gpu_check.sh --simulate-node [--out DIR]  # here: a clean venv with only the GPU node's
#                                          # packages (torch, transformers, peft, pytest, einops), wheels
#                                          # prepared for its Python, then the check with it (no CUDA)
#
# Without CUDA the GPU half is skipped: the kit's own checks (gpu_kit: everything the tier imports imports)
# run, and every GPU test must skip for want of CUDA and nothing else (anything else: exit 3).
# Environment: PYTHON (default .venv/bin/python, else python3); GPU_NODE_VENV / GPU_NODE_BASE_PYTHON
# (--simulate-node: the venv, default /tmp/megamarl_gpu_node_venv, and the python3 that builds it); GPU_CHECK_OUT (default $OUT when set,
# else runs/gpu_check); MEGAMARL_WHEELS (default .whl); GPU_PYTHON_VERSION (--prepare: 3.12);
# GPU_CHECK_TEST_TIMEOUT / GPU_CHECK_BENCH_TIMEOUT (seconds: 390 / 150); GPU_CHECK_BENCH_MODEL
# (an architecture preset, default smollm2-135m-instruct, built with random weights).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"

mode=check
out="${GPU_CHECK_OUT:-${OUT:-$ROOT/runs/gpu_check}}"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --prepare) mode=prepare; shift ;;
    --simulate-node) mode=simulate; shift ;;
    --out) out="$2"; shift 2 ;;
    --out=*) out="${1#--out=}"; shift ;;
    -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$1' (allowed: --prepare, --simulate-node, --out DIR)" >&2; exit 2 ;;
  esac
done

if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
wheels="${MEGAMARL_WHEELS:-$ROOT/.whl}"
limit_mib=64  # what travels to the device machine with the working tree
# modules megamarl's training path imports that a bare GPU image lacks -> the wheels that provide them
modules=(megatron.core omegaconf hydra antlr4 einops)

prepare() {
  local pyver="${GPU_PYTHON_VERSION:-3.12}" tmp
  # the versions of this environment (the ones the CPU suite runs), else the tested defaults
  read -r mcore omegaconf hydra antlr einops < <("$PYTHON" - <<'EOF'
import importlib.metadata as m
defaults = {"megatron-core": "0.16.1", "omegaconf": "2.3.1", "hydra-core": "1.3.8",
            "antlr4-python3-runtime": "4.9.3", "einops": "0.8.2"}
def version(name):
    try:
        return m.version(name)
    except m.PackageNotFoundError:
        return defaults[name]
print(*(version(n) for n in defaults))
EOF
)
  rm -rf "$wheels" && mkdir -p "$wheels"
  echo "gpu_check --prepare: wheels for CPython $pyver manylinux x86_64 -> $wheels"
  local platforms=()
  for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
           manylinux2014_x86_64 manylinux1_x86_64; do platforms+=(--platform "$p"); done
  # megatron-core ships a CPython-specific wheel (a compiled dataset helper); the others are pure Python
  "$PYTHON" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version "$pyver" --implementation cp "${platforms[@]}" \
    -d "$wheels" "megatron-core==$mcore" "omegaconf==$omegaconf" "hydra-core==$hydra" "einops==$einops" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
  # antlr4-python3-runtime 4.9.x (what omegaconf 2.3 pins) exists only as an sdist: build its pure wheel here
  tmp="$(mktemp -d)"
  "$PYTHON" -m pip download -q --disable-pip-version-check --no-deps --no-binary=:all: -d "$tmp" \
    "antlr4-python3-runtime==$antlr" 2> >(grep -v "is ignored" >&2)
  "$PYTHON" -m pip wheel -q --disable-pip-version-check --no-deps -w "$wheels" "$tmp"/antlr4*.tar.gz \
    2> >(grep -v "is ignored" >&2)
  rm -rf "$tmp"
  local count bytes
  count=$(find "$wheels" -type f -name '*.whl' | wc -l)
  bytes=$(du -sb "$wheels" | cut -f1)
  ls -l "$wheels"
  for whl in "$wheels"/*.whl; do
    echo "  $(basename "$whl") needs: $(unzip -p "$whl" '*.dist-info/METADATA' | grep '^Requires-Dist' \
      | grep -v 'extra ==' | sed 's/^Requires-Dist: //' | paste -sd '|' - | sed 's/|/ | /g')"
  done
  echo "gpu_check --prepare: $count wheels, $bytes bytes ($(awk "BEGIN {printf \"%.2f\", $bytes / 1048576}") MiB; limit $limit_mib MiB) in $wheels"
  if (( bytes > limit_mib * 1048576 )); then
    echo "gpu_check --prepare: $wheels is over $limit_mib MiB: it cannot travel with the working tree" >&2
    exit 1
  fi
}

if [[ "$mode" == prepare ]]; then
  prepare
  exit 0
fi

if [[ "$mode" == simulate ]]; then
  # The GPU node's package set (docs/gpu.md) in a clean venv, with this environment's torch version
  # (a CPU build here), then the wheels --prepare makes for that venv's Python, then the check itself.
  venv="${GPU_NODE_VENV:-/tmp/megamarl_gpu_node_venv}"
  torch_version=$("$PYTHON" -c 'import torch; print(torch.__version__.split("+")[0])')
  if [[ ! -x "$venv/bin/python" ]]; then
    "${GPU_NODE_BASE_PYTHON:-python3}" -m venv "$venv"
  fi
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "torch==$torch_version" transformers peft pytest \
    einops 2> >(grep -v "is ignored" >&2)
  node_wheels="$(mktemp -d /tmp/megamarl_node_wheels.XXXXXX)"
  MEGAMARL_WHEELS="$node_wheels" GPU_PYTHON_VERSION="$("$venv/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" \
    bash "$0" --prepare >/dev/null
  echo "gpu_check --simulate-node: $venv ($("$venv/bin/python" -m pip list 2>/dev/null | tail -n +3 | wc -l) packages;" \
       "aiohttp/megatron-core/vllm absent: $(for m in aiohttp megatron vllm; do "$venv/bin/python" -c "import $m" 2>/dev/null \
       && echo -n "$m PRESENT " || echo -n "$m "; done))"
  rc=0
  PYTHON="$venv/bin/python" MEGAMARL_WHEELS="$node_wheels" bash "$0" --out "$out" || rc=$?
  rm -rf "$node_wheels"
  exit "$rc"
fi

# ---- the check, on the GPU node ----------------------------------------------------------------
start=$(date +%s)
mkdir -p "$out"
missing=$("$PYTHON" - "${modules[@]}" <<'EOF'
import importlib.util, sys

def found(module):
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False

print(" ".join(m for m in sys.argv[1:] if not found(m)))
EOF
)
site=""
if [[ -n "$missing" ]]; then
  if ! compgen -G "$wheels/*.whl" >/dev/null; then
    echo "gpu_check: $PYTHON lacks [$missing] and $wheels has no wheels: run 'bash scripts/gpu_check.sh --prepare'" \
         "where pip reaches PyPI, and bring .whl/ along" >&2
    exit 2
  fi
  site="$(mktemp -d /tmp/megamarl_site.XXXXXX)"
  trap 'rm -rf "$site"' EXIT
  echo "gpu_check: $PYTHON lacks [$missing]: installing $(ls "$wheels"/*.whl | wc -l) wheels into $site"
  "$PYTHON" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir \
    --target "$site" "$wheels"/*.whl
fi
export PYTHONPATH="${site:+$site:}$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline PYTHONUNBUFFERED=1
cuda=$("$PYTHON" -c 'import torch; print(int(torch.cuda.is_available()))')

# pyproject's addopts run two xdist workers; here the tier runs in one process (each test spawns its ranks)
# (xunit1: the junit XML keeps the figures the tests record with record_property)
pytest_cmd=("$PYTHON" -m pytest -o "addopts=-ra --strict-markers" -o junit_family=xunit1 -p no:cacheprovider
            -m "gpu or gpu_kit" tests/gpu -v --junitxml "$out/gpu_tests.xml")
tests_rc=0
bench_rc=skipped
if [[ "$cuda" != 1 ]]; then
  echo "gpu_check: no CUDA device ($PYTHON: torch.cuda.is_available() is False): the GPU half is skipped;" \
       "the tier is collected and must skip"
  "${pytest_cmd[@]}" 2>&1 | tee "$out/gpu_tests.log" || tests_rc=$?
else
  nvidia-smi -L 2>/dev/null || true
  timeout "${GPU_CHECK_TEST_TIMEOUT:-390}" "${pytest_cmd[@]}" 2>&1 | tee "$out/gpu_tests.log" || tests_rc=$?
  bench_rc=0
  timeout "${GPU_CHECK_BENCH_TIMEOUT:-150}" "$PYTHON" scripts/bench_train.py --random-weights \
    --model "${GPU_CHECK_BENCH_MODEL:-smollm2-135m-instruct}" --samples 32 --prompt-len 40 200 \
    --response-len 10 120 --micro-batch-size 8 --max-tokens 1024 --repeats 3 --shared-prefix none \
    --out "$out/bench_train_gpu.json" \
    2>&1 | tee "$out/bench_train_gpu.log" || bench_rc=$?
fi

"$PYTHON" - "$out" "$cuda" "$tests_rc" "$bench_rc" "$(( $(date +%s) - start ))" <<'EOF'
"""gpu_check.json: the node, every test's outcome, time and recorded figures, the benchmark's summary."""
import datetime, importlib.metadata, json, platform, sys
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

out, cuda, wall_s = Path(sys.argv[1]), sys.argv[2] == "1", int(sys.argv[5])
tests_rc, bench_rc = (int(x) if x.isdigit() else x for x in sys.argv[3:5])

def version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None

tests = []
if (out / "gpu_tests.xml").is_file():
    for case in ET.parse(out / "gpu_tests.xml").getroot().iter("testcase"):
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            node = case.find(kind)
            if node is not None:
                outcome, message = {"failure": "failed", "error": "error", "skipped": "skipped"}[kind], node.get("message", "")
        tests.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "seconds": float(case.get("time", 0)), "message": message[:2000],
                      "figures": {p.get("name"): p.get("value") for p in case.iter("property")}})
bench = None
if (out / "bench_train_gpu.json").is_file():
    raw = json.loads((out / "bench_train_gpu.json").read_text())
    bench = {"model": raw["model"], "batch_tokens": raw["batch"]["num_tokens"],
             "matmul_peak_flops_per_s": raw["matmul_peak_flops_per_s"],
             "variants": {k: {f: v[f] for f in ("seconds_best", "tokens_per_s", "useful_flops_per_s",
                                                "fraction_of_matmul_peak", "speedup_vs_fp32_padded")}
                          for k, v in raw["variants"].items()}}
counts = {o: sum(t["outcome"] == o for t in tests) for o in ("passed", "failed", "error", "skipped")}
summary = {
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "device": torch.cuda.get_device_name() if cuda else None, "cuda_available": cuda,
    "gpu_half": "ran" if cuda else "skipped: no CUDA device",
    "versions": {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
                 **{n: version(n) for n in ("megatron-core", "transformers", "transformer-engine")}},
    "tests_exit_code": tests_rc, "bench_exit_code": bench_rc, "counts": counts, "tests": tests,
    "bench_train": bench, "wall_s": wall_s,
}
(out / "gpu_check.json").write_text(json.dumps(summary, indent=1) + "\n")
print(f"\ngpu_check: {summary['gpu_half']} | device {summary['device']} | torch {torch.__version__} | "
      f"megatron-core {summary['versions']['megatron-core']} | {wall_s} s")
for t in tests:
    figures = ", ".join(f"{k}={v}" for k, v in t["figures"].items())
    print(f"  {t['outcome']:<7} {t['seconds']:6.1f} s  {t['test'].rsplit('.', 1)[-1]}" + (f"  [{figures}]" if figures else ""))
print(f"  tests: {counts} (pytest exit {tests_rc})")
if bench:
    for name, v in bench["variants"].items():
        print(f"  bench {name}: {v['tokens_per_s']:.0f} tokens/s, {v['fraction_of_matmul_peak']:.1%} of the matmul peak")
elif bench_rc != "skipped":
    print(f"  bench_train: no result (exit {bench_rc})")
print(f"  wrote {out / 'gpu_check.json'}")
# without CUDA: the kit's checks pass and every GPU test skips for want of CUDA, for no other reason
if not cuda:
    def fine(t):
        if "test_kit_imports" in t["test"]:  # the gpu_kit checks run anywhere
            return t["outcome"] == "passed"
        return t["outcome"] == "skipped" and "CUDA" in t["message"]
    odd = [t for t in tests if not fine(t)]
    if odd or not tests:
        print("gpu_check: without CUDA every GPU test must skip for want of CUDA and the kit's checks pass; not so:")
        for t in odd:
            print(f"  {t['outcome']} {t['test']}: {t['message'][:300]}")
        sys.exit(3)
EOF

if [[ "$cuda" != 1 ]]; then
  # pytest exits 0 when everything skipped; anything else (a collection error) is a failure here too
  exit "$tests_rc"
fi
[[ "$tests_rc" == 0 && "$bench_rc" == 0 ]]
