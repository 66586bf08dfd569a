"""The run-time integrity check: every trained token is one a sampler drew, in the context it drew it in.

    receipts = Receipts()
    sampler = Recorded(run.sampler, receipts)     # every `sample` leaves a receipt of what it drew
    ...                                           # episodes, agents, the endpoint: rows laid out from those samples
    breaches = check_rows(rollout, receipts)      # [] when each trained row is what was drawn, where it was drawn
    tolerance("hf", "float32", "float32")         # Tolerance(row=1e-3, mean=1e-4): the first on-policy minibatch's

Why. Between a sampler and the loss sit layers that cut, join and re-lay tokens: multi-turn
episodes, an agent's calls through the endpoint (gspo.agents.endpoint), stop strings, token
budgets, refill rounds, rollout workers, checkpoints of batches sampled ahead. A bug in any of
them, or an agent or environment written elsewhere that none of them expected, can put a
sampled token in a context it was not sampled in. Nothing downstream notices: the loss is
computed, the run exits 0, and the policy learns from rows no policy produced. This check is
independent of those layers: the receipts are taken at the sampler's own interface, and the
rows are read as the loss reads them.

What is checked (`check_rows`), for each row with trained tokens (completion_mask 1): each
run of trained tokens, read left to right, must be one or more samples drawn with exactly the
row's tokens before it as their prompt (the prompt, then every completion column before the
run) — each whole, the last one possibly cut short (a stop string, a budget, a cap) — with the
log-probs the sampler returned for them. A row whose context was never sampled from, whose
tokens differ from every sample drawn in that context, or whose log-probs are not the
sampler's, is a breach naming the row, the column and the likely cause.

The second check is in the trainer (gspo.train.trainer.update): the first minibatch of a step
whose batch was sampled by the current weights (on-policy) is forwarded by the trainer before
any update; where the sampler runs in the training precision, |log π_train − log π_sampler| over
its trained tokens must stay within `tolerance`: each row's mean within `row`, and the
minibatch's mean within `mean` (measured: docs/agents.md, "Integrity"). In float32 both are
tight; in bfloat16 a row of a few tokens can differ by a tenth of a nat, so the row bound is
loose there and the minibatch's mean does the work. A breach there means the sampler drew from
other weights (a failed weight sync), another context, or another precision than the plan says.

Receipts hold, per prompt (keyed by the hash of its token ids), each completion drawn from it
and its log-probs: a batch's worth of token ids, kept with the batch (gspo.sampling.produce.Produced)
through rollout workers and checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gspo.models.sequences import Rollout


@dataclass(frozen=True)
class Tolerance:
    """The first on-policy minibatch's bounds on |log π_train − log π_sampler|: each row's mean
    over its trained tokens (`row`), and the minibatch's mean over its tokens (`mean`)."""

    row: float
    mean: float


# by (engine, dtype) where the sampler and the trainer compute in that dtype; measured (largest
# row, minibatch mean) in docs/agents.md, "Integrity"
TOLERANCES = {
    ("hf", "float32"): Tolerance(1e-3, 1e-4),
    ("vllm", "float32"): Tolerance(2e-2, 2e-3),
    ("hf", "tf32"): Tolerance(0.5, 0.05),  # float32 on CUDA with TensorFloat-32 matmuls allowed: as float16
    ("vllm", "tf32"): Tolerance(0.5, 0.05),
    ("hf", "bfloat16"): Tolerance(2.0, 0.25),
    ("vllm", "bfloat16"): Tolerance(2.0, 0.25),
    ("hf", "float16"): Tolerance(0.5, 0.05),
    ("vllm", "float16"): Tolerance(0.5, 0.05),
}
LOGP_ATOL = 1e-6  # a row's recorded log-prob and the sampler's: the same float32, copied


def tolerance(engine: str, sampler_dtype: str, train_dtype: str) -> Tolerance | None:
    """The first on-policy minibatch's tolerance (TOLERANCES) for a sampler `engine` ("hf" or
    "vllm") in `sampler_dtype` and a trainer computing in `train_dtype`; None where they differ
    (a precision gap is then expected, and measured by mismatch/*, not checked)."""
    if sampler_dtype != train_dtype:
        return None
    return TOLERANCES.get(("vllm" if engine == "vllm-server" else engine, sampler_dtype))


def renormalises(engine: str, sampling) -> bool:
    """Whether a vLLM engine's recorded log-probs are not the policy's full distribution: vLLM
    renormalises them over what top-p/top-k keep, and without the stop tokens --min-new-tokens
    bans (gspo.train.resolve then recomputes pi_old). The on-policy log-ratio check has nothing to
    compare there; the token check still holds."""
    return engine != "hf" and (sampling.top_p < 1 or sampling.top_k > 0 or sampling.min_new_tokens > 0)


def tf32_matmuls() -> bool:
    """Whether float32 matmuls on CUDA may run in TensorFloat-32: set by the older
    (`torch.set_float32_matmul_precision`, `allow_tf32`) or the newer API (`torch.backends.
    fp32_precision`, which makes the older one's getter raise once used)."""
    try:
        return torch.get_float32_matmul_precision() != "highest"
    except RuntimeError:  # the newer API is in use: read it
        matmul = getattr(getattr(torch.backends, "cuda", None), "matmul", None)
        return getattr(matmul, "fp32_precision", "ieee") == "tf32"


@dataclass
class Receipts:
    """What a batch's samplers drew: per prompt (the hash of its ids), each completion drawn
    from it, (token ids, log-probs (n,) float32)."""

    by_prompt: dict[int, list[tuple[tuple[int, ...], torch.Tensor]]] = field(default_factory=dict)
    samples: int = 0

    def record(self, prompts: list[list[int]], ro: Rollout) -> None:
        """A `sample(prompts, ...)` call's result: its rows, G per prompt, in order."""
        rows = ro.completion_ids.shape[0]
        per = rows // max(1, len(prompts))
        ids, logp, lengths = ro.completion_ids.cpu().tolist(), ro.logp.float().cpu(), ro.lengths.tolist()
        keys = [hash(tuple(p)) for p in prompts]
        for i in range(rows):
            n = int(lengths[i])
            self.by_prompt.setdefault(keys[i // per], []).append((tuple(ids[i][:n]), logp[i, :n].clone()))
        self.samples += rows


class Recorded:
    """A sampler whose every `sample` leaves a receipt in `receipts`; the rest of the sampler's
    interface (sync, end_rollout, its attributes) is the sampler's own."""

    def __init__(self, sampler, receipts: Receipts):
        self.sampler, self.receipts = sampler, receipts

    def sample(self, prompts, params, *, generator=None, rows=None) -> Rollout:
        ro = self.sampler.sample(prompts, params, generator=generator, rows=rows)
        self.receipts.record(prompts, ro)
        return ro

    def __getattr__(self, name):
        return getattr(self.sampler, name)


@dataclass(frozen=True)
class Breach:
    """A row that fails the check: its index in the batch, the completion column where it goes
    wrong, and what is wrong there."""

    row: int
    column: int
    why: str


NOT_DRAWN = ("no sample was drawn with the tokens before it as the prompt: its context is not the one it was "
             "sampled in")
DIFFERENT = "its tokens are not those of any sample drawn in this context"
LOGPROBS = "its tokens are a sample's, but its log-probs are not the ones the sampler returned"


def check_rows(ro: Rollout, receipts: Receipts) -> tuple[list[Breach], int]:
    """The breaches among `ro`'s rows with trained tokens (module docstring), and how many rows
    were checked."""
    mask = (ro.completion_mask > 0).cpu()  # (B, T)
    rows = mask.any(1).nonzero().flatten()
    if not rows.numel():
        return [], 0
    mask = mask[rows]  # (R, T)
    edges = torch.nn.functional.pad(mask.to(torch.int8), (1, 1)).diff(dim=1)  # (R, T+1): +1 a run's start, -1 its end
    at = edges.nonzero().tolist()  # (row, column) of every start and end, in order
    runs: list[list[int]] = [[] for _ in range(len(rows))]
    for r, col in at:
        runs[r].append(col)
    ids = ro.completion_ids.cpu()[rows].tolist()
    logp = ro.logp.float().cpu()[rows]  # (R, T)
    kept = ro.prompt_mask.cpu()[rows].sum(1).tolist()  # (R,) left-padded prompts: their last n columns
    prompts = ro.prompt_ids.cpu()[rows].tolist()
    out = []
    for j, b in enumerate(rows.tolist()):
        prompt = prompts[j][len(prompts[j]) - int(kept[j]):]
        why = _check_row(prompt, ids[j], logp[j], runs[j], receipts)
        if why is not None:
            out.append(Breach(b, *why))
    return out, len(rows)


def _check_row(prompt: list[int], ids: list[int], logp: torch.Tensor, edges: list[int],
               receipts: Receipts) -> tuple[int, str] | None:
    """(column, why) of a row's first breach, or None. `edges`: its runs of trained tokens,
    start, end, start, end ..."""
    for start, end in zip(edges[::2], edges[1::2]):
        t = start
        while t < end:  # the run start..end: whole samples, then a sample's prefix
            drawn = receipts.by_prompt.get(hash(tuple(prompt + ids[:t])))
            if not drawn:
                return t, NOT_DRAWN
            took = _longest(drawn, ids[t:end], logp[t:end])
            if took is None:
                return t, DIFFERENT
            if took < 0:
                return t, LOGPROBS
            t += took
    return None


def _longest(drawn: list, want: list[int], logp: torch.Tensor) -> int | None:
    """The most tokens of `want` one sample of `drawn` accounts for: all of `want` (a prefix of
    the sample), or the whole sample (a prefix of `want`); -1 when only log-probs differ; None
    when no sample matches. `logp` (len(want),): the row's log-probs of `want`."""
    want = tuple(want)
    n, best, logp_off = len(want), 0, False
    for tokens, lps in drawn:
        if tokens[:n] == want:
            k = n
        elif 0 < len(tokens) < n and want[:len(tokens)] == tokens:
            k = len(tokens)
        else:
            continue
        if float((lps[:k] - logp[:k]).abs().max()) > LOGP_ATOL:
            logp_off = True
            continue
        best = max(best, k)
        if best == n:
            break
    if best:
        return best
    return -1 if logp_off else None
