"""Which log-probs anchor π_old: the behaviour policy's (the sampler's, `--old-logp sampling`) or the
proximal policy's (recomputed by the trainer at consumption, `--old-logp recompute`), and the rollout
correction between them (`--rollout-is`, π_prox/π_behav).

Under staleness the two anchors differ. Every registered loss must compute its ratio against exactly
the `old_logp` it is handed (never `rollout_logp` nor anything else: SkyRL PR #1859 anchored CISPO on
the recomputed log-probs, so its correction did nothing), and `gspo.train.batch.prepare` must hand it the one
the option names.

The hand case (float64), two responses of two tokens, every token a completion token, Â = [+1, -1]:
    logp      = [[-1.0, -2.0], [-1.5, -0.5]]
    proximal  = logp                              log-ratio 0 everywhere: every ratio is exactly 1
    behaviour = logp - [[0.5, 0], [0, 0]]         log-ratio [[0.5, 0], [0, 0]]
    rollout   = logp - 1.0                        a third tensor: a loss anchored on it would show e^1
Token ratios under behaviour: [[e^0.5, 1], [1, 1]]; sequence ratios (GSPO's s_i = exp(mean_t log w)):
[e^0.25, e^0] = [1.284025, 1], broadcast over each response's tokens.
Default aggregation seq-mean-token-mean: each token weighs 1/2 (its response) x 1/2 (two responses) = 1/4.
"""

import dataclasses
import math

import pytest
import torch

from gspo.algo.corrections import rollout_is_weights
from gspo.algo.losses import LOSSES, policy_loss
from gspo.config import Corrections, Loss, TrainConfig
from gspo.models.logprobs import token_logprobs
from gspo.rewards.builtin import score_completions
from gspo.sampling.rollout import decode_completions, encode_prompts, sampling_params
from gspo.tasks.scoring import Scored
from gspo.train.batch import prepare
from gspo.train.run import build_run

D = torch.float64
E = math.exp
LN = math.log
ADV = torch.tensor([1.0, -1.0], dtype=D)
MASK = torch.ones(2, 2, dtype=D)
LOGP = torch.tensor([[-1.0, -2.0], [-1.5, -0.5]], dtype=D)
PROXIMAL = LOGP.clone()
BEHAVIOUR = LOGP - torch.tensor([[0.5, 0.0], [0.0, 0.0]], dtype=D)
ROLLOUT = LOGP - 1.0
ON_POLICY_GRAD = [[-0.25, -0.25], [0.25, 0.25]]  # -Â/4 per token: every loss's gradient at ratio 1

# the ratio each loss reports: per token, or its response's sequence ratio on every token
SEQUENCE_RATIO = {"gspo", "gspo_token", "gmpo"}
TOKEN_RATIO = {"ppo", "grpo", "cispo", "sapo", "dppo_tv", "dppo_kl", "cppo"}
PREFIX_RATIO = {"ctpo"}  # the product of the token ratios up to each token
_SAPO_SIG = 1 / (1 + E(-(E(0.5) - 1)))  # σ(τ(r - 1)) at r = e^0.5, τ = τ_pos = 1: 0.656722
# d loss / d logp anchored on behaviour, by hand, with each loss's preset clip range:
BEHAVIOUR_GRAD = {
    # w00 = e^0.5 = 1.6487 > 1 + 0.27 (grpo) / 1 + 0.2 (ppo) with Â > 0: clipped, no gradient; others -Â/4
    "grpo": [[0.0, -0.25], [0.25, 0.25]],
    "ppo": [[0.0, -0.25], [0.25, 0.25]],
    # CISPO: -sg(clip(w, 0, 1.28))·Â/4; w00 clipped to 1.28 -> -0.32; no gradient is ever cut
    "cispo": [[-1.28 / 4, -0.25], [0.25, 0.25]],
    # SAPO: -Â·4σ(1-σ)·r/4 = -σ(1-σ)·e^0.5 = -0.371685 at token 00; at r = 1, σ = 1/2: -Â/4
    "sapo": [[-_SAPO_SIG * (1 - _SAPO_SIG) * E(0.5), -0.25], [0.25, 0.25]],
    # s_0 = e^0.25 = 1.284 > 1 + 4e-4 with Â > 0: response 0 clipped whole; response 1 at s = 1: -Â/4
    "gspo": [[0.0, 0.0], [0.25, 0.25]],
    "gspo_token": [[0.0, 0.0], [0.25, 0.25]],
    # GMPO: log w00 = 0.5 clipped to 0.4 (no gradient there); ratio_0 = exp((0.4 + 0)/2) = e^0.2;
    # token 01: -Â·ratio_0/|y|/2 = -e^0.2/4 = -0.305351; response 1 at ratio 1: -Â/4
    "gmpo": [[0.0, -E(0.2) / 4], [0.25, 0.25]],
    # DPPO-TV: token 00 moved p - q = e^-1 - e^-1.5 = 0.367879 - 0.223130 = 0.144749 <= δ 0.15: kept, unclipped
    # gradient -Â·w/4 = -e^0.5/4 = -0.412180 (anchored on the rollout, e^-1 - e^-2 = 0.232 would drop it: 0)
    "dppo_tv": [[-E(0.5) / 4, -0.25], [0.25, 0.25]],
    # DPPO-KL: q ln(q/p) + (1-q) ln((1-q)/(1-p)) = 0.223130·(-0.5) + 0.776870·ln(0.776870/0.632121)
    # = -0.111565 + 0.160185 = 0.048620 <= δ 0.05: kept, as DPPO-TV
    "dppo_kl": [[-E(0.5) / 4, -0.25], [0.25, 0.25]],
    # CPPO: token 00 is first (w = 1, nothing spent: c = δ = 0.15), Z = 0.144749: kept; token 01 has D = 0
    "cppo": [[-E(0.5) / 4, -0.25], [0.25, 0.25]],
    # CTPO: response 0's prefix log-ratios are 0.5 and 0.5 + 0, past the bands 0.05·1 and 0.05·√2 with Â > 0:
    # both clipped; response 1 at ratio 1: -Â/4
    "ctpo": [[0.0, 0.0], [0.25, 0.25]],
}


def close(a, b, tol=1e-6):
    torch.testing.assert_close(torch.as_tensor(a, dtype=D), torch.as_tensor(b, dtype=D), rtol=tol, atol=1e-12)


def preset(name: str, **kw) -> Loss:
    """The loss section of loss `name` with its own preset clip range and default options."""
    return Loss(algorithm=name, clip_low=LOSSES[name].clip_low, clip_high=LOSSES[name].clip_high, **kw)


def loss_and_grad(name: str, old: torch.Tensor, **kw):
    """policy_loss of the hand case anchored on `old`, with the rollout's log-probs handed too (and
    consumed, by OPSM with a δ so wide it drops nothing: mean(rollout - logp) = -1 < 10)."""
    logp = LOGP.clone().requires_grad_()
    loss, m = policy_loss(logp, old, ADV, MASK, preset(name), rollout_logp=ROLLOUT, opsm_delta=10.0, max_len=2, **kw)
    loss.backward()
    return loss, m, logp.grad


def test_every_loss_is_classified_for_the_hand_case():
    # a newly registered loss must state which ratio it reports and its hand gradient below
    assert SEQUENCE_RATIO | TOKEN_RATIO | PREFIX_RATIO == set(LOSSES) == set(BEHAVIOUR_GRAD)
    assert not SEQUENCE_RATIO & TOKEN_RATIO and not PREFIX_RATIO & (SEQUENCE_RATIO | TOKEN_RATIO)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_every_loss_ratio_is_anchored_on_old_logp(name):
    # proximal anchor (== logp): every ratio is exactly 1, k3 KL(old‖new) = 1 - 1 - 0 = 0, and every
    # loss reduces to the policy gradient -Â/4 per token
    _, m, grad = loss_and_grad(name, PROXIMAL)
    for key in ("ratio/mean", "ratio/min", "ratio/max"):
        assert float(m[key]) == 1.0, (key, float(m[key]))  # exp(0) exactly: not e^1 (rollout), not e^0.5 (behaviour)
    close(m["kl/old_new"], 0.0)
    close(m["ratio/seq_log_abs"], 0.0)
    close(m["ratio/token_spread"], 0.0)
    close(m["opsm/masked_frac"], 0.0)  # the rollout's log-probs were consumed, and dropped nothing
    close(grad, ON_POLICY_GRAD)
    # behaviour anchor: log w = [[0.5, 0], [0, 0]]
    _, m, grad = loss_and_grad(name, BEHAVIOUR)
    if name in SEQUENCE_RATIO:  # [e^0.25, e^0.25, 1, 1]: mean (e^0.25 + 1)/2 = 1.142013, max e^0.25, min 1
        close(m["ratio/mean"], (E(0.25) + 1) / 2)
        close(m["ratio/max"], E(0.25))
    elif name in PREFIX_RATIO:  # [e^0.5, e^0.5 · 1, 1, 1]: mean (e^0.5 + 1)/2 = 1.324361, max e^0.5
        close(m["ratio/mean"], (E(0.5) + 1) / 2)
        close(m["ratio/max"], E(0.5))
    else:  # [e^0.5, 1, 1, 1]: mean (e^0.5 + 3)/4 = 1.162180, max e^0.5 = 1.648721, min 1
        close(m["ratio/mean"], (E(0.5) + 3) / 4)
        close(m["ratio/max"], E(0.5))
    close(m["ratio/min"], 1.0)
    close(m["kl/old_new"], (E(0.5) - 1 - 0.5) / 4)  # k3 on token 00: e^0.5 - 1 - 0.5 = 0.148721, over 4 tokens
    # whatever the loss: log s = [0.25, 0], so |log s| averages (0.25 + 0) / 2 = 0.125 over the 2 responses;
    # |log w - log s| = [|0.5 - 0.25|, |0 - 0.25|, 0, 0] averages 0.5 / 4 = 0.125 over the 4 tokens
    close(m["ratio/seq_log_abs"], 0.125)
    close(m["ratio/token_spread"], 0.125)
    close(grad, BEHAVIOUR_GRAD[name])


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_the_ratio_ignores_rollout_logp(name):
    # the same anchor with two different rollout tensors (logp - 1 and logp + 3): the same loss,
    # metrics and gradient; with OPSM off, rollout_logp is not read at all
    a, ma, ga = loss_and_grad(name, BEHAVIOUR)
    logp = LOGP.clone().requires_grad_()
    b, mb = policy_loss(logp, BEHAVIOUR, ADV, MASK, preset(name), rollout_logp=LOGP + 3.0, max_len=2)
    b.backward()
    assert float(a.detach()) == float(b.detach())
    for key in ("ratio/mean", "ratio/min", "ratio/max", "kl/old_new", "clip/frac"):
        assert float(ma[key]) == float(mb[key]), key
    assert torch.equal(ga, logp.grad)


# --------------------------------------------------------------------------------------------------
# The rollout correction under staleness: old = proximal, rollout = behaviour
# --------------------------------------------------------------------------------------------------

# d = prox - behav = [[ln 1.5, -0.5], [ln 3, 0]]: exp(d) = [[1.5, 0.606531], [3, 1]]
PROX = torch.tensor([[-0.4, -1.2], [-0.9, -2.0]], dtype=D)
BEHAV = PROX - torch.tensor([[LN(1.5), -0.5], [LN(3.0), 0.0]], dtype=D)
IS_HAND = {
    # TIS, cap 2: [[1.5, e^-0.5], [min(3, 2) = 2, 1]]; 1 of 4 tokens truncated
    ("token", "truncate"): ([[1.5, E(-0.5)], [2.0, 1.0]], "is/truncated_frac", 1 / 4),
    # IcePop, [0.5, 2]: 3 is out -> 0; 1.5, 0.6065, 1 in -> 1
    ("token", "mask"): ([[1.0, 1.0], [0.0, 1.0]], "is/masked_frac", 1 / 4),
    # per response: exp(ln 1.5 - 0.5) = 1.5·e^-0.5 = 0.909796; exp(ln 3) = 3 -> cap 2; 1 of 2 truncated
    ("sequence", "truncate"): ([[1.5 * E(-0.5)] * 2, [2.0, 2.0]], "is/truncated_frac", 1 / 2),
    # geometric: sqrt(0.909796) = 0.953832; sqrt(3) = 1.732051 (under the cap)
    ("geometric", "truncate"): ([[(1.5 * E(-0.5)) ** 0.5] * 2, [3 ** 0.5] * 2], "is/truncated_frac", 0.0),
}


@pytest.mark.parametrize("level,mode", sorted(IS_HAND))
def test_rollout_is_weights_are_prox_over_behaviour(level, mode):
    corrections = Corrections(rollout_is=level, rollout_is_mode=mode, rollout_is_low=0.5, rollout_is_high=2.0)
    w, m = rollout_is_weights(PROX, BEHAV, MASK, corrections)
    expected, frac_key, frac = IS_HAND[(level, mode)]
    close(w, expected)
    close(m[frac_key], frac)
    # anchored on behaviour itself (old = behav, the sampling anchor): exp(0) = 1 everywhere, nothing cut
    w, m = rollout_is_weights(BEHAV, BEHAV, MASK, corrections)
    assert torch.equal(w, torch.ones_like(w))
    assert float(m[frac_key]) == 0.0


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_the_correction_changes_every_loss(name):
    # decoupled objective: anchor proximal (ratio 1), weights w = TIS's [[1.5, e^-0.5], [2, 1]]; the
    # weighted gradient is -Â·w/4 per token (token terms), or -Â·mean_t(w)/4 on every token of a
    # response (a response's single term, weighted token by token: row means 1.053265 and 1.5);
    # unweighted it is -Â/4 (ON_POLICY_GRAD): the correction is not a no-op for any loss
    w = torch.tensor([[1.5, E(-0.5)], [2.0, 1.0]], dtype=D)
    _, _, grad = loss_and_grad(name, PROXIMAL, is_weights=w)
    if name in ("gspo", "gmpo"):
        row = [(1.5 + E(-0.5)) / 2, 1.5]
        expected = [[-row[0] / 4] * 2, [row[1] / 4] * 2]
    else:
        expected = [[-1.5 / 4, -E(-0.5) / 4], [2.0 / 4, 1.0 / 4]]
    close(grad, expected)
    assert not torch.allclose(grad, torch.tensor(ON_POLICY_GRAD, dtype=D))


# --------------------------------------------------------------------------------------------------
# prepare: the anchor the option names
# --------------------------------------------------------------------------------------------------

# a stale sampler's log-probs: the policy's shifted per completion column by these (hand) amounts;
# prox - behav = -shift, so exp(-shift) = [e^1 = 2.718 (cut to the cap 2), e^-0.5 = 0.606531,
# e^0.2 = 1.221403, e^-0.3 = 0.740818]
SHIFT = [-1.0, 0.5, -0.2, 0.3]
IS_BY_COLUMN = [2.0, E(-0.5), E(0.2), E(-0.3)]


def stale_batch(tmp_path, **options):
    """A run on the built-in tiny model (float64), one rollout from the run's sampler whose `logp` is
    overwritten by a stale behaviour tensor, and prepare's batch of it. Returns (run, batch, behaviour,
    the policy's log-probs, the completion mask). (gspo.train.trainer's `rollout` is this, plus stop strings
    and episodes; it is not imported here, so that these tests stand apart from the trainer's loop.)"""
    cfg = TrainConfig(prompts_per_step=2, group_size=2, max_new_tokens=4, num_minibatches=1, progress=False,
                      output_dir=str(tmp_path / "run"), **options)
    run = build_run(cfg)
    run.policy.double()
    c, G = run.cfg, run.cfg.sampling.group_size
    examples = run.task.train_batch(1, c.sampling.prompts_per_step, c.run.seed)
    params = sampling_params(run.tokenizer, stop=run.stop_ids, group_size=G, max_new_tokens=c.sampling.max_new_tokens,
                             temperature=c.sampling.temperature)
    run.sampler.sync(run.policy)
    prompts = encode_prompts(run.tokenizer, [ex.prompt for ex in examples], c.data.max_prompt_length)
    ro = run.sampler.sample(prompts, params, generator=torch.Generator().manual_seed(0))
    mask = ro.completion_mask.to(D)
    policy_logp, _ = token_logprobs(run.policy, ro, temperature=c.sampling.temperature)  # (B, T)
    T = mask.shape[1]
    shift = torch.tensor(SHIFT[:T], dtype=D).expand_as(mask) * mask
    behaviour = (policy_logp.to(D) + shift) * mask
    ro.logp = behaviour
    texts, ids = decode_completions(run.tokenizer, ro)
    total, parts = score_completions(run.rewards, examples, texts, ids, G)
    batch = prepare(run, ro, Scored(rewards=torch.tensor(total), parts=parts, examples=examples, completions=texts))
    return run, batch, behaviour, policy_logp.to(D), mask


def test_prepare_sampling_hands_the_behaviour_logprobs(tmp_path):
    run, batch, behaviour, policy_logp, mask = stale_batch(tmp_path, old_logp="sampling")
    assert run.cfg.loss.old_logp == "sampling"
    assert torch.equal(batch.old_logp, behaviour)  # the sampler's own, as recorded: not recomputed
    assert batch.is_weights is None
    # and it is not the policy's: they differ by the hand shift, |-1.0| on the first column
    close(((policy_logp - batch.old_logp) * mask)[:, 0], [1.0] * mask.shape[0])


def test_prepare_recompute_hands_the_proximal_logprobs_and_weights(tmp_path):
    run, batch, behaviour, policy_logp, mask = stale_batch(tmp_path, old_logp="recompute", rollout_is="token",
                                                           rollout_is_high=2.0)
    assert (run.cfg.loss.old_logp, run.cfg.corrections.rollout_is) == ("recompute", "token")
    close(batch.old_logp * mask, policy_logp * mask)  # the trainer's weights, recomputed
    # not the behaviour tensor: prox - behav = -shift on every completion token, by hand
    T = mask.shape[1]
    close((batch.old_logp - behaviour) * mask, -torch.tensor(SHIFT[:T], dtype=D) * mask)
    # is_weights = min(exp(prox - behav), 2) per column, 0 on padding
    close(batch.is_weights, torch.tensor(IS_BY_COLUMN[:T], dtype=D) * mask)
    # the first column (every completion has one) is the only one cut: B of all tokens
    close(batch.is_metrics["is/truncated_frac"], mask[:, 0].sum() / mask.sum())
    cfg = dataclasses.replace(run.cfg.corrections, rollout_is_high=3.0)  # cap above e^1: nothing cut
    w, _ = rollout_is_weights(batch.old_logp, behaviour, mask, cfg)
    close(w[:, 0], [E(1.0)] * mask.shape[0])
