"""The divergence-masked and prefix-cumulative losses: DPPO (binary TV, binary KL), CPPO and CTPO.

Each is checked against a reference written from its paper's definition as plain loops over
rows and tokens (`math`, no library helper), by hand cases, for padding and micro-batch
invariance, and for the reductions the papers state. All in float64, to 1e-12.
"""

import math

import pytest
import torch

from gspo.algo.aggregation import AGG_MODES, agg_count
from gspo.algo.losses import policy_loss
from gspo.algo.metrics import combine
from gspo.config import Loss

D = torch.float64
LN = math.log


def t(x):
    return torch.tensor(x, dtype=D)


def close(a, b, rtol=1e-12, atol=1e-12):
    torch.testing.assert_close(torch.as_tensor(a, dtype=D), torch.as_tensor(b, dtype=D), rtol=rtol, atol=atol)


def L(name, clip_low, clip_high, **kw):
    return Loss(algorithm=name, clip_low=clip_low, clip_high=clip_high, **kw)


def run(logp, old, adv, mask, opts, max_len=None):
    """(loss, d loss / d logp, metrics) of policy_loss."""
    lp = logp.clone().requires_grad_()
    loss, m = policy_loss(lp, old, adv, mask, opts, max_len=max_len)
    loss.backward()
    return loss.detach(), lp.grad, m


# ----------------------------------------------------------------------------------------------
# The reference: each paper's definition, token by token
# ----------------------------------------------------------------------------------------------


def _quantile(xs, level):
    s = sorted(xs)
    pos = level * (len(s) - 1)
    i = math.floor(pos)
    return s[i] + (s[min(i + 1, len(s) - 1)] - s[i]) * (pos - i)


def reference(o, logp, old, adv, mask, max_len=None):
    """(loss, gradient (B, T) list, low count, high count, completion tokens) of loss `o` by its definition."""
    logp, old, mask = logp.tolist(), old.tolist(), mask.tolist()
    B, T = len(mask), len(mask[0])
    adv = adv.tolist() if adv.dim() == 2 else [[a] * T for a in adv.tolist()]
    rows = [[j for j in range(T) if mask[b][j] > 0] for b in range(B)]
    R, N = sum(1 for r in rows if r), sum(len(r) for r in rows)
    loss, grad, low, high = 0.0, [[0.0] * T for _ in range(B)], 0, 0
    for b, idx in enumerate(rows):
        n = len(idx)
        weight = {"seq-mean-token-mean": 1 / (n * R) if n else 0.0, "token-mean": 1 / N, "seq-mean-token-sum": 1 / R,
                  "seq-mean-token-sum-norm": 1 / (R * max_len) if max_len else None}[o.loss_agg]
        p = [math.exp(logp[b][j]) for j in idx]
        q = [math.exp(old[b][j]) for j in idx]
        a = [adv[b][j] for j in idx]
        r = [math.exp(logp[b][j] - old[b][j]) for j in idx]
        if o.algorithm == "cppo" and n:
            dev = [abs(pi - qi) for pi, qi in zip(p, q)]
            rate = min(max(1.0 * _quantile(dev, 0.9), o.cppo_budget), 2 * o.cppo_budget)
            spent, wsum = 0.0, 0.0  # S_{t-1}, W_{t-1}
        prefix = 0.0  # CTPO's L_t
        for k in range(n):
            pos = k + 1  # 1-based among the completion tokens
            value, g, clipped, dual = None, None, False, False
            if o.algorithm == "dppo_tv":
                d = p[k] - q[k]
                clipped = (a[k] > 0 and d > o.clip_high) or (a[k] < 0 and d < -o.clip_low)
            elif o.algorithm == "dppo_kl":
                kl = q[k] * math.log(q[k] / p[k]) + (1 - q[k]) * math.log((1 - q[k]) / (1 - p[k]))
                rose, fell = a[k] > 0 and p[k] > q[k], a[k] < 0 and p[k] < q[k]
                clipped = (rose and kl > o.clip_high) or (fell and kl > o.clip_low)
            elif o.algorithm == "cppo":
                w = 1.0 if n == 1 else o.cppo_w_min + (1 - o.cppo_w_min) * (n - pos) / (n - 1)
                z = w * dev[k]
                delta = o.clip_high if a[k] > 0 else o.clip_low
                c = min(delta, delta + rate * wsum - spent)
                clipped = not (a[k] * (r[k] - 1) <= 0 or z <= c)
                spent, wsum = spent + z, wsum + w
            else:  # ctpo
                prefix += logp[b][idx[k]] - old[b][idx[k]]
                scale = pos ** o.ctpo_power
                lo, hi = o.clip_low * scale, o.clip_high * scale
                raw, cut = -a[k] * math.exp(prefix), -a[k] * math.exp(min(max(prefix, -lo), hi))
                clipped = cut > raw
                value, g = (cut, 0.0) if clipped else (raw, -a[k] * math.exp(prefix))
                cap = -a[k] * math.exp(o.ctpo_dual_clip * scale) if o.ctpo_dual_clip is not None else math.inf
                if a[k] < 0 and value > cap:  # the dual clip: a high clip, whatever the sign of A
                    value, g, dual = cap, 0.0, True
            if value is None:  # the masked surrogate -(1 - drop) r A; its gradient is the same
                value = g = 0.0 if clipped else -r[k] * a[k]
            low += clipped and a[k] < 0
            high += (clipped and a[k] > 0) or dual
            loss += weight * value
            grad[b][idx[k]] = weight * g
    return loss, grad, low, high, N


def batch(seed, spread, token_adv=False, B=5, T=7):
    """Probabilities q in (0.05, 0.95), p moved in logit space by `spread`·N(0, 1); rows of 7, 7, 4, 7, 6
    completion tokens, row 3 with an environment token (mask 0) at column 2; advantages of both signs."""
    g = torch.Generator().manual_seed(seed)
    q = 0.05 + 0.9 * torch.rand(B, T, generator=g, dtype=D)
    old = q.log()
    logp = torch.nn.functional.logsigmoid(torch.logit(q) + spread * torch.randn(B, T, generator=g, dtype=D))
    mask = (torch.arange(T)[None, :] < t([7, 7, 4, 7, 6])[:, None]).to(D)
    mask[3, 2] = 0.0
    if token_adv:
        adv = torch.randn(B, T, generator=g, dtype=D)
        adv[0, :2] = 0.0  # no push either way: never dropped nor clipped
    else:
        adv = torch.rand(B, generator=g, dtype=D).add(0.1) * t([1, -1, 1, -1, 1])
    return logp, old, adv, mask


def _insert_junk(x, fill):
    """x (B, T) with a column of `fill` inserted in front, before column 3 and at the end."""
    cols, at = [], (0, 3, x.shape[1])
    for j in range(x.shape[1] + 1):
        if j in at:
            cols.append(torch.full_like(x[:, :1], fill))
        if j < x.shape[1]:
            cols.append(x[:, j:j + 1])
    return torch.cat(cols, 1)


# (options, spread): asymmetric ranges, so a swapped low/high fails
CASES = {
    "dppo_tv": (L("dppo_tv", 0.1, 0.2), 1.5),
    "dppo_kl": (L("dppo_kl", 0.03, 0.06), 1.5),
    "cppo": (L("cppo", 0.1, 0.2, cppo_w_min=0.8, cppo_budget=0.02), 0.9),
    "ctpo": (L("ctpo", 0.025, 0.05, ctpo_power=0.5, ctpo_dual_clip=0.03), 0.2),
    "ctpo-nodual": (L("ctpo", 0.025, 0.05, ctpo_power=0.7, ctpo_dual_clip=None), 0.2),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("token_adv", [False, True])
def test_matches_the_definition(case, seed, token_adv):
    o, spread = CASES[case]
    logp, old, adv, mask = batch(seed, spread, token_adv)
    loss, grad, m = run(logp, old, adv, mask, o)
    ref, ref_grad, low, high, n = reference(o, logp, old, adv, mask)
    close(loss, ref)
    close(grad, ref_grad)
    close(m["clip/low_frac"], low / n)
    close(m["clip/high_frac"], high / n)
    close(m["clip/frac"], (low + high) / n)
    assert low > 0 and high > 0 and low + high < n  # kept tokens, and drops (clips) on both sides
    assert (grad[mask == 0] == 0).all()


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mode", AGG_MODES)
def test_matches_the_definition_in_every_aggregation(case, mode):
    o, spread = CASES[case]
    o = Loss(**{**vars(o), "loss_agg": mode})
    logp, old, adv, mask = batch(7, spread, token_adv=True)
    loss, grad, _ = run(logp, old, adv, mask, o, max_len=9)
    ref, ref_grad, *_ = reference(o, logp, old, adv, mask, max_len=9)
    close(loss, ref)
    close(grad, ref_grad)


# ----------------------------------------------------------------------------------------------
# Hand cases: one response, Â = ±1, seq-mean-token-mean over its tokens
# ----------------------------------------------------------------------------------------------


DPPO_TV_HAND = ([0.7, 0.6, 0.3], [0.5, 0.5, 0.5])  # (p, q) per token
DPPO_KL_HAND = ([0.99, 0.6, 0.75], [0.9, 0.5, 0.9])


@pytest.mark.parametrize("name,probs,adv,loss_value,grad,low,high", [
    # DPPO-TV, δ = 0.15: p - q = [0.2, 0.1, -0.2], r = [1.4, 1.2, 0.6]
    # Â = +1: token 1 rose past δ_high -> dropped; token 3 fell, against Â: kept
    #         loss = -(0 + 1.2 + 0.6)/3 = -0.6; gradient -r·Â/3 on kept tokens = [0, -0.4, -0.2]
    ("dppo_tv", DPPO_TV_HAND, 1.0, -0.6, [0.0, -0.4, -0.2], 0, 1),
    # Â = -1: token 3 fell past δ_low -> dropped; loss = (1.4 + 1.2)/3 = 0.8666667; gradient [1.4/3, 0.4, 0]
    ("dppo_tv", DPPO_TV_HAND, -1.0, 2.6 / 3, [1.4 / 3, 0.4, 0.0], 1, 0),
    # DPPO-KL, δ = 0.05: K = q ln(q/p) + (1-q) ln((1-q)/(1-p)) = [0.1444793, 0.0204110, 0.0724603],
    # r = [1.1, 1.2, 0.8333333]
    # Â = +1: token 1 (K > δ, p > q) dropped, though its TV 0.09 is within DPPO-TV's 0.15; token 3 (p < q) kept
    #         loss = -(1.2 + 0.8333333)/3 = -0.6777778; gradient [0, -0.4, -0.2777778]
    ("dppo_kl", DPPO_KL_HAND, 1.0, -(1.2 + 0.75 / 0.9) / 3, [0.0, -0.4, -0.75 / 0.9 / 3], 0, 1),
    # Â = -1: token 3 (K > δ, p < q) dropped; loss = (1.1 + 1.2)/3 = 0.7666667; gradient [1.1/3, 0.4, 0]
    ("dppo_kl", DPPO_KL_HAND, -1.0, 2.3 / 3, [1.1 / 3, 0.4, 0.0], 1, 0),
])
def test_dppo_hand_case(name, probs, adv, loss_value, grad, low, high):
    delta = 0.15 if name == "dppo_tv" else 0.05
    loss, g, m = run(t([probs[0]]).log(), t([probs[1]]).log(), t([adv]), t([[1.0] * 3]), L(name, delta, delta))
    close(loss, loss_value)
    close(g, [grad])
    assert (m["clip/low_frac"], m["clip/high_frac"]) == (low / 3, high / 3)


def test_cppo_hand_case():
    # q = 0.5 for all 4 tokens, p = [0.62, 0.6, 0.3, 0.58], Â = +1, δ = 0.15, w_min = 0.8, budget 0.02
    # D = [0.12, 0.1, 0.2, 0.08]; r = [1.24, 1.2, 0.6, 1.16]; T = 4: w = 0.8 + 0.2(4-t)/3 = [1, 0.9333, 0.8667, 0.8]
    # Z = w·D = [0.12, 0.093333, 0.173333, 0.064]
    # quantile_0.9(D): sorted [0.08, 0.1, 0.12, 0.2], position 2.7 -> 0.12 + 0.7·0.08 = 0.176
    # δ_b = clamp(0.176, 0.02, 0.04) = 0.04
    # S_{t-1} = [0, 0.12, 0.213333, 0.386667], W_{t-1} = [0, 1, 1.933333, 2.8]
    # c = min(0.15, 0.15 + 0.04 W - S) = [0.15, 0.07, 0.014, -0.124667]
    # token 1: Z 0.12 <= 0.15 kept; token 2: 0.0933 > 0.07 dropped (DPPO-TV would keep it: D = 0.1 < 0.15)
    # token 3: r < 1 with Â > 0 moves back towards π_old: kept, but its Z still spends the budget
    # token 4: 0.064 > -0.1247 dropped. loss = -(1.24 + 0.6)/4 = -0.46; gradient -r/4 on kept = [-0.31, 0, -0.15, 0]
    loss, g, m = run(t([[LN(0.62), LN(0.6), LN(0.3), LN(0.58)]]), t([[LN(0.5)] * 4]), t([1.0]), t([[1.0] * 4]),
                     L("cppo", 0.15, 0.15, cppo_w_min=0.8, cppo_budget=0.02))
    close(loss, -0.46)
    close(g, [[-0.31, 0.0, -0.15, 0.0]])
    assert (m["clip/low_frac"], m["clip/high_frac"]) == (0.0, 0.5)


def test_cppo_budget_floor_hand_case():
    # q = 0.5, p = [0.545, 0.53, 0.501 × 18]: D = [0.045, 0.03, 0.001 × 18], r = [1.09, 1.06, 1.002 × 18]; Â = +1,
    # δ = 0.05, w_min = 1 (every w = 1), budget 0.02. quantile_0.9: position 0.9·19 = 17.1 of the sorted D, between
    # 0.001 and 0.03: 0.001 + 0.1·0.029 = 0.0039, clamped up to δ_b = 0.02. c_1 = 0.05 >= 0.045: kept;
    # c_2 = min(0.05, 0.05 + 0.02·1 - 0.045) = 0.025 < 0.03: dropped, though within δ; then
    # c_t = 0.05 + 0.02(t-1) - 0.075 - 0.001(t-3) >= 0.015 > 0.001: kept. loss = -(1.09 + 18·1.002)/20 = -0.9563
    # Padding must not enter the quantile: three junk columns with D ≈ 0.99 would lift it to ≈ 0.8, δ_b to 0.04
    # and c_2 to 0.045, keeping token 2.
    logp, old, mask = t([[LN(0.545), LN(0.53)] + [LN(0.501)] * 18]), t([[LN(0.5)] * 20]), t([[1.0] * 20])
    o = L("cppo", 0.05, 0.05, cppo_w_min=1.0, cppo_budget=0.02)
    for pad in (False, True):
        args = (_insert_junk(logp, -0.01), _insert_junk(old, -6.01), t([1.0]), _insert_junk(mask, 0.0)) if pad else (
            logp, old, t([1.0]), mask)
        loss, g, m = run(*args, o)
        close(loss, -0.9563)
        close(g[args[3] > 0], [-0.0545, 0.0] + [-0.0501] * 18)
        close(m["clip/high_frac"], 0.05)


E = math.exp
S2 = math.sqrt(2)


@pytest.mark.parametrize("adv,dual,loss_value,grad,low,high", [
    # log w = [0.04, 0.04, -0.1]: L = [0.04, 0.08, -0.02]; power 0.5: t^0.5 = [1, 1.414214, 1.732051]
    # hi = 0.05 t^p = [0.05, 0.070711, 0.086603], lo = 0.025 t^p = [0.025, 0.035355, 0.043301]
    # Â = +1: token 2's own log w 0.04 is within 0.05, but its prefix 0.08 > 0.070711: clipped, value -e^0.070711
    #         loss = -(e^0.04 + e^0.070711 + e^-0.02)/3 = -1.0314267; gradient [-e^0.04/3, 0, -e^-0.02/3]
    (1.0, None, -(E(0.04) + E(0.05 * S2) + E(-0.02)) / 3, [-E(0.04) / 3, 0.0, -E(-0.02) / 3], 0, 1),
    # Â = -1, no dual clip: max(e^L, e^clip(L)) keeps every raw e^L: loss (e^0.04 + e^0.08 + e^-0.02)/3 = 1.0347655
    (-1.0, None, (E(0.04) + E(0.08) + E(-0.02)) / 3, [E(0.04) / 3, E(0.08) / 3, E(-0.02) / 3], 0, 0),
    # Â = -1, dual clip c = 0.05: token 2 capped at e^(0.05·1.414214) = e^0.070711 (no gradient, counted high);
    #         token 1: 0.04 < 0.05, under its cap. loss 1.0314267; gradient [e^0.04/3, 0, e^-0.02/3]
    (-1.0, 0.05, (E(0.04) + E(0.05 * S2) + E(-0.02)) / 3, [E(0.04) / 3, 0.0, E(-0.02) / 3], 0, 1),
])
def test_ctpo_hand_case(adv, dual, loss_value, grad, low, high):
    loss, g, m = run(t([[-1.0 + 0.04, -2.0 + 0.04, -0.5 - 0.1]]), t([[-1.0, -2.0, -0.5]]), t([adv]), t([[1.0] * 3]),
                     L("ctpo", 0.025, 0.05, ctpo_power=0.5, ctpo_dual_clip=dual))
    close(loss, loss_value)
    close(g, [grad])
    assert (m["clip/low_frac"], m["clip/high_frac"]) == (low / 3, high / 3)


def test_ctpo_clips_low_for_negative_advantages():
    # one token, log w = -0.03 < -ε_low = -0.025, Â = -1: max(e^-0.03, e^-0.025) = e^-0.025, the clipped branch
    loss, g, m = run(t([[-1.03]]), t([[-1.0]]), t([-1.0]), t([[1.0]]), L("ctpo", 0.025, 0.05))
    close(loss, E(-0.025))
    close(g, [[0.0]])
    assert (m["clip/low_frac"], m["clip/high_frac"]) == (1.0, 0.0)


# ----------------------------------------------------------------------------------------------
# Invariances: padding anywhere, micro-batches of rows
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("token_adv", [False, True])
def test_padding_anywhere_changes_nothing(case, token_adv):
    # Non-completion columns (mask 0) in front, in the middle and at the end, with log-probs far from
    # the old ones (r = e^6, p - q ≈ 0.99): CPPO's w_t and quantile, CTPO's t and prefix sums must skip them.
    o, spread = CASES[case]
    logp, old, adv, mask = batch(0, spread, token_adv)
    loss, grad, m = run(logp, old, adv, mask, o)
    real = _insert_junk(torch.ones_like(mask), 0.0) > 0
    adv_pad = _insert_junk(adv, 5.0) if token_adv else adv
    loss_pad, grad_pad, m_pad = run(_insert_junk(logp, -0.01), _insert_junk(old, -6.01), adv_pad,
                                    _insert_junk(mask, 0.0), o)
    close(loss_pad, loss)
    close(grad_pad[real].view_as(grad), grad)
    assert (grad_pad[~real] == 0).all()
    for k in m:
        close(m_pad[k], m[k])


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mode", AGG_MODES)
def test_micro_batches_of_rows_sum_to_the_whole(case, mode):
    # As gspo.train.trainer does: each micro-batch's loss scaled by its agg_count over the minibatch's,
    # its padding columns trimmed; the metrics combined by their counts (gspo.algo.metrics.combine).
    o, spread = CASES[case]
    o = Loss(**{**vars(o), "loss_agg": mode})
    logp, old, adv, mask = batch(4, spread, token_adv=True)
    loss, grad, m = run(logp, old, adv, mask, o, max_len=9)
    total = float(agg_count(mask, mode))
    acc, acc_grad, parts = 0.0, torch.zeros_like(grad), []
    for rows in ([2], [0, 4], [1, 3]):
        width = int(mask[rows].sum(0).nonzero().max()) + 1  # row 2 alone: 4 columns
        part = [x[rows, :width] for x in (logp, old, adv, mask)]
        part_loss, part_grad, part_m = run(*part, o, max_len=9)
        scale = float(agg_count(part[3], mode)) / total
        acc += scale * part_loss
        acc_grad[rows, :width] += scale * part_grad
        parts.append(part_m)
    close(acc, loss)
    close(acc_grad, grad)
    merged = combine(parts)
    for k in ("clip/frac", "clip/low_frac", "clip/high_frac", "ratio/mean", "ratio/min", "ratio/max"):
        close(merged[k], m[k])


# ----------------------------------------------------------------------------------------------
# The reductions the papers state
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
def test_cppo_without_weights_or_budget_is_dppo_tv(seed):
    # w_min = 1 (every w_t = 1) and a budget no prefix can spend: c_t = δ, so kept iff moving back or |p - q| <= δ,
    # which is DPPO-TV's mask (p - q > δ_high where Â > 0, p - q < -δ_low where Â < 0): the same numbers, exactly
    logp, old, adv, mask = batch(seed, 0.9, token_adv=True)
    tv = run(logp, old, adv, mask, L("dppo_tv", 0.1, 0.2))
    same = run(logp, old, adv, mask, L("cppo", 0.1, 0.2, cppo_w_min=1.0, cppo_budget=1e6))
    assert torch.equal(tv[0], same[0]) and torch.equal(tv[1], same[1])
    assert all(tv[2][k] == same[2][k] for k in ("clip/low_frac", "clip/high_frac"))
    # the paper's weights and budget drop more than DPPO-TV alone
    assert run(logp, old, adv, mask, L("cppo", 0.1, 0.2))[2]["clip/frac"] > tv[2]["clip/frac"] > 0


@pytest.mark.parametrize("clip", [(0.025, 0.05), (0.2, 0.3)])
def test_ctpo_on_one_token_rows_is_grpo_in_log_space(clip):
    # One token: L_1 = log r, t^p = 1, so max(-A r, -A e^clip(log r, -ε_low, ε_high)) is GRPO's clip of r
    # to [e^-ε_low, e^ε_high], i.e. GRPO with clip_low = 1 - e^-ε_low, clip_high = e^ε_high - 1
    g = torch.Generator().manual_seed(5)
    old = -torch.rand(16, 1, generator=g, dtype=D) * 3
    logp = old + 2 * clip[1] * torch.randn(16, 1, generator=g, dtype=D)
    adv = torch.randn(16, generator=g, dtype=D)
    mask = torch.ones(16, 1, dtype=D)
    ctpo = run(logp, old, adv, mask, L("ctpo", *clip, ctpo_power=0.0, ctpo_dual_clip=None))
    grpo = run(logp, old, adv, mask, L("grpo", 1 - math.exp(-clip[0]), math.exp(clip[1]) - 1))
    close(ctpo[0], grpo[0])
    close(ctpo[1], grpo[1])
    for k in ("clip/low_frac", "clip/high_frac"):
        assert ctpo[2][k] == grpo[2][k] > 0


@pytest.mark.parametrize("seed", range(3))
def test_dppo_tv_with_delta_one_is_unclipped_grpo(seed):
    # |p - q| < 1 always: nothing is dropped, and the gradient is GRPO's unclipped -Â r / (|y_i| · rows)
    logp, old, adv, mask = batch(seed, 3.0, token_adv=True)
    loss, grad, m = run(logp, old, adv, mask, L("dppo_tv", 1.0, 1.0))
    assert m["clip/frac"] == 0.0
    r = torch.exp(logp - old)
    by_hand = -adv * r * mask / mask.sum(-1, keepdim=True) / mask.shape[0]
    close(grad, by_hand)
    close(loss, by_hand.sum())
    grpo = run(logp, old, adv, mask, L("grpo", 1.0, 1e6))
    close(grad, grpo[1])
