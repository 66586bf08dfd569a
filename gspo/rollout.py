"""Sampling groups of completions with their log-probs, and recomputing those log-probs.

    from gspo.rollout import generate, completion_logprobs
    ro = generate(model, prompt_ids, group_size=8, max_new_tokens=8, temperature=1.0,
                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, generator=g)
    logp = completion_logprobs(model, ro.input_ids, ro.attention_mask, ro.completion_mask,
                               temperature=1.0)   # (B, T), equals ro.logp in fp32

Layout. Prompts are left-padded to a common width P and completions right-padded to T, so
every completion starts at column P; row b holds prompt b // G (groups are contiguous).
Position ids count real tokens only (cumsum of the attention mask), in sampling and in
training alike, so a padded row computes exactly what it would alone.

Log-probs are those of the temperature-scaled distribution, log softmax(logits / τ), recorded
while sampling; top-p truncation changes which tokens can be drawn but not the recorded
log-prob (as in TRL and verl), so recorded and recomputed log-probs agree.

The sampling loop prefills each distinct prompt once and shares its KV cache across the G
samples of its group, computes logits only for the last position, decodes Llama-family
models with a compact step (gspo.fastdecode), samples by inverse CDF, and runs under
`torch.inference_mode` (the returned tensors are ordinary ones).

Left out: vLLM and other inference engines; beam search.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from gspo.fastdecode import decoder
from gspo.lmhead import chunked_logprobs, fused_head

Tensor = torch.Tensor


@dataclass
class Rollout:
    """G completions for each of N prompts, B = N·G rows, groups contiguous."""

    prompt_ids: Tensor  # (B, P) left-padded prompt tokens
    prompt_mask: Tensor  # (B, P) 1 on real prompt tokens
    completion_ids: Tensor  # (B, T) right-padded sampled tokens (pad after EOS)
    completion_mask: Tensor  # (B, T) 1.0 on completion tokens, EOS included
    logp: Tensor  # (B, T) log-prob of each sampled token at sampling time; 0 on padding
    lengths: Tensor  # (B,) completion lengths (number of ones in completion_mask)
    truncated: Tensor  # (B,) bool: stopped by max_new_tokens before an EOS
    group_size: int
    routing: Tensor | None = None  # (B, P+T, L, k) int16 MoE experts used while sampling; -1 = not fed

    @property
    def input_ids(self) -> Tensor:
        return torch.cat([self.prompt_ids, self.completion_ids], 1)  # (B, P+T)

    @property
    def attention_mask(self) -> Tensor:
        return torch.cat([self.prompt_mask, self.completion_mask.to(self.prompt_mask.dtype)], 1)  # (B, P+T)

    def select(self, idx: Tensor) -> "Rollout":
        """Rows `idx` (for minibatches); the group layout no longer holds for the result."""
        return Rollout(
            self.prompt_ids[idx], self.prompt_mask[idx], self.completion_ids[idx], self.completion_mask[idx],
            self.logp[idx], self.lengths[idx], self.truncated[idx], self.group_size,
            None if self.routing is None else self.routing[idx],
        )


def left_pad(seqs: list[list[int]], pad_id: int, device=None) -> tuple[Tensor, Tensor]:
    """Left-pad token lists to one width: (ids (N, P), mask (N, P))."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s):] = 1
    return ids.to(device), mask.to(device)


def position_ids_from_mask(mask: Tensor) -> Tensor:
    """Positions that count real tokens only: (B, L) attention mask -> (B, L) positions."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def sample_token(logits: Tensor, temperature: float, top_p: float, generator: torch.Generator | None,
                 banned: int | None = None, uniforms: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Draw one token per row from `logits` (B, V); returns (tokens (B,), log-probs (B,)).

    Sampling is by inverse CDF: one uniform u per row, and the token is the first whose
    cumulative probability exceeds u (the exact categorical distribution). It costs a cumsum
    over the vocabulary instead of torch.multinomial's one exponential draw per vocabulary
    entry (which was as slow as the model's own decode step), and one number per row is what
    makes sampling independent of how rows are split across processes (`uniforms`, (B,),
    supplied by the caller, else drawn from `generator`).

    temperature == 0 means greedy; the returned log-prob is then that of τ = 1. `banned` is a
    token id that cannot be drawn (EOS before min_new_tokens); like top-p, it changes what can
    be drawn, not the recorded log-prob.
    """
    logits = logits.float()  # (B, V)
    scaled = logits if temperature in (0, 1) else logits / temperature  # (B, V)
    if temperature == 0:
        logprobs = torch.log_softmax(scaled, -1)  # (B, V)
        masked = logits if banned is None else logits.index_fill(-1, torch.tensor([banned], device=logits.device),
                                                                  float("-inf"))
        tokens = masked.argmax(-1)  # (B,)
        return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)
    # one exp pass serves both: e = exp(z - max), the cumulative sum's last entry is the
    # normaliser, and log p(token) = z - max - log(sum e) is log_softmax without a pass of its own
    top = scaled.amax(-1, keepdim=True)  # (B, 1)
    e = (scaled - top).exp_()  # (B, V) unnormalised probabilities
    if banned is None and top_p >= 1.0:
        cdf = e.cumsum(-1)  # (B, V)
        log_total = cdf[:, -1:].log()  # (B, 1)
    else:
        log_total = e.sum(-1, keepdim=True).log()  # (B, 1) of the full distribution: the recorded log-prob
        if banned is not None:
            e[:, banned] = 0.0
        if top_p < 1.0:
            sorted_e, order = e.sort(-1, descending=True)  # (B, V)
            mass = sorted_e.cumsum(-1)  # (B, V)
            # drop a token once the mass before it already reaches top_p (the first always stays)
            drop = (mass - sorted_e) >= top_p * log_total.exp()  # (B, V)
            e = torch.zeros_like(e).scatter_(-1, order, sorted_e.masked_fill(drop, 0.0))  # (B, V)
        cdf = e.cumsum(-1)  # (B, V) non-decreasing; zero-mass tokens can never be drawn
    if uniforms is None:
        uniforms = torch.rand(e.shape[0], generator=generator, device=e.device)
    target = uniforms.to(cdf.device, cdf.dtype)[:, None] * cdf[:, -1:]  # (B, 1) u · remaining mass
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=e.shape[-1] - 1)  # (B,)
    logp = scaled.gather(-1, tokens[:, None]).squeeze(-1) - top.squeeze(-1) - log_total.squeeze(-1)  # (B,)
    return tokens, logp


def generate(
    model,
    prompts: list[list[int]],
    *,
    group_size: int,
    max_new_tokens: int,
    eos_token_id: int,
    pad_token_id: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    min_new_tokens: int = 0,
    routing=None,
    rows: tuple[int, int] | None = None,
) -> Rollout:
    """Sample `group_size` completions for each prompt (token id lists) with a KV cache.

    generator: a CPU generator; each decode step draws one uniform per row from it.
    rows: (offset, total): these rows are rows offset... of a batch of `total` rows split
    across processes; every process draws all `total` uniforms each step and uses its own,
    so a row's tokens do not depend on how the batch is split (nor on the device).
    min_new_tokens: EOS cannot be drawn before this many tokens (min = max gives every
    completion the same length, as benchmarks need).
    routing: a gspo.moe.Routing on `model`: record the experts every token used while
    sampling into `Rollout.routing` (for Routing Replay with sampling-time log-probs).
    """
    ctx = routing.capture() if routing is not None else contextlib.nullcontext()
    with ctx as cap, torch.inference_mode():
        ro = _generate(model, prompts, group_size=group_size, max_new_tokens=max_new_tokens,
                       eos_token_id=eos_token_id, pad_token_id=pad_token_id, temperature=temperature, top_p=top_p,
                       generator=generator, min_new_tokens=min_new_tokens, rows=rows)
        if routing is not None:
            ro.routing = _assemble_routing(cap, ro, len(prompts))
    # ordinary tensors from here on: inference tensors cannot take part in autograd later
    # (old log-probs and replayed expert ids meet the training graph)
    for f in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "logp", "lengths", "truncated", "routing"):
        v = getattr(ro, f)
        if v is not None:
            setattr(ro, f, v.clone())
    return ro


def _assemble_routing(cap, ro: Rollout, n_prompts: int) -> Tensor:
    """Per-call captures -> (B, P+T, L, k): the prefill gives the prompt columns (shared by a
    group), decode step j the column of the token it fed; the last token is never fed (-1)."""
    B, P = ro.prompt_ids.shape
    T = ro.completion_ids.shape[1]
    prefill = cap.call_indices(0)  # (N·P, L, k)
    L, k = prefill.shape[-2:]
    out = torch.full((B, P + T, L, k), -1, dtype=torch.int16, device=prefill.device)
    out[:, :P] = prefill.view(n_prompts, P, L, k).repeat_interleave(ro.group_size, 0)
    for j in range(1, T):  # decode call j fed completion token j-1
        out[:, P + j - 1] = cap.call_indices(j)
    return out


def _generate(
    model,
    prompts: list[list[int]],
    *,
    group_size: int,
    max_new_tokens: int,
    eos_token_id: int,
    pad_token_id: int,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
    min_new_tokens: int,
    rows: tuple[int, int] | None,
) -> Rollout:
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    G = group_size
    prompt_ids, prompt_mask = left_pad(prompts, pad_token_id, device)  # (N, P)
    dec = decoder(model, prompt_ids.shape[1] + max_new_tokens)
    pos = position_ids_from_mask(prompt_mask)  # (N, P)
    logits = dec.prefill(prompt_ids, prompt_mask, pos)  # (N, V)
    dec.expand(G)  # one prefill per prompt, shared by its G samples
    logits = logits.repeat_interleave(G, 0)  # (B, V)
    prompt_ids = prompt_ids.repeat_interleave(G, 0)  # (B, P)
    prompt_mask = prompt_mask.repeat_interleave(G, 0)  # (B, P)
    next_pos = pos[:, -1].repeat_interleave(G, 0) + 1  # (B,)
    B, P = prompt_ids.shape

    tokens = torch.full((B, max_new_tokens), pad_token_id, dtype=torch.long, device=device)  # (B, T)
    logp = torch.zeros((B, max_new_tokens), dtype=torch.float32, device=device)  # (B, T)
    done = torch.zeros(B, dtype=torch.bool, device=device)  # (B,)
    lengths = torch.zeros(B, dtype=torch.long, device=device)  # (B,)
    attn = torch.cat([prompt_mask, torch.ones((B, max_new_tokens), dtype=prompt_mask.dtype, device=device)], 1)
    offset, total = rows or (0, B)
    n_steps = 0
    for t in range(max_new_tokens):
        banned = eos_token_id if t < min_new_tokens else None
        u = None if temperature == 0 else torch.rand(total, generator=generator)[offset:offset + B]  # (B,) CPU
        tok, lp = sample_token(logits, temperature, top_p, generator, banned, u)  # (B,), (B,)
        tok = tok.masked_fill(done, pad_token_id)
        tokens[:, t] = tok
        logp[:, t] = lp.masked_fill(done, 0.0)
        lengths += (~done).long()
        done |= tok == eos_token_id
        n_steps = t + 1
        if bool(done.all()) or t == max_new_tokens - 1:
            break
        logits = dec.step(tok, attn[:, :P + t + 1], next_pos)  # (B, V)
        next_pos = next_pos + 1

    model.train(was_training)
    tokens, logp = tokens[:, :n_steps], logp[:, :n_steps]  # (B, T)
    completion_mask = (torch.arange(n_steps, device=device)[None, :] < lengths[:, None]).float()  # (B, T)
    return Rollout(prompt_ids, prompt_mask, tokens, completion_mask, logp, lengths, ~done, G)


def completion_logprobs(model, input_ids: Tensor, attention_mask: Tensor, completion_mask: Tensor,
                        *, temperature: float = 1.0, return_hidden: bool = False):
    """log π(y_t | x, y_<t) / τ-scaled, for the last T columns of `input_ids`; (B, T).

    One forward pass over prompt + completion; the LM head runs only on the T positions that
    predict completion tokens, and (for a plain linear head, see gspo.lmhead) in chunks,
    without ever holding T × vocabulary logits. With `return_hidden`, also returns the final
    hidden state at those positions, (B, T, H) (for a shared value head).
    """
    B, T = completion_mask.shape
    pos = position_ids_from_mask(attention_mask)  # (B, P+T)
    targets = input_ids[:, -T:]  # (B, T)
    fused = fused_head(model)
    if fused is not None:
        backbone, head = fused
        hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos,
                          use_cache=False).last_hidden_state[:, -T - 1:-1]  # (B, T, H) position j predicts j+1
        logp = chunked_logprobs(hidden.reshape(B * T, -1), head.weight, targets.reshape(-1), temperature)
        logp = logp.view(B, T) * completion_mask  # (B, T)
        return (logp, hidden) if return_hidden else logp
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos, use_cache=False,
                logits_to_keep=T + 1, output_hidden_states=return_hidden)
    logits = out.logits[:, :-1].float()  # (B, T, V) position j predicts token j+1
    if temperature not in (0, 1):
        logits = logits / temperature
    logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)  # (B, T)
    if return_hidden:
        return logp * completion_mask, out.hidden_states[-1][:, -T - 1:-1]  # (B, T), (B, T, H)
    return logp * completion_mask
