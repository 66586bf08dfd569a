"""How noisy the importance ratios of one update are, as a function of response length.

    from gspo.lab.variance import ratio_variance
    table = ratio_variance(TrainConfig(model="tiny-long-moe", task="chain"), responses=512)

The measurement of the paper's §3 argument that needs no training run. A fixed policy pair:
π_old, the model as loaded, and π_new, the same model after one minibatch update (the run's
algorithm, learning rate and minibatch size, on a rollout of its own). `responses`
completions are sampled from π_old on held-apart training prompts; for each response i, of
length |y_i|, and each of its tokens t:

    log w_{i,t} = log π_new(y_{i,t} | x, y_{i,<t}) - log π_old(y_{i,t} | x, y_{i,<t})
    w_{i,t}                      the per-token ratio (GRPO's, PPO's)
    log Π_t w_{i,t}              the log of their product, the likelihood ratio of the response
    s_i = exp(mean_t log w_{i,t})  GSPO's length-normalised sequence ratio (paper Eq. 7)

Responses are binned by length (equal-count bins) and, per bin, the variance across the bin
of each quantity is reported (w_{i,t} pooled over every token of the bin's responses).
If the log-ratios of a response's tokens were independent with variance σ², Var log Π w would
grow as |y| σ² and Var log s_i shrink as σ² / |y|; the table says what this model does.

One process (no torchrun); devices as the configuration says. MoE models: π_new's forward routes by its own router
("router free": expert volatility
included, what GRPO sees) and, again, with the experts π_old used replayed ("routing
replayed", what Routing Replay sees); the table shows both.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch

from gspo.algo.aggregation import agg_count
from gspo.config import TrainConfig
from gspo.io.files import atomic_write_text, json_clean
from gspo.lab.plot import plot_panels
from gspo.models.logprobs import Split, forward_logprobs, token_logprobs
from gspo.models.moe import drift
from gspo.sampling.produce import rollout, score, step_generator
from gspo.tasks.scoring import Scored
from gspo.train.batch import prepare
from gspo.train.run import Run, build_run
from gspo.train.trainer import Totals, accumulate, optimizer_step

Tensor = torch.Tensor
QUANTITIES = ("w_token", "log_product", "s_seq")
LABELS = {"w_token": "per-token ratio w_{i,t}", "log_product": "log of the product Π_t w_{i,t}",
          "s_seq": "GSPO's s_i"}
FIRST_STEP = 1_000_000  # the measurement's prompts: training steps no run of this length reaches


def ratio_variance(cfg: TrainConfig, *, responses: int = 512, n_bins: int = 5, log=print) -> dict:
    """Sample `responses` completions from the model, take one minibatch update, and return the
    per-length-bin variances (module docstring): {"model", ..., "drift", "settings": {setting: bins}}."""
    run = build_run(dataclasses.replace(cfg, eval_size=0, eval_every=0))  # no evaluation (--eval-every needs one)
    chunks = sample_old(run, responses)
    n = one_minibatch_update(run)
    log(f"[variance] {cfg.policy.model}: {sum(c[0].prompt_ids.shape[0] for c in chunks)} responses sampled; one "
        f"minibatch of {n} responses, {cfg.loss.algorithm}, lr {cfg.optim.lr:g}")
    settings, drift_mean = measure(run, chunks, n_bins)
    first = next(iter(settings.values()))
    return {"model": cfg.policy.model, "task": cfg.data.dataset or cfg.data.task, "algorithm": cfg.loss.algorithm,
            "lr": cfg.optim.lr, "responses": int(sum(b["n"] for b in first)), "minibatch": n, "drift": drift_mean,
            "settings": settings}


def sample_old(run: Run, responses: int) -> list[tuple]:
    """At least `responses` completions sampled from the policy as it is (π_old), on training
    prompts of steps no run reaches, as (rollout, log π_old float64, experts used or None) chunks
    of one step's size."""
    cfg = run.cfg
    chunks = []
    for k in range(max(1, math.ceil(responses / (cfg.sampling.prompts_per_step * cfg.sampling.group_size)))):
        step = FIRST_STEP + 1 + k
        ro, _, _, _ = rollout(run, run.task.train_batch(step, cfg.sampling.prompts_per_step, cfg.run.seed), step)
        old, experts = _logprobs(run, ro)
        chunks.append((ro, old, experts))
    return chunks


def one_minibatch_update(run: Run) -> int:
    """One optimizer step of the run's algorithm on the first minibatch of an ordinary step's
    rollout (its own prompts); returns the minibatch's number of responses."""
    cfg = run.cfg
    examples = run.task.train_batch(FIRST_STEP, cfg.sampling.prompts_per_step, cfg.run.seed)
    ro, texts, ids, _ = rollout(run, examples, FIRST_STEP)
    rewards, parts = score(run.rewards, examples, texts, ids, cfg.sampling.group_size)
    batch = prepare(run, ro, Scored(rewards, parts, examples, texts))
    mask = batch.rollout.completion_mask  # (B, T)
    B = mask.shape[0]
    order = torch.randperm(B, generator=step_generator(cfg.run.seed, FIRST_STEP, "minibatches"))
    idx = order[: B // cfg.loss.num_minibatches]
    run.train_model.train()
    accumulate(run, batch, idx, Totals(float(agg_count(mask[idx], cfg.loss.loss_agg)), float(mask[idx].sum())))
    optimizer_step(run)
    return len(idx)


def measure(run: Run, chunks: list[tuple], n_bins: int) -> tuple[dict[str, list[dict]], float | None]:
    """The binned variances of the ratios of the policy now to π_old over the sampled chunks,
    per routing setting ("" for a dense model), and the mean expert drift (None: dense)."""
    moe = run.routing.moe
    settings = {"router free": [], "routing replayed": []} if moe else {"": []}
    drifts = []
    for ro, old, experts in chunks:
        new, now = _logprobs(run, ro)
        settings["router free" if moe else ""].append(_per_response(new - old, ro.completion_mask))
        if moe:
            drifts.append(drift(now, experts, ro.attention_mask))
            settings["routing replayed"].append(_per_response(_replayed(run, ro, experts) - old, ro.completion_mask))
    binned = {name: _binned(_concat(parts), n_bins) for name, parts in settings.items()}
    return binned, (sum(drifts) / len(drifts) if drifts else None)


def _logprobs(run: Run, ro) -> tuple[Tensor, Tensor | None]:
    """log π of the sampled tokens under the run's policy now (float64), and the experts it used."""
    with run.autocast():
        split = Split(run.cfg.policy.micro_batch_tokens, max(1, ro.prompt_ids.shape[0] // run.cfg.loss.num_minibatches))
        logp, experts = token_logprobs(run.policy, ro, temperature=run.cfg.sampling.temperature, split=split,
                                       routing=run.routing)
    return logp.double(), experts


@torch.no_grad()
def _replayed(run: Run, ro, experts: Tensor) -> Tensor:
    """log π_new of the sampled tokens with π_old's experts forced (Routing Replay), float64."""
    run.policy.eval()
    out = []
    for idx in torch.arange(ro.prompt_ids.shape[0]).split(max(1, ro.prompt_ids.shape[0]
                                                              // run.cfg.loss.num_minibatches)):
        with run.routing.capture(experts[idx]), run.autocast():
            out.append(forward_logprobs(run.policy, ro.select(idx), temperature=run.cfg.sampling.temperature).logp)
    return torch.cat(out).double()


def _per_response(log_w: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Per response: its length, log Π w, log s_i; and every token's w with the response's length."""
    mask = mask.double()
    log_w = log_w * mask  # (B, T) 0 on padding
    lengths = mask.sum(1)  # (B,)
    keep = lengths > 0
    token_len = lengths[:, None].expand_as(mask)[mask > 0]  # (N,) each token's response length
    return {"length": lengths[keep], "log_product": log_w.sum(1)[keep],
            "log_s": (log_w.sum(1)[keep] / lengths[keep]), "w": log_w[mask > 0].exp(), "w_length": token_len}


def _concat(parts: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def length_edges(lengths: Tensor, n_bins: int) -> list[float]:
    """Edges of `n_bins` equal-count bins of `lengths` (first edge = min, last = max).

    >>> length_edges(torch.tensor([10., 20., 30., 40.]), 2)
    [10.0, 25.0, 40.0]
    """
    q = torch.quantile(lengths.double(), torch.linspace(0, 1, n_bins + 1, dtype=torch.float64))
    return [float(x) for x in q]


def _binned(r: dict[str, Tensor], n_bins: int) -> list[dict]:
    """Per length bin: the variance across the bin of w_{i,t}, log Π w and s_i."""
    edges = length_edges(r["length"], n_bins)
    rows = []
    for j, (lo, hi) in enumerate(zip(edges, edges[1:])):
        last = j == n_bins - 1
        inside = (r["length"] >= lo) & ((r["length"] <= hi) if last else (r["length"] < hi))
        tok = (r["w_length"] >= lo) & ((r["w_length"] <= hi) if last else (r["w_length"] < hi))
        if inside.sum() < 2:
            continue
        s = r["log_s"][inside].exp()
        rows.append({"lo": lo, "hi": hi, "n": int(inside.sum()), "mean_length": float(r["length"][inside].mean()),
                     "w_token": float(r["w"][tok].var()), "log_product": float(r["log_product"][inside].var()),
                     "s_seq": float(s.var()), "log_s": float(r["log_s"][inside].var())})
    return rows


def write_variance(results: list[dict], out_dir) -> None:
    """variance.json, variance.md (the table) and variance.png (one panel per quantity, x = mean
    response length of the bin, one line per model and routing setting) in `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "variance.json", json.dumps(json_clean(results), indent=2) + "\n")
    panels = {f"Var {LABELS[q]}": {} for q in QUANTITIES}
    for r in results:
        for setting, rows in r["settings"].items():
            label = f"{r['model']}, {setting}" if setting else r["model"]
            for q in QUANTITIES:
                panels[f"Var {LABELS[q]}"][label] = ([row["mean_length"] for row in rows], [row[q] for row in rows])
    plot_panels(panels, out / "variance.png", log_y=list(panels), xlabel="response length (tokens, bin mean)",
                title="importance-ratio variance by response length (one minibatch update)")
    atomic_write_text(out / "variance.md", variance_table(results))


def variance_table(results: list[dict]) -> str:
    """The length-binned variance table, in Markdown."""
    lines = ["| model | routing | length bin (tokens) | responses | Var w_{i,t} | Var log Π w | Var s_i | "
             "Var log s_i |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        for setting, rows in r["settings"].items():
            for row in rows:
                lines.append(f"| {r['model']} | {setting or 'dense'} | {row['lo']:.0f}-{row['hi']:.0f} | {row['n']} | "
                             f"{row['w_token']:.3g} | {row['log_product']:.3g} | {row['s_seq']:.3g} | "
                             f"{row['log_s']:.3g} |")
    notes = [f"{r['model']}: one {r['algorithm']} minibatch of {r['minibatch']} responses at lr {r['lr']:g}"
             + ("" if r["drift"] is None else f"; expert drift of the update {r['drift']:.4f}") for r in results]
    return "\n".join(["# Importance-ratio variance by response length", "", *notes, "", *lines, ""])
