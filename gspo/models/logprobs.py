"""Log-probs of sampled completions under a model: the forward passes of training, within a token budget.

    out = forward_logprobs(model, mb, temperature=1.0)            # LogProbs: logp (b, T) [, hidden, entropy]
    parts = micro_batches(ro, idx, budget=8192, packed=False)     # row groups within a token budget
    logp, experts = token_logprobs(model, ro, temperature=1.0, split=Split(budget=8192))   # no gradient
    for m in passes(ro, Split(budget=8192).groups(ro, idx), 8192): ...   # MicroBatch: idx, rollout, ps, ts

Memory is bounded by a token budget, not by the batch. Every forward (and backward) runs on a
micro-batch of rows whose padded size (rows × (longest prompt + longest completion) among
them) or, packed, whose real token count is at most `budget`; padding columns that no row of
a micro-batch uses are trimmed. The LM head runs only on the positions that predict
completion tokens, in chunks (gspo.models.lmhead): there is no tokens × vocabulary term.

Packing (`packed=True`): the micro-batch's sequences are laid end to end in one row, position
ids restart at 0 for each, and no attention mask is passed, so transformers confines
attention to each sequence (a block-diagonal mask built from the position ids, or sequence
boundaries for FlashAttention): no padding token is computed. `supports_packing` checks once
per model that a packed forward gives the padded forward's hidden states, else padding is used
(gspo.train.run decides before FSDP shards the model, and says so when it refuses).

Left out: packing together with MoE routing capture (routing is recorded in the padded
layout, so MoE models use padded micro-batches; the run says so).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from gspo.models.lmhead import chunked_logprobs, fused_head
from gspo.models.moe import NO_ROUTING
from gspo.models.sequences import Rollout, position_ids_from_mask

Tensor = torch.Tensor


@dataclass
class LogProbs:
    logp: Tensor  # (b, T) log π of each completion token (τ-scaled), 0 on padding
    hidden: Tensor | None = None  # (b, T, H) final hidden state at the positions that predict them
    entropy: Tensor | None = None  # (b, T) entropy of π there, 0 on padding (no gradient)


def completion_logprobs(model, input_ids: Tensor, attention_mask: Tensor, completion_mask: Tensor,
                        *, temperature: float = 1.0, return_hidden: bool = False):
    """log π(y_t | x, y_<t) / τ-scaled, for the last T columns of `input_ids`; (B, T).

    One forward pass over prompt + completion; the LM head runs only on the T positions that
    predict completion tokens, and (for a plain linear head, see gspo.models.lmhead) in chunks,
    without ever holding T × vocabulary logits. With `return_hidden`, also returns the final
    hidden state at those positions, (B, T, H) (for a shared value head).
    """
    out = _padded(model, (input_ids, attention_mask, completion_mask), temperature, hidden=return_hidden)
    return (out.logp, out.hidden) if return_hidden else out.logp


def forward_logprobs(model, mb: Rollout, *, temperature: float, packed: bool = False, hidden: bool = False,
                     entropy: bool = False) -> LogProbs:
    """Log-probs of a micro-batch's completion tokens (those `mb.completion_mask` covers; a
    zero row adds nothing), one forward pass, padded or packed."""
    if packed and fused_head(model) is not None:
        return _packed(model, mb, temperature, hidden=hidden, entropy=entropy)
    return _padded(model, (mb.input_ids, mb.attention_mask, mb.completion_mask), temperature, hidden=hidden,
                   entropy=entropy)


def _padded(model, inputs: tuple[Tensor, Tensor, Tensor], temperature: float, *, hidden: bool = False,
            entropy: bool = False) -> LogProbs:
    """One padded forward; inputs: (input_ids (B, P+T), attention_mask (B, P+T), completion mask (B, T))."""
    input_ids, attention_mask, mask = inputs
    B, T = mask.shape
    pos = position_ids_from_mask(attention_mask)  # (B, P+T)
    targets = input_ids[:, -T:]  # (B, T)
    fused = fused_head(model)
    if fused is not None:
        backbone, head = fused
        h = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos,
                     use_cache=False).last_hidden_state[:, -T - 1:-1]  # (B, T, H) position j predicts j+1
        logp, ent = chunked_logprobs(h.reshape(B * T, -1), head.weight, targets.reshape(-1), temperature,
                                     entropy=True) if entropy else \
            (chunked_logprobs(h.reshape(B * T, -1), head.weight, targets.reshape(-1), temperature), None)
        return LogProbs(logp.view(B, T) * mask, h if hidden else None,
                        None if ent is None else ent.view(B, T) * mask)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos, use_cache=False,
                logits_to_keep=T + 1, output_hidden_states=hidden)
    logits = out.logits[:, :-1].float()  # (B, T, V) position j predicts token j+1
    if temperature not in (0, 1):
        logits = logits / temperature
    logprobs = torch.log_softmax(logits, -1)  # (B, T, V)
    logp = logprobs.gather(-1, targets[..., None]).squeeze(-1)  # (B, T)
    ent = None
    if entropy:
        with torch.no_grad():
            ent = -(logprobs.exp() * logprobs).sum(-1) * mask  # (B, T)
    return LogProbs(logp * mask, out.hidden_states[-1][:, -T - 1:-1] if hidden else None, ent)


def _packed(model, mb: Rollout, temperature: float, *, hidden: bool, entropy: bool) -> LogProbs:
    """One packed row: the real tokens of every sequence end to end, positions restarting."""
    backbone, head = fused_head(model)
    h, comp, scatter = _packed_hidden(backbone, mb)  # (N, H) at the positions predicting completion tokens
    targets = mb.completion_ids[comp]  # (N,)
    logp, ent = chunked_logprobs(h, head.weight, targets, temperature, entropy=True) if entropy else \
        (chunked_logprobs(h, head.weight, targets, temperature), None)
    mask = mb.completion_mask  # (b, T)
    return LogProbs(scatter(logp) * mask, scatter(h) if hidden else None,
                    None if ent is None else scatter(ent) * mask)


def _packed_hidden(backbone, mb: Rollout):
    """The backbone over one packed row; returns the hidden states (N, H) at the positions
    that predict the N completion tokens, their (b, T) mask, and `scatter`, which lays an
    (N, ...) tensor out as (b, T, ...) with zeros elsewhere."""
    b, P = mb.prompt_ids.shape
    T = mb.completion_ids.shape[1]
    comp = torch.arange(T, device=mb.lengths.device)[None] < mb.lengths[:, None]  # (b, T) sampled tokens
    real = torch.cat([mb.prompt_mask.bool(), comp], 1)  # (b, P+T) real tokens
    ids = mb.input_ids[real]  # (L,) row after row, each in sequence order
    pos = (real.long().cumsum(1) - 1)[real]  # (L,) positions restart per sequence
    where = torch.full(real.shape, -1, dtype=torch.long, device=real.device)  # (b, P+T) packed index
    where[real] = torch.arange(ids.shape[0], device=real.device)
    src = where[:, P:][comp] - 1  # (N,) the position that predicts each completion token (prompts are non-empty)
    dst = comp.reshape(-1).nonzero().squeeze(-1)  # (N,) its place in (b, T)
    h = backbone(input_ids=ids[None], position_ids=pos[None], attention_mask=None,
                 use_cache=False).last_hidden_state[0, src]  # (N, H)

    def scatter(flat: Tensor) -> Tensor:  # (N, ...) -> (b, T, ...), zeros elsewhere
        out = flat.new_zeros((b * T, *flat.shape[1:]))
        return out.index_copy(0, dst, flat).view(b, T, *flat.shape[1:])

    return h, comp, scatter


def completion_hidden(backbone, mb: Rollout, packed: bool = False) -> Tensor:
    """The backbone's final hidden states at the positions that predict each completion token:
    (b, T, H), zeros at padding when packed (a critic's trunk reads values there)."""
    if packed:
        h, _, scatter = _packed_hidden(backbone, mb)
        return scatter(h)
    T = mb.completion_ids.shape[1]
    pos = position_ids_from_mask(mb.attention_mask)  # (b, P+T)
    return backbone(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=pos,
                    use_cache=False).last_hidden_state[:, -T - 1:-1]  # (b, T, H)


_PACKING: dict[int, bool] = {}


@torch.no_grad()
def supports_packing(model) -> bool:
    """Whether a packed forward of `model` gives the padded forward's hidden states (to 1e-4,
    in the model's dtype tolerance): checked once per model on two short sequences. Call it
    on the unsharded model: under FSDP the head is a DTensor shard and the answer would be no."""
    key = id(model)
    if key not in _PACKING:
        fused = fused_head(model)
        if fused is None:
            _PACKING[key] = False
            return False
        backbone = fused[0]
        device = next(model.parameters()).device
        a, b = torch.tensor([[3, 4, 5, 6]], device=device), torch.tensor([[7, 8, 9]], device=device)
        ref = [backbone(input_ids=x, use_cache=False).last_hidden_state[0] for x in (a, b)]
        pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2]], device=device)
        out = backbone(input_ids=torch.cat([a, b], 1), position_ids=pos, attention_mask=None,
                       use_cache=False).last_hidden_state[0]
        tol = 1e-4 if out.dtype == torch.float32 else 5e-2
        _PACKING[key] = bool(torch.allclose(out, torch.cat(ref), atol=tol, rtol=tol))
    return _PACKING[key]


def micro_batches(ro: Rollout, idx: Tensor, budget: int, packed: bool = False) -> list[Tensor]:
    """Split rows `idx` into groups whose forward stays within `budget` tokens (padded: rows ×
    (longest prompt + longest completion) of the group; packed: their real tokens). Rows are
    taken shortest first, so that rows of similar length share a group; a row longer than the
    budget forms a group of its own. budget <= 0: one group, in the given order."""
    if budget <= 0 or len(idx) <= 1:
        return [idx]
    p = ro.prompt_mask[idx].sum(1).tolist()
    c = ro.lengths[idx].tolist()
    order = sorted(range(len(idx)), key=lambda i: (p[i] + c[i], i))
    groups, cur, max_p, max_c, total = [], [], 0, 0, 0
    for i in order:
        mp, mc, tot = max(max_p, p[i]), max(max_c, c[i]), total + p[i] + c[i]
        size = tot if packed else (len(cur) + 1) * (mp + mc)
        if cur and size > budget:
            groups.append(cur)
            cur, mp, mc, tot = [], p[i], c[i], p[i] + c[i]
        cur.append(i)
        max_p, max_c, total = mp, mc, tot
    groups.append(cur)
    return [idx[torch.tensor(g, dtype=torch.long)] for g in groups]


def trim(mb: Rollout) -> tuple[Rollout, slice, slice]:
    """Drop the padding columns no row of `mb` uses; returns the rollout and the prompt and
    completion column slices it kept (to slice other (b, P) / (b, T) tensors alike)."""
    P, T = mb.prompt_ids.shape[1], mb.completion_ids.shape[1]
    keep_p = int(mb.prompt_mask.sum(1).max()) if mb.prompt_mask.numel() else P
    keep_t = max(1, int(mb.lengths.max())) if mb.lengths.numel() else T
    ps, ts = slice(P - keep_p, P), slice(0, keep_t)
    routing = None if mb.routing is None else torch.cat([mb.routing[:, ps], mb.routing[:, P:][:, ts]], 1)
    out = dataclasses.replace(mb, prompt_ids=mb.prompt_ids[:, ps], prompt_mask=mb.prompt_mask[:, ps],
                              completion_ids=mb.completion_ids[:, ts], completion_mask=mb.completion_mask[:, ts],
                              logp=mb.logp[:, ts], routing=routing,
                              env_mask=None if mb.env_mask is None else mb.env_mask[:, ts])
    return out, ps, ts


@dataclass(frozen=True)
class Split:
    """How a pass splits rows into micro-batches: within `budget` tokens (padded, or real tokens
    when `packed`), or, budget 0, into chunks of `rows` rows (0: all at once)."""

    budget: int = 0
    rows: int = 0
    packed: bool = False

    def groups(self, ro: Rollout, idx: Tensor) -> list[Tensor]:
        """Rows `idx` in groups (`micro_batches`; budget 0: chunks of `rows`, in order)."""
        if self.budget > 0 or len(idx) == 0:
            return micro_batches(ro, idx, self.budget, self.packed)
        return list(idx.split(self.rows or len(idx)))


@dataclass
class MicroBatch:
    """One forward pass's rows: `idx` of the rollout, the rollout cut to them (and, within a
    token budget, trimmed to the columns they use: prompt columns `ps`, completion columns
    `ts`), and `live`, 0.0 for a zero-weight stand-in (an empty group runs row 0)."""

    idx: Tensor
    rollout: Rollout
    ps: slice
    ts: slice
    live: float = 1.0


def passes(ro: Rollout, groups: list[Tensor], budget: int):
    """The micro-batches of row `groups` (from `Split.groups`), in order: what every pass runs
    (old-policy, reference and critic passes, and the updates' forward and backward)."""
    P, T = ro.prompt_ids.shape[1], ro.completion_ids.shape[1]
    for idx in groups:
        live = 1.0 if len(idx) else 0.0
        idx = idx if len(idx) else torch.zeros(1, dtype=torch.long)  # a zero-weight stand-in row
        mb, ps, ts = trim(ro.select(idx)) if budget > 0 else (ro.select(idx), slice(0, P), slice(0, T))
        yield MicroBatch(idx, mb, ps, ts, live)


@torch.no_grad()
def token_logprobs(model, ro: Rollout, *, temperature: float, split: Split = Split(),
                   routing=NO_ROUTING) -> tuple[Tensor, Tensor | None]:
    """log π of every sampled token under `model`, without gradient, in eval mode: (B, T),
    in the micro-batches of `split`. With `routing` (an MoE model's gspo.models.moe.Routing), also
    the experts every token used, (B, P+T, L, k), -1 where not fed (None: a dense model)."""
    B, P = ro.prompt_ids.shape
    T = ro.completion_ids.shape[1]
    was_training = model.training
    model.eval()
    logp = experts = None
    for m in passes(ro, split.groups(ro, torch.arange(B)), split.budget):
        with routing.capture() as cap:
            out = forward_logprobs(model, m.rollout, temperature=temperature, packed=split.packed and not routing.moe)
        if logp is None:
            logp = out.logp.new_zeros((B, T))  # (B, T) in the log-probs' dtype (float32, float64)
        logp[m.idx, m.ts] = out.logp
        experts = _place_experts(experts, cap.indices(*m.rollout.input_ids.shape), m, (B, P, T))
    model.train(was_training)
    return logp, experts


def _place_experts(experts: Tensor | None, got: Tensor | None, m: MicroBatch, shape: tuple) -> Tensor | None:
    """The experts a micro-batch used, `got` (b, p+t, L, k) (None: nothing recorded), put into
    `experts` (B, P+T, L, k), made on the first call."""
    if got is None:
        return experts
    B, P, T = shape
    if experts is None:
        experts = torch.full((B, P + T, *got.shape[2:]), -1, dtype=got.dtype, device=got.device)
    ps, ts = m.ps, m.ts
    experts[m.idx, ps] = got[:, : ps.stop - ps.start]
    experts[m.idx, P + ts.start:P + ts.stop] = got[:, ps.stop - ps.start:]
    return experts


class TokenLogprobs(torch.nn.Module):
    """A policy whose forward is `forward_logprobs`: what DDP wraps and FSDP shards as its root,
    so that the chunked LM head runs inside the wrapper's forward (DDP sees every gradient,
    FSDP holds the head's full weight there). Returns (logp, hidden, entropy)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, mb: Rollout, *, temperature: float, packed: bool = False, hidden: bool = False,
                entropy: bool = False):
        out = forward_logprobs(self.model, mb, temperature=temperature, packed=packed, hidden=hidden,
                               entropy=entropy)
        return out.logp, out.hidden, out.entropy
