"""Rollouts: who samples (the `Sampler` interface) and our own sampler.

    from gspo.sampling.rollout import PolicySampler, sampling_params
    params = sampling_params(tokenizer, group_size=8, max_new_tokens=8, temperature=1.0)
    ro = PolicySampler(model).sample(prompt_ids, params, generator=g)   # a Rollout
    # ro.logp (B, T) equals gspo.models.logprobs.completion_logprobs(model, ...) in fp32

A `Sampler` turns prompts (token id lists) into a `Rollout` of G completions per prompt, with
the log-prob of every sampled token recorded, and loads the policy's current weights before
each rollout (`sync`). `PolicySampler` is gspo's own (the policy itself, or a copy in
another precision); inference engines implement the same two methods.

The layout of a Rollout (left-padded prompts, right-padded completions, groups contiguous,
positions that count real tokens only) is gspo.models.sequences'.

Log-probs are those of the temperature-scaled distribution, log softmax(logits / τ), recorded
while sampling; top-p truncation changes which tokens can be drawn but not the recorded
log-prob (as in TRL and verl), so recorded and recomputed log-probs agree.

The sampling loop (`generate`) prefills each distinct prompt once and shares its KV cache
across the G samples of its group, computes logits only for the last position, decodes
Llama-family models with a compact step (gspo.sampling.fastdecode), samples by inverse CDF, and runs
under `torch.inference_mode` (the returned tensors are ordinary ones). `PolicySampler` keeps
each row's KV cache from one `sample` to the next until `end_rollout`, so a later turn of
multi-turn episodes feeds only the tokens its cache lacks (gspo.sampling.turncache; `keep_cache=False`:
every turn prefilled whole), with the same tokens and log-probs.

Left out: beam search.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Protocol

import torch

from gspo.models.moe import NO_ROUTING
from gspo.models.sequences import Rollout, left_pad, position_ids_from_mask
from gspo.processes import parallel
from gspo.sampling.fastdecode import decoder, describe
from gspo.sampling.hfdecode import DecodeError, why_inexact
from gspo.sampling.turncache import Start, TurnCache

Tensor = torch.Tensor


@dataclass(frozen=True)
class SamplingParams:
    """How completions are sampled; every engine takes the same parameters."""

    group_size: int  # G completions per prompt
    max_new_tokens: int
    stop_token_ids: tuple[int, ...]  # any of them ends a completion (and is part of it)
    pad_token_id: int
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_new_tokens: int = 0  # no stop token before this many tokens
    cuda_graphs: bool = True  # gspo's own sampler on a CUDA device: decode in CUDA graphs where the model allows it


def stop_token_ids(tokenizer, model=None, extra: tuple[str, ...] = ()) -> tuple[int, ...]:
    """The tokens that end a completion, for rollouts and evaluation alike: the tokenizer's EOS,
    the model's `generation_config.eos_token_id` (an id or a list: a chat model closes its turns
    with a token of its own, e.g. Qwen2.5's `<|im_end|>` beside the base `<|endoftext|>`), and
    `extra` token strings (`--stop-token`), each of which must be one token of the vocabulary."""
    ids = [tokenizer.eos_token_id]
    gen = getattr(model.get_base_model() if hasattr(model, "get_base_model") else model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    ids += list(eos) if isinstance(eos, (list, tuple)) else [eos]
    for token in extra:
        found = tokenizer.convert_tokens_to_ids(token)
        if found is None or (found == tokenizer.unk_token_id and token != tokenizer.unk_token):
            raise ValueError(f"stop_token: {token!r} is not a token of the tokenizer's vocabulary")
        ids.append(found)
    return tuple(dict.fromkeys(i for i in ids if i is not None))


def sampling_params(tokenizer, *, stop: tuple[int, ...] | None = None, **kw) -> SamplingParams:
    """SamplingParams with the tokenizer's padding token and the stop set (default: the
    tokenizer's own stop tokens, `stop_token_ids(tokenizer)`)."""
    return SamplingParams(stop_token_ids=stop or stop_token_ids(tokenizer), pad_token_id=tokenizer.pad_token_id, **kw)


class Sampler(Protocol):
    """A rollout engine: gspo's own `PolicySampler`, or an inference engine (vLLM)."""

    def sync(self, policy, version: int | None = None) -> None:
        """Load the policy's current weights, so the next rollout samples from it. `version`: the
        policy version they are (the steps done; None: unknown). vLLM's servers push only a
        version they do not hold yet; the in-process samplers load every time, and ignore it."""

    def sample(self, prompts: list[list[int]], params: SamplingParams, *, generator: torch.Generator | None = None,
               rows: tuple[int, int] | None = None) -> Rollout:
        """G completions per prompt (see `generate` for `generator` and `rows`); may be called
        several times per rollout (once per turn of multi-turn episodes)."""

    def end_rollout(self) -> None:
        """The rollout's last `sample` is done (an engine may sleep until the next `sync`)."""


class PolicySampler:
    """gspo's own sampler: the policy itself, or a copy of it in another precision (an inference
    engine's, `--rollout-dtype`) whose weights are copied from the policy before every rollout.

    routing: a gspo.models.moe.Routing on `model` that records the experts used while sampling.
    dist: under FSDP `model` is the sharded policy itself (never a copy: that would be a full
    model per process), its parameters gathered for the rollout, those of `root` (the FSDP root
    that holds `model`; default `model` itself), in the root's MixedPrecisionPolicy dtype: the
    compute --dtype, as a copy in it would sample.
    keep_cache: keep each row's KV cache from one `sample` to the next, so that a later turn of
    multi-turn episodes feeds only its new tokens (gspo.sampling.turncache); `end_rollout` and `sync` drop
    it. False: every `sample` prefills its prompts whole.
    strict: refuse (DecodeError, one line) a `sample` whose rollouts no decoder can sample as the training
    forward computes them (gspo.sampling.hfdecode.why_inexact: rotary scaling chosen by the sequence's
    length, past its threshold); a training run's sampler is strict, an evaluation's is not.
    """

    def __init__(self, model, *, routing=NO_ROUTING, dist=None, root=None, keep_cache: bool = True,
                 strict: bool = False):
        self.model, self.routing, self.dist, self.root = model, routing, dist, root
        self.turns = TurnCache() if keep_cache else None
        self.strict = strict

    def end_rollout(self) -> None:
        """The rollout is over: the KV cache kept for its next turn is dropped (the sampler itself
        is the policy, or a copy kept between rollouts)."""
        if self.turns is not None:
            self.turns.drop()

    def sync(self, policy, version: int | None = None) -> None:
        self.end_rollout()
        if self.model is not policy:
            with torch.no_grad():
                for dst, src in zip(self.model.parameters(), policy.parameters()):
                    dst.copy_(src)

    def sample(self, prompts, params, *, generator=None, rows=None) -> Rollout:
        if self.strict and (why := why_inexact(self.model, max(map(len, prompts)) + params.max_new_tokens)):
            raise DecodeError(f"decode: {why}")
        turns = self.turns.begin(self.model) if self.turns is not None else None  # (FSDP: the sharded weights)
        with (parallel.gathered(self.root or self.model, self.dist) if self.dist is not None
              else contextlib.nullcontext()):
            return _sample(self.model, prompts, params, (generator, rows), self.routing, turns)


def fsdp_sampling_note(model, dtype: torch.dtype, max_len: int, cuda_graphs: bool = True) -> str:
    """What a run says at its start under FSDP: how it samples and what that costs. `model`: the
    policy before sharding (the decode path is read from its plain parameters)."""
    size = dtype.itemsize * sum(p.numel() for p in model.parameters())  # tied weights count once
    size_text = f"{size / 2**30:.1f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"
    return (f"parallel: fsdp samples with the sharded policy itself: each rollout gathers all its parameters on "
            f"every process in {str(dtype).removeprefix('torch.')} ({size_text}, freed when the rollout ends; no "
            f"copy is kept between rollouts) and decodes with {describe(model, max_len, cuda_graphs=cuda_graphs)}")


def encode_prompts(tokenizer, prompts: list, max_length: int = 0, tools: list | None = None) -> list[list[int]]:
    """Token ids of prompts: plain text as is, chat messages through the chat template (with
    the environment's `tools` schemas, if any); with `max_length`, a longer prompt keeps its
    last max_length tokens (TRL truncates so too)."""
    out = []
    kw = {"tools": tools} if tools else {}
    for prompt in prompts:
        if isinstance(prompt, list):
            text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False, **kw)
            out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
        else:
            out.append(tokenizer(prompt)["input_ids"])
    return [ids[-max_length:] for ids in out] if max_length > 0 else out


def cut_at_stop_strings(ro: Rollout, tokenizer, strings: tuple[str, ...]) -> Rollout:
    """End each completion at the token that completes the first occurrence of any of
    `strings` in its text: the tokens after it are dropped (padding, mask 0, log-prob 0) and
    the row counts as ended, not truncated. The sampler may have run past the string."""
    if not strings:
        return ro
    for b in range(ro.completion_ids.shape[0]):
        n = int(ro.lengths[b])
        pieces = tokenizer.batch_decode([[t] for t in ro.completion_ids[b, :n].tolist()])  # one text per token
        ends, text = [], ""
        for piece in pieces:
            text += piece
            ends.append(len(text))  # characters up to and including token j
        hits = [text.find(s) + len(s) for s in strings if s in text]
        if hits:
            ro.lengths[b] = next(j for j, e in enumerate(ends) if e >= min(hits)) + 1
            ro.truncated[b] = False
    keep = torch.arange(ro.completion_ids.shape[1], device=ro.lengths.device)[None] < ro.lengths[:, None]  # (B, T)
    ro.completion_ids = ro.completion_ids.masked_fill(~keep, tokenizer.pad_token_id)
    ro.completion_mask = ro.completion_mask * keep
    ro.logp = ro.logp * keep
    return ro


def decode_completions(tokenizer, ro: Rollout) -> tuple[list[str], list[list[int]]]:
    """Completion texts (special tokens dropped) and token ids (padding dropped, stop token kept)."""
    ids = [row[: int(n)].tolist() for row, n in zip(ro.completion_ids, ro.lengths)]
    return tokenizer.batch_decode(ro.completion_ids, skip_special_tokens=True), ids


def sample_token(logits: Tensor, temperature: float, top_p: float, uniforms: Tensor | None, *,
                 banned: tuple[int, ...] | None = None, top_k: int = 0) -> tuple[Tensor, Tensor]:
    """Draw one token per row from `logits` (B, V); returns (tokens (B,), log-probs (B,)).

    Sampling is by inverse CDF: one uniform u per row, and the token is the first whose
    cumulative probability exceeds u (the exact categorical distribution). It costs a cumsum
    over the vocabulary instead of torch.multinomial's one exponential draw per vocabulary
    entry (which was as slow as the model's own decode step), and one number per row is what
    makes sampling independent of how rows are split across processes (`uniforms`, (B,) in
    [0, 1), drawn by the caller: `generate` draws them from the step's generator by global row).

    temperature == 0 means greedy (`uniforms` unused: None); the returned log-prob is then that
    of τ = 1. `banned`: token ids that cannot be drawn (stop tokens before min_new_tokens); like
    top-p and top-k (only the k most likely tokens), they change what can be drawn, not the
    recorded log-prob.
    """
    logits = logits.float()  # (B, V)
    scaled = logits if temperature in (0, 1) else logits / temperature  # (B, V)
    if temperature == 0:
        logprobs = torch.log_softmax(scaled, -1)  # (B, V)
        masked = logits if banned is None else logits.index_fill(-1, torch.tensor(banned, device=logits.device),
                                                                  float("-inf"))
        tokens = masked.argmax(-1)  # (B,)
        return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)
    # one exp pass serves both: e = exp(z - max), the cumulative sum's last entry is the
    # normaliser, and log p(token) = z - max - log(sum e) is log_softmax without a pass of its own
    top = scaled.amax(-1, keepdim=True)  # (B, 1)
    e = (scaled - top).exp_()  # (B, V) unnormalised probabilities
    if banned is None and top_p >= 1.0 and not 0 < top_k < e.shape[-1]:
        cdf = e.cumsum(-1)  # (B, V)
        log_total = cdf[:, -1:].log()  # (B, 1)
    else:
        log_total = e.sum(-1, keepdim=True).log()  # (B, 1) of the full distribution: the recorded log-prob
        if banned is not None:
            e[:, list(banned)] = 0.0
        if 0 < top_k < e.shape[-1]:
            kth = e.topk(top_k, -1).values[:, -1:]  # (B, 1) the k-th largest mass
            e = e.masked_fill(e < kth, 0.0)
        if top_p < 1.0:
            sorted_e, order = e.sort(-1, descending=True)  # (B, V)
            mass = sorted_e.cumsum(-1)  # (B, V)
            # drop a token once the mass before it already reaches top_p (the first always stays)
            drop = (mass - sorted_e) >= top_p * mass[:, -1:]  # (B, V) of what top-k and bans left
            e = torch.zeros_like(e).scatter_(-1, order, sorted_e.masked_fill(drop, 0.0))  # (B, V)
        cdf = e.cumsum(-1)  # (B, V) non-decreasing; zero-mass tokens can never be drawn
    target = uniforms.to(cdf.device, cdf.dtype)[:, None] * cdf[:, -1:]  # (B, 1) u · remaining mass
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=e.shape[-1] - 1)  # (B,)
    logp = scaled.gather(-1, tokens[:, None]).squeeze(-1) - top.squeeze(-1) - log_total.squeeze(-1)  # (B,)
    return tokens, logp


def generate(model, prompts: list[list[int]], params: SamplingParams, *, generator: torch.Generator | None = None,
             routing=NO_ROUTING, rows: tuple[int, int] | None = None) -> Rollout:
    """Sample `params.group_size` completions for each prompt (token id lists) with a KV cache.

    generator: a CPU generator; each decode step draws one uniform per row from it.
    rows: (offset, total): these rows are rows offset... of a batch of `total` rows split
    across processes; every process draws all `total` uniforms each step and uses its own,
    so a row's tokens do not depend on how the batch is split (nor on the device).
    (indices, total): these rows are rows `indices` (a (B,) long tensor) of the `total` (the
    episodes still running in a multi-turn rollout, gspo.sampling.episodes).
    params.min_new_tokens: no stop token can be drawn before this many tokens (min = max gives
    every completion the same length, as benchmarks need).
    routing: a gspo.models.moe.Routing on `model`: record the experts every token used while
    sampling into `Rollout.routing` (for Routing Replay with sampling-time log-probs); NO_ROUTING: none.
    """
    return _sample(model, prompts, params, (generator, rows), routing)


def _sample(model, prompts: list[list[int]], params: SamplingParams, draws: tuple, routing=NO_ROUTING,
            turns=None) -> Rollout:
    """`generate` with draws = (generator, rows); with `turns` (a PolicySampler's
    gspo.sampling.turncache.TurnCache) a later turn may go on from the rows' kept KV caches, and then
    its routing is not assembled (`Rollout.routing` None: episodes drop it anyway)."""
    with routing.capture() as cap, torch.inference_mode():  # a dense model's (NO_ROUTING) records nothing
        ro, resumed = _generate(model, prompts, params, draws, turns)
        if routing.moe and not resumed:
            ro.routing = _assemble_routing(cap, ro, len(prompts))
    # ordinary tensors from here on: inference tensors cannot take part in autograd later
    # (old log-probs and replayed expert ids meet the training graph)
    return ro.map(Tensor.clone)


def _assemble_routing(cap, ro: Rollout, n_prompts: int) -> Tensor:
    """Per-call captures -> (B, P+T, L, k): the prefill gives the prompt columns (shared by a
    group), decode step j the column of the token it fed; the last token is never fed (-1)."""
    B, P = ro.prompt_ids.shape
    T = ro.completion_ids.shape[1]
    prefill = cap.call_indices(0)  # (N·P, L, k)
    L, k = prefill.shape[-2:]
    out = torch.full((B, P + T, L, k), -1, dtype=prefill.dtype, device=prefill.device)
    out[:, :P] = prefill.view(n_prompts, P, L, k).repeat_interleave(ro.group_size, 0)
    for j in range(1, T):  # decode call j fed completion token j-1
        out[:, P + j - 1] = cap.call_indices(j)
    return out


def _generate(model, prompts: list[list[int]], params: SamplingParams, draws: tuple,
              turns=None) -> tuple[Rollout, bool]:
    """The rollout, and whether it went on from kept KV caches (`turns.resume`) rather than a prefill."""
    generator, rows = draws
    was_training = model.training
    model.eval()
    start = turns.resume(prompts, params, rows) if turns is not None else None
    resumed = start is not None
    start = start or _prefill(model, prompts, params, turns is not None)
    tokens, logp, lengths, done = _decode(start, params, generator, rows)
    model.train(was_training)
    n_steps = tokens.shape[1]
    completion_mask = (torch.arange(n_steps, device=tokens.device)[None, :] < lengths[:, None]).float()  # (B, T)
    ro = Rollout(start.prompt_ids, start.prompt_mask, tokens, completion_mask, logp, lengths, ~done, params.group_size)
    if turns is not None:
        turns.keep(start, tokens, lengths, rows)
    return ro, resumed


def _prefill(model, prompts: list[list[int]], params: SamplingParams, keep: bool) -> Start:
    """Prefill each distinct prompt once and share its KV cache with its G samples; `keep`: note
    the tokens each row fed (for gspo.sampling.turncache)."""
    device = next(model.parameters()).device
    G = params.group_size
    prompt_ids, prompt_mask = left_pad(prompts, params.pad_token_id, device)  # (N, P)
    dec = decoder(model, prompt_ids.shape[1] + params.max_new_tokens, cuda_graphs=params.cuda_graphs)
    pos = position_ids_from_mask(prompt_mask)  # (N, P)
    logits = dec.prefill(prompt_ids, prompt_mask, pos)  # (N, V)
    dec.expand(G)  # one prefill per prompt, shared by its G samples
    fed = [list(prompts[b // G]) for b in range(len(prompts) * G)] if keep else None
    prompt_mask = prompt_mask.repeat_interleave(G, 0)  # (B, P)
    return Start(dec, logits.repeat_interleave(G, 0), prompt_mask, pos[:, -1].repeat_interleave(G, 0) + 1,
                 prompt_ids.repeat_interleave(G, 0), prompt_mask, fed)


def _decode(start: Start, params: SamplingParams, generator: torch.Generator | None,
            rows: tuple | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The decode loop from `start`: tokens (B, T), log-probs (B, T), lengths (B,), done (B,)."""
    dec, logits, next_pos = start.dec, start.logits, start.next_pos
    B, W = start.attn.shape  # W: the cache's columns before the first decode step
    max_new_tokens, pad_token_id, device = params.max_new_tokens, params.pad_token_id, logits.device
    stop = torch.tensor(params.stop_token_ids, device=device)  # (S,)
    tokens = torch.full((B, max_new_tokens), pad_token_id, dtype=torch.long, device=device)  # (B, T)
    logp = torch.zeros((B, max_new_tokens), dtype=torch.float32, device=device)  # (B, T)
    done = torch.zeros(B, dtype=torch.bool, device=device)  # (B,)
    lengths = torch.zeros(B, dtype=torch.long, device=device)  # (B,)
    attn = torch.cat([start.attn, torch.ones((B, max_new_tokens), dtype=start.attn.dtype, device=device)], 1)
    offset, total = rows or (0, B)
    mine = slice(offset, offset + B) if isinstance(offset, int) else offset  # this call's rows of the `total`
    n_steps = 0
    for t in range(max_new_tokens):
        banned = params.stop_token_ids if t < params.min_new_tokens else None
        u = None if params.temperature == 0 else torch.rand(total, generator=generator)[mine]  # (B,) CPU
        tok, lp = sample_token(logits, params.temperature, params.top_p, u, banned=banned,
                               top_k=params.top_k)  # (B,), (B,)
        tok = tok.masked_fill(done, pad_token_id)
        tokens[:, t] = tok
        logp[:, t] = lp.masked_fill(done, 0.0)
        lengths += (~done).long()
        done |= torch.isin(tok, stop)
        n_steps = t + 1
        if bool(done.all()) or t == max_new_tokens - 1:
            break
        logits = dec.step(tok, attn[:, :W + t + 1], next_pos)  # (B, V)
        next_pos = next_pos + 1
    return tokens[:, :n_steps], logp[:, :n_steps], lengths, done
