"""Policy losses by name: PPO, GRPO, GSPO, GSPO-token and the successors CISPO, SAPO and GMPO,
their aggregation, KL estimators, and the sampler/trainer mismatch weights (gspo.algo.corrections).

Every loss is a pure function of `(B, T)` tensors and its options, `LossOptions` (the loss's
name, its clip range, aggregation, KL and SAPO's temperatures; the section
gspo.config.sections.Loss, `cfg.loss` of a resolved TrainConfig, has them). The formulas follow the GSPO paper
(Qwen team, arXiv 2507.18071); the equation numbers in the comments are the paper's.

    from gspo.algo.losses import policy_loss
    from gspo.config import Loss
    loss, metrics = policy_loss(logp, old_logp, adv, mask, Loss(algorithm="gspo", clip_low=3e-4, clip_high=4e-4))

A loss is computed in two steps:

1. `LOSSES[name].fn(logp, old_logp, advantages, mask, loss)` (`register_loss`: the function with
   its preset clip range and facts; adding a loss is one decorated function here) gives a
   per-token loss `(B, T)` (for GSPO every token of a response carries that response's single
   sequence-level term) together with the ratio that was clipped and where its gradient was cut.
2. `aggregate(per_token, mask, mode)` (gspo.algo.aggregation) reduces it to a scalar. The mode is whatever the caller
   asked for, for every loss; the default `"seq-mean-token-mean"` is the paper's weighting
   (Eq. 2 and Eq. 5: each response counts once, whatever its length).

Left out on purpose: entropy bonuses (they need the full distribution, not just the sampled
token's log-prob) and the value loss, which lives with the critic (`gspo.models.value`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from gspo.algo.aggregation import agg_count, aggregate
from gspo.algo.corrections import apply_opsm
from gspo.algo.metrics import Max, Mean, Min

Tensor = torch.Tensor


class LossOptions(Protocol):
    """What a loss reads of its options. gspo.config.sections.Loss (`cfg.loss` of a resolved
    TrainConfig) has them all; any object with these attributes will do (this room imports no
    configuration)."""

    algorithm: str  # the registered loss's name
    clip_low: float  # the clip range (resolved: the algorithm's preset unless given)
    clip_high: float
    loss_agg: str  # gspo.algo.aggregation's mode
    beta: float  # the KL penalty's coefficient (0: off)
    kl_estimator: str  # k1, k2 or k3
    sapo_tau_pos: float  # SAPO's gate temperatures
    sapo_tau_neg: float
    ctpo_power: float  # CTPO: its clip band grows as t^power
    ctpo_dual_clip: float | None  # CTPO: the dual clip's c (None: off)
    cppo_w_min: float  # CPPO: the last token's budget weight
    cppo_budget: float  # CPPO: δ_b_min, the floor of each response's budget rate

# log-ratios are clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP] before exp(): e^20 ≈ 4.9e8 is
# far outside any clip range, so the objective is unchanged wherever it is finite, and
# exp() can never overflow to inf (which would then give inf * 0 = NaN in the masked sums).
LOG_RATIO_CLAMP = 20.0

KL_ESTIMATORS = ("k1", "k2", "k3")


@dataclass
class TokenLoss:
    """What a per-token loss function returns, before aggregation."""

    loss: Tensor  # (B, T) per-token loss to minimise; any value at masked positions
    ratio: Tensor  # (B, T) the ratio that is clipped (w_{i,t}, or s_i broadcast over tokens)
    clipped_low: Tensor  # (B, T) bool: gradient cut because ratio < 1 - clip_low and adv < 0
    clipped_high: Tensor  # (B, T) bool: gradient cut because ratio > 1 + clip_high and adv > 0


def _safe_exp(log_ratio: Tensor) -> Tensor:
    return torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def _clipped_surrogate(ratio: Tensor, adv: Tensor, clip_low: float, clip_high: float) -> TokenLoss:
    """-min(r·A, clip(r, 1-ε_low, 1+ε_high)·A), elementwise over broadcastable tensors."""
    surr = ratio * adv  # (B, T) or (B,)
    surr_clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv  # (B, T) or (B,)
    loss = -torch.minimum(surr, surr_clipped)  # (B, T) or (B,)
    with torch.no_grad():
        # the min() picks the clipped (constant) branch exactly in these two cases
        clipped_low = (ratio < 1.0 - clip_low) & (adv < 0)
        clipped_high = (ratio > 1.0 + clip_high) & (adv > 0)
    return TokenLoss(loss, ratio, clipped_low, clipped_high)


def _token_advantages(advantages: Tensor, mask: Tensor, name: str) -> Tensor:
    if advantages.dim() == 1:
        return advantages.unsqueeze(-1).expand_as(mask)  # (B,) -> (B, T)
    if advantages.shape != mask.shape:
        raise ValueError(
            f"{name}: advantages must be (B,) or (B, T)={tuple(mask.shape)}, got {tuple(advantages.shape)}"
        )
    return advantages


@dataclass(frozen=True)
class LossInfo:
    """What gspo knows about a registered loss (`register_loss`)."""

    name: str
    fn: Callable[..., TokenLoss]  # (logp, old_logp, advantages, mask, loss: LossOptions)
    summary: str  # one line for `gspo train --help` and the plan
    clip_low: float  # the preset clip range (--clip-low / --clip-high when not given)
    clip_high: float
    log_space_clip: bool = False  # the clip range bounds log-ratios, not ratios (--clip-low may exceed 1)
    turn_advantages: bool = False  # takes per-token advantages (B, T) (--turn-advantages)
    group_advantages: bool = True  # advantages are relative to a group: --group-size >= 2 (PPO: a critic's)
    gate: bool = False  # a soft gate, not a clip: the clip range is unused
    options: tuple[str, ...] = ()  # the options only this loss reads (SAPO's gate temperatures): unused by the others
    title: str = ""  # its name in a model card ("GSPO (Group Sequence Policy Optimization)"); "" : the name in capitals
    clip_words: str = "clip [1 - {low:g}, 1 + {high:g}]"  # what its clip range bounds, in the plan's words

    @property
    def display(self) -> str:
        return self.title or self.name.upper()

    def clip_text(self, low: float, high: float) -> str:
        """The clip range (low, high) in words: `clip [1 - 0.0003, 1 + 0.0004]`."""
        return self.clip_words.format(low=low, high=high)


def own_options() -> dict[str, str]:
    """Option -> the loss that owns it: the options some registered loss reads and the others do not."""
    return {option: info.name for info in LOSSES.values() for option in info.options}


LOSSES: dict[str, LossInfo] = {}  # registered losses, by name, in registration order


def register_loss(name: str, *, preset: tuple[float, float], summary: str, **facts):
    """Register a per-token loss function under `name` with its facts (LossInfo's fields):
    `--algorithm name` then runs it, with `preset` as its clip range. A function may be
    registered under several names (PPO and GRPO share one)."""
    def add(fn):
        if name in LOSSES:
            raise ValueError(f"loss {name!r} is already registered")
        LOSSES[name] = LossInfo(name, fn, summary, *preset, **facts)
        return fn
    return add


def sequence_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """log s_i = (1/|y_i|) Σ_t log w_{i,t}  (Eq. 7, in log space). Empty rows give 0."""
    length = mask.sum(-1).clamp(min=1.0)  # (B,)  |y_i|
    return ((logp - old_logp) * mask).sum(-1) / length  # (B,)


@register_loss("gspo", preset=(3e-4, 4e-4), summary="sequence ratio s_i, one clipped term per response (paper Eq. 5)",
               title="GSPO (Group Sequence Policy Optimization)")
def gspo_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, loss: LossOptions
) -> TokenLoss:
    """GSPO (Eq. 5): one clipped term per response, with the length-normalised sequence ratio.

    s_i = (π_θ(y_i|x) / π_θold(y_i|x))^(1/|y_i|) = exp((1/|y_i|) Σ_t log w_{i,t})
    per-response term: min(s_i Â_i, clip(s_i, 1-ε_low, 1+ε_high) Â_i)

    The term is broadcast over the response's tokens so that the named aggregation modes
    apply; under "seq-mean-token-mean" each response then counts exactly once, as in Eq. 5.
    """
    if advantages.dim() != 1:
        raise ValueError(
            f"gspo: advantages must be one per sequence, shape (B,), got {tuple(advantages.shape)}; "
            "use 'gspo_token' for per-token advantages"
        )
    ratio = _safe_exp(sequence_log_ratio(logp, old_logp, mask))  # (B,)  s_i
    seq = _clipped_surrogate(ratio, advantages, loss.clip_low, loss.clip_high)  # fields (B,)

    def per_token(x: Tensor) -> Tensor:
        return x.unsqueeze(-1).expand_as(mask)  # (B,) -> (B, T)

    return TokenLoss(per_token(seq.loss), per_token(seq.ratio), per_token(seq.clipped_low), per_token(seq.clipped_high))


# Clip ranges: the paper's §5.1 for gspo and grpo; gspo_token shares GSPO's ranges because its
# ratio has the same value s_i; ppo uses the classic symmetric 0.2. The successors follow their
# papers: CISPO (MiniMax-M1) sets no lower bound on the IS weight (clip_low 1.0 -> 0) and tunes the
# upper, 0.28 as verl/Trinity's defaults; GMPO clips log-ratios to [-0.4, 0.4] (its paper's
# (e^-0.4, e^0.4)); SAPO clips nothing (its gate temperatures are --sapo-tau-pos/--sapo-tau-neg,
# 1.0 and 1.05 as in its paper).
@register_loss("ppo", preset=(0.2, 0.2), summary="token ratios with GAE advantages from a learned value model (Eq. 1)",
               group_advantages=False)
@register_loss("grpo", preset=(0.2, 0.27), summary="token ratios, each token clipped on its own (Eq. 2)",
               turn_advantages=True, title="GRPO (Group Relative Policy Optimization)")
def token_level_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, loss: LossOptions
) -> TokenLoss:
    """PPO (Eq. 1) and GRPO (Eq. 2): token ratios w_{i,t}, each token clipped on its own.

    w_{i,t} = π_θ(y_{i,t}|x, y_{i,<t}) / π_θold(y_{i,t}|x, y_{i,<t})
    per-token term: min(w_{i,t} Â, clip(w_{i,t}, 1-ε_low, 1+ε_high) Â)
    """
    adv = _token_advantages(advantages, mask, "ppo/grpo")  # (B, T)
    ratio = _safe_exp(logp - old_logp)  # (B, T)  w_{i,t}
    return _clipped_surrogate(ratio, adv, loss.clip_low, loss.clip_high)


@register_loss("gspo_token", preset=(3e-4, 4e-4), summary="GSPO's ratio per token, for per-token advantages (Eq. 13)",
               turn_advantages=True, title="GSPO-token")
def gspo_token_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, loss: LossOptions
) -> TokenLoss:
    """GSPO-token (Eq. 13-14): GRPO's form with s_{i,t} = sg[s_i] · π_θ(y_{i,t}) / sg[π_θ(y_{i,t})].

    The value of s_{i,t} is s_i for every token, and its gradient w.r.t. log π_θ(y_{i,t}) is s_i,
    so with Â_{i,t} = Â_i this equals GSPO in value, clipping decision and gradient.
    """
    adv = _token_advantages(advantages, mask, "gspo_token")  # (B, T)
    log_s = sequence_log_ratio(logp, old_logp, mask).detach()  # (B,)  sg[log s_i]
    # sg[s_i] · exp(logp - sg[logp]): the log is log s_i + (logp - sg[logp]), clamped as one
    log_ratio = log_s.unsqueeze(-1) + (logp - logp.detach())  # (B, T), value log s_i
    ratio = _safe_exp(log_ratio)  # (B, T)  s_{i,t}
    return _clipped_surrogate(ratio, adv, loss.clip_low, loss.clip_high)


@register_loss("cispo", preset=(1.0, 0.28), turn_advantages=True,
               summary="token ratios as detached, clipped weights of log π: no gradient is cut (MiniMax-M1)")
def cispo_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, loss: LossOptions
) -> TokenLoss:
    """CISPO (MiniMax-M1, arXiv 2506.13585): clip the importance weight, never the gradient.

    per-token loss: -sg(clip(r_t, 1-ε_low, 1+ε_high)) · Â · log π_θ(y_t)
    Every token keeps a gradient, sg(ŵ_t)·Â; the clip fractions count the tokens whose weight
    was truncated (whatever the advantage's sign), as no gradient is ever cut.
    """
    adv = _token_advantages(advantages, mask, "cispo")  # (B, T)
    clip_low, clip_high = loss.clip_low, loss.clip_high
    ratio = _safe_exp(logp - old_logp)  # (B, T)  r_t
    weight = ratio.detach().clamp(1.0 - clip_low, 1.0 + clip_high)  # (B, T)  sg(clip(r_t))
    with torch.no_grad():
        clipped_low, clipped_high = ratio < 1.0 - clip_low, ratio > 1.0 + clip_high
    return TokenLoss(-weight * adv * logp, ratio, clipped_low, clipped_high)


@register_loss("sapo", preset=(0.0, 0.0), turn_advantages=True, gate=True, options=("sapo_tau_pos", "sapo_tau_neg"),
               summary="token ratios through a soft sigmoid gate instead of a clip (Qwen SAPO)")
def sapo_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, loss: LossOptions
) -> TokenLoss:
    """SAPO (Qwen, soft adaptive policy optimisation, arXiv 2511.20347): a smooth gate instead of a clip.

    per-token loss: -σ(τ (r_t - 1)) · (4/τ) · Â, τ = τ_pos where Â > 0, τ_neg where Â < 0
    Its gradient w.r.t. log π_θ(y_t) is -Â · 4σ(1-σ) · r_t: exactly GRPO's -Â·r_t at r_t = 1, fading
    smoothly as r_t moves away. Nothing is clipped (the clip fractions are 0).
    """
    adv = _token_advantages(advantages, mask, "sapo")  # (B, T)
    ratio = _safe_exp(logp - old_logp)  # (B, T)  r_t
    tau_pos, tau_neg = loss.sapo_tau_pos, loss.sapo_tau_neg
    tau = torch.where(adv > 0, torch.full_like(adv, tau_pos), torch.full_like(adv, tau_neg))  # (B, T)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)  # (B, T)
    none = torch.zeros_like(mask, dtype=torch.bool)
    return TokenLoss(-gate * adv, ratio, none, none)


@register_loss("gmpo", preset=(0.4, 0.4), log_space_clip=True, clip_words="log-ratio clip [-{low:g}, {high:g}]",
               summary="geometric mean of token ratios clipped in log space, one term per response (GMPO)")
def gmpo_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, loss: LossOptions
) -> TokenLoss:
    """GMPO (geometric-mean policy optimisation, arXiv 2507.20673): the geometric mean of token
    ratios, each clipped in log space on the side the advantage's sign makes it matter.

    l_t = log π_θ(y_t) - log π_θold(y_t);  m_t = sign(Â) · min(sign(Â) l_t, sign(Â) clip(l_t, -ε_low, ε_high))
    ratio_i = exp(Σ_t m_t / |y_i|);  per-response loss: -Â_i · ratio_i  (broadcast over its tokens)
    The reported ratio is the unclipped geometric mean, GSPO's s_i.
    """
    if advantages.dim() != 1:
        raise ValueError(f"gmpo: advantages must be one per sequence, shape (B,), got {tuple(advantages.shape)}")
    clip_low, clip_high = loss.clip_low, loss.clip_high
    sign = torch.sign(advantages).unsqueeze(-1)  # (B, 1)
    log_w = (logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (B, T)  l_t
    m = sign * torch.minimum(sign * log_w, sign * log_w.clamp(-clip_low, clip_high))  # (B, T)
    length = mask.sum(-1).clamp(min=1.0)  # (B,)
    ratio = torch.exp((m * mask).sum(-1) / length)  # (B,)
    seq_ratio = torch.exp(sequence_log_ratio(logp, old_logp, mask).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    with torch.no_grad():
        clipped_low = (log_w < -clip_low) & (sign < 0)  # (B, T)
        clipped_high = (log_w > clip_high) & (sign > 0)
    per_token = (-advantages * ratio).unsqueeze(-1).expand_as(mask)  # (B, T)
    return TokenLoss(per_token, seq_ratio.unsqueeze(-1).expand_as(mask), clipped_low, clipped_high)


# ----------------------------------------------------------------------------------------------
# Divergence masks in place of ratio clipping: DPPO (arXiv 2602.04879) and CPPO (arXiv 2606.10968)
# ----------------------------------------------------------------------------------------------


def _masked_surrogate(logp: Tensor, old_logp: Tensor, adv: Tensor, drop: Tensor) -> TokenLoss:
    """-M_t · r_t · Â_t with M_t = 1 - drop_t (a stop-gradient mask): the kept tokens' gradient is
    -Â·r_t·∇log π, GRPO's unclipped one; a dropped token has none. A drop where Â > 0 counts as a
    high clip, where Â < 0 as a low one (the direction the update was pushing)."""
    ratio = _safe_exp(logp - old_logp)  # (B, T)  r_t
    keep = (~drop).to(ratio.dtype)  # (B, T)
    with torch.no_grad():
        clipped_low, clipped_high = drop & (adv < 0), drop & (adv > 0)
    return TokenLoss(-keep * ratio * adv, ratio, clipped_low, clipped_high)


def _probs(logp: Tensor, old_logp: Tensor) -> tuple[Tensor, Tensor]:
    """π_θ(y_t) and π_old(y_t), the sampled tokens' probabilities, in float64 (no gradient)."""
    return logp.detach().double().exp(), old_logp.double().exp()


@register_loss("dppo_tv", preset=(0.15, 0.15), turn_advantages=True, title="DPPO (binary total variation)",
               clip_words="TV mask: π - π_old within [-{low:g}, {high:g}]",
               summary="unclipped token ratios; a token whose probability moved past δ is dropped (DPPO)")
def dppo_tv_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, loss: LossOptions
) -> TokenLoss:
    """DPPO with the binary total variation (Qi et al., arXiv 2602.04879; verl's `dppo_tv`).

    D_t = π_θ(y_t) - π_old(y_t), the sampled token's probabilities (its total variation on the
    two outcomes {y_t, not y_t} is |D_t|). A token is dropped when its probability moved past δ
    in the direction its advantage pushes: D_t > δ_high where Â > 0, D_t < -δ_low where Â < 0.
    per-token loss: -M_t · r_t · Â_t (no ratio clipping; the clip range is δ). Preset δ = 0.15 both
    sides, the paper's dense-model value (verl's recipe; 0.20 for its MoE model).
    """
    adv = _token_advantages(advantages, mask, "dppo_tv")  # (B, T)
    p, q = _probs(logp, old_logp)  # (B, T)
    with torch.no_grad():
        d = p - q
        drop = torch.where(adv > 0, d > loss.clip_high, torch.where(adv < 0, d < -loss.clip_low, False))
    return _masked_surrogate(logp, old_logp, adv, drop)


def binary_kl(p: Tensor, q: Tensor) -> Tensor:
    """KL(Bern(q) ‖ Bern(p)) = q log(q/p) + (1-q) log((1-q)/(1-p)): the old policy's KL to the new
    on the two outcomes {y_t, not y_t}; inf where p = 1 > q or p = 0 < q."""
    head = q * (q.log() - p.log())
    tail = torch.where(q < 1, (1 - q) * (torch.log1p(-q) - torch.log1p(-p)), torch.zeros_like(q))
    return head + tail


@register_loss("dppo_kl", preset=(0.05, 0.05), turn_advantages=True, title="DPPO (binary KL)",
               clip_words="binary-KL mask: KL(π_old‖π) within {low:g} (falling), {high:g} (rising)",
               summary="unclipped token ratios; a token whose binary KL to π_old passed δ is dropped (DPPO)")
def dppo_kl_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, loss: LossOptions
) -> TokenLoss:
    """DPPO with the binary KL (arXiv 2602.04879; verl's `dppo_kl`).

    K_t = KL(Bern(π_old(y_t)) ‖ Bern(π_θ(y_t))) (`binary_kl`). A token is dropped when K_t passed
    δ and its probability moved the way its advantage pushes: K_t > δ_high and π_θ > π_old where
    Â > 0, K_t > δ_low and π_θ < π_old where Â < 0. per-token loss: -M_t · r_t · Â_t. Preset
    δ = 0.05 both sides (verl's recipe for the paper).
    """
    adv = _token_advantages(advantages, mask, "dppo_kl")  # (B, T)
    p, q = _probs(logp, old_logp)  # (B, T)
    with torch.no_grad():
        k = binary_kl(p, q)
        drop = torch.where(adv > 0, (k > loss.clip_high) & (p > q),
                           torch.where(adv < 0, (k > loss.clip_low) & (p < q), False))
    return _masked_surrogate(logp, old_logp, adv, drop)


CPPO_QUANTILE, CPPO_K = 0.9, 1.0  # δ_b of a response: clamp(k · q-quantile of its D_t, δ_b_min, 2 δ_b_min)


def _positions(mask: Tensor) -> tuple[Tensor, Tensor]:
    """(t, T): each token's 1-based position among its response's completion tokens (B, T), and
    the response's count of them (B, 1). Padding and masked-out (environment) tokens are skipped."""
    t = mask.cumsum(-1)  # (B, T)
    return t, mask.sum(-1, keepdim=True)


def cppo_keep(d: Tensor, toward: Tensor, mask: Tensor, delta: Tensor, w_min: float, budget: float) -> Tensor:
    """CPPO's mask (its Eq. 8-10, 22), float64, (B, T) bool: which tokens keep their gradient.

    D_t = |π_θ(y_t) - π_old(y_t)|; w_t = w_min + (1 - w_min)(T - t)/(T - 1) (1 at the first token,
    w_min at the last; T the response's own length, so padding changes nothing);
    Z_t = w_t D_t; S_t = Σ_{j<=t} Z_j and W_t = Σ_{j<=t} w_j over the response's tokens, every one
    (kept or not); δ_b = clamp(CPPO_K · quantile_0.9(D), budget, 2 budget) per response;
    c_t = min(δ, δ + δ_b W_{t-1} - S_{t-1}); kept iff the update moves π back towards π_old
    (`toward`: Â (r - 1) <= 0) or Z_t <= c_t. `delta`: δ per token (δ_high where Â > 0, δ_low else).
    """
    t, T = _positions(mask)  # (B, T), (B, 1)
    w = w_min + (1.0 - w_min) * (T - t) / (T - 1).clamp(min=1.0)  # (B, T)
    w = torch.where(T > 1, w, torch.ones_like(w)) * mask
    z = w * d * mask  # (B, T)  Z_t
    s_before, w_before = z.cumsum(-1) - z, w.cumsum(-1) - w  # (B, T)  S_{t-1}, W_{t-1}
    q = torch.nanquantile(torch.where(mask > 0, d, float("nan")), CPPO_QUANTILE, dim=-1, keepdim=True)  # (B, 1)
    delta_b = (CPPO_K * q.nan_to_num(0.0)).clamp(budget, 2.0 * budget)  # (B, 1)
    c = torch.minimum(delta, delta + delta_b * w_before - s_before)  # (B, T)
    return toward | (z <= c)


@register_loss("cppo", preset=(0.15, 0.15), turn_advantages=True, options=("cppo_w_min", "cppo_budget"),
               title="CPPO (cumulative prefix trust region)",
               clip_words="TV mask: π - π_old within [-{low:g}, {high:g}] and a prefix budget",
               summary="DPPO's TV mask, each token's δ also bounded by its prefix's cumulative budget (CPPO)")
def cppo_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, loss: LossOptions
) -> TokenLoss:
    """CPPO (Mao et al., arXiv 2606.10968): DPPO's binary-TV mask, each token's threshold also
    bounded by what its prefix has spent of a budget (`cppo_keep`; --cppo-w-min, --cppo-budget:
    the paper's 0.8 and 0.02). per-token loss: -M_t · r_t · Â_t. Preset δ = 0.15 both sides (the
    paper's dense models; 0.20 for its MoE model). The paper's main runs measure D_t as a top-20
    total variation over the vocabulary; this is its binary-TV form (the sampled token's own
    probabilities), the one its reference code implements.
    """
    adv = _token_advantages(advantages, mask, "cppo")  # (B, T)
    p, q = _probs(logp, old_logp)  # (B, T)
    with torch.no_grad():
        delta = torch.where(adv > 0, loss.clip_high, loss.clip_low).to(p.dtype)  # (B, T)
        toward = (adv.double() * (p / q - 1.0)) <= 0  # (B, T)  moving π back to π_old
        keep = cppo_keep((p - q).abs(), toward, mask.double(), delta, loss.cppo_w_min, loss.cppo_budget)
    return _masked_surrogate(logp, old_logp, adv, ~keep)


# ----------------------------------------------------------------------------------------------
# Prefix-cumulative ratios: CTPO (arXiv 2605.07331)
# ----------------------------------------------------------------------------------------------


@register_loss("ctpo", preset=(0.025, 0.05), turn_advantages=True, log_space_clip=True,
               options=("ctpo_power", "ctpo_dual_clip"), title="CTPO (cumulative token ratios)",
               clip_words="prefix log-ratio clip [-{low:g}, {high:g}]·t^p",
               summary="token t's ratio is its prefix's product, clipped in log space on a band growing as t^p")
def ctpo_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, loss: LossOptions
) -> TokenLoss:
    """CTPO (Zhang et al., arXiv 2605.07331; its code's `cum-token-cumprod-la`): token t's ratio is
    the product of its prefix's token ratios, unbiased for the prefix, between GRPO's w_t and
    the whole sequence's product.

    L_t = Σ_{k<=t} log w_k over the response's tokens (not length-normalised);
    log ρ_t = sg(L_t) + log π_θ(y_t) - sg(log π_θ(y_t))  (value L_t; gradient through token t only)
    the clip band grows as the prefix's random walk does: lo_t = ε_low t^p, hi_t = ε_high t^p, t the
    1-based position among the completion tokens (--ctpo-power p, the paper's 0.5);
    per-token loss: max(-Â ρ_t, -Â exp(clip(log ρ_t, -lo_t, hi_t))), and where Â < 0 at most
    -Â exp(c t^p) (dual clip, --ctpo-dual-clip c, the paper's 0.05; None: off).
    Preset (ε_low, ε_high) = (0.025, 0.05), the paper's: a band of [0.975, 1.05] at t = 1, [0.78, 1.65] at t = 100.
    """
    adv = _token_advantages(advantages, mask, "ctpo")  # (B, T)
    t, _ = _positions(mask)  # (B, T)
    scale = t.clamp(min=1.0).pow(loss.ctpo_power)  # (B, T)  t^p
    prefix = ((logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP) * mask).cumsum(-1).detach()  # (B, T)  L_t
    log_rho = (prefix + (logp - logp.detach())).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (B, T), value L_t
    lo, hi = loss.clip_low * scale, loss.clip_high * scale  # (B, T)
    ratio = torch.exp(log_rho)
    clipped = torch.exp(torch.maximum(torch.minimum(log_rho, hi), -lo))  # (B, T)
    per_token = torch.maximum(-adv * ratio, -adv * clipped)  # (B, T)
    with torch.no_grad():
        clipped_low = (log_rho < -lo) & (adv < 0)
        clipped_high = (log_rho > hi) & (adv > 0)
    if loss.ctpo_dual_clip is not None:
        cap = -adv * torch.exp(loss.ctpo_dual_clip * scale)  # (B, T)
        dual = (adv < 0) & (per_token > cap)
        per_token = torch.where(dual, cap, per_token)
        clipped_high = clipped_high | dual.detach()
    return TokenLoss(per_token, ratio, clipped_low, clipped_high)


def kl_penalty(logp: Tensor, ref_logp: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token estimate of KL(π_θ ‖ π_ref) from samples of π_θ; `(B, T)` in, `(B, T)` out.

    With log ρ = log π_ref - log π_θ:
    - k1 = -log ρ                 (unbiased, high variance, can be negative)
    - k2 = ½ (log ρ)²             (biased, low variance)
    - k3 = ρ - 1 - log ρ          (unbiased, low variance, always ≥ 0)

    As a loss term (`beta > 0`) what matters is the expected gradient over y ~ π_θ, and it is
    not the same KL for each (tests/test_losses.py checks it exactly): k1's is 0 (E[∇log π] = 0:
    no pull towards the reference at all), k2's is ∇KL(π_θ‖π_ref), k3's is ∇KL(π_ref‖π_θ),
    the reverse KL (what GRPO's penalty pulls along).
    """
    log_rho = ref_logp - logp  # (B, T)
    if estimator == "k1":
        return -log_rho
    if estimator == "k2":
        return 0.5 * log_rho.square()
    if estimator == "k3":
        return _safe_exp(log_rho) - 1.0 - log_rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    raise ValueError(f"unknown KL estimator {estimator!r}; valid estimators: {', '.join(KL_ESTIMATORS)}")


def policy_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, loss: LossOptions, *,
    ref_logp: Tensor | None = None,
    is_weights: Tensor | None = None, rollout_logp: Tensor | None = None, opsm_delta: float | None = None,
    max_len: int | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The clipped policy loss `loss.algorithm`, aggregated with `loss.loss_agg`, plus metrics.

    Args:
        logp, old_logp: (B, T) log π_θ (with gradient) and log π_θold of the sampled tokens.
        advantages: (B,) per response, or (B, T) per token (all but gspo and gmpo).
        mask: (B, T) 1.0 on completion tokens, 0.0 on padding.
        loss: the loss section (gspo.config.sections.Loss, `cfg.loss` of a resolved config); read here:
            algorithm ("ppo", "grpo", "gspo", "gspo_token", "cispo", "sapo", "gmpo" or any
            registered loss), clip_low/clip_high (the ratio is clipped to [1 - low, 1 + high];
            gmpo: the log-ratio to [-low, high]; None is refused: resolve them first), loss_agg
            (see `aggregate`), beta (the penalty β·KL is added per token before aggregation),
            kl_estimator, sapo_tau_pos/sapo_tau_neg (SAPO's gate temperatures).
        ref_logp: (B, T) log π_ref for the KL penalty; required when beta > 0.
        is_weights: (B, T) weights of the per-token policy loss (`rollout_is_weights`; not of the KL).
        rollout_logp, opsm_delta: the sampler's log-probs and off-policy sequence masking's δ
            (`cfg.corrections.opsm_delta`; gspo.algo.corrections.apply_opsm; None: off).
        max_len: the fixed length for "seq-mean-token-sum-norm" (`cfg.sampling.max_new_tokens`).

    Returns:
        loss: scalar to minimise (the negative of the objective, plus β·KL).
        metrics: floats (gspo.algo.metrics.Mean/Min/Max, which say how each averages), see docs/metrics.md.
    """
    _check_inputs(logp, old_logp, mask, loss)
    agg = loss.loss_agg
    mask = mask.to(logp.dtype)
    old_logp = old_logp.detach()
    advantages = advantages.detach()
    out = LOSSES[loss.algorithm].fn(logp, old_logp, advantages, mask, loss)
    per_token = out.loss if is_weights is None else out.loss * is_weights.detach()  # (B, T)
    metrics: dict[str, float] = {}
    if opsm_delta is not None:
        if rollout_logp is None:
            raise ValueError("opsm_delta needs rollout_logp, the sampler's log-probs")
        per_token, metrics = apply_opsm(per_token, logp=logp.detach(), rollout_logp=rollout_logp,
                                        advantages=advantages, mask=mask, delta=opsm_delta)
    pg_loss = aggregate(per_token, mask, agg, max_len=max_len)
    n_agg = float(agg_count(mask, agg))  # what the aggregated metrics average over
    total, kl_loss = _with_kl(pg_loss, logp, ref_logp, mask, loss, max_len)
    if kl_loss is not None:
        metrics["kl/ref"] = Mean(kl_loss.detach(), n_agg)
        metrics["loss/kl"] = Mean(loss.beta * kl_loss.detach(), n_agg)
    metrics.update(_ratio_metrics(out, logp, old_logp, mask))
    metrics["loss/policy"] = Mean(pg_loss.detach(), n_agg)
    return total, metrics


def _with_kl(pg_loss: Tensor, logp: Tensor, ref_logp: Tensor | None, mask: Tensor, loss: LossOptions,
             max_len: int | None) -> tuple[Tensor, Tensor | None]:
    """(pg_loss + β·KL, the aggregated KL), or (pg_loss, None) without a KL term (β = 0 and no ref_logp)."""
    if loss.beta == 0.0 and ref_logp is None:
        return pg_loss, None
    if ref_logp is None:
        raise ValueError("beta > 0 needs ref_logp, the reference policy's log-probs")
    kl = kl_penalty(logp, ref_logp.detach(), loss.kl_estimator)  # (B, T)
    kl_loss = aggregate(kl, mask, loss.loss_agg, max_len=max_len)
    return pg_loss + loss.beta * kl_loss, kl_loss


def _check_inputs(logp: Tensor, old_logp: Tensor, mask: Tensor, loss: LossOptions) -> None:
    if loss.algorithm not in LOSSES:
        raise ValueError(f"unknown policy loss {loss.algorithm!r}; valid losses: {', '.join(LOSSES)}")
    clip_low, clip_high = loss.clip_low, loss.clip_high
    if clip_low is None or clip_high is None:
        raise ValueError(f"clip_low and clip_high must be set (gspo.train.resolve fills the algorithm's preset), "
                         f"got clip_low={clip_low}, clip_high={clip_high}")
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip ranges must be >= 0, got clip_low={clip_low}, clip_high={clip_high}")
    if not (logp.shape == old_logp.shape == mask.shape) or logp.dim() != 2:
        raise ValueError(
            f"logp, old_logp and mask must share one (B, T) shape, got "
            f"{tuple(logp.shape)}, {tuple(old_logp.shape)}, {tuple(mask.shape)}"
        )


@torch.no_grad()
def _ratio_metrics(out: TokenLoss, logp: Tensor, old_logp: Tensor, mask: Tensor) -> dict[str, float]:
    """Clip fractions and ratio statistics over completion tokens (each token counts once)."""
    on = mask > 0  # (B, T)
    tokens = float(on.sum())  # every metric here averages over completion tokens
    n = on.sum().clamp(min=1).to(logp.dtype)
    low = (out.clipped_low & on).sum() / n
    high = (out.clipped_high & on).sum() / n
    ratio = out.ratio[on]  # (N,)
    log_w = (logp - old_logp)[on].clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (N,)
    # k3 estimate of KL(π_old ‖ π_θ) from samples of π_old: w - 1 - log w, with w = π_θ/π_old
    kl_old_new = (torch.exp(log_w) - 1.0 - log_w).mean() if log_w.numel() else log_w.new_zeros(())
    # how stale or off-policy the batch is, whatever the loss clips: |log s_i| per response, and each
    # token's |log w_{i,t} - log s_i| (the spread of the token ratios around their sequence's ratio)
    has = on.any(-1)  # (B,)
    log_s = sequence_log_ratio(logp, old_logp, mask)  # (B,)
    spread = ((logp - old_logp) - log_s[:, None]).abs()[on]  # (N,)
    empty = ratio.numel() == 0
    return {
        "clip/frac": Mean(low + high, tokens),
        "clip/low_frac": Mean(low, tokens),
        "clip/high_frac": Mean(high, tokens),
        "ratio/mean": Mean("nan" if empty else ratio.mean(), tokens),
        "ratio/min": Min("nan" if empty else ratio.min()),
        "ratio/max": Max("nan" if empty else ratio.max()),
        "kl/old_new": Mean(kl_old_new, tokens),
        "ratio/seq_log_abs": Mean("nan" if empty else log_s[has].abs().mean(), float(has.sum())),
        "ratio/token_spread": Mean("nan" if empty else spread.mean(), tokens),
    }


__all__ = ["KL_ESTIMATORS", "LOSSES", "LossInfo", "LossOptions", "TokenLoss", "kl_penalty", "own_options",
           "policy_loss", "register_loss", "sequence_log_ratio"]
