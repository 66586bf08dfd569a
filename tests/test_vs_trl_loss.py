"""gspo's GSPO loss equals TRL's (GRPOTrainer._compute_loss, sequence-level importance sampling)
on one identical batch: benchmarks/vs_trl.py's `loss_check`, on a small random Qwen3. And it
tells them apart when they are not the same loss (token-level ratios on gspo's side)."""

import importlib.util
import sys
from pathlib import Path

import pytest

from tests.conftest import random_tiny_model

pytest.importorskip("trl")

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["12+34=", "7*8=", "100-1=", "5+5="]


@pytest.fixture(scope="module")
def vs_trl():
    """benchmarks/vs_trl.py as a module (it imports benchmarks/common.py as `common`)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location("vs_trl", ROOT / "benchmarks" / "vs_trl.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return module


def test_gspo_loss_equals_trl(vs_trl, char_tokenizer):
    model = random_tiny_model(char_tokenizer)
    r = vs_trl.loss_check(model, char_tokenizer, PROMPTS, group_size=4, new_tokens=16)
    assert r["loss_type"] == "grpo"  # gspo.config.trl: TRL's grpo is gspo's default seq-mean-token-mean
    assert r["rows"] == 16 and r["tokens"] == 16 * 16
    assert 0 < r["clipped"] < 1  # some responses clipped, some not: both branches of the min are compared
    assert abs(r["gspo"]) > 30 * vs_trl.LOSS_TOL  # the ratios move the loss far more than the tolerance
    assert r["diff"] <= vs_trl.LOSS_TOL, r
    assert r["grad_diff"] < 1e-4, r


def test_token_level_differs(vs_trl, char_tokenizer):
    """gspo's token-level GRPO (same clip range) against TRL's sequence level: the check must fail."""
    model = random_tiny_model(char_tokenizer)
    r = vs_trl.loss_check(model, char_tokenizer, PROMPTS, group_size=4, new_tokens=16, algorithm="grpo", grads=False)
    assert r["diff"] > 3 * vs_trl.LOSS_TOL, r  # ~1e-4 here, against ~1e-7 for the same loss
