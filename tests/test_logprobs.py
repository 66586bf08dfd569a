"""Forward passes within a token budget: micro-batches and packing give the unsplit, padded results.

The equivalence tests run in float64, where the only differences left between one pass and
several are float rounding (~1e-15); the tolerance is 1e-6 relative, so a wrong loss scale (a
micro-batch's loss normalised by its own counts, not the minibatch's), a metric averaged
without its counts, or a lost micro-batch gradient all fail them by orders of magnitude.
"""

import dataclasses

import pytest
import torch

from gspo.algo.aggregation import AGG_MODES, agg_count
from gspo.config import TrainConfig
from gspo.models.logprobs import (
    Split,
    completion_logprobs,
    forward_logprobs,
    micro_batches,
    supports_packing,
    token_logprobs,
    trim,
)
from gspo.models.sequences import position_ids_from_mask
from gspo.sampling.produce import rollout, score
from gspo.sampling.rollout import generate, sampling_params
from gspo.tasks.scoring import Scored
from gspo.train.batch import prepare
from gspo.train.run import build_run
from gspo.train.trainer import Totals, accumulate

D = torch.float64
PROMPTS = ["12+7=", "999-123=", "5+5=", "40+2=", "1+1=", "345-67="]


def _rollout(model, tok, G=3, L=7, seed=0):
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    return generate(model, ids, sampling_params(tok, group_size=G, max_new_tokens=L),
                    generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def fp64_model(tiny_random):
    return tiny_random.double()


def test_micro_batches_respect_the_budget(fp64_model, char_tokenizer):
    ro = _rollout(fp64_model, char_tokenizer)
    idx = torch.arange(ro.prompt_ids.shape[0])
    for budget, packed in ((60, False), (40, True), (1, False)):
        groups = micro_batches(ro, idx, budget, packed)
        assert sorted(torch.cat(groups).tolist()) == idx.tolist()  # every row exactly once
        for g in groups:
            p, c = ro.prompt_mask[g].sum(1), ro.lengths[g]
            size = int((p + c).sum()) if packed else len(g) * int(p.max() + c.max())
            assert size <= budget or len(g) == 1, (budget, packed, size)
    assert len(micro_batches(ro, idx, 60)) > 1 and micro_batches(ro, idx, 0)[0] is idx


def test_trim_drops_only_padding(fp64_model, char_tokenizer):
    ro = _rollout(fp64_model, char_tokenizer)
    sub = ro.select(torch.tensor([6, 15]))  # a "5+5=" row and a "345-67=" row: short and long prompts
    mb, ps, ts = trim(sub)
    assert mb.prompt_mask.sum() == sub.prompt_mask.sum() and mb.completion_mask.sum() == sub.completion_mask.sum()
    assert mb.prompt_ids.shape[1] == int(sub.prompt_mask.sum(1).max())
    assert mb.completion_ids.shape[1] == int(sub.lengths.max())
    a = completion_logprobs(fp64_model, sub.input_ids, sub.attention_mask, sub.completion_mask)
    b = completion_logprobs(fp64_model, mb.input_ids, mb.attention_mask, mb.completion_mask)
    torch.testing.assert_close(a[:, ts], b, rtol=1e-10, atol=1e-12)
    assert (a[:, ts.stop:] == 0).all()


def test_packed_forward_equals_padded(fp64_model, char_tokenizer):
    assert supports_packing(fp64_model)
    ro = _rollout(fp64_model, char_tokenizer)
    pad = forward_logprobs(fp64_model, ro, temperature=0.8, hidden=True, entropy=True)
    pack = forward_logprobs(fp64_model, ro, temperature=0.8, packed=True, hidden=True, entropy=True)
    m = ro.completion_mask
    torch.testing.assert_close(pack.logp, pad.logp, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(pack.entropy, pad.entropy, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(pack.hidden * m[..., None], pad.hidden * m[..., None], rtol=1e-9, atol=1e-10)
    # and the gradients through the packed forward are the padded forward's
    ga = torch.autograd.grad(pad.logp.sum(), fp64_model.lm_head.weight)[0]
    pad2 = forward_logprobs(fp64_model, ro, temperature=0.8, packed=True)
    gb = torch.autograd.grad(pad2.logp.sum(), fp64_model.lm_head.weight)[0]
    torch.testing.assert_close(gb, ga, rtol=1e-9, atol=1e-10)


def test_entropy_by_hand(fp64_model, char_tokenizer):
    ro = _rollout(fp64_model, char_tokenizer)
    out = forward_logprobs(fp64_model, ro, temperature=0.7, entropy=True)
    with torch.no_grad():  # H = -Σ_v p_v log p_v with p = softmax(logits / τ) at each completion position
        T = ro.completion_ids.shape[1]
        pos = position_ids_from_mask(ro.attention_mask)  # positions count real tokens (left padding)
        logits = fp64_model(ro.input_ids, attention_mask=ro.attention_mask, position_ids=pos).logits[:, -T - 1:-1] / 0.7
        lp = torch.log_softmax(logits, -1)
        want = -(lp.exp() * lp).sum(-1) * ro.completion_mask
    torch.testing.assert_close(out.entropy, want, rtol=1e-9, atol=1e-10)
    assert (out.entropy[ro.completion_mask > 0] > 0).all()


@pytest.mark.parametrize("packed", [False, True])
def test_token_logprobs_in_micro_batches(fp64_model, char_tokenizer, packed):
    ro = _rollout(fp64_model, char_tokenizer)
    whole, _ = token_logprobs(fp64_model, ro, temperature=1.0)
    split, _ = token_logprobs(fp64_model, ro, temperature=1.0, split=Split(budget=30, packed=packed))
    torch.testing.assert_close(split, whole, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(whole, ro.logp.to(D), rtol=1e-6, atol=1e-6)  # and the sampler recorded the same


def _grads(run):
    return {n: p.grad.clone() for n, p in run.policy.named_parameters() if p.grad is not None} | (
        {"critic." + n: p.grad.clone() for t in run.trainables[1:] for n, p in t.model.named_parameters()
         if p.grad is not None})


def _one_minibatch(run, batch, budget, packed):
    """accumulate() over all rows as one minibatch; returns (metrics, gradients) and clears them."""
    run.cfg = dataclasses.replace(run.cfg, micro_batch_tokens=budget)
    run.packed = packed
    mask = batch.rollout.completion_mask
    idx = torch.arange(mask.shape[0])
    total = Totals(float(agg_count(mask, run.cfg.loss_agg)), float(mask.sum()))
    metrics = accumulate(run, batch, idx, total)
    grads = _grads(run)
    for t in run.trainables:
        t.optimizer.zero_grad(set_to_none=True)
    return metrics, grads


@pytest.mark.slow  # trains
@pytest.mark.parametrize("algorithm", ["gspo", "grpo", "gspo_token", "ppo"])
@pytest.mark.parametrize("agg", AGG_MODES)
def test_micro_batches_and_packing_equal_one_pass(algorithm, agg, tmp_path):
    # one rollout, then the same minibatch update three ways: one pass, micro-batches of <= 40
    # padded tokens, packed micro-batches of <= 40 real tokens; loss (loss/policy), every metric
    # and every gradient agree to 1e-6 in float64
    cfg = TrainConfig(algorithm=algorithm, loss_agg=agg, prompts_per_step=4, group_size=4, max_new_tokens=6,
                      num_minibatches=1, beta=0.05 if algorithm != "ppo" else 0.0, clip_low=0.002, clip_high=0.003,
                      output_dir=str(tmp_path / "run"), progress=False, critic="separate", reward_kl_coef=0.0)
    run = build_run(cfg)
    run.policy.double()
    if run.reference is not None:
        run.reference.double()
    for t in run.trainables[1:]:  # the separate critic
        t.model.double()
    examples = run.task.train_batch(1, cfg.prompts_per_step, cfg.seed)
    ro, texts, ids, _ = rollout(run, examples, step=1)
    rewards, parts = score(run.rewards, examples, texts, ids, cfg.group_size)
    batch = prepare(run, ro, Scored(rewards=rewards, parts=parts, examples=examples, completions=texts))
    with torch.no_grad():  # move off-policy so that ratios differ from 1 and some clip
        batch.old_logp = batch.old_logp.to(D) + 0.01 * torch.randn(batch.old_logp.shape, dtype=D,
                                                                    generator=torch.Generator().manual_seed(0))
        batch.old_logp *= batch.rollout.completion_mask
    base, g0 = _one_minibatch(run, batch, 0, False)
    for budget, packed in ((40, False), (40, True)):
        assert len(micro_batches(ro, torch.arange(16), budget, packed)) >= 3
        m, g = _one_minibatch(run, batch, budget, packed)
        assert m.keys() == base.keys()
        for k in base:
            if base[k] == base[k]:
                assert m[k] == pytest.approx(base[k], rel=1e-6, abs=1e-9), (k, budget, packed)
        assert g.keys() == g0.keys() and len(g0) > 0
        for n in g0:
            torch.testing.assert_close(g[n], g0[n], rtol=1e-6, atol=1e-10, msg=f"{n} {budget} {packed}")
    assert base["clip/frac"] > 0  # the clipped branch is exercised too


def test_packing_refused_is_said_and_granted_is_not(tmp_path, monkeypatch):
    # a model whose packed forward does not match its padded one trains padded, and the run says so
    import gspo.train.run

    def run_with(**kw):
        return build_run(TrainConfig(packing=True, micro_batch_tokens=40, output_dir=str(tmp_path / "r"),
                                     progress=False, **kw))

    run = run_with()
    assert run.packed and not [n for n in run.notes if "--packing" in n]
    monkeypatch.setattr(gspo.train.run, "supports_packing", lambda model: False)
    run = run_with()
    assert not run.packed
    assert [n for n in run.notes if "--packing" in n] == [
        "--packing: off for tiny (a packed forward does not give the padded forward's hidden states, or the model "
        "has no plain linear LM head); micro-batches are padded"]
