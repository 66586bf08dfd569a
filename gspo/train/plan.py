"""The run's resolved plan: what was asked is what runs, said once at the start and kept in summary.json.

    from gspo.train.plan import plan, describe
    p = plan(build_run(TrainConfig(dtype="bfloat16")))   # plain JSON values
    p["sampler"], p["old_logp"]   # 'a bfloat16 copy of the policy', 'recompute'
    print(describe(p))            # a few lines; `gspo train` prints them before the first step

`plan(run)` reads the built run (gspo.train.run.Run) where each fact was decided: the sampler it
holds (gspo.sampling.rollout, gspo.sampling.vllm_engine), whether training forwards pack (`run.packed`, decided
by gspo.train.run._packing: a refusal is a note), the decode path (gspo.sampling.fastdecode.unsupported), the
chunked LM head (gspo.models.lmhead.fused_head), the resolved configuration (--old-logp auto is
resolved by then) and the process layout (gspo.processes.distributed.Dist). It only reads: no forward
pass, no collective, cheap enough to call at the start and again for the summary.

Keys (stable; another test checks each configuration's plan against its request):

| key | value |
| --- | --- |
| `objective` | `{"loss", "summary", "clip", "clip_text", "clip_target", "options", "advantages", "advantages_summary"}`: the registered loss (gspo.algo.losses.LOSSES) with its clip range (`[low, high]`; None for a gate), the range in words (`clip [1 - 0.0003, 1 + 0.0004]`), --target-clip-frac (None: a fixed range) and its own options' values, and the advantage estimator (gspo.algo.advantages.ESTIMATORS) |
| `model` | `{"name", "gguf", "path"}`: the policy as named; for a .gguf file what its conversion records (gspo.models.gguf: source, architecture, quantization, parameters) and the converted directory |
| `engine` | `"hf"` (gspo's own sampler), `"vllm"` (colocated) or `"vllm-server"` (vLLM servers: `sampler` names them) |
| `processes` | number of processes (torchrun's world size; 1 without torchrun) |
| `threads` | `{"count", "why", "memory"}`: torch's CPU threads in this process and how that count was chosen (gspo.processes.threads: `--threads`, OMP_NUM_THREADS, or the cores free when the run started), and where large CPU tensors are allocated, in words (gspo.processes.memory: `--malloc-heap`) |
| `parallel` | `"none"` (one process), `"ddp"` or `"fsdp"` |
| `weights_dtype` | the trained weights' dtype (`--param-dtype`), read from the policy |
| `compute_dtype` | forwards' dtype (`--dtype`) |
| `autocast` | forwards run under autocast (mixed precision: compute dtype != weights dtype) |
| `sampler` | who samples, in words: "the policy itself", "a bfloat16 copy of the policy", "the sharded policy gathered in bfloat16" (FSDP), "vLLM bfloat16" |
| `sampler_dtype` | the dtype rollouts are sampled in |
| `old_logp` | where π_old comes from: `"sampling"` (the sampler's own log-probs) or `"recompute"` (a training forward before the updates) |
| `packing` | training forwards pack their sequences (bool) |
| `packing_why` | `"not asked"`, `"asked"` (and on), or `"asked, but ..."` (off) with the reason (MoE routing, or the model cannot pack) |
| `micro_batch_tokens` | token budget of a forward/backward pass; 0: a whole minibatch per pass |
| `lm_head` | `"chunked"` (gspo.models.lmhead: no (N, V) logits) or `"full"` (the model's own head) |
| `lm_head_chunk` | tokens per chunk of the chunked head (None with the full head) |
| `decode` | `"fast"` (gspo.sampling.fastdecode's hand-written compact decode step), `"layers"` (the compact decode step over the model's own layers, gspo.sampling.layerdecode), `"graphs"` (the same, captured in CUDA graphs), `"hf"` (Hugging Face's forward) or `"vllm"` |
| `decode_why` | for `"layers"`, why not the hand-written step (and, on a GPU, why no CUDA graphs); for `"hf"`, why neither of gspo's steps; None otherwise |
| `gradient_checkpointing` | bool |
| `lora` | None, or `{"r", "alpha", "dropout", "target_modules"}` |
| `moe` | the policy is a Mixture-of-Experts model whose routers are hooked (bool) |
| `routing_replay` | Routing Replay forces the old experts in the ratio's forward (bool) |
| `env` | the multi-turn environment's class name, or None (single-turn completions) |
| `max_turns` | model turns per episode at most (1 without an environment; an agent's calls per episode) |
| `agent` | None, or `{"timeout"}`: `env` is agent code (gspo.agents.runner) talking to the policy through an OpenAI endpoint on loopback, each episode within `timeout` seconds (0: none) |
| `integrity` | `{"on_breach", "tolerance"}`: what a breach of the integrity check does (`--integrity`: `"stop"` or `"warn"`) and the first on-policy minibatch's log-ratio bounds, `{"row", "mean"}` (gspo.sampling.integrity.tolerance; None where the sampler's precision is not the trainer's) |
| `rollouts` | `{"max_staleness", "workers", "devices", "mode"}`: batches sampled up to K versions late, by N rollout workers on these devices; mode `"this process"`, `"processes"` (each trainer process starts its N), `"ranks"` (the torchrun world's last N ranks) or `"servers"` (vllm-server: a sampling thread while the trainer trains); `"partial"`: --partial-rollouts (gspo.sampling.pipeline) |
| `warnings` | the run's start-up notes (`run.notes`: every fallback from what was asked), plus any the plan finds |

Left out: facts decided during the run (the compact decode step's first-step check can still
fall back to Hugging Face's forward; that is said in its own warning when it happens).
"""  # noqa: E501 (the keys table above: a row is as long as its key needs)

from __future__ import annotations

from pathlib import Path

import torch

from gspo.algo.advantages import ESTIMATORS
from gspo.algo.losses import LOSSES
from gspo.config import TrainConfig
from gspo.io.words import plural
from gspo.models import gguf as gguf_models
from gspo.models.lmhead import _SPECIAL_HEAD_ATTRS, chunk_tokens, fused_head
from gspo.processes import distributed
from gspo.sampling import fastdecode
from gspo.sampling.integrity import renormalises, tolerance
from gspo.sampling.pipeline import overlaps
from gspo.sampling.rollout import PolicySampler
from gspo.tasks.env import is_agent
from gspo.train.critic import estimator_name
from gspo.train.run import Run


def plan(run: Run) -> dict:
    """The resolved plan of a built run (gspo.train.run.Run) as plain JSON values; see the module docstring."""
    cfg, dist = run.cfg, run.dist
    fsdp = dist.enabled and dist.parallel == "fsdp"
    workers = cfg.async_rl.rollout_workers
    engine = "hf" if isinstance(run.sampler, PolicySampler) and not workers else cfg.sampling.rollout_engine
    weights = _dtype(run.policy) or cfg.policy.param_dtype
    sampler, sampler_dtype = _sampler(run, engine, fsdp, weights)
    devices = distributed.worker_devices(cfg, dist)
    if workers:  # the trainer's own sampler never samples: the workers' copies do
        sampler_dtype = cfg.policy.dtype if cfg.sampling.rollout_dtype == "same" else cfg.sampling.rollout_dtype
        ranks = dist.link is not None  # the torchrun world's last N ranks, else processes each trainer starts
        if ranks:
            devices = list(cfg.async_rl.rollout_devices) or ["their own"]
        where = f"the torchrun world's last {workers} rank(s)" if ranks else \
            f"{workers} rollout worker process(es) per trainer process"
        sampler = (f"{where} ({', '.join(devices)}), each with its own {'vLLM engine' if engine == 'vllm' else 'copy'} "
                   f"in {sampler_dtype}")
    decode, decode_why = _decode(run, engine, fsdp)
    chunked = _chunked_head(run.policy, fsdp)
    vocab = _base(run.policy).get_output_embeddings().weight.shape[0] if chunked else None
    warnings = list(run.notes)
    old_logp = _old_logp(run, warnings)
    return {
        "objective": _objective(cfg),
        "model": _model(run),
        "engine": engine,
        "rollouts": {"max_staleness": cfg.async_rl.max_staleness, "workers": workers, "devices": devices,
                     "mode": "ranks" if dist.link is not None else "processes" if workers else
                     "servers" if overlaps(run) else "this process", "partial": cfg.async_rl.partial_rollouts},
        "processes": dist.world,
        "threads": {"count": torch.get_num_threads(), "why": run.threads, "memory": run.memory},
        "parallel": dist.parallel if dist.enabled else "none",
        "weights_dtype": weights,
        "compute_dtype": cfg.policy.dtype,
        "autocast": cfg.policy.dtype != cfg.policy.param_dtype,
        "sampler": sampler,
        "sampler_dtype": sampler_dtype,
        "old_logp": old_logp,
        "packing": bool(run.packed),
        "packing_why": _packing_why(run),
        "micro_batch_tokens": cfg.policy.micro_batch_tokens,
        "lm_head": "chunked" if chunked else "full",
        "lm_head_chunk": chunk_tokens(vocab) if chunked else None,
        "decode": decode,
        "decode_why": decode_why,
        "gradient_checkpointing": cfg.policy.gradient_checkpointing,
        "lora": {"r": cfg.lora.lora_r, "alpha": cfg.lora.lora_alpha, "dropout": cfg.lora.lora_dropout,
                 "target_modules": list(cfg.lora.lora_target_modules)} if cfg.lora.lora_r > 0 else None,
        "moe": run.routing.moe,
        "routing_replay": bool(cfg.moe.routing_replay and run.routing.moe),
        "env": run.env.__name__ if run.env is not None else None,
        "agent": ({"timeout": cfg.episodes.episode_timeout} if run.env is not None and is_agent(run.env)
                  else None),  # gspo.agents.runner: the env is agent code, over the OpenAI endpoint
        "max_turns": run.max_turns,
        "integrity": _integrity(cfg, engine, sampler_dtype),
        "distill": (run.teachers.describe(cfg, LOSSES[cfg.loss.algorithm].turn_advantages)
                    if run.teachers is not None else None),
        "warnings": warnings,
    }


def _integrity(cfg: TrainConfig, engine: str, sampler_dtype: str) -> dict:
    """What a breach does and the on-policy log-ratio check's bounds (None: not checked)."""
    tol = None if renormalises(engine, cfg.sampling) else tolerance(engine, sampler_dtype, cfg.policy.dtype)
    return {"on_breach": cfg.sampling.integrity,
            "tolerance": {"row": tol.row, "mean": tol.mean} if tol is not None else None}


def _old_logp(run: Run, warnings: list) -> str:
    """Where π_old comes from, as the run will do it (a note added to `warnings` where that is not as asked)."""
    cfg = run.cfg
    if cfg.loss.old_logp == "sampling" and run.env is not None and cfg.moe.routing_replay:  # gspo.train.batch.prepare
        warnings.append("old_logp: sampling, but multi-turn episodes record no experts while sampling: Routing "
                        "Replay takes a recomputation's (old log-probs recomputed by a training forward)")
        return "recompute"
    return cfg.loss.old_logp


def _objective(cfg: TrainConfig) -> dict:
    """The loss and the advantage estimator, as their registrations describe them."""
    info, estimator = LOSSES[cfg.loss.algorithm], ESTIMATORS[estimator_name(cfg)]
    return {"loss": info.name, "summary": info.summary,
            "clip": None if info.gate else [cfg.loss.clip_low, cfg.loss.clip_high],
            "clip_text": None if info.gate else info.clip_text(cfg.loss.clip_low, cfg.loss.clip_high),
            "clip_target": cfg.loss.target_clip_frac,
            "options": {o: getattr(cfg, o) for o in info.options},
            "advantages": estimator.name, "advantages_summary": estimator.summary}


def describe(p: dict, warnings: bool = True) -> str:
    """The plan in a few lines (what `gspo train` prints once at the start; `warnings=False`
    leaves out the warnings, which the trainer says on stderr)."""
    layout = "1 process" if p["processes"] == 1 else f"{p['parallel'].upper()} over {p['processes']} processes"
    t = p.get("threads") or {}
    if t.get("count"):
        layout += f" of {plural(t['count'], 'CPU thread')}" + (f" ({t['why']})" if t.get("why") else "")
    compute = f"compute {p['compute_dtype']}" + (" (autocast)" if p["autocast"] else "")
    decode = "vLLM's" if p["decode"] == "vllm" else fastdecode.words(p["decode"], p["decode_why"])
    old = {"sampling": "the sampler's own log-probs", "recompute": "a training forward before the updates"}
    packing = f"{'on' if p['packing'] else 'off'} ({p['packing_why']})"
    micro = f"{p['micro_batch_tokens']} tokens" if p["micro_batch_tokens"] else "the whole minibatch"
    head = f"chunked ({p['lm_head_chunk']} tokens a chunk)" if p["lm_head"] == "chunked" else \
        "the model's own (full logits)"
    lora = p["lora"]
    lora = (f"LoRA r={lora['r']} (alpha {lora['alpha']:g}, {', '.join(lora['target_modules'])})" if lora
            else "LoRA off (all weights train)")
    moe = ("MoE, Routing Replay " + ("on" if p["routing_replay"] else "off")) if p["moe"] else "dense"
    env = f"env {p['env']} (up to {p['max_turns']} turns)" if p["env"] else "single-turn"
    if p.get("agent"):
        deadline = f"{p['agent']['timeout']:g} s" if p["agent"]["timeout"] else "none"
        env = (f"agent {p['env']}() over an OpenAI endpoint on 127.0.0.1 (up to {p['max_turns']} calls an "
               f"episode, deadline {deadline})")
    o = p["objective"]
    clip = o["clip_text"] if o["clip"] else ", ".join(f"--{k.replace('_', '-')} {v:g}" for k, v in o["options"].items())
    if o["clip_target"] is not None:
        clip += f", adapted between steps to hold clip/frac near {o['clip_target']:g}"
    lines = [
        f"plan: engine {p['engine']}, {layout}; weights {p['weights_dtype']}, {compute}; sampler: {p['sampler']}",
        f"  objective: {o['loss']} ({clip}); advantages: {o['advantages']} ({o['advantages_summary']})",
        f"  decode: {decode}; pi_old ({p['old_logp']}): {old[p['old_logp']]}",
        f"  packing: {packing}; micro-batches: {micro}; LM head: {head}"
        + ("; gradient checkpointing" if p["gradient_checkpointing"] else "")
        + (f"; {t['memory']}" if t.get("memory") else ""),
        f"  {lora}; {moe}; {env}",
    ]
    if (m := p.get("model") or {}).get("gguf"):
        lines.insert(1, f"  model: {m['gguf']['source']} ({gguf_models.describe(m['gguf'])}; "
                        f"converted copy {m['path']})")
    r = p["rollouts"]
    if r["max_staleness"] or r["workers"]:
        by = {"ranks": f"the torchrun world's last {r['workers']} rank(s)",
              "processes": f"{r['workers']} worker process(es) per trainer process",
              "servers": "the servers while the trainer trains (a sampling thread of this process)"
              }.get(r["mode"], "this process (no overlap)")
        how = ("; a sync aborts the generations under way and they continue under the new weights (partial "
               "rollouts)" if r["partial"] else "; a sync waits for the generations under way" if r["mode"] == "servers"
               else "")
        lines.append(f"  rollouts: at most {r['max_staleness']} version(s) stale, sampled by {by}{how}")
    if (i := p.get("integrity")) is not None:
        ratio = (f"an on-policy step's log-probs against the sampler's (mean gap at most {i['tolerance']['row']:g} "
                 f"a row, {i['tolerance']['mean']:g} over the minibatch)" if i["tolerance"]
                 else "log-probs not checked (the sampler's precision is not the trainer's: mismatch/* measures it)")
        lines.append(f"  integrity: every trained token checked against what the samplers drew; {ratio}; a breach "
                     f"{'stops the run' if i['on_breach'] == 'stop' else 'is said, its rows left out'}")
    if p.get("distill"):
        lines.append(f"  {p['distill']}")
    if warnings:
        lines += [f"  warning: {' '.join(w.split())}" for w in p["warnings"]]
    return "\n".join(lines)


def _model(run: Run) -> dict:
    """The policy's name and, for a GGUF file, where it came from (gspo.models.gguf)."""
    name = run.cfg.policy.model
    if not isinstance(name, str) or not Path(name).expanduser().exists():  # an object, a built-in, a Hub id
        return {"name": name, "gguf": None}
    src = gguf_models.gguf_source(Path(name).expanduser(), name)
    path = gguf_models.converted(src) if src else None  # cached by the load: a lookup
    info = gguf_models.source_info(path) if path else None
    return {"name": name, "gguf": info, "path": str(path) if info else None}


def _dtype(model) -> str | None:
    param = next(iter(model.parameters()), None)
    return None if param is None else str(param.dtype).removeprefix("torch.")


def _sampler(run: Run, engine: str, fsdp: bool, weights: str) -> tuple[str, str]:
    """Who samples, in words, and in which dtype."""
    cfg = run.cfg
    if engine != "hf":
        dtype = cfg.policy.dtype if cfg.sampling.rollout_dtype == "same" else cfg.sampling.rollout_dtype
        if engine == "vllm-server":
            return server_words(run.sampler, dtype), dtype
        sleeps = " (sleeps between rollouts)" if getattr(run.sampler, "sleep", False) else ""
        return f"vLLM {dtype}{sleeps}", dtype
    if fsdp:  # the sharded policy itself, gathered in its MixedPrecisionPolicy's dtype: the compute dtype
        return f"the sharded policy gathered in {cfg.policy.dtype}", cfg.policy.dtype
    if run.sampler.model is run.policy:
        return "the policy itself", weights
    dtype = _dtype(run.sampler.model) or cfg.policy.dtype
    return f"a {dtype} copy of the policy (synced before every rollout)", dtype


def server_words(sampler, dtype: str) -> str:
    """The servers a vllm-server run samples on, their model and vLLM version, and how weights reach them."""
    servers = getattr(sampler, "servers", [])
    who = "a vLLM server gspo started here" if getattr(sampler, "owned", None) is not None else \
        plural(len(servers), "vLLM server")
    each = "; ".join(f"{s.url} ({s.model}, vLLM {s.version})" for s in servers)
    how = {"directory": "weights synced through vLLM's reload_weights from a directory",
           "nccl": "weights synced over NCCL (vLLM's weight transfer)"}.get(sampler.push.name, "")
    check = ", sync checked every step" if getattr(sampler, "check", None) is not None else ""
    return f"{who} in {dtype}: {each}; {how}{check}"


def _packing_why(run: Run) -> str:
    """Why training forwards pack or not: gspo.train.run._packing's decision, in words."""
    if not run.cfg.policy.packing:
        return "not asked"
    if run.packed:
        return "asked"
    if run.routing.moe:
        return "asked, but MoE routing is recorded in the padded layout"
    return ("asked, but the model cannot pack (a packed forward does not give the padded forward's hidden states, "
            "or its LM head is not a plain linear map)")


def _decode(run: Run, engine: str, fsdp: bool) -> tuple[str, str | None]:
    """The decode path of gspo's sampler: fastdecode's answer. Under FSDP it was decided before
    sharding (a shard's head is no plain tensor) and said in gspo.sampling.rollout.fsdp_sampling_note."""
    if engine != "hf":
        return "vllm", None
    cfg = run.cfg
    if fsdp:
        said = [n.rpartition("decodes with ")[2] for n in run.notes if n.startswith("parallel: fsdp samples")]
        if said:
            return fastdecode.kind_of(said[0])
    return fastdecode.path(run.sampler.model, cfg.data.max_prompt_length + cfg.sampling.max_new_tokens,
                           cuda_graphs=cfg.sampling.cuda_graphs)


def _chunked_head(policy, fsdp: bool) -> bool:
    """Whether training forwards use gspo.models.lmhead's chunked head (`fused_head`). Under FSDP the
    head's weight is a DTensor shard between forwards, so fused_head says no there; inside the
    root's forward, where it runs, the weight is whole: the other conditions decide."""
    if fused_head(policy) is not None:
        return True
    if not fsdp:
        return False
    base = _base(policy)
    prefix = getattr(base, "base_model_prefix", None)
    if not prefix or getattr(base, prefix, None) is None:
        return False
    head = base.get_output_embeddings()
    if type(head) is not torch.nn.Linear or head.bias is not None or not hasattr(head.weight, "placements"):
        return False
    text = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    return all(getattr(text, attr, None) in (None, 1.0, 0.0) for attr in _SPECIAL_HEAD_ATTRS)  # as fused_head


def _base(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT
