"""GPU checks: skipped (marked `gpu`) on machines without CUDA."""

import pytest
import torch

from gspo.config import TrainConfig
from gspo.models.logprobs import completion_logprobs
from gspo.sampling.rollout import generate, sampling_params
from gspo.train.trainer import train


@pytest.mark.gpu
@pytest.mark.slow
def test_train_on_cuda_bf16(tmp_path):
    summary = train(TrainConfig(steps=3, prompts_per_step=8, group_size=4, eval_size=32, device="cuda",
                                dtype="bfloat16", output_dir=str(tmp_path / "run"), progress=False),
                    log=lambda *a: None)
    assert summary["eval_after"]["n"] == 32


@pytest.mark.gpu
def test_pass_at_k_on_cuda(char_tokenizer):
    from gspo.models.loading import load_policy
    from gspo.rewards.builtin import load_rewards
    from gspo.tasks import get_task
    from gspo.train.evaluation import EvalOptions, evaluate

    model, tok = load_policy("tiny", device="cuda")
    out = evaluate(model, tok, get_task("arithmetic"), load_rewards(["exact_integer"], None),
                   EvalOptions(n=16, k=4))
    assert 0.0 <= out["accuracy"] <= out["pass@4"] <= 1.0


@pytest.mark.gpu
def test_rollout_logprobs_match_on_cuda(char_tokenizer):
    from tests.conftest import random_tiny_model

    model = random_tiny_model(char_tokenizer).cuda()
    g = torch.Generator().manual_seed(0)  # the sampler draws its uniforms on the CPU, whatever the model's device
    ids = [char_tokenizer(p)["input_ids"] for p in ["12+7=", "999-123="]]
    ro = generate(model, ids, sampling_params(char_tokenizer, group_size=4, max_new_tokens=6), generator=g)
    with torch.no_grad():
        lp = completion_logprobs(model, ro.input_ids, ro.attention_mask, ro.completion_mask)
    torch.testing.assert_close(lp, ro.logp, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3", "gemma3", "phi3"])
def test_cuda_graph_decode_records_the_training_forwards_logprobs(char_tokenizer, monkeypatch, family):
    # on CUDA every dense model decodes over its own layers with its step captured in a CUDA graph: the graph
    # is captured once, every later step is a replay, nothing falls back, and the recorded log-probs equal a
    # full-sequence training forward (fp32)
    import gspo.sampling.fastdecode as fd
    import gspo.sampling.rollout as rollout_module
    from tests.conftest import random_tiny_model
    from tests.test_decode_families import build

    tok = char_tokenizer
    model = (random_tiny_model(tok) if family == "qwen3" else build(family, tok)).cuda()
    assert fd.path(model, 64) == ("graphs", None)
    made, real = [], fd.decoder
    monkeypatch.setattr(rollout_module, "decoder", lambda m, n, **kw: made.append(real(m, n, **kw)) or made[-1])
    ids = [tok(p)["input_ids"] for p in ["12+7=", "999-123=", "5+5="]]
    ro = generate(model, ids, sampling_params(tok, group_size=4, max_new_tokens=20, min_new_tokens=20),
                  generator=torch.Generator().manual_seed(0))
    dec = made[0]
    assert dec.static and dec.graphs.graph is not None and not dec.graphs.off and not dec.fallback
    with torch.no_grad():
        lp = completion_logprobs(model, ro.input_ids, ro.attention_mask, ro.completion_mask)
    torch.testing.assert_close(lp, ro.logp, rtol=1e-4, atol=1e-4)
    # --cuda-graphs false: the same tokens, launched eagerly
    eager = generate(model, ids, sampling_params(tok, group_size=4, max_new_tokens=20, min_new_tokens=20,
                                                 cuda_graphs=False), generator=torch.Generator().manual_seed(0))
    assert torch.equal(eager.completion_ids, ro.completion_ids)
