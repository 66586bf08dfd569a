"""PPO's value model: the clipped value loss by hand, explained variance, the critic's
checkpoint round-trip, GAE with a KL penalty in the reward, and PPO runs."""

import json
import math

import pytest
import torch

from gspo.algo.advantages import ESTIMATORS, AdvantageInputs, kl_rewards
from gspo.config import TrainConfig
from gspo.models.value import Critic, ValueHead, explained_variance, value_loss
from gspo.train.trainer import train

D = torch.float64


def t(x):
    return torch.tensor(x, dtype=D)


def test_value_loss_clipping_by_hand():
    # three tokens, ε_v = 0.2
    # token 1: V_old 0.0, V 0.5, R 1.0  -> V_clip = 0.0 + clip(0.5) = 0.2
    #          (V - R)² = 0.25, (V_clip - R)² = 0.64 -> max = 0.64 (clipped: gradient cut)
    # token 2: V_old 0.0, V 0.1, R 1.0  -> V_clip = 0.1 (inside the range)
    #          both 0.81 -> 0.81, not clipped
    # token 3: V_old 1.0, V 0.5, R 0.0  -> V_clip = 1.0 - 0.2 = 0.8
    #          (0.5)² = 0.25, (0.8)² = 0.64 -> 0.64 (clipped)
    # loss = ½ (0.64 + 0.81 + 0.64) / 3 = 0.3483333
    values = t([[0.5, 0.1, 0.5, 9.0]]).requires_grad_()
    old, ret = t([[0.0, 0.0, 1.0, 0.0]]), t([[1.0, 1.0, 0.0, 0.0]])
    mask = t([[1, 1, 1, 0]])
    loss, m = value_loss(values, old, ret, mask, clip_range=0.2)
    torch.testing.assert_close(loss, t(0.5 * (0.64 + 0.81 + 0.64) / 3))
    assert m["value/clip_frac"] == pytest.approx(2 / 3)
    loss.backward()
    # only token 2 passes gradient: d/dV ½(V - R)²/3 = (0.1 - 1.0)/3 = -0.3
    torch.testing.assert_close(values.grad, t([[0.0, -0.3, 0.0, 0.0]]))
    # ε_v = 0: plain squared error ½ (0.25 + 0.81 + 0.25) / 3
    loss0, m0 = value_loss(values, old, ret, mask, clip_range=0.0)
    torch.testing.assert_close(loss0, t(0.5 * (0.25 + 0.81 + 0.25) / 3))
    assert m0["value/clip_frac"] == 0.0


def test_explained_variance_by_hand():
    # R = [1, 2, 3, 4] (var 1.25), V = [1, 2, 3, 3]: R - V = [0, 0, 0, 1] (var 0.1875)
    # EV = 1 - 0.1875 / 1.25 = 0.85; the masked-out 100 is ignored
    r = t([[1.0, 2.0, 3.0, 4.0, 100.0]])
    v = t([[1.0, 2.0, 3.0, 3.0, 0.0]])
    mask = t([[1, 1, 1, 1, 0]])
    assert explained_variance(v, r, mask) == pytest.approx(0.85)
    assert explained_variance(r, r, mask) == pytest.approx(1.0)
    assert math.isnan(explained_variance(v, t([[2.0, 2.0, 2.0, 2.0, 0.0]]), mask))


def test_ppo_advantages_with_kl_in_reward():
    # one response, 2 tokens, score 1.0, γ = 1, λ = 1, no whitening, values 0
    # log π_old - log π_ref = [0.5, 0.25], coef 0.2 -> token rewards [-0.1, -0.05 + 1.0]
    # GAE with V = 0, γ = λ = 1: Â_t = Σ_{k≥t} r_k -> [0.85, 0.95]; returns the same
    mask = t([[1.0, 1.0]])
    kl = t([[-0.5, -1.0]]) - t([[-1.0, -1.25]])  # log π_old - log π_ref
    rewards = kl_rewards(t([1.0]), kl, mask, 0.2)
    torch.testing.assert_close(rewards, t([[-0.1, 0.95]]))
    # the estimator `gae` (a run's with PPO) makes the same token rewards from kl and kl_coef
    kw = dict(values=t([[0.0, 0.0]]), mask=mask, kl=kl, kl_coef=0.2, gamma=1.0, lam=1.0)
    adv, ret = ESTIMATORS["gae"].fn(AdvantageInputs(t([1.0]), whiten=False, **kw))
    torch.testing.assert_close(adv, t([[0.85, 0.95]]))
    torch.testing.assert_close(ret, t([[0.85, 0.95]]))
    # whitened: zero mean and unit variance over the tokens
    adv, _ = ESTIMATORS["gae"].fn(AdvantageInputs(t([1.0]), whiten=True, **kw))
    torch.testing.assert_close(adv, t([[-1.0, 1.0]]), rtol=1e-6, atol=1e-6)


def test_critic_starts_from_the_policy_and_round_trips(tmp_path):
    from gspo.models.loading import load_policy

    policy, tok = load_policy("tiny")
    critic = Critic.from_pretrained("tiny")
    # the trunk is the policy's (no LM head), the head starts at exactly 0
    for name, p in critic.trunk.state_dict().items():
        torch.testing.assert_close(p, policy.model.state_dict()[name], rtol=0, atol=0)
    from gspo.models.sequences import Rollout

    ids = torch.tensor([tok("12+34=56")["input_ids"]])
    ro = Rollout(ids[:, :-3], torch.ones_like(ids[:, :-3]), ids[:, -3:], torch.ones(1, 3), torch.zeros(1, 3),
                 torch.tensor([3]), torch.tensor([False]), 1)  # prompt "12+34", completion "=56"
    assert (critic(ro) == 0).all()
    with torch.no_grad():
        critic.head.linear.weight.normal_()
        critic.head.linear.bias.fill_(0.3)
    v = critic(ro)  # (1, 3)
    torch.testing.assert_close(critic(ro, packed=True), v, rtol=1e-5, atol=1e-5)  # one sequence: the same
    critic.save_pretrained(tmp_path / "critic")
    again = Critic.from_pretrained(tmp_path / "critic", head_from=tmp_path / "critic")
    torch.testing.assert_close(again(ro), v, rtol=0, atol=0)
    # the value of token t is read at the position before it: same as the policy's logits
    hidden = critic.trunk(input_ids=ids).last_hidden_state
    torch.testing.assert_close(v, critic.head(hidden[:, -4:-1]))


def test_value_head_is_zero_initialised():
    head = ValueHead(8)
    assert (head(torch.randn(2, 3, 8)) == 0).all()


@pytest.mark.slow
@pytest.mark.parametrize("critic", ["separate", "shared"])
def test_ppo_run_and_checkpoint(tmp_path, critic):
    cfg = TrainConfig(algorithm="ppo", critic=critic, steps=3, prompts_per_step=4, group_size=4, eval_size=16,
                      save_every=1, keep_checkpoints=1, output_dir=str(tmp_path / "run"), progress=False)
    summary = train(cfg, log=lambda *a: None)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for m in rows:
        assert {"value/loss", "value/clip_frac", "value/explained_variance", "value/mean"} <= set(m)
    assert rows[0]["value/mean"] == 0.0  # zero-initialised head
    assert rows[-1]["value/mean"] != 0.0  # and it learned
    last = tmp_path / "run" / "checkpoints" / "step-000003"
    if critic == "separate":
        assert (last / "critic" / "config.json").exists() and (last / "critic" / "value_head.pt").exists()
        assert "value/grad_norm" in rows[0]
    else:
        assert (last / "value_head" / "value_head.pt").exists()
    optimizers = torch.load(last / "optimizer.pt", weights_only=False)
    assert ("critic_optimizer" in optimizers) == (critic == "separate") and "optimizer" in optimizers
    assert summary["algorithm"] == "ppo"


def test_value_loss_counts_tokens_exactly_under_bf16_autocast():
    # 1001 completion tokens; the head (a Linear, zero weights) runs under bf16 autocast, so its
    # values come out in bf16. Values 0, returns 1 at the first token and 0 elsewhere:
    # ½·(0 - 1)² = 0.5 at one token, 0 at the other 1000 -> loss = 0.5 / 1001 = 4.995e-4.
    # bf16 has 8 significant bits: between 512 and 1024 it steps by 4, so a mask summed in bf16
    # counts 1000 tokens (loss 5.0e-4, 0.1% off) and the token count the metrics weigh by is 1000.
    head = torch.nn.Linear(4, 1)
    torch.nn.init.zeros_(head.weight), torch.nn.init.zeros_(head.bias)
    mask = torch.ones(1, 1001)  # (B, T)
    returns = torch.zeros(1, 1001)
    returns[0, 0] = 1.0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        values = head(torch.ones(1, 1001, 4)).squeeze(-1)  # (B, T) bf16
        assert values.dtype == torch.bfloat16 and float(mask.to(torch.bfloat16).sum()) == 1000.0
        loss, m = value_loss(values, values.detach(), returns, mask, clip_range=0.2)
    assert m["value/loss"].count == 1001.0
    assert loss.item() == pytest.approx(0.5 / 1001, rel=1e-6)
