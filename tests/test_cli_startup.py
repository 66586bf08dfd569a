"""`gspo --help`, `--version`, usage errors and most commands' --help import neither torch nor
transformers (gspo/__init__.py is lazy, gspo.cli imports what a command needs in that command).

Each command runs in a fresh interpreter (`python -c PROBE ARGS`), as `python -m gspo` runs it; the
probe reports the exit code and whether torch / transformers were imported. That is the deterministic
check of a fast start (timings: see the commit that made it so); the help text or the one-line error
and the exit code are checked too, so a command that printed nothing cannot pass.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow  # every test starts a fresh interpreter

PROBE = """
import json, runpy, sys
sys.argv = ["gspo", *sys.argv[1:]]
code = 0
try:
    runpy.run_module("gspo", run_name="__main__")
except SystemExit as e:
    code = e.code
sys.stdout.flush()
print("\\n@probe " + json.dumps({"code": code, "torch": "torch" in sys.modules,
                                 "transformers": "transformers" in sys.modules, "cli": "gspo.cli" in sys.modules}))
"""


def run_gspo(*args: str) -> tuple[dict, str, str]:
    """`gspo ARGS` in a fresh interpreter: the probe's report, stdout (without it), stderr."""
    env = {k: v for k, v in os.environ.items() if k not in ("GSPO_DEBUG", "RANK", "TORCHELASTIC_RUN_ID")}
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    out, _, report = proc.stdout.rpartition("\n@probe ")
    assert proc.returncode == 0 and report, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    return json.loads(report), out, proc.stderr


def _version() -> str:
    import gspo

    return gspo.__version__


LIGHT = [  # args, exit code, text printed (stdout for help, stderr for an error)
    (["--help"], 0, "usage: gspo <command> [options]"),
    (["-h"], 0, "usage: gspo <command> [options]"),
    ([], 2, "usage: gspo <command> [options]"),
    (["--version"], 0, f"gspo {_version()}"),
    (["trian"], 2, "gspo: error: unknown command 'trian'; commands: train, eval, plot, compare, export"),
    (["eval", "--help"], 0, "usage: gspo eval [-h] [OPTIONS]"),
    (["plot", "--help"], 0, "usage: gspo plot [-h] [OPTIONS]"),
    (["train", "--no-such-option"], 2, "gspo train: error: unknown option --no-such-option"),
    (["train", "--stepz", "3"], 2, "gspo train: error: unknown option --stepz; did you mean --steps?"),
    (["train", "--steps", "abc"], 2, "gspo train: error: --steps: expected an integer, got 'abc'"),
    (["eval", "--no-such-option"], 2, "gspo eval: error: unknown option --no-such-option"),
    (["eval", "--model", "tiny", "--k", "-1"], 2, "gspo eval: error: --k: must be >= 0, got -1"),
    (["plot", "--bogus", "x"], 2, "gspo plot: error: unknown option --bogus"),
    (["plot"], 2, "gspo plot: error: give at least one run directory"),
]


@pytest.mark.parametrize("args,code,text", LIGHT, ids=[" ".join(a) or "(none)" for a, _, _ in LIGHT])
def test_help_version_and_usage_errors_import_no_torch(args, code, text):
    report, out, err = run_gspo(*args)
    assert report["cli"] and report["code"] == code
    assert text in (out if code == 0 or not args else err), (out[-2000:], err[-2000:])
    if code == 2 and args:
        assert err.count("\n") == 1 and err.startswith(text)  # one line, no traceback
    assert not report["torch"] and not report["transformers"]


# Errors found once the options parsed import torch: the algorithm is checked against the registered
# losses first (gspo.algo.losses), then TRL's names (`--num-generations x`) and the option's bounds.
# These import torch, not transformers: `train --help` lists the algorithms and their presets, the
# losses registered in gspo.algo.losses (a torch module); compare's presets and help live in gspo.lab.compare
# (gspo.train.checkpoint: torch), export's options in gspo.export (torch at its top).
TORCH_ONLY = [
    (["train", "--help"], "usage: gspo train [--config FILE]"),
    (["compare", "--help"], "gspo compare: train several configurations"),
    (["export", "--help"], "usage: gspo export [-h] [OPTIONS] RUN_DIR|CHECKPOINT OUT"),
]


@pytest.mark.parametrize("args,text", TORCH_ONLY, ids=[" ".join(a) for a, _ in TORCH_ONLY])
def test_other_commands_help_imports_no_transformers(args, text):
    report, out, err = run_gspo(*args)
    assert report["cli"] and report["code"] == 0 and text in out, (out[-2000:], err[-2000:])
    assert not report["transformers"]


def test_import_gspo_is_lazy_and_its_names_still_work():
    code = """
import sys
import gspo
assert "torch" not in sys.modules and "gspo.api" not in sys.modules
from gspo import TrainConfig
assert gspo.__all__ == ["Trainer", "TrainConfig", "__version__"] and isinstance(gspo.__version__, str)
cfg = gspo.TrainConfig.from_trl(num_generations=8)  # gspo.config.trl registers from_trl when first asked
assert cfg.group_size == 8 and TrainConfig is gspo.TrainConfig
assert "torch" not in sys.modules and "transformers" not in sys.modules
from gspo import Trainer  # the training stack, on first use
assert Trainer.__module__ == "gspo.api" and "torch" in sys.modules
assert gspo.models.loading.BUILTIN_MODELS  # a submodule as an attribute, as when `import gspo` imported them all
assert {"Trainer", "TrainConfig"} <= set(dir(gspo))
try:
    gspo.no_such_name
except AttributeError:
    print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
