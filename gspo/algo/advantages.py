"""Advantage estimators: group-relative (GRPO, GSPO, GSPO-token) and GAE (PPO), by name.

    from gspo.algo.advantages import ESTIMATORS, AdvantageInputs
    adv, _ = ESTIMATORS["group"].fn(AdvantageInputs(rewards, group_size=8))   # (B,) the paper's Â_i
    adv, ret = ESTIMATORS["gae"].fn(AdvantageInputs(rewards, values=v, mask=m))  # (B, T), a critic's

A run's estimator is named by its loss and --adv-scale (gspo.train.batch.estimator_name): `gae`
for a loss whose advantages come from a value model (PPO), else `group`, `batch` or `none`. A new
estimator is one function decorated with `register_estimator`; one that `needs_values` makes the
run train a critic. The functions they are made of:

    from gspo.algo.advantages import group_advantages, gae, turn_advantages
    adv = group_advantages(rewards, group_size=8)            # (B,) one per response
    adv = turn_advantages(returns_to_go, group_size=8)       # (B, K) per turn of multi-turn episodes
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=0.95)  # (B, T) per token

Group layout: a batch of B responses holds B // G groups, each G contiguous rows sampled for
the same prompt (rows 0..G-1 are prompt 0, rows G..2G-1 prompt 1, ...). The rollout code
produces exactly this layout.

Left out: reward shaping and reward normalisation across steps (running statistics); rewards
arrive here already scored for this batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from gspo.algo.metrics import Max, Mean, Min
from gspo.io.words import plural

Tensor = torch.Tensor

ADV_SCALES = ("group", "batch", "none")


def group_advantages(rewards: Tensor, group_size: int, *, scale: str = "group", eps: float = 1e-6,
                     valid: Tensor | None = None) -> Tensor:
    """Â_i = (r_i - mean_group(r)) / (std + eps), one per response; `(B,)` in, `(B,)` out.

    scale:
        "group": std over the response's own group (GRPO/GSPO, the paper's Â_i).
        "batch": std over the whole batch (robust when a group's spread is tiny).
        "none":  no scaling, only the group mean is subtracted (Dr. GRPO).
    The std is the sample standard deviation (Bessel's correction, as torch.std, TRL and verl).
    A group whose rewards are all equal carries no signal: its advantages are exactly 0.
    valid: (B,) bool, the responses that count (None: all). The others (an agent's failed
    episodes) are left out of their group's mean and std and get 0; a group with fewer than 2
    valid responses has no baseline and gets 0 throughout.
    """
    if scale not in ADV_SCALES:
        raise ValueError(f"unknown advantage scale {scale!r}; valid scales: {', '.join(ADV_SCALES)}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be one per response, shape (B,), got {tuple(rewards.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if rewards.numel() % group_size != 0:
        raise ValueError(
            f"batch of {plural(rewards.numel(), 'reward')} is not a whole number of groups of size {group_size}"
        )
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards contain NaN or inf")
    adv = _relative(rewards[:, None], rewards, group_size, scale, eps, valid)[:, 0]  # (B,)
    return adv.to(rewards.dtype if rewards.is_floating_point() else torch.float32)


def turn_advantages(returns: Tensor, group_size: int, *, scale: str = "group", eps: float = 1e-6,
                    valid: Tensor | None = None) -> Tensor:
    """Per-turn advantages of multi-turn episodes: (B, K) in, (B, K) out, float64.

    returns[i, k] = R_{i,k}, episode i's reward from its turn k on (the final reward plus the
    environment's rewards of turns k, k+1, ...); column 0 is the whole episode's reward R_i.
    Â_{i,k} = (R_{i,k} - mean_group(R)) / (std_group(R) + eps): the reward-to-go less the
    group's baseline, the same for every turn (it depends on the other episodes, not on what
    this one does in turn k, so the estimate stays unbiased), scaled as `group_advantages`.
    With rewards only at the end, R_{i,k} = R_i and every turn gets the episode's advantage.
    A group whose episode rewards are all equal gets 0 in every turn. valid: as group_advantages.
    """
    if scale not in ADV_SCALES:
        raise ValueError(f"unknown advantage scale {scale!r}; valid scales: {', '.join(ADV_SCALES)}")
    return _relative(returns, returns[:, 0], group_size, scale, eps, valid)


def _relative(values: Tensor, episode: Tensor, group_size: int, scale: str, eps: float,
              valid: Tensor | None = None) -> Tensor:
    """(values - mean_group(episode)) / (std + eps), values (B, K), episode (B,), in float64;
    0 throughout a group whose `episode` values are all equal; `valid` (B,) bool: only those
    rows count (_relative_among), None: all."""
    if valid is not None and not bool(valid.all()):
        return _relative_among(values, episode, group_size, scale, eps, valid)
    r = episode.reshape(-1, group_size).to(torch.float64)  # (B/G, G)
    v = values.reshape(r.shape[0], group_size, -1).to(torch.float64)  # (B/G, G, K)
    centered = v - r.mean(-1)[:, None, None]  # (B/G, G, K)
    if scale == "group" and group_size > 1:
        centered = centered / (r.std(-1) + eps)[:, None, None]
    elif scale == "batch" and episode.numel() > 1:
        centered = centered / (episode.to(torch.float64).std() + eps)
    flat = (r.amax(-1) == r.amin(-1))[:, None, None]  # (B/G, 1, 1) no spread in the group
    return torch.where(flat, torch.zeros_like(centered), centered).reshape(values.shape)  # (B, K)


def _relative_among(values: Tensor, episode: Tensor, group_size: int, scale: str, eps: float,
                    valid: Tensor) -> Tensor:
    """_relative over the valid rows alone: each group's mean and sample std over its valid
    rows (n of them), 0 for the others, and 0 throughout a group with n < 2 or no spread; the
    "batch" scale is the std of every valid row."""
    r = episode.reshape(-1, group_size).to(torch.float64)  # (B/G, G)
    v = values.reshape(r.shape[0], group_size, -1).to(torch.float64)  # (B/G, G, K)
    m = valid.reshape(r.shape).to(torch.float64)  # (B/G, G) 1: counts
    n = m.sum(-1)  # (B/G,)
    mean = (r * m).sum(-1) / n.clamp(min=1)  # (B/G,) mean over the group's valid rows
    centered = v - mean[:, None, None]  # (B/G, G, K)
    if scale == "group" and group_size > 1:
        std = ((r - mean[:, None]).square() * m).sum(-1).div((n - 1).clamp(min=1)).sqrt()  # (B/G,) Bessel
        centered = centered / (std + eps)[:, None, None]
    elif scale == "batch":
        kept = episode.to(torch.float64)[valid]  # (n_valid,)
        centered = centered / ((kept.std() if kept.numel() > 1 else kept.new_zeros(())) + eps)
    high = torch.where(m > 0, r, -torch.inf).amax(-1)  # (B/G,) over the valid rows
    low = torch.where(m > 0, r, torch.inf).amin(-1)  # (B/G,)
    flat = ((high == low) | (n < 2))[:, None, None]  # (B/G, 1, 1) no spread, or no baseline
    out = torch.where(flat, torch.zeros_like(centered), centered) * m[:, :, None]  # (B/G, G, K) 0 off the valid rows
    return out.reshape(values.shape)  # (B, K)


def at_last_token(rewards: Tensor, mask: Tensor) -> Tensor:
    """(B,) one reward per response -> (B, T) zeros with each reward at its response's last
    completion token (right-padded rows; an empty row gets nothing)."""
    B = mask.shape[0]
    last = (mask.sum(-1).long() - 1).clamp(min=0)  # (B,) index of each row's last completion token
    out = torch.zeros(mask.shape, dtype=rewards.dtype, device=mask.device)  # (B, T)
    out[torch.arange(B), last] = rewards * (mask.sum(-1) > 0)
    return out


def gae(
    rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float = 1.0, lam: float = 0.95
) -> tuple[Tensor, Tensor]:
    """Generalized Advantage Estimation over right-padded completions.

    Args:
        rewards: (B,) one reward per response, placed at its last completion token, or
            (B, T) per-token rewards (e.g. a sequence reward plus a per-token KL penalty).
        values: (B, T) the critic's value of each completion position.
        mask: (B, T) 1.0 on completion tokens, 0.0 on padding; completions are right-padded
            (each row's ones form a prefix), the end of a response is terminal.

    Returns:
        advantages: (B, T), 0 on padding.
        returns: (B, T) advantages + values, the critic's regression target; 0 on padding.

    δ_t = r_t + γ V_{t+1} - V_t   (V after the last completion token is 0: terminal)
    Â_t = δ_t + γ λ Â_{t+1}
    """
    mask = mask.to(values.dtype)
    B, T = mask.shape
    if values.shape != (B, T):
        raise ValueError(f"values must be (B, T)={(B, T)}, got {tuple(values.shape)}")
    if rewards.dim() == 1:
        token_rewards = at_last_token(rewards.to(values.dtype), mask)  # (B, T)
    elif rewards.shape == (B, T):
        token_rewards = rewards.to(values.dtype)  # (B, T)
    else:
        raise ValueError(f"rewards must be (B,) or (B, T)={(B, T)}, got {tuple(rewards.shape)}")

    values = values * mask  # (B, T)
    token_rewards = token_rewards * mask  # (B, T)
    adv = torch.zeros_like(values)  # (B, T)
    next_value = values.new_zeros(B)  # (B,)
    next_adv = values.new_zeros(B)  # (B,)
    for t in reversed(range(T)):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]  # (B,)
        next_adv = (delta + gamma * lam * next_adv) * mask[:, t]  # (B,) zero on padding: terminal
        next_value = values[:, t]  # (B,) already zero on padding
        adv[:, t] = next_adv
    returns = (adv + values) * mask  # (B, T)
    return adv, returns


def masked_whiten(values: Tensor, mask: Tensor, *, eps: float = 1e-8, shift_mean: bool = True,
                  all_sum=None) -> Tensor:
    """Normalise `(B, T)` values to zero mean and unit variance over masked positions (PPO).

    all_sum: sums a tensor over processes (gspo.processes.distributed.Dist.all_sum), so that the mean
    and variance are those of the global batch when each process holds a part of it.
    """
    total = all_sum or (lambda t: t)
    mask = mask.to(values.dtype)
    n = total(mask.sum()).clamp(min=1.0)
    mean = total((values * mask).sum()) / n
    var = total(((values - mean).square() * mask).sum()) / n
    out = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * mask


def kl_rewards(rewards: Tensor, kl: Tensor | None, mask: Tensor, kl_coef: float) -> Tensor:
    """Token rewards (B, T) with the RLHF penalty: the sequence reward (B,) at the last completion
    token, minus kl_coef · kl on every token (kl: (B, T) log π_old - log π_ref); kl_coef <= 0:
    the sequence rewards as they are (gae places them at the last token)."""
    if kl_coef <= 0:
        return rewards
    return -kl_coef * kl * mask + at_last_token(rewards.to(kl.device), mask)  # (B, T)


# ----------------------------------------------------------------------------------------------
# Estimators by name
# ----------------------------------------------------------------------------------------------


@dataclass
class AdvantageInputs:
    """What an estimator reads. The group-relative ones read the global batch's `rewards` (and
    `to_go`); GAE reads this process's rows (`values`, `mask`, `kl`) and sums over processes with
    `all_sum` to whiten over the global batch."""

    rewards: Tensor  # (N,) one reward per response
    group_size: int = 1  # G: rows g*G .. g*G+G-1 answer the same prompt
    to_go: Tensor | None = None  # (N, K) rewards-to-go per turn (--turn-advantages): advantages (N, K)
    values: Tensor | None = None  # (B, T) a critic's V(s_t)
    mask: Tensor | None = None  # (B, T) 1 on the model's tokens (an episode's may sit between the environment's)
    kl: Tensor | None = None  # (B, T) log π_old - log π_ref, for the KL penalty in the reward
    kl_coef: float = 0.0
    gamma: float = 1.0
    lam: float = 0.95
    whiten: bool = True
    all_sum: Callable[[Tensor], Tensor] | None = None
    valid: Tensor | None = None  # (N,) bool: rows in their group's baseline (None: all; not an agent's failed episode)


@dataclass(frozen=True)
class Estimator:
    """A registered advantage estimator (`register_estimator`)."""

    name: str
    fn: Callable[[AdvantageInputs], tuple[Tensor, Tensor | None]]  # -> (advantages, returns or None)
    summary: str  # one line for the docs and the plan
    needs_values: bool = False  # reads a critic's values: the run trains a value model


ESTIMATORS: dict[str, Estimator] = {}  # registered estimators, by name, in registration order


def register_estimator(name: str, *, summary: str, needs_values: bool = False):
    """Register an advantage estimator under `name`."""
    def add(fn):
        if name in ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ESTIMATORS[name] = Estimator(name, fn, summary, needs_values)
        return fn
    return add


def _relative_to_group(inp: AdvantageInputs, scale: str) -> Tensor:
    if inp.to_go is not None:
        return turn_advantages(inp.to_go, inp.group_size, scale=scale, valid=inp.valid)  # (N, K)
    return group_advantages(inp.rewards, inp.group_size, scale=scale, valid=inp.valid)  # (N,)


@register_estimator("group", summary="(r - group mean) / group std: the paper's Â_i (GRPO, GSPO)")
def group_scaled(inp: AdvantageInputs) -> tuple[Tensor, None]:
    return _relative_to_group(inp, "group"), None


@register_estimator("batch", summary="(r - group mean) / the whole batch's std")
def batch_scaled(inp: AdvantageInputs) -> tuple[Tensor, None]:
    return _relative_to_group(inp, "batch"), None


@register_estimator("none", summary="r - group mean, unscaled (Dr. GRPO)")
def group_centered(inp: AdvantageInputs) -> tuple[Tensor, None]:
    return _relative_to_group(inp, "none"), None


@register_estimator("gae", needs_values=True,
                    summary="GAE over a value model's V(s_t), whitened over the global batch (PPO)")
def gae_advantages(inp: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """(advantages, returns) (B, T). GAE runs over the model's tokens alone: an episode's are moved
    to the front, in order, and the results moved back (0 on the environment's tokens)."""
    order = torch.sort((inp.mask == 0).to(torch.uint8), dim=1, stable=True).indices  # (B, T)
    mask = inp.mask.gather(1, order)  # (B, T) a prefix of ones per row
    kl = None if inp.kl is None else inp.kl.gather(1, order)
    rewards = kl_rewards(inp.rewards, kl, mask, inp.kl_coef)  # (B,) or (B, T)
    values = inp.values.gather(1, order)  # (B, T)
    advantages, returns = gae(rewards.to(values.device), values, mask, gamma=inp.gamma, lam=inp.lam)  # (B, T)
    if inp.whiten:
        advantages = masked_whiten(advantages, mask, all_sum=inp.all_sum)
    return tuple(torch.zeros_like(x).scatter(1, order, x) for x in (advantages, returns))  # back in place


# ----------------------------------------------------------------------------------------------
# On-policy distillation: the teacher's per-token signal (gspo.train.distill reads the teacher)
# ----------------------------------------------------------------------------------------------


def distill_advantages(teacher_logp: Tensor, student_logp: Tensor, mask: Tensor, coef: float, *,
                       per_token: bool = True) -> Tensor:
    """λ·(log π_T(y_t) − log π_S(y_t)), the negative reverse KL's per-token estimate, detached, with
    discount 0 (each token its own term, as TRL, Tinker and prime-rl's on-policy distillation):
    (B, T), 0 where `mask` is 0. per_token=False: one per response, its mean over the response's
    tokens, (B,), 0 for an empty row: the length-normalised sequence log-ratio, the advantage a
    sequence-level loss (GSPO, GMPO: one ratio s_i per response) can take.

    >>> t, s, m = torch.tensor([[-1.0, -2.0, 0.0]]), torch.tensor([[-1.5, -1.0, -9.0]]), torch.tensor([[1.0, 1.0, 0.0]])
    >>> distill_advantages(t, s, m, 2.0)          # 2·(-1+1.5), 2·(-2+1), masked
    tensor([[ 1., -2.,  0.]])
    >>> distill_advantages(t, s, m, 2.0, per_token=False)   # (1 - 2) / 2 tokens
    tensor([-0.5000])
    """
    gap = (teacher_logp.detach() - student_logp.detach()) * mask  # (B, T)
    if per_token:
        return coef * gap
    return coef * gap.sum(-1) / mask.sum(-1).clamp(min=1)  # (B,)


def with_distill(group: Tensor | None, distill: Tensor) -> Tensor:
    """The group-relative advantages plus the teacher's: (B,) + (B,) or (B,) / (B, T) + (B, T).
    group None: the teacher's alone."""
    if group is None:
        return distill
    if distill.dim() == 2 and group.dim() == 1:
        group = group[:, None]
    if group.dim() == 2 and distill.dim() == 1:
        raise ValueError("per-token group advantages take per-token distillation advantages (a token-level loss)")
    return group.to(distill) + distill


def distill_metrics(teacher_logp: Tensor, student_logp: Tensor, term: Tensor, mask: Tensor) -> dict[str, float]:
    """distill/reverse_kl (the mean over scored tokens of log π_S − log π_T, the k1 estimate of
    KL(π_S ‖ π_T) on the student's own samples), distill/teacher_logp and distill/student_logp (their
    means), and distill/advantage_mean, _min, _max of the teacher's term: over its tokens when per
    token (B, T), over the responses with a scored token when one per response (B,)."""
    n = float(mask.sum())
    mean = (lambda x: Mean(float((x * mask).sum()) / n, count=n)) if n else (lambda x: Mean(float("nan"), count=0))
    on = mask.bool() if term.dim() == 2 else mask.sum(-1) > 0  # (B, T) or (B,) where the term is defined
    values = term[on].double()
    return {"distill/reverse_kl": mean(student_logp - teacher_logp), "distill/teacher_logp": mean(teacher_logp),
            "distill/student_logp": mean(student_logp),
            "distill/advantage_mean": Mean(float(values.mean()) if len(values) else float("nan"), count=len(values)),
            "distill/advantage_min": Min(float(values.min()) if len(values) else float("nan")),
            "distill/advantage_max": Max(float(values.max()) if len(values) else float("nan"))}
