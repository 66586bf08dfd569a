#!/usr/bin/env bash
# Set up a virtual environment for gspo in .venv (or $GSPO_VENV) and install the project.
#
# torch is installed first, pinned to 2.13.0, and only when the environment has no torch
# yet: on a CPU machine that picks the CPU wheel, and a user's own CUDA torch is left alone.
# Unpinned `pip install torch` would pull several GB of CUDA packages on a CPU-only box.
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
"$py" -m pip install -q -e ".[$extras]"
