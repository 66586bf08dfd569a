"""Advantages: group-relative by hand, GAE against a slow loop reference, properties."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gspo.algo.advantages import gae, group_advantages, masked_whiten

D = torch.float64


def close(a, b, rtol=1e-6, atol=1e-9):
    torch.testing.assert_close(torch.as_tensor(a, dtype=D), torch.as_tensor(b, dtype=D), rtol=rtol, atol=atol)


def test_group_advantages_by_hand():
    # group 1: r = [1, 0, 0, 0]; mean 0.25; centred [0.75, -0.25, -0.25, -0.25]
    #   sample std = sqrt((0.75² + 3·0.25²) / 3) = sqrt(0.75 / 3) = 0.5
    #   Â = [1.5, -0.5, -0.5, -0.5]
    # group 2: r = [1, 1, 1, 1]: no spread, Â = 0 exactly
    r = torch.tensor([1.0, 0, 0, 0, 1, 1, 1, 1], dtype=D)
    adv = group_advantages(r, 4, eps=0.0)
    close(adv, [1.5, -0.5, -0.5, -0.5, 0, 0, 0, 0])
    assert (adv[4:] == 0).all()


def test_group_advantages_batch_and_none_scales():
    r = torch.tensor([1.0, 0, 0, 0, 1, 1, 1, 1], dtype=D)
    # batch mean 5/8 = 0.625; deviations 0.375 (×5), -0.625 (×3)
    # sample var = (5·0.140625 + 3·0.390625) / 7 = 1.875 / 7; std = 0.5175492
    batch_std = math.sqrt(1.875 / 7)
    close(group_advantages(r, 4, scale="batch", eps=0.0),
          [0.75 / batch_std, -0.25 / batch_std, -0.25 / batch_std, -0.25 / batch_std, 0, 0, 0, 0])
    # Dr. GRPO: only the group mean removed
    close(group_advantages(r, 4, scale="none"), [0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0])


def test_equal_rewards_give_exact_zero_even_with_rounding():
    # 0.1 summed three times is not 0.3 in binary: the mean differs from 0.1 by one ulp, but a
    # flat group must still give exactly 0, not ±1e-17 / (0 + eps) = ±1e-11 noise or worse.
    r = torch.tensor([0.1, 0.1, 0.1], dtype=torch.float32)
    for scale in ("group", "batch", "none"):
        assert (group_advantages(r, 3, scale=scale) == 0).all()


def test_group_advantages_errors():
    with pytest.raises(ValueError, match="whole number of groups"):
        group_advantages(torch.zeros(7), 4)
    with pytest.raises(ValueError, match="scale"):
        group_advantages(torch.zeros(8), 4, scale="global")
    with pytest.raises(ValueError, match="NaN"):
        group_advantages(torch.tensor([1.0, float("nan")]), 2)
    with pytest.raises(ValueError, match=r"\(B,\)"):
        group_advantages(torch.zeros(2, 4), 4)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=2, max_size=24).filter(lambda x: len(x) % 2 == 0))
def test_group_advantages_properties(rewards):
    r = torch.tensor(rewards)
    adv = group_advantages(r, 2)
    assert torch.isfinite(adv).all()
    # within each group the advantages sum to zero and order like the rewards
    g = adv.view(-1, 2)
    close(g.sum(-1), torch.zeros(g.shape[0]), atol=1e-6)
    rg = r.view(-1, 2)
    assert ((rg[:, 0] > rg[:, 1]) == (g[:, 0] > g[:, 1])).all()


def gae_reference(rewards, values, lengths, gamma, lam):
    """Slow, obvious GAE: one response at a time, one token at a time."""
    B, T = values.shape
    adv = torch.zeros(B, T, dtype=D)
    for i in range(B):
        L = lengths[i]
        last_adv = 0.0
        for t in reversed(range(L)):
            r_t = rewards[i] if t == L - 1 else 0.0
            v_next = values[i, t + 1].item() if t + 1 < L else 0.0
            delta = r_t + gamma * v_next - values[i, t].item()
            last_adv = delta + gamma * lam * last_adv
            adv[i, t] = last_adv
    ret = adv + values * (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None])
    return adv, ret


def test_gae_by_hand():
    # one response, 3 tokens, reward 1 at the end, V = [0.5, 0.6, 0.7], γ = 0.9, λ = 0.8
    # δ_2 = 1 + 0 - 0.7 = 0.3            Â_2 = 0.3
    # δ_1 = 0 + 0.9·0.7 - 0.6 = 0.03     Â_1 = 0.03 + 0.72·0.3 = 0.246
    # δ_0 = 0 + 0.9·0.6 - 0.5 = 0.04     Â_0 = 0.04 + 0.72·0.246 = 0.21712
    adv, ret = gae(torch.tensor([1.0], dtype=D), torch.tensor([[0.5, 0.6, 0.7, 9.0]], dtype=D),
                   torch.tensor([[1.0, 1, 1, 0]], dtype=D), gamma=0.9, lam=0.8)
    close(adv, [[0.21712, 0.246, 0.3, 0.0]])
    close(ret, [[0.71712, 0.846, 1.0, 0.0]])


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (1.0, 0.95), (0.99, 0.9), (0.5, 0.0)])
def test_gae_matches_loop_reference(seed, gamma, lam):
    g = torch.Generator().manual_seed(seed)
    B, T = 6, 9
    lengths = torch.randint(0, T + 1, (B,), generator=g).tolist()
    values = torch.randn(B, T, generator=g, dtype=D)
    rewards = torch.rand(B, generator=g, dtype=D)
    mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).to(D)
    adv, ret = gae(rewards, values, mask, gamma=gamma, lam=lam)
    ref_adv, ref_ret = gae_reference(rewards.tolist(), values, lengths, gamma, lam)
    close(adv, ref_adv)
    close(ret, ref_ret)


def test_gae_per_token_rewards_equal_sequence_reward_at_end():
    values = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.0]], dtype=D)
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]], dtype=D)
    per_token = torch.tensor([[0.0, 0, 2.0], [0, 3.0, 0]], dtype=D)
    a1, r1 = gae(torch.tensor([2.0, 3.0], dtype=D), values, mask, gamma=0.9, lam=0.7)
    a2, r2 = gae(per_token, values, mask, gamma=0.9, lam=0.7)
    close(a1, a2)
    close(r1, r2)


def test_masked_whiten():
    # masked values [1, 2, 3] (4 is padding): mean 2, population var 2/3
    v = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=D)
    m = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=D)
    s = math.sqrt(2 / 3)
    close(masked_whiten(v, m, eps=0.0), [[-1 / s, 0.0], [1 / s, 0.0]])
