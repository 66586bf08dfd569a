"""The documented commands print nothing from the dependencies: no `...Warning` line on stderr.

Each command of the README and the docs' quick-starts that runs here offline, cut to seconds
(--steps 1, a few prompts and held-out problems), runs as a user runs it: `python -m gspo` in a
subprocess, PYTHONWARNINGS unset (pytest's own warning filters do not reach it). gspo's own
`gspo: warning: ...` lines are for the user and may appear. A dependency's warning that says
nothing to the user is silenced where gspo triggers it (gspo.models.loading.quiet_peft), never globally:
the unit tests below check that the silence is that narrow.
"""

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FAST = ["--steps", "1", "--eval-size", "8", "--prompts-per-step", "2", "--group-size", "2", "--no-progress"]
DEPENDENCY_WARNING = re.compile(r"\w*Warning\b|warnings\.warn\(")


def gspo(*args, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    # cwd outside the checkout, so that a PYTHONPATH (another copy of gspo) is what runs
    r = subprocess.run([sys.executable, "-m", "gspo", *map(str, args)], capture_output=True, text=True, env=env,
                       cwd=cwd, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def dependency_warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines()
            if DEPENDENCY_WARNING.search(line) and not line.startswith("gspo: warning:")]


@pytest.fixture(scope="module")
def moe_lora_run(tmp_path_factory):
    """`gspo train --model tiny-moe --lora-r 8` (docs/moe.md, docs/byo.md's LoRA), its stderr."""
    d = tmp_path_factory.mktemp("quiet")
    r = gspo("train", "--model", "tiny-moe", "--lora-r", "8", *FAST, "--output-dir", d / "run", cwd=d)
    return d, d / "run", r.stderr


@pytest.mark.slow
def test_moe_lora_train_eval_and_export_are_quiet(moe_lora_run):
    d, run, stderr = moe_lora_run
    assert dependency_warnings(stderr) == []  # peft's rank_pattern/alpha_pattern RuntimeWarnings were here
    assert dependency_warnings(gspo("eval", "--model", run, "--k", "2", "--eval-size", "8", cwd=d).stderr) == []
    assert dependency_warnings(gspo("export", run, d / "exported", cwd=d).stderr) == []
    assert (d / "exported" / "model.safetensors").exists()


@pytest.mark.slow
@pytest.mark.parametrize("args", [
    [],  # README: `gspo train`
    ["--algorithm", "ppo"],  # docs/ppo.md
    ["--rollout-workers", "1", "--max-staleness", "1", "--threads", "1"],  # docs/async.md
    ["--dataset", REPO / "examples/arithmetic.jsonl", "--prompt-column", "question", "--reward", "exact_match",
     "--reward", REPO / "examples/rewards.py:digit_credit", "--reward-weights", "1.0", "0.5"],  # README, docs/byo.md
], ids=["default", "ppo", "rollout-workers", "byo"])
def test_documented_train_commands_are_quiet(args, tmp_path):
    r = gspo("train", *args, *FAST, "--output-dir", tmp_path / "run", cwd=tmp_path)
    assert dependency_warnings(r.stderr) == []  # eval and export: test_moe_lora_train_eval_and_export_are_quiet


def test_the_check_sees_a_dependency_warning_and_not_gspos():
    stderr = ("/x/peft/tuners/tuners_utils.py:1123: RuntimeWarning: The following rank_pattern keys ...\n"
              "  warnings.warn(\ngspo: warning: max_new_tokens: the default ... capped to 56\nstep 1/1  reward 0.5\n")
    assert dependency_warnings(stderr) == stderr.splitlines()[:2]


def test_quiet_peft_hides_peft_s_own_fused_expert_keys_only():
    """tiny-moe's experts are one fused `gate_up_proj` parameter: peft targets it with r and alpha
    doubled through rank_pattern/alpha_pattern keys of its own, applies them, and then warns that
    they matched no module (its check reads module names only). quiet_peft hides that warning,
    and only that one: a key that really matches nothing still warns."""
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    from gspo.models.loading import add_lora, load_policy, quiet_peft

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        policy = add_lora(load_policy("tiny-moe")[0], r=8, alpha=16, dropout=0.0, target_modules=["all-linear"])
    assert [str(w.message) for w in caught] == []
    config = policy.peft_config["default"]
    assert config.rank_pattern == {r".*\.gate_up_proj": 16} and config.alpha_pattern == {r".*\.gate_up_proj": 32}
    fused = [m for m in policy.modules() if getattr(m, "parameter_name", None) == "gate_up_proj"]  # one per layer
    assert fused and all(m.r["default"] == 16 and m.scaling["default"] == 2.0 for m in fused)  # applied: r x2

    with warnings.catch_warnings(record=True) as caught, quiet_peft():
        warnings.simplefilter("always")
        get_peft_model(load_policy("tiny")[0], LoraConfig(r=4, target_modules=["q_proj"], rank_pattern={"nothing": 2}))
    assert [w.category for w in caught if "rank_pattern keys" in str(w.message)] == [RuntimeWarning]
