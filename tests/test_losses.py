"""Policy losses: hand-computed cases, the paper's identities, and property tests.

All hand cases are in float64 and compared with rtol=1e-6 (tighter than the project's 1e-5).
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gspo.algo.aggregation import AGG_MODES, aggregate
from gspo.algo.losses import LOSSES, kl_penalty, policy_loss
from gspo.config import Loss

D = torch.float64
LN = math.log


def t(x):
    return torch.tensor(x, dtype=D)


def close(a, b, rtol=1e-6, atol=1e-12):
    torch.testing.assert_close(torch.as_tensor(a, dtype=D), torch.as_tensor(b, dtype=D), rtol=rtol, atol=atol)


def L(name, clip_low, clip_high, **kw):
    """The loss section of loss `name` with this clip range (other options by Loss's names: loss_agg=, beta= ...)."""
    return Loss(algorithm=name, clip_low=clip_low, clip_high=clip_high, **kw)


# ----------------------------------------------------------------------------------------------
# Hand-computed cases
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["grpo", "ppo"])
def test_token_level_positive_advantage_clips_high_only(name):
    # One response, two tokens, w = [1.5, 0.5], Â = +1, ε = 0.2 / 0.2
    # token 1: min(1.5·1, clip(1.5)=1.2 ·1) = 1.2   -> clipped at the top (gradient cut)
    # token 2: min(0.5·1, clip(0.5)=0.8 ·1) = 0.5   -> unclipped branch is the min
    # objective = (1.2 + 0.5) / 2 = 0.85, loss = -0.85
    logp, old = t([[LN(1.5), LN(0.5)]]), t([[0.0, 0.0]])
    loss, m = policy_loss(logp, old, t([1.0]), t([[1.0, 1.0]]), L(name, 0.2, 0.2))
    close(loss, -0.85)
    close(m["clip/frac"], 0.5)
    close(m["clip/high_frac"], 0.5)
    close(m["clip/low_frac"], 0.0)
    close(m["ratio/mean"], 1.0)  # (1.5 + 0.5) / 2
    close(m["ratio/min"], 0.5)
    close(m["ratio/max"], 1.5)
    # k3 of KL(old‖new), w - 1 - ln w: (0.5 - ln 1.5 + (-0.5) - ln 0.5) / 2 = -ln(0.75) / 2
    close(m["kl/old_new"], -LN(0.75) / 2)
    close(m["loss/policy"], -0.85)


def test_grpo_negative_advantage_clips_low_only():
    # w = [1.5, 0.5], Â = -1, ε = 0.2 / 0.2
    # token 1: min(-1.5, -1.2) = -1.5   -> unclipped
    # token 2: min(-0.5, -0.8) = -0.8   -> clipped at the bottom
    # objective = (-1.5 - 0.8) / 2 = -1.15, loss = +1.15
    logp, old = t([[LN(1.5), LN(0.5)]]), t([[0.0, 0.0]])
    loss, m = policy_loss(logp, old, t([-1.0]), t([[1.0, 1.0]]), L("grpo", 0.2, 0.2))
    close(loss, 1.15)
    close(m["clip/low_frac"], 0.5)
    close(m["clip/high_frac"], 0.0)


def test_grpo_asymmetric_clip_and_gradient():
    # w = [1.25], Â = +2, ε_low = 0.2, ε_high = 0.27: 1.25 < 1.27 so not clipped.
    # objective = 1.25·2 = 2.5; d(loss)/d(logp) = -w·Â = -2.5 (d w / d logp = w)
    logp = t([[LN(1.25)]]).requires_grad_()
    loss, m = policy_loss(logp, t([[0.0]]), t([2.0]), t([[1.0]]), L("grpo", 0.2, 0.27))
    loss.backward()
    close(loss, -2.5)
    close(logp.grad, [[-2.5]])
    close(m["clip/frac"], 0.0)
    # Same with ε_high = 0.2: clipped at 1.2, objective 2.4, gradient cut to 0
    logp = t([[LN(1.25)]]).requires_grad_()
    loss, m = policy_loss(logp, t([[0.0]]), t([2.0]), t([[1.0]]), L("grpo", 0.2, 0.2))
    loss.backward()
    close(loss, -2.4)
    close(logp.grad, [[0.0]])
    close(m["clip/frac"], 1.0)


def test_ppo_per_token_advantages():
    # PPO with per-token Â = [+1, -1], w = [1.1, 1.1], ε = 0.2:
    # token 1: min(1.1, 1.1) = 1.1; token 2: min(-1.1, -1.1) = -1.1; mean = 0, loss = 0
    # gradient: d/dlogp of -(1/2)(w1·1 + w2·(-1)) = [-1.1/2, +1.1/2]
    logp = t([[LN(1.1), LN(1.1)]]).requires_grad_()
    loss, _ = policy_loss(logp, t([[0.0, 0.0]]), t([[1.0, -1.0]]), t([[1.0, 1.0]]), L("ppo", 0.2, 0.2))
    loss.backward()
    close(loss, 0.0)
    close(logp.grad, [[-0.55, 0.55]])


def _gspo_case():
    # Three responses (padded to T = 3), ε_low = 0.2, ε_high = 0.27
    # r1: 2 tokens, log w = [ln 1.5, ln 0.5]       s1 = (1.5·0.5)^(1/2) = √0.75 = 0.8660254, Â = +1
    #     0.8 ≤ s1 ≤ 1.27: unclipped, term = 0.8660254
    # r2: 1 token,  log w = [ln 1.5]               s2 = 1.5, Â = +1 -> clipped at 1.27, term = 1.27
    # r3: 3 tokens, log w = [ln 2, ln .5, ln .5]   s3 = 0.5^(1/3) = 0.7937005, Â = -1
    #     min(-0.7937005, -0.8) = -0.8: clipped at the bottom
    # objective = (0.8660254 + 1.27 - 0.8) / 3 = 0.4453418, loss = -0.4453418
    # clipped tokens: r2's 1 (high) + r3's 3 (low) = 4 of 6 completion tokens
    logp = t([[LN(1.5), LN(0.5), 0.0], [LN(1.5), 0.0, 0.0], [LN(2.0), LN(0.5), LN(0.5)]])
    old = torch.zeros_like(logp)
    mask = t([[1, 1, 0], [1, 0, 0], [1, 1, 1]])
    adv = t([1.0, 1.0, -1.0])
    return logp, old, adv, mask


def test_gspo_hand_case():
    logp, old, adv, mask = _gspo_case()
    logp.requires_grad_()
    loss, m = policy_loss(logp, old, adv, mask, L("gspo", 0.2, 0.27))
    s1, s3 = math.sqrt(0.75), 0.5 ** (1 / 3)
    close(loss, -(s1 + 1.27 - 0.8) / 3)
    close(m["clip/frac"], 4 / 6)
    close(m["clip/high_frac"], 1 / 6)
    close(m["clip/low_frac"], 3 / 6)
    # ratio stats are per completion token (s_i repeated |y_i| times): (2·s1 + 1.5 + 3·s3) / 6
    close(m["ratio/mean"], (2 * s1 + 1.5 + 3 * s3) / 6)
    close(m["ratio/min"], s3)
    close(m["ratio/max"], 1.5)
    loss.backward()
    # Only r1 is unclipped: d(-s1·Â/3)/d logp_{1,t} = -(1/3)·s1·(1/2) for both its tokens (Eq. 10)
    g = -s1 / 6
    close(logp.grad, [[g, g, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])


def test_gspo_token_hand_case_matches_gspo():
    logp, old, adv, mask = _gspo_case()
    loss, m = policy_loss(logp, old, adv, mask, L("gspo_token", 0.2, 0.27))
    s1 = math.sqrt(0.75)
    close(loss, -(s1 + 1.27 - 0.8) / 3)
    close(m["clip/frac"], 4 / 6)


def test_gspo_rejects_per_token_advantages():
    with pytest.raises(ValueError, match="gspo_token"):
        policy_loss(t([[0.0]]), t([[0.0]]), t([[1.0]]), t([[1.0]]), L("gspo", 0.2, 0.2))


def test_unknown_loss_lists_valid_names():
    with pytest.raises(ValueError) as e:
        policy_loss(t([[0.0]]), t([[0.0]]), t([1.0]), t([[1.0]]), L("dpo", 0.2, 0.2))
    for name in ("ppo", "grpo", "gspo", "gspo_token", "cispo", "sapo", "gmpo"):
        assert name in str(e.value)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="clip"):
        policy_loss(t([[0.0]]), t([[0.0]]), t([1.0]), t([[1.0]]), L("grpo", -0.1, 0.2))
    with pytest.raises(ValueError, match="clip_low and clip_high must be set"):  # an unresolved section
        policy_loss(t([[0.0]]), t([[0.0]]), t([1.0]), t([[1.0]]), Loss(algorithm="grpo"))
    with pytest.raises(ValueError, match="shape"):
        policy_loss(t([[0.0, 0.0]]), t([[0.0]]), t([1.0]), t([[1.0]]), L("grpo", 0.1, 0.2))
    with pytest.raises(ValueError, match="aggregation"):
        policy_loss(t([[0.0]]), t([[0.0]]), t([1.0]), t([[1.0]]), L("grpo", 0.1, 0.2, loss_agg="sum"))
    with pytest.raises(ValueError, match="max_len"):
        aggregate(t([[1.0]]), t([[1.0]]), "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(t([[0.0]]), t([[0.0]]), t([1.0]), t([[1.0]]), L("grpo", 0.1, 0.2, beta=0.1))


def test_one_registration_adds_a_loss():
    # A loss is one decorated function: register_loss puts it in LOSSES, and what the code derives
    # from the registry picks it up with nothing else edited: policy_loss runs it for
    # Loss(algorithm=name) (with the section's clip range), LOSSES lists it, and resolve
    # fills its preset clip range. The toy loss is -3·Â·log π per token.
    from gspo.algo.losses import TokenLoss, register_loss
    from gspo.config import TrainConfig
    from gspo.train.resolve import resolve

    seen = []

    @register_loss("toy", preset=(0.125, 0.375), summary="a test loss")
    def toy(logp, old_logp, advantages, mask, loss):
        seen.append((loss.clip_low, loss.clip_high))
        none = torch.zeros_like(mask, dtype=torch.bool)
        return TokenLoss(-3.0 * advantages.unsqueeze(-1) * logp, torch.ones_like(logp), none, none)

    try:
        assert "toy" in LOSSES and LOSSES["toy"].fn is toy
        cfg = resolve(TrainConfig(algorithm="toy"))
        assert (cfg.loss.clip_low, cfg.loss.clip_high) == (0.125, 0.375)
        # logp = [-1, -2], Â = 2: per-token loss [6, 12], seq-mean-token-mean 9; gradient -3·2/2 = -3 per token
        logp = t([[-1.0, -2.0]]).requires_grad_()
        loss, m = policy_loss(logp, logp.detach(), t([2.0]), t([[1.0, 1.0]]), cfg.loss)
        close(loss, 9.0)
        loss.backward()
        close(logp.grad, [[-3.0, -3.0]])
        assert seen == [(0.125, 0.375)] and m["loss/policy"] == 9.0
    finally:
        del LOSSES["toy"]
    assert "toy" not in LOSSES
    with pytest.raises(ValueError, match="unknown policy loss 'toy'"):
        policy_loss(logp, logp.detach(), t([2.0]), t([[1.0, 1.0]]), cfg.loss)


# ----------------------------------------------------------------------------------------------
# Aggregation modes
# ----------------------------------------------------------------------------------------------

# Two responses: r1 has 1 token with value 2; r2 has 3 tokens with values 1, 3, 5.
# 100 sits on padding and must never count.
AGG_VALUES = [[2.0, 100.0, 100.0], [1.0, 3.0, 5.0]]
AGG_MASK = [[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]]
AGG_EXPECTED = {
    "seq-mean-token-mean": (2 / 1 + (1 + 3 + 5) / 3) / 2,  # (2 + 3) / 2 = 2.5
    "token-mean": (2 + 1 + 3 + 5) / 4,  # 11 / 4 = 2.75
    "seq-mean-token-sum": (2 + 9) / 2,  # 5.5
    "seq-mean-token-sum-norm": (2 / 4 + 9 / 4) / 2,  # max_len = 4: 11 / 8 = 1.375
}


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_by_hand(mode):
    close(aggregate(t(AGG_VALUES), t(AGG_MASK), mode, max_len=4), AGG_EXPECTED[mode])


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_ignores_empty_rows(mode):
    values = t(AGG_VALUES + [[7.0, 7.0, 7.0]])
    mask = t(AGG_MASK + [[0.0, 0.0, 0.0]])
    close(aggregate(values, mask, mode, max_len=4), AGG_EXPECTED[mode])


@pytest.mark.parametrize("name", list(LOSSES))
@pytest.mark.parametrize("mode", AGG_MODES)
def test_every_loss_uses_the_requested_mode(name, mode):
    # On-policy (logp == old_logp) every ratio is 1, nothing clips, and each token's term is
    # -Â. With per-response Â = [a1, a2] = [2, 3] on the two responses above:
    #   seq-mean-token-mean     = -(2 + 3) / 2               = -2.5
    #   token-mean              = -(2·1 + 3·3) / 4           = -2.75
    #   seq-mean-token-sum      = -(2·1 + 3·3) / 2           = -5.5
    #   seq-mean-token-sum-norm = -((2·1)/4 + (3·3)/4) / 2   = -1.375
    # CISPO's and SAPO's values are not -Â (they are -Â·log π and -2Â/τ): for them the
    # gradient is checked instead, which on-policy is GRPO's in every mode.
    expected = {"seq-mean-token-mean": -2.5, "token-mean": -2.75, "seq-mean-token-sum": -5.5,
                "seq-mean-token-sum-norm": -1.375}
    logp = t([[-0.3, -9.0, -9.0], [-1.0, -2.0, -0.5]]).requires_grad_()
    loss, _ = policy_loss(logp, logp.detach().clone(), t([2.0, 3.0]), t(AGG_MASK), L(name, 0.2, 0.2, loss_agg=mode),
                          max_len=4)
    if name not in ("cispo", "sapo"):
        close(loss, expected[mode])
        return
    loss.backward()
    grpo_logp = logp.detach().clone().requires_grad_()
    grpo, _ = policy_loss(grpo_logp, logp.detach().clone(), t([2.0, 3.0]), t(AGG_MASK),
                          L("grpo", 0.2, 0.2, loss_agg=mode), max_len=4)
    grpo.backward()
    close(logp.grad, grpo_logp.grad)
    assert logp.grad.abs().sum() > 0


# ----------------------------------------------------------------------------------------------
# KL penalty
# ----------------------------------------------------------------------------------------------


def test_kl_estimators_by_hand():
    # log π_θ = ln 0.5, log π_ref = ln 0.25: log ρ = ln 0.5 = -0.6931472
    # k1 = -log ρ = 0.6931472; k2 = ½ (log ρ)² = 0.2402265; k3 = ρ - 1 - log ρ = 0.5 - 1 + 0.6931472 = 0.1931472
    logp, ref = t([[LN(0.5)]]), t([[LN(0.25)]])
    close(kl_penalty(logp, ref, "k1"), [[LN(2)]])
    close(kl_penalty(logp, ref, "k2"), [[0.5 * LN(2) ** 2]])
    close(kl_penalty(logp, ref, "k3"), [[0.5 - 1 + LN(2)]])
    with pytest.raises(ValueError, match="k1"):
        kl_penalty(logp, ref, "k4")


def test_kl_penalty_added_with_beta():
    # on-policy, Â = 0: policy term 0; k3 per token as above = 0.1931472 on both tokens;
    # loss = β · 0.1931472 with β = 0.5 -> 0.0965736
    logp = t([[LN(0.5), LN(0.5)]])
    ref = t([[LN(0.25), LN(0.25)]])
    loss, m = policy_loss(logp, logp.clone(), t([0.0]), t([[1.0, 1.0]]), L("gspo", 3e-4, 4e-4, beta=0.5),
                          ref_logp=ref)
    close(loss, 0.5 * (0.5 - 1 + LN(2)))
    close(m["kl/ref"], 0.5 - 1 + LN(2))
    close(m["loss/kl"], 0.5 * (0.5 - 1 + LN(2)))
    close(m["loss/policy"], 0.0)


# ----------------------------------------------------------------------------------------------
# Identities from PAPER.md
# ----------------------------------------------------------------------------------------------


def _random_batch(seed, B=6, T=7, spread=0.05):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=D) * 3  # (B, T)
    logp = old + spread * torch.randn(B, T, generator=g, dtype=D)  # (B, T)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(D)  # (B, T) right-padded
    adv = torch.randn(B, generator=g, dtype=D)  # (B,)
    return logp, old, adv, mask


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("clip", [(3e-4, 4e-4), (0.02, 0.03), (0.2, 0.27)])
def test_gspo_token_equals_gspo_with_sequence_advantages(seed, clip):
    logp, old, adv, mask = _random_batch(seed)
    lp1 = logp.clone().requires_grad_()
    lp2 = logp.clone().requires_grad_()
    l1, m1 = policy_loss(lp1, old, adv, mask, L("gspo", clip[0], clip[1]))
    l2, m2 = policy_loss(lp2, old, adv[:, None].expand_as(mask), mask, L("gspo_token", clip[0], clip[1]))
    l1.backward()
    l2.backward()
    close(l1, l2)
    assert m1["clip/frac"] == m2["clip/frac"]
    close(lp1.grad, lp2.grad)


@pytest.mark.parametrize("name", list(LOSSES))
def test_on_policy_every_ratio_is_one_and_nothing_clips(name):
    logp, _, adv, mask = _random_batch(0)
    _, m = policy_loss(logp, logp.clone(), adv, mask, L(name, 3e-4, 4e-4))
    assert m["clip/frac"] == 0.0
    assert m["ratio/min"] == 1.0 and m["ratio/max"] == 1.0
    assert m["kl/old_new"] == 0.0


@pytest.mark.parametrize("name", list(LOSSES))
@pytest.mark.parametrize("mode", AGG_MODES)
def test_padding_changes_nothing(name, mode):
    logp, old, adv, mask = _random_batch(1, spread=0.3)
    lp = logp.clone().requires_grad_()
    loss, m = policy_loss(lp, old, adv, mask, L(name, 0.1, 0.1, loss_agg=mode), max_len=16)
    loss.backward()
    # append 3 padding columns with junk log-probs, and 2 empty rows
    junk_cols = torch.full((6, 3), -5.0, dtype=D)
    lp_pad = torch.cat([logp, junk_cols], 1)
    lp_pad = torch.cat([lp_pad, torch.full((2, 10), -1.0, dtype=D)], 0).requires_grad_()
    old_pad = torch.cat([torch.cat([old, junk_cols * 0.5], 1), torch.full((2, 10), -3.0, dtype=D)], 0)
    mask_pad = torch.cat([torch.cat([mask, torch.zeros(6, 3, dtype=D)], 1), torch.zeros(2, 10, dtype=D)], 0)
    adv_pad = torch.cat([adv, t([5.0, -5.0])])
    loss_pad, m_pad = policy_loss(lp_pad, old_pad, adv_pad, mask_pad, L(name, 0.1, 0.1, loss_agg=mode), max_len=16)
    loss_pad.backward()
    close(loss, loss_pad)
    for k in m:
        close(m[k], m_pad[k])
    close(lp.grad, lp_pad.grad[:6, :7])
    assert (lp_pad.grad[6:] == 0).all() and (lp_pad.grad[:, 7:] == 0).all()


@pytest.mark.parametrize("clip", [(0.01, 0.01), (0.2, 0.27)])
def test_one_token_responses_gspo_equals_grpo(clip):
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(8, 1, generator=g, dtype=D)
    logp = old + 0.1 * torch.randn(8, 1, generator=g, dtype=D)
    adv = torch.randn(8, generator=g, dtype=D)
    mask = torch.ones(8, 1, dtype=D)
    lp1, lp2 = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    l1, m1 = policy_loss(lp1, old, adv, mask, L("gspo", clip[0], clip[1]))
    l2, m2 = policy_loss(lp2, old, adv, mask, L("grpo", clip[0], clip[1]))
    l1.backward()
    l2.backward()
    close(l1, l2)
    close(lp1.grad, lp2.grad)
    assert m1["clip/frac"] == m2["clip/frac"]


class LinearSoftmaxPolicy:
    """π(y | f) = softmax(f W): a policy whose score function has a closed form.

    ∇_W log π(y | f) = f ⊗ (e_y - softmax(f W))
    """

    def __init__(self, seed, B=4, T=5, D_=3, V=6):
        g = torch.Generator().manual_seed(seed)
        self.feats = torch.randn(B, T, D_, generator=g, dtype=D)  # (B, T, D)
        self.W = torch.randn(D_, V, generator=g, dtype=D)  # (D, V)
        self.W_old = self.W + 0.05 * torch.randn(D_, V, generator=g, dtype=D)  # (D, V)
        self.tokens = torch.randint(0, V, (B, T), generator=g)  # (B, T)
        lengths = torch.tensor([5, 2, 3, 1])[:B]
        self.mask = (torch.arange(T)[None, :] < lengths[:, None]).to(D)  # (B, T)
        self.adv = torch.randn(B, generator=g, dtype=D)  # (B,)
        self.V = V

    def logp(self, W):
        logits = self.feats @ W  # (B, T, V)
        return torch.log_softmax(logits, -1).gather(-1, self.tokens[..., None]).squeeze(-1)  # (B, T)

    def score(self):
        """∇_W log π(y_t) for every (i, t): (B, T, D, V)."""
        probs = torch.softmax(self.feats @ self.W, -1)  # (B, T, V)
        onehot = torch.nn.functional.one_hot(self.tokens, self.V).to(D)  # (B, T, V)
        return self.feats[..., :, None] * (onehot - probs)[..., None, :]  # (B, T, D, V)


@pytest.mark.parametrize("seed", range(3))
def test_gspo_gradient_is_eq10(seed):
    # ∇J = (1/G) Σ_i s_i Â_i · (1/|y_i|) Σ_t ∇ log π_θ(y_{i,t})  (clipping out of reach)
    pol = LinearSoftmaxPolicy(seed)
    W = pol.W.clone().requires_grad_()
    old = pol.logp(pol.W_old).detach()
    loss, m = policy_loss(pol.logp(W), old, pol.adv, pol.mask, L("gspo", 1.0, 1e6))
    (-loss).backward()  # J = -loss
    assert m["clip/frac"] == 0.0
    logp = pol.logp(pol.W)
    s = torch.exp(((logp - old) * pol.mask).sum(-1) / pol.mask.sum(-1))  # (B,)
    per_token = pol.score() * pol.mask[..., None, None]  # (B, T, D, V)
    seq_score = per_token.sum(1) / pol.mask.sum(-1)[:, None, None]  # (B, D, V)
    expected = ((s * pol.adv)[:, None, None] * seq_score).mean(0)  # (D, V)
    close(W.grad, expected, rtol=1e-9)


@pytest.mark.parametrize("seed", range(3))
def test_grpo_gradient_is_eq11(seed):
    # ∇J = (1/G) Σ_i Â_i · (1/|y_i|) Σ_t w_{i,t} ∇ log π_θ(y_{i,t})
    pol = LinearSoftmaxPolicy(seed)
    W = pol.W.clone().requires_grad_()
    old = pol.logp(pol.W_old).detach()
    loss, m = policy_loss(pol.logp(W), old, pol.adv, pol.mask, L("grpo", 1.0, 1e6))
    (-loss).backward()
    assert m["clip/frac"] == 0.0
    w = torch.exp(pol.logp(pol.W) - old) * pol.mask  # (B, T)
    weighted = (w[..., None, None] * pol.score()).sum(1) / pol.mask.sum(-1)[:, None, None]  # (B, D, V)
    expected = (pol.adv[:, None, None] * weighted).mean(0)  # (D, V)
    close(W.grad, expected, rtol=1e-9)


def test_gspo_and_grpo_gradients_differ_off_policy():
    # The identities above are not vacuous: off-policy the two estimators give different
    # gradients (they only coincide on-policy, where every w and s is 1).
    pol = LinearSoftmaxPolicy(0)
    old = pol.logp(pol.W_old).detach()
    grads = []
    for name in ("gspo", "grpo"):
        W = pol.W.clone().requires_grad_()
        policy_loss(pol.logp(W), old, pol.adv, pol.mask, L(name, 1.0, 1e6))[0].backward()
        grads.append(W.grad)
    assert (grads[0] - grads[1]).abs().max() > 1e-3
    grads = []
    for name in ("gspo", "grpo"):
        W = pol.W.clone().requires_grad_()
        on = pol.logp(pol.W).detach()
        policy_loss(pol.logp(W), on, pol.adv, pol.mask, L(name, 1.0, 1e6))[0].backward()
        grads.append(W.grad)
    close(grads[0], grads[1], rtol=1e-9)


# ----------------------------------------------------------------------------------------------
# Property tests: nothing blows up
# ----------------------------------------------------------------------------------------------


@st.composite
def extreme_batches(draw):
    B = draw(st.integers(1, 5))
    T = draw(st.integers(1, 6))
    lp = st.floats(-1e4, 0.0, allow_nan=False)
    logp = torch.tensor(draw(st.lists(lp, min_size=B * T, max_size=B * T)), dtype=torch.float32).view(B, T)
    old = torch.tensor(draw(st.lists(lp, min_size=B * T, max_size=B * T)), dtype=torch.float32).view(B, T)
    lengths = draw(st.lists(st.integers(0, T), min_size=B, max_size=B))  # 0 = zero-length completion
    mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).float()
    adv = torch.tensor(draw(st.lists(st.floats(-10, 10), min_size=B, max_size=B)), dtype=torch.float32)
    return logp, old, adv, mask


@settings(max_examples=60, deadline=None)
@given(batch=extreme_batches(), name=st.sampled_from(list(LOSSES)), mode=st.sampled_from(AGG_MODES),
       est=st.sampled_from(["k1", "k2", "k3"]))
def test_extreme_inputs_stay_finite(batch, name, mode, est):
    logp, old, adv, mask = batch
    logp = logp.clone().requires_grad_()
    loss, m = policy_loss(logp, old, adv, mask, L(name, 3e-4, 4e-4, loss_agg=mode, beta=0.1, kl_estimator=est),
                          max_len=8, ref_logp=old.flip(0))
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(logp.grad).all()
    for k, v in m.items():
        if not k.startswith("ratio/") or mask.sum() > 0:  # ratio stats of no tokens are NaN by design
            assert math.isfinite(v), k


def test_kl_estimators_gradients_in_expectation():
    # A one-token policy π = softmax(θ) over 5 tokens and a fixed reference. Exact expectations
    # over y ~ π (weights π(y), no gradient through them, as when y is sampled) of each per-sample
    # estimator and of its gradient (the estimator used as a loss term):
    #   k1 = log π - log ref:            E = KL(π‖ref), but E[∇k1] = E[∇log π] = Σ_y ∇π(y) = 0: no KL pressure
    #   k2 = ½ (log π - log ref)²:       E[∇k2] = Σ_y π (log π - log ref) ∇log π = ∇KL(π‖ref)
    #   k3 = ρ - 1 - log ρ, ρ = ref/π:   E = KL(π‖ref); E[∇k3] = Σ_y π (1 - ρ) ∇log π = -Σ_y ref ∇log π = ∇KL(ref‖π)
    theta = torch.tensor([0.3, -1.2, 0.8, 0.0, -0.4], dtype=D, requires_grad=True)
    ref = torch.log_softmax(torch.tensor([0.1, 0.5, -0.7, 1.1, 0.2], dtype=D), -1)

    def expected(estimator):
        logp = torch.log_softmax(theta, -1)
        k = kl_penalty(logp[None], ref[None], estimator)[0]  # (5,) one value per token y
        value = (logp.exp().detach() * k).sum()
        return value, torch.autograd.grad(value, theta)[0]

    logp = torch.log_softmax(theta, -1)
    kl_fwd = (logp.exp() * (logp - ref)).sum()  # KL(π‖ref)
    kl_rev = (ref.exp() * (ref - logp)).sum()  # KL(ref‖π)
    g_fwd = torch.autograd.grad(kl_fwd, theta, retain_graph=True)[0]
    g_rev = torch.autograd.grad(kl_rev, theta)[0]
    v1, g1 = expected("k1")
    v2, g2 = expected("k2")
    v3, g3 = expected("k3")
    torch.testing.assert_close(v1, kl_fwd.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(v3, kl_fwd.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g1, torch.zeros(5, dtype=D), rtol=0, atol=1e-12)
    torch.testing.assert_close(g2, g_fwd, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g3, g_rev, rtol=1e-12, atol=1e-12)
    assert (g_fwd - g_rev).abs().max() > 1e-2  # the two KL directions really differ here


# ----------------------------------------------------------------------------------------------
# The successors: CISPO, SAPO, GMPO (hand cases, on-policy identities) and LUSPO as an aggregation
# ----------------------------------------------------------------------------------------------


def test_cispo_hand_case():
    # One response, two tokens: logp = [-1, -2], r = [1.5, 0.7], clip [1 - 0.2, 1 + 0.05] = [0.8, 1.05]
    #   sg(clip(r)) = [1.05, 0.8] (token 1 cut at the top, token 2 lifted at the bottom)
    #   Â = +1: per-token loss -ŵ·Â·logp = [1.05, 1.6]; seq-mean-token-sum: 2.65
    #           gradient -ŵ·Â = [-1.05, -0.8]: no token loses its gradient (PPO would cut both)
    #   Â = -1: loss -2.65, gradient [1.05, 0.8]
    for adv, sign in ((1.0, 1.0), (-1.0, -1.0)):
        logp = t([[-1.0, -2.0]]).requires_grad_()
        old = t([[-1.0 - LN(1.5), -2.0 - LN(0.7)]])
        loss, m = policy_loss(logp, old, t([adv]), t([[1.0, 1.0]]),
                              L("cispo", 0.2, 0.05, loss_agg="seq-mean-token-sum"))
        close(loss, sign * 2.65)
        loss.backward()
        close(logp.grad, t([[-1.05, -0.8]]) * sign)
        # both weights were clipped, one at each end, whatever Â's sign
        assert (m["clip/frac"], m["clip/low_frac"], m["clip/high_frac"]) == (1.0, 0.5, 0.5)
        close(m["ratio/max"], 1.5)


@pytest.mark.parametrize("adv,tau,loss_value,grad", [
    # r = e^0.2 = 1.221403, r - 1 = 0.221403
    # Â = +1, τ = τ_pos = 1:    σ(0.221403) = 0.555126;  loss = -0.555126 · 4/1 · 1 = -2.220503
    #                          grad = -Â · 4σ(1-σ) · r = -4 · 0.555126 · 0.444874 · 1.221403 = -1.206556
    (1.0, 1.0, -2.220502754484925, -1.2065561603767567),
    # Â = -1, τ = τ_neg = 1.05: σ(0.232473) = 0.557858;  loss = 0.557858 · 4/1.05 = 2.125173
    #                          grad = 4 · 0.557858 · 0.442142 · 1.221403 = 1.205048
    (-1.0, 1.05, 2.1251729046842947, 1.2050480035304199),
])
def test_sapo_hand_case(adv, tau, loss_value, grad):
    logp = t([[-1.0 + 0.2]]).requires_grad_()
    loss, m = policy_loss(logp, t([[-1.0]]), t([adv]), t([[1.0]]), L("sapo", 0.0, 0.0))
    close(loss, loss_value)
    loss.backward()
    close(logp.grad, [[grad]])
    assert m["clip/frac"] == 0.0  # a gate, not a clip
    # the formula, from its parts: -σ(τ(r - 1)) · 4/τ · Â
    s = 1 / (1 + math.exp(-tau * (math.exp(0.2) - 1)))
    close(loss_value, -s * 4 / tau * adv)


def test_sapo_uses_each_temperature_for_its_sign():
    # τ_pos only touches Â > 0 tokens, τ_neg only Â < 0 ones
    logp, old = t([[-0.8], [-0.8]]), t([[-1.0], [-1.0]])
    adv = t([1.0, -1.0])
    base, _ = policy_loss(logp, old, adv, t([[1.0], [1.0]]), L("sapo", 0, 0, loss_agg="seq-mean-token-sum"))
    pos, _ = policy_loss(logp[:1], old[:1], adv[:1], t([[1.0]]), L("sapo", 0, 0, sapo_tau_neg=9.0))
    neg, _ = policy_loss(logp[1:], old[1:], adv[1:], t([[1.0]]), L("sapo", 0, 0, sapo_tau_pos=9.0))
    close(base, (pos + neg) / 2)
    changed, _ = policy_loss(logp[:1], old[:1], adv[:1], t([[1.0]]), L("sapo", 0, 0, sapo_tau_pos=2.0))
    assert abs(float(changed) - float(pos)) > 1e-3


@pytest.mark.parametrize("adv,loss_value,grad", [
    # l = logp - old = [0.5, -0.1], log-space clip [-0.4, 0.4]
    # Â = +1: m = min(l, clip(l)) = [0.4, -0.1] (token 1 clipped above); ratio = e^(0.3/2) = 1.161834
    #         loss = -Â·ratio = -1.161834; grad = -Â·ratio/|y| on unclipped tokens = [0, -0.580917]
    (1.0, -1.161834242728283, [0.0, -0.5809171213641415]),
    # Â = -1: m = max(l, clip(l)) = [0.5, -0.1] (nothing clipped: 0.5 is above, on the harmless side)
    #         ratio = e^(0.4/2) = 1.221403; loss = 1.221403; grad = 1.221403/2 = 0.610701 on both
    (-1.0, 1.2214027581601699, [0.6107013790800849, 0.6107013790800849]),
])
def test_gmpo_hand_case(adv, loss_value, grad):
    logp = t([[-1.0, -2.0]]).requires_grad_()
    old = t([[-1.5, -1.9]])
    loss, m = policy_loss(logp, old, t([adv]), t([[1.0, 1.0]]), L("gmpo", 0.4, 0.4))
    close(loss, loss_value)
    loss.backward()
    close(logp.grad, [grad])
    assert m["clip/high_frac"] == (0.5 if adv > 0 else 0.0) and m["clip/low_frac"] == 0.0
    close(m["ratio/mean"], math.exp(0.2))  # the unclipped geometric mean, GSPO's s_i


def test_gmpo_clips_low_for_negative_advantages():
    # l = [-0.6, 0.0], Â = -1: m = max(l, clip(l)) = [-0.4, 0.0]; ratio e^(-0.2); token 1's gradient cut
    logp = t([[-1.6, -1.0]]).requires_grad_()
    loss, m = policy_loss(logp, t([[-1.0, -1.0]]), t([-1.0]), t([[1.0, 1.0]]), L("gmpo", 0.4, 0.4))
    close(loss, math.exp(-0.2))
    loss.backward()
    close(logp.grad, [[0.0, math.exp(-0.2) / 2]])
    assert (m["clip/low_frac"], m["clip/high_frac"]) == (0.5, 0.0)


@pytest.mark.parametrize("seed", range(3))
def test_gmpo_without_clipping_is_gspo(seed):
    # exp(mean_t l_t) is GSPO's s_i: with clip ranges no ratio reaches, the two are one objective
    logp, old, adv, mask = _random_batch(seed, spread=0.3)
    a, b = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    la, _ = policy_loss(a, old, adv, mask, L("gmpo", 50.0, 50.0))
    lb, _ = policy_loss(b, old, adv, mask, L("gspo", 0.99, 1e6))
    close(la, lb)
    la.backward()
    lb.backward()
    close(a.grad, b.grad)


@pytest.mark.parametrize("name", ["cispo", "sapo"])
@pytest.mark.parametrize("seed", range(3))
def test_on_policy_gradient_is_grpos_unclipped(name, seed):
    # r = 1: CISPO's gradient is sg(1)·(-Â) and SAPO's is -Â·4σ(0)(1-σ(0))·1 = -Â: GRPO's
    logp, _, adv, mask = _random_batch(seed)
    a, b = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    la, _ = policy_loss(a, logp, adv, mask, L(name, 0.2, 0.28))
    lb, _ = policy_loss(b, logp, adv, mask, L("grpo", 0.2, 0.28))
    la.backward()
    lb.backward()
    close(a.grad, b.grad)


def test_gmpo_on_policy_ratio_is_one():
    logp, _, adv, mask = _random_batch(4)
    loss, m = policy_loss(logp, logp.clone(), adv, mask, L("gmpo", 0.4, 0.4))
    assert m["ratio/min"] == 1.0 and m["ratio/max"] == 1.0
    close(loss, -adv.mean())  # each response's -Â_i · 1, averaged


def test_luspo_is_gspo_with_token_sum_aggregation():
    # LUSPO weighs each response's GSPO term by its length: (1/G) Σ_i |y_i| · ℓ_i, which is
    # GSPO's broadcast term under "seq-mean-token-sum". By hand (ε = 0.2):
    #   response 1: 1 token, log w = ln 1.1 -> s = 1.1, Â = +1: ℓ = -min(1.1, 1.1) = -1.1
    #   response 2: 3 tokens, log w = [ln 2, 0, 0] -> s = 2^(1/3) = 1.259921, Â = -1:
    #               ℓ = -min(-1.259921, -1.2) = 1.259921
    #   LUSPO = (1 · -1.1 + 3 · 1.259921) / 2 = 1.339882;  GSPO (each response once) = 0.079961
    logp = t([[LN(1.1), 0.0, 0.0], [LN(2.0), 0.0, 0.0]])
    mask = t([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    old = torch.zeros_like(logp)
    luspo, _ = policy_loss(logp, old, t([1.0, -1.0]), mask, L("gspo", 0.2, 0.2, loss_agg="seq-mean-token-sum"))
    close(luspo, (-1.1 + 3 * 2 ** (1 / 3)) / 2)
    gspo, _ = policy_loss(logp, old, t([1.0, -1.0]), mask, L("gspo", 0.2, 0.2))
    close(gspo, (-1.1 + 2 ** (1 / 3)) / 2)
