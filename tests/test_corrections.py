"""Sampler/trainer mismatch corrections: rollout IS weights and OPSM, by hand and by identity.

The hand case: two responses, d_t = old_logp - rollout_logp (log π_old/π_rollout),
    response 1 (3 tokens): d = [ln 1.2, -0.5, 0]     exp(d) = [1.2, 0.606531, 1.0]
    response 2 (2 tokens + 1 padding): d = [-0.2, ln 1.5]   exp(d) = [0.818731, 1.5]
    per response: Σd = ln 1.2 - 0.5 = -0.317678 -> exp 0.727838;  -0.2 + ln 1.5 = 0.205465 -> exp 1.228096
    geometric:   mean d = -0.105893 -> exp 0.899522;            0.102733 -> exp 1.108195
"""

import math

import pytest
import torch

from gspo.algo.aggregation import aggregate
from gspo.algo.corrections import rollout_is_weights
from gspo.algo.losses import policy_loss
from gspo.config import Corrections, Loss

D = torch.float64
LN = math.log
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=D)
ROLLOUT = torch.tensor([[-1.0, -2.0, -0.3], [-0.7, -1.1, -4.0]], dtype=D)
D_HAND = torch.tensor([[LN(1.2), -0.5, 0.0], [-0.2, LN(1.5), 9.0]], dtype=D)  # 9.0 sits on padding
OLD = ROLLOUT + D_HAND
E = math.exp
SEQ = [1.2 * E(-0.5), E(-0.2) * 1.5]  # [0.727838, 1.228096]
GEO = [SEQ[0] ** (1 / 3), SEQ[1] ** (1 / 2)]  # [0.899522, 1.108195]


def close(a, b, rtol=1e-6, atol=1e-12):
    torch.testing.assert_close(torch.as_tensor(a, dtype=D), torch.as_tensor(b, dtype=D), rtol=rtol, atol=atol)


def section(level, mode, low=0.5, high=2.0):
    return Corrections(rollout_is=level, rollout_is_mode=mode, rollout_is_low=low, rollout_is_high=high)


def weights(level, mode, low=0.5, high=2.0, tensors=(OLD, ROLLOUT, MASK)):
    """rollout_is_weights of (old_logp, rollout_logp, mask), the hand case's by default."""
    return rollout_is_weights(*tensors, section(level, mode, low, high))


def L(name, clip_low, clip_high, **kw):
    """The loss section of loss `name` with this clip range (other options by Loss's names: loss_agg=, beta= ...)."""
    return Loss(algorithm=name, clip_low=clip_low, clip_high=clip_high, **kw)


# (level, mode, low, high) -> expected weights (0 on padding), fraction changed, what it counts
HAND = {
    # TIS: min(exp d, 1.1): 1.2 and 1.5 are cut to 1.1 -> 2 of 5 tokens truncated
    ("token", "truncate", 0.5, 1.1): ([[1.1, E(-0.5), 1.0], [E(-0.2), 1.1, 0.0]], 2 / 5),
    # IcePop: 1 inside [0.7, 1.1]: only 1.0 and 0.818731 are -> 3 of 5 tokens masked
    ("token", "mask", 0.7, 1.1): ([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]], 3 / 5),
    # sequence TIS: min(0.727838, 1.1) = 0.727838, min(1.228096, 1.1) = 1.1 -> 1 of 2 responses
    ("sequence", "truncate", 0.5, 1.1): ([[SEQ[0]] * 3, [1.1, 1.1, 0.0]], 1 / 2),
    # sequence mask [0.7, 1.2]: 0.727838 inside, 1.228096 outside -> 1 of 2 responses
    ("sequence", "mask", 0.7, 1.2): ([[1.0] * 3, [0.0, 0.0, 0.0]], 1 / 2),
    # geometric mask [0.7, 1.2]: 0.899522 and 1.108195 both inside (the length-normalised gap is smaller)
    ("geometric", "mask", 0.7, 1.2): ([[1.0] * 3, [1.0, 1.0, 0.0]], 0.0),
    # geometric truncate at 1.05: 0.899522 stays, 1.108195 -> 1.05
    ("geometric", "truncate", 0.5, 1.05): ([[GEO[0]] * 3, [1.05, 1.05, 0.0]], 1 / 2),
}


@pytest.mark.parametrize("key", list(HAND))
def test_weights_by_hand(key):
    level, mode, low, high = key
    expected, frac = HAND[key]
    w, m = weights(level, mode, low, high)
    close(w, expected)
    name = "is/truncated_frac" if mode == "truncate" else "is/masked_frac"
    close(m[name], frac)
    exp = torch.tensor(expected, dtype=D)
    close(m["is/weight_mean"], float(exp.sum()) / 5)  # over the 5 completion tokens
    close(m["is/weight_max"], float(exp.max()))
    assert m[name].count == (5 if level == "token" else 2)  # tokens, or responses


def test_token_truncation_weight_mean_by_hand():
    # (1.1 + 0.606531 + 1.0 + 0.818731 + 1.1) / 5 = 4.625261 / 5 = 0.925052
    _, m = weights("token", "truncate", high=1.1)
    close(m["is/weight_mean"], 0.9250524, rtol=1e-6)


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_no_gap_gives_weights_exactly_one(level, mode):
    w, m = weights(level, mode, low=0.999, high=1.001, tensors=(ROLLOUT.clone(), ROLLOUT, MASK))
    assert torch.equal(w, MASK)  # exactly 1 on completion tokens, 0 on padding
    assert float(m["is/truncated_frac" if mode == "truncate" else "is/masked_frac"]) == 0.0


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_padding_changes_nothing(level, mode):
    w, m = weights(level, mode, low=0.7, high=1.1)
    junk = torch.full((2, 2), -50.0, dtype=D)
    pad = torch.zeros(2, 2, dtype=D)
    padded = (torch.cat([OLD, junk], 1), torch.cat([ROLLOUT, -junk], 1), torch.cat([MASK, pad], 1))
    w2, m2 = weights(level, mode, low=0.7, high=1.1, tensors=padded)
    close(w2[:, :3], w)
    assert (w2[:, 3:] == 0).all()
    assert m.keys() == m2.keys()
    for k in m:  # equal up to the order of a sum
        close(m[k], m2[k], rtol=1e-12)


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_extreme_gaps_stay_finite(level, mode):
    old = torch.tensor([[-1e4, 0.0], [0.0, -1e4]], dtype=D)
    rollout = torch.tensor([[0.0, -1e4], [-1e4, 0.0]], dtype=D)
    w, m = rollout_is_weights(old, rollout, torch.ones(2, 2, dtype=D), section(level, mode, low=0.5, high=2.0))
    assert torch.isfinite(w).all() and all(math.isfinite(v) for v in m.values())
    assert float(w.max()) <= 2.0


def test_bad_arguments_raise():
    for kw, msg in [({"level": "batch", "mode": "mask"}, "level"), ({"level": "token", "mode": "clip"}, "mode"),
                    ({"level": "token", "mode": "mask", "low": 1.5}, "low"),
                    ({"level": "token", "mode": "mask", "high": 0.9}, "high")]:
        with pytest.raises(ValueError, match=msg):
            rollout_is_weights(OLD, ROLLOUT, MASK, section(**kw))
    with pytest.raises(ValueError, match="shape"):
        rollout_is_weights(OLD, ROLLOUT[:, :2], MASK, section(level="token", mode="mask"))


def test_weights_multiply_the_per_token_loss_before_aggregation():
    # GRPO on-policy: every token's loss is -Â. Â = [1, -2], token TIS weights at 1.1 (HAND):
    #   response 1: -1 · [1.1, 0.606531, 1.0]     mean -0.902177
    #   response 2: +2 · [0.818731, 1.1]          mean  1.918731
    #   seq-mean-token-mean: (-0.902177 + 1.918731) / 2 = 0.508277
    w, _ = weights("token", "truncate", high=1.1)
    logp = OLD.clone().requires_grad_()
    adv = torch.tensor([1.0, -2.0], dtype=D)
    loss, _ = policy_loss(logp, OLD, adv, MASK, L("grpo", 0.2, 0.2), is_weights=w)
    r1 = -(1.1 + E(-0.5) + 1.0) / 3
    r2 = 2 * (E(-0.2) + 1.1) / 2
    close(loss, (r1 + r2) / 2)
    loss.backward()
    # d loss / d logp_t = -Â_i · w_t / |y_i| / 2 (r = 1): response 1 -[1.1, 0.606531, 1.0]/6
    close(logp.grad[0], -torch.tensor([1.1, E(-0.5), 1.0], dtype=D) / 6)
    close(logp.grad[1], torch.tensor([2 * E(-0.2) / 4, 2 * 1.1 / 4, 0.0], dtype=D))
    # a weight of 1 everywhere is no correction at all
    plain, _ = policy_loss(OLD, OLD, adv, MASK, L("gspo", 0.2, 0.2))
    ones, _ = policy_loss(OLD, OLD, adv, MASK, L("gspo", 0.2, 0.2), is_weights=MASK.clone())
    assert torch.equal(plain, ones)


def test_weights_do_not_touch_the_kl_term():
    # masking every token removes the policy term only: what is left is β · KL
    ref = OLD - 0.1
    zero = torch.zeros_like(MASK)
    adv = torch.tensor([1.0, -2.0], dtype=D)
    loss, m = policy_loss(OLD, OLD, adv, MASK, L("grpo", 0.2, 0.2, beta=0.5), is_weights=zero, ref_logp=ref)
    # k3 with log ρ = -0.1 on every token: e^-0.1 - 1 + 0.1 = 0.0048374; β · that = 0.0024187
    close(loss, 0.5 * (E(-0.1) - 0.9))
    close(m["loss/policy"], 0.0)


def test_opsm_drops_negative_responses_far_off_policy():
    # ratio 1 (logp = old_logp); mean per-token gap log π_rollout - log π_θ per response:
    #   response 1: Â = -1, gap 0.2  > δ = 0.1 -> dropped
    #   response 2: Â = -2, gap 0.05 <= δ      -> kept
    #   response 3: Â = +0.5, gap 0.5          -> kept (only negative advantages are masked)
    # GRPO per-token loss on-policy is -Â: terms [0 (dropped), 2, -0.5]; the denominator keeps
    # all 3 responses: (0 + 2 - 0.5) / 3 = 0.5 (without OPSM: (1 + 2 - 0.5) / 3 = 0.833333)
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.5], [-1.0, -1.0]], dtype=D)
    rollout = logp + torch.tensor([[0.1, 0.3], [0.05, 0.05], [0.5, 0.5]], dtype=D)
    mask = torch.ones(3, 2, dtype=D)
    adv = torch.tensor([-1.0, -2.0, 0.5], dtype=D)
    grpo = L("grpo", 0.2, 0.2)
    loss, m = policy_loss(logp, logp, adv, mask, grpo, rollout_logp=rollout, opsm_delta=0.1)
    close(loss, 0.5)
    close(m["opsm/masked_frac"], 1 / 3)
    off, _ = policy_loss(logp, logp, adv, mask, grpo, rollout_logp=rollout)
    close(off, 2.5 / 3)
    # 0.2 < 0.25: nothing dropped
    wide, m = policy_loss(logp, logp, adv, mask, grpo, rollout_logp=rollout, opsm_delta=0.25)
    close(wide, 2.5 / 3)
    assert m["opsm/masked_frac"] == 0.0
    with pytest.raises(ValueError, match="rollout_logp"):
        policy_loss(logp, logp, adv, mask, L("grpo", 0.2, 0.2), opsm_delta=0.1)


def test_aggregation_keeps_masked_tokens_in_the_denominator():
    # token-mean over 5 tokens with the IcePop weights [[0,0,1],[1,0,0]] and values all 1: 2 / 5
    w, _ = weights("token", "mask", low=0.7, high=1.1)
    close(aggregate(torch.ones_like(MASK) * w, MASK, "token-mean"), 2 / 5)


def test_the_spread_of_the_weights_is_their_standard_deviation_over_tokens():
    # sequence truncate (cap 2.0) on the hand case: weights [0.727838 x3, 1.228096 x2] on the 5 completion tokens
    from gspo.algo.corrections import spread

    _, m = rollout_is_weights(OLD, ROLLOUT, MASK, Corrections(rollout_is="sequence", rollout_is_high=2.0))
    m = spread(m)
    w = [SEQ[0]] * 3 + [SEQ[1]] * 2
    mean = sum(w) / 5  # 0.928342
    std = math.sqrt(sum((x - mean) ** 2 for x in w) / 5)  # population: 0.245434
    assert "is/weight_sq_mean" not in m
    assert math.isclose(m["is/weight_mean"], mean, rel_tol=1e-12)
    assert math.isclose(m["is/weight_std"], std, rel_tol=1e-9)
    assert math.isclose(m["is/weight_min"], SEQ[0], rel_tol=1e-12)


def test_the_guard_fires_on_sequence_weights_that_collapse_at_real_length_and_not_on_their_geometric_mean():
    # 64 responses of 4096 tokens (a long reasoning answer), the sampler a little more confident than the trainer
    # on average, as a bf16 engine is: d_t ~ N(-0.001, 0.01) per token. Σ_t d_t ≈ -4.1 ± 0.64 per response, so the
    # product weight is about e^-4.1 ≈ 0.017 (NeMo-RL PR #2269 saw 0.06 at 9k tokens); the geometric mean's
    # log is -0.001 ± 0.00016: weight 0.999.
    from gspo.algo.corrections import COLLAPSE_MEAN, spread, weight_collapse

    g = torch.Generator().manual_seed(0)
    rollout = torch.full((64, 4096), -1.0, dtype=D)
    old = rollout + (-0.001 + 0.01 * torch.randn(64, 4096, generator=g, dtype=D))
    mask = torch.ones(64, 4096, dtype=D)
    seq = spread(rollout_is_weights(old, rollout, mask, Corrections(rollout_is="sequence"))[1])
    geo = spread(rollout_is_weights(old, rollout, mask, Corrections(rollout_is="geometric"))[1])
    assert seq["is/weight_mean"] < 0.05 < COLLAPSE_MEAN < 0.99 < geo["is/weight_mean"]
    warning = weight_collapse(seq, "sequence")
    assert warning is not None and "--rollout-is geometric" in warning and "\n" not in warning
    assert weight_collapse(geo, "geometric") is None
    # a sequence level whose weights stay near 1 (short answers, a faithful sampler) is silent
    near = spread(rollout_is_weights(rollout[:, :8] + 1e-4, rollout[:, :8], mask[:, :8],
                                     Corrections(rollout_is="sequence"))[1])
    assert weight_collapse(near, "sequence") is None
