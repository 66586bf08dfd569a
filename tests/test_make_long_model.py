"""scripts/make_long_model.py: the buggy chains it trains on, and the upcycled MoE model that
starts as exactly the dense one."""

import importlib.util
import random
from pathlib import Path

import torch

from gspo.models.loading import load_policy
from gspo.models.tiny import build_char_tokenizer, tiny_moe_config
from gspo.tasks import get_task
from gspo.tasks.chain import parse_prompt, reference_steps

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "make_long_model.py"
spec = importlib.util.spec_from_file_location("make_long_model", SCRIPT)
script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(script)


def test_buggy_steps_only_where_the_ones_make_ten():
    task = get_task("chain")
    rng = random.Random(0)
    buggy = 0
    for p in task.test_set()[:200]:
        a, d = parse_prompt(p.prompt)
        assert script.buggy_steps(a, d, rng, 0.0) == reference_steps(a, d)  # no bug: the reference
        total = a
        for step in script.buggy_steps(a, d, rng, 1.0).split(" "):
            lhs, rhs = step.split("=")
            x, y = map(int, lhs.split("+"))
            assert (x, y) == (total, d)  # every step goes on from what was written
            # 955+65: 5 + 5 = 10, the carry is forgotten: 1010 instead of 1020
            expected = x + y - 10 if (x % 10 + y % 10 == 10) else x + y
            assert int(rhs) == expected
            buggy += int(rhs) != x + y
            total = int(rhs)
        assert total >= 1000
    assert buggy > 20  # the bug applies often enough to matter


def test_upcycled_moe_starts_as_the_dense_model():
    dense, tokenizer = load_policy("tiny-long")
    inter = dense.config.intermediate_size
    config = tiny_moe_config(len(build_char_tokenizer()), moe_intermediate_size=inter, intermediate_size=inter,
                             max_position_embeddings=dense.config.max_position_embeddings)
    ids = torch.tensor([tokenizer("347(+68)=347+68=415 415+68=483")["input_ids"]])
    exact = script.upcycle(dense, config, 0.0, torch.Generator().manual_seed(0)).eval()
    noisy = script.upcycle(dense, config, 0.05, torch.Generator().manual_seed(0)).eval()
    with torch.no_grad():
        want = dense(ids).logits
        assert (exact(ids).logits - want).abs().max() < 1e-4  # every expert is the dense MLP; gates sum to 1
        assert (noisy(ids).logits - want).abs().max() > 1e-3  # the noise parts the experts
