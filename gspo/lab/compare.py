"""`gspo compare`: the paper's comparisons at small scale, in one command.

    gspo compare                                   # GSPO, GRPO, GRPO + Routing Replay on tiny-moe
    gspo compare --preset length                   # long answers (chain task), + the ratio variance by length
    gspo compare --preset staleness                # losses x fixed lags K (gspo.lab.studies; docs/staleness.md)
    gspo compare --preset precision                # sampler + trainer in fp32 / bf16 / fp16 (docs/precision.md)
    gspo compare --preset objectives               # DPPO, CTPO, CPPO, a self-setting clip range (docs/objectives.md)
    gspo compare --configs gspo grpo --seeds 0 1 --steps 40
    gspo compare --configs gspo "grpo-hot:algorithm=grpo,lr=3e-4"
    from gspo.lab.compare import compare; compare(base_config, ["gspo", "grpo"], seeds=[0], out_dir="runs/cmp")

Every configuration trains from the same model on the same task with the same seeds (so the
same prompts), each in `OUT/runs/<name>-seed<k>/` (an ordinary run directory). Then:

- `compare.json`: configuration name -> {"accuracy", "accuracy_before", "accuracy_best",
  "accuracy_curve_mean", "clip_frac_mean", "drift_mean", "drift_in_ratio_mean", "mismatch_mean",
  "mismatch_seq_mean", "seq_log_abs_mean", "token_spread_mean", "staleness_mean", "is_truncated_mean", "eps_high_mean",
  "reward_last10_mean", "grad_norm_max", "wall_seconds", "eval_seconds", "eval_n", "diverged", "diverged_count",
  "seeds": {...}}, averaged over seeds (the `_mean` figures: a metric's mean over the run's
  steps; `grad_norm_max` its largest gradient norm), each averaged `<name>` with a sibling
  `<name>_ci95`, the half-width of its 95% interval (Student t over the seeds: gspo.lab.stats; null with
  one seed); drift values are null for dense models.
- `report.md`: the same as a table, the clip-fraction ratio of GSPO to GRPO, the plots, and the
  noise in words: one evaluation's own (binomial over the held-out problems), and which
  differences of final accuracy are outside the seeds' noise (paired over the seeds).
- `reward_accuracy.png` (Fig. 1 in miniature), `clip_fraction.png` (Fig. 2, log scale),
  `drift.png` (expert drift per update; Fig. 3's subject), `mismatch.png` (the sampler/trainer
  log-prob gap, when a configuration recomputes the old log-probs).
- with a Study (the `staleness` and `precision` presets: every configuration at every level of a
  factor, named `<config>@<level>`): `study.json`, `study.md` and `<figure>_vs_<factor>.png`, the
  figures against the factor (gspo.lab.studies), also in report.md.
- with `variance_models` (the `length` preset): `variance.md`, `variance.json`, `variance.png`,
  the importance-ratio variance by response length of one update (gspo.lab.variance), also in report.md.

"Diverged": a non-finite loss, or a final held-out accuracy more than 10 points below the
best held-out accuracy the run reached (an irreversible collapse).

Configurations are named presets (`PRESETS`) or `name:key=value,key=value` over the base
configuration (keys are `gspo train` option names).
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from gspo.config import SECTION_OF, ConfigError, TrainConfig
from gspo.config.checks import check_value, yaml_value
from gspo.io.files import atomic_write_text, json_clean, read_jsonl
from gspo.io.reporting import flushing, labelled, line_on_stdout
from gspo.io.words import plural
from gspo.lab.jobs import for_job, in_processes, plan_jobs, resumed, saved_config, set_aside
from gspo.lab.report import COLLAPSE_POINTS, aggregate, write_report
from gspo.lab.studies import Study
from gspo.train import checkpoint as ckpt
from gspo.train.resolve import resolve

PRESETS: dict[str, dict] = {
    "gspo": {"algorithm": "gspo"},
    "grpo": {"algorithm": "grpo"},
    "grpo-rr": {"algorithm": "grpo", "routing_replay": True},
    "gspo-rr": {"algorithm": "gspo", "routing_replay": True},
    "gspo_token": {"algorithm": "gspo_token"},
    "ppo": {"algorithm": "ppo"},
    "gspo-bf16-sampling": {"algorithm": "gspo", "old_logp": "sampling", "rollout_dtype": "bfloat16"},
    "grpo-bf16-sampling": {"algorithm": "grpo", "old_logp": "sampling", "rollout_dtype": "bfloat16"},
    "cispo": {"algorithm": "cispo"},
    "sapo": {"algorithm": "sapo"},
    "gmpo": {"algorithm": "gmpo"},
    "dppo_tv": {"algorithm": "dppo_tv"},
    "dppo_kl": {"algorithm": "dppo_kl"},
    "ctpo": {"algorithm": "ctpo"},
    "cppo": {"algorithm": "cppo"},
    # GSPO with its clip range adapted to hold 15% of tokens clipped (the paper's Fig. 2 scale for GSPO)
    "gspo-target": {"algorithm": "gspo", "target_clip_frac": 0.15},
    # the same, pi_old the behaviour policy's log-probs under --max-staleness (the clip sees the whole lag)
    "gspo-target-behaviour": {"algorithm": "gspo", "target_clip_frac": 0.15, "old_logp": "sampling"},
    # sampler/trainer mismatch corrections, for a base with --rollout-dtype bfloat16 or --rollout-engine vllm
    "gspo-tis": {"algorithm": "gspo", "rollout_is": "token"},
    "gspo-icepop": {"algorithm": "gspo", "rollout_is": "token", "rollout_is_mode": "mask"},
    "gspo-seq-mask": {"algorithm": "gspo", "rollout_is": "geometric", "rollout_is_mode": "mask",
                      "rollout_is_low": 0.999, "rollout_is_high": 1.001},  # the per-token geometric gap within ±0.1%
    "gspo-opsm": {"algorithm": "gspo", "opsm_delta": 1e-3},
    "grpo-tis": {"algorithm": "grpo", "rollout_is": "token"},
    # pi_old = the behaviour policy (the sampler's own log-probs) under --max-staleness; the others
    # (old_logp auto) anchor stale batches on the proximal policy, recomputed (docs/async.md)
    **{f"{name}-behaviour": {**options, "old_logp": "sampling"} for name, options in (
        ("gspo", {"algorithm": "gspo"}), ("grpo", {"algorithm": "grpo"}),
        ("grpo-rr", {"algorithm": "grpo", "routing_replay": True}), ("cispo", {"algorithm": "cispo"}),
        ("sapo", {"algorithm": "sapo"}), ("gmpo", {"algorithm": "gmpo"}))},
}
DEFAULT_CONFIGS = ("gspo", "grpo", "grpo-rr")


@dataclasses.dataclass(frozen=True)
class ComparePreset:
    """A named comparison: its configurations, its base `gspo train` options (flags override
    them) and the models of its no-training ratio-variance measurement (gspo.lab.variance)."""

    configs: tuple[str, ...]
    base: dict
    variance_models: tuple[str, ...] = ()
    about: str = ""
    axis: str | None = None  # a study along a factor (gspo.lab.studies.AXES): every configuration at every level
    levels: tuple | None = None  # the factor's levels when its flag is not given (None: the axis's own)
    seeds: tuple[int, ...] | None = None  # its seeds when --seeds is not given (None: 0 1 2)


# the studies' runs: the paper preset's (80 steps of tiny-moe on arithmetic, 500 held-out problems)
STUDY_BASE = {"model": "tiny-moe", "steps": 80, "eval_every": 10, "eval_size": 500}

COMPARE_PRESETS = {
    "paper": ComparePreset(DEFAULT_CONFIGS, {"model": "tiny-moe", "steps": 80, "eval_every": 10},
                           about="GSPO, GRPO, GRPO + Routing Replay on tiny-moe, arithmetic (4-token answers)"),
    # where expert drift reaches the paper's ~10%: Qwen3-MoE's fine-grained routing scaled down (32 experts, top-8),
    # 16 minibatches a rollout at lr 3e-4; 6 seeds and the task's 1000 held-out problems; docs/moe.md
    "moe": ComparePreset(
        DEFAULT_CONFIGS,
        {"model": "tiny-moe-wide", "num_minibatches": 16, "lr": 3e-4, "steps": 40, "eval_every": 10,
         "eval_size": 1000}, variance_models=("tiny-moe-wide", "tiny-moe"), seeds=(0, 1, 2, 3, 4, 5),
        about="GSPO, GRPO, GRPO + RR on tiny-moe-wide where moe/drift reaches ~11% (6 seeds); ratio variance with "
              "the router free and replayed"),
    # long answers (55-217 tokens): where token and sequence ratios part ways; docs/length.md
    "length": ComparePreset(
        ("gspo", "grpo", "grpo-rr", "gspo_token"),
        {"model": "tiny-long-moe", "task": "chain", "steps": 10, "prompts_per_step": 8, "eval_every": 5,
         "eval_size": 100, "lr": 2e-4, "samples_per_step": 2},
        variance_models=("tiny-long-moe", "tiny-long"),
        about="GSPO, GRPO, GRPO + RR, GSPO-token on tiny-long-moe, chain (long answers); ratio variance"),
    # batch t sampled by the policy K versions older than the one it trains (fixed lag); docs/staleness.md
    "staleness": ComparePreset(
        ("gspo", "grpo", "grpo-rr", "cispo", "gspo-behaviour", "grpo-behaviour"), STUDY_BASE, axis="staleness",
        about="GSPO, GRPO, GRPO + RR, CISPO (pi_old proximal) and GSPO, GRPO (behaviour) at lags K = 0, 2, 8; "
              "tiny-moe, arithmetic"),
    # the same lags on the long-answer chains (verl#7356): GSPO's clip fraction at the paper's range and with a
    # range that sets itself, pi_old proximal (recomputed) or the behaviour policy; docs/staleness.md
    "staleness-chain": ComparePreset(
        ("gspo", "gspo-target", "gspo-behaviour", "gspo-target-behaviour"),
        {"model": "tiny-long-moe", "task": "chain", "steps": 20, "prompts_per_step": 8, "eval_every": 5,
         "eval_size": 100, "lr": 2e-4, "samples_per_step": 2}, axis="staleness", levels=(0, 1, 2, 4, 8),
        about="GSPO at the paper's clip range and holding clip/frac 0.15, pi_old proximal or behaviour, at lags "
              "K = 0, 1, 2, 4, 8; tiny-long-moe, chain (long answers)"),
    # sampler and trainer computing in fp32 / bf16 / fp16 (fp32 master weights); docs/precision.md
    "precision": ComparePreset(
        ("gspo", "grpo", "gspo-tis", "grpo-tis"), {**STUDY_BASE, "steps": 60}, axis="precision",
        about="GSPO, GRPO, with and without TIS, sampler and trainer in fp32 / bf16 / fp16; tiny-moe, arithmetic"),
    # the objectives after GSPO: divergence masks, prefix-cumulative ratios, a clip range that sets itself, on
    # the long-answer chains and the paper's arithmetic (each task with its model and sizes); docs/objectives.md
    "objectives": ComparePreset(
        ("gspo", "grpo", "dppo_tv", "ctpo", "cppo", "gspo-target"), {}, axis="task",
        about="GSPO, GRPO, DPPO (TV), CTPO, CPPO, GSPO holding clip/frac 0.15, on chain (tiny-long-moe) and "
              "arithmetic (tiny-moe)"),
}


def _flags(options: dict) -> str:
    """`{"model": "tiny-moe", "lr": 2e-4}` -> `--model tiny-moe --lr 0.0002` (as gspo train takes them)."""
    return " ".join(f"--{k.replace('_', '-')} {v:g}" if isinstance(v, float) else f"--{k.replace('_', '-')} {v}"
                    for k, v in options.items())


def _base_lines(p: ComparePreset) -> str:
    """A preset's base options as flags, and each of its levels' own (`--task chain: --model ...`)."""
    from gspo.lab.studies import AXES

    pad = " " * 25
    lines = [f"{pad}({_flags(p.base)})"] if p.base else []
    axis = AXES[p.axis] if p.axis else None
    for level, options in (axis.level_options.items() if axis else ()):
        lines.append(f"{pad}--{axis.option.replace('_', '-')} {level}: ({_flags(options)})")
    return "\n".join(lines)


def compare_help() -> str:
    """`gspo compare --help`'s own part (the base options follow it)."""
    presets = "\n".join(f"{' ' * 23}{name}: {p.about}\n{_base_lines(p)}" for name, p in COMPARE_PRESETS.items())
    return ("gspo compare: train several configurations on the same model, task and seeds; write a report.\n"
            "  --preset NAME        a named comparison (default: paper), with its base options:\n"
            f"{presets}\n"
            f"  --configs NAME ...   presets: {', '.join(PRESETS)}; or name:key=value,key=value\n"
            "                       (default: the preset's)\n"
            "  --seeds N ...        seeds (default: 0 1 2; the moe preset 0-5); results are averaged over them\n"
            "  --lags K ...         the staleness preset's fixed lags (default: 0 2 8; the full grid: 0 1 2 4 8)\n"
            "  --precisions D ...   the precision preset's dtypes (default: float32 bfloat16 float16)\n"
            "  --tasks T ...        the objectives preset's tasks (default: chain arithmetic), each with its model\n"
            "                       and sizes; an option given here holds at every task\n"
            "  --variance-responses N  responses sampled for the length preset's ratio variance (default 512)\n"
            "  --jobs N             runs trained at once, each in its own process (default 0: one per core\n"
            "                       up to 4 on a CPU, with the cores shared out as --threads; 1 on a GPU);\n"
            "                       each run equals `gspo train` alone with its --threads (gspo.lab.jobs)\n"
            "  --plan               train nothing: the minimum detectable difference (80% power, Holm over the\n"
            "                       differences the report will judge) at these seeds and --eval-size, the seeds\n"
            "                       and held-out problems a difference needs, one seed against more problems per\n"
            "                       CPU minute (gspo.lab.plan; the spreads from the preset's stored study)\n"
            "  --detect POINTS ...  --plan: differences to size for, in points of accuracy (default: 5 10)\n"
            "  --pilot DIR          --plan: take the spreads from this comparison's compare.json instead\n"
            "  --output-dir DIR     report directory (default: runs/compare-<date>-<time>); given again, its\n"
            "                       runs of the same configuration, gspo version and files (--dataset,\n"
            "                       --reward, ...) are reused or resumed, others set aside (<run>.replaced-<k>)\n"
            "                       and trained again\n"
            "Every gspo train option sets the base configuration over the preset's (stress length with\n"
            "--num-minibatches 8 or 16, a higher --lr, or a --model built with more experts).\n")


def parse_config(spec: str) -> tuple[str, dict]:
    """A preset name, or `name:key=value,key=value` (values parsed as YAML, checked by type; a list
    in brackets keeps its commas)."""
    if ":" not in spec:
        if spec not in PRESETS:
            raise ConfigError(f"unknown configuration {spec!r}; presets: {', '.join(PRESETS)}, "
                              "or name:key=value,key=value")
        return spec, dict(PRESETS[spec])
    name, _, body = spec.partition(":")
    fields = set(SECTION_OF)
    out = {}
    for item in filter(None, _items(body)):
        key, eq, raw = item.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or key not in fields:
            raise ConfigError(f"configuration {name!r}: {item!r} is not key=value with a gspo train option as key")
        out[key] = check_value(key, yaml_value(raw), f"configuration {name!r}: {key}")
    return name, out


def _items(body: str) -> list[str]:
    """`key=value,key=value` split at the commas outside brackets: a value may be a YAML flow list
    (`reward=[exact_integer,judge:tiny]`) or mapping.

    >>> _items("reward=[a,b],reward_weights=[0,1],lr=1e-3")
    ['reward=[a,b]', 'reward_weights=[0,1]', 'lr=1e-3']
    """
    items, depth, start = [], 0, 0
    for i, c in enumerate(body):
        depth += (c in "[{") - (c in "]}")
        if c == "," and depth == 0:
            items.append(body[start:i])
            start = i + 1
    return [*items, body[start:]]


def _mean(xs):
    xs = [x for x in xs if x is not None and isinstance(x, (int, float)) and math.isfinite(x)]
    return statistics.fmean(xs) if xs else None


def summarise(run_dir: Path) -> dict:
    rows = read_jsonl(run_dir / "metrics.jsonl")
    summary = json.loads((run_dir / "summary.json").read_text())
    evals = [e["accuracy"] for e in summary.get("evals", []) if e.get("accuracy") is not None]
    final = summary["eval_after"]["accuracy"]  # None: no evaluation, or the reward scored no completion
    def bad(v):  # NaN/inf are written to metrics.jsonl as null
        return v is None or (isinstance(v, float) and not math.isfinite(v))

    nonfinite = any(k in r and bad(r[k]) for r in rows for k in ("loss/policy", "grad_norm"))
    return {
        "accuracy": final,
        "accuracy_before": summary["eval_before"]["accuracy"],
        "accuracy_best": max(evals + [final], default=None, key=lambda a: -1 if a is None else a),  # the best reached
        "accuracy_curve_mean": _mean(evals),  # the mean over the run's evaluations: how fast it learned
        "clip_frac_mean": _mean([r.get("clip/frac") for r in rows]),
        "drift_mean": _mean([r.get("moe/drift") for r in rows]),
        "drift_in_ratio_mean": _mean([r.get("moe/drift_in_ratio") for r in rows]),
        "mismatch_mean": _mean([r.get("mismatch/token_abs") for r in rows]),
        "mismatch_seq_mean": _mean([r.get("mismatch/seq_log_ratio") for r in rows]),
        "seq_log_abs_mean": _mean([r.get("ratio/seq_log_abs") for r in rows]),
        "token_spread_mean": _mean([r.get("ratio/token_spread") for r in rows]),
        "staleness_mean": _mean([r.get("async/staleness_mean", 0.0) for r in rows]),
        "is_truncated_mean": _mean([r.get("is/truncated_frac") for r in rows]),  # with --rollout-is truncate
        "eps_high_mean": _mean([r.get("clip/eps_high") for r in rows]),  # with --target-clip-frac: the range used
        "reward_last10_mean": _mean([r.get("reward/mean") for r in rows[-10:]]),
        "grad_norm_max": max((r["grad_norm"] for r in rows if not bad(r.get("grad_norm"))), default=None),
        "diverged": bool(nonfinite or (evals and final is not None and final < max(evals) - COLLAPSE_POINTS)),
        "wall_seconds": summary["wall_seconds"],
        "eval_seconds": summary.get("eval_seconds"),  # of wall_seconds (runs before it was recorded: None)
        "eval_n": summary["eval_after"].get("n") or 0,  # held-out problems each accuracy is measured on
    }


@dataclass(frozen=True)
class CompareOptions:
    """How a comparison runs beyond its configurations. variance_models: also measure the ratio
    variance by response length of each of these models under the base configuration
    (gspo.lab.variance), from `variance_responses` sampled responses per model. jobs: runs trained at
    once, each in a process of its own (0: gspo.lab.jobs.plan_jobs chooses; 1: one after another in
    this process)."""

    variance_models: tuple[str, ...] = ()
    variance_responses: int = 512
    jobs: int = 1


def compare(base: TrainConfig, configs: list[str | tuple[str, dict]] | Study, *, seeds: list[int],
            out_dir: str | Path, log=print, options: CompareOptions = CompareOptions()) -> dict:
    """Train every configuration for every seed; write compare.json, report.md and the plots.
    configs: preset names, `name:key=value,...` specs or (name, options) pairs; or a Study, whose
    configurations run at every level of its factor, tabled and plotted against it (gspo.lab.studies).
    options: the ratio variance by response length (variance.md, .json, .png) and the runs at
    once (CompareOptions)."""
    out = Path(out_dir)
    study = configs if isinstance(configs, Study) else None
    specs = study.expand() if study else [c if isinstance(c, tuple) else parse_config(c) for c in configs]
    names = [n for n, _ in specs]
    if len(set(names)) != len(names):
        raise ConfigError(f"configuration names repeat: {', '.join(names)}")
    if out.exists() and any(out.iterdir()) and not (out / "runs").is_dir():
        raise FileExistsError(f"{out}: exists, is not empty, and is not a gspo compare directory")
    cfgs = _configs(base, specs, seeds, out)  # every configuration checked before any of them trains
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    results = _train_all(cfgs, log, options.jobs)
    report = {name: aggregate(per_seed) for name, per_seed in results.items()}
    atomic_write_text(out / "compare.json", json.dumps(json_clean(report), indent=2) + "\n")
    models = options.variance_models
    if models and not (out / "variance.json").exists():
        from gspo.lab.variance import write_variance

        log(f"[compare] ratio variance by response length: {', '.join(models)}")
        cfgs = [dataclasses.replace(base, model=m) for m in models]
        write_variance(ratio_variances(cfgs, options.variance_responses,
                                       *plan_jobs(base, len(cfgs), options.jobs), log=log), out)
    write_report(out, base, report, seeds, time.time() - t0, study=study)
    return report


def _configs(base: TrainConfig, specs: list[tuple[str, dict]], seeds: list[int], out: Path) -> dict:
    """(name, seed) -> (the run's configuration, the earlier run it resolves the same as or None),
    each configuration resolved once (a bad value raises here). `gspo@K0` and `gspo-behaviour@K0`
    are one run: at K = 0 both anchors are the sampling pass."""
    cfgs, first = {}, {}  # first: the resolved configuration (without its directory) -> its run
    for name, overrides in specs:
        for seed in seeds:
            run = out / "runs" / f"{name}-seed{seed}"
            cfg = dataclasses.replace(base, **{**overrides, "seed": seed, "output_dir": str(run)})
            twin = first.setdefault(repr(dataclasses.replace(resolve(cfg), output_dir=None)), run)
            cfgs[(name, seed)] = (cfg, None if twin == run else twin)
    return cfgs


def _train_all(cfgs: dict, log, jobs: int = 1) -> dict[str, dict]:
    """Train each run not done yet (resuming an interrupted one), `jobs` at a time (0: as
    gspo.lab.jobs.plan_jobs chooses; each job in a process of its own); configuration -> seed -> its
    figures. A run that resolves the same as an earlier one is not trained again: its directory
    links to the earlier one's. A run directory trained with another configuration is set aside
    (_to_train)."""
    pending, asked = [], []
    for (name, seed), (cfg, same) in cfgs.items():
        todo = _to_train(f"{name} seed {seed}", cfg, log) if same is None else None
        if todo is not None:
            pending.append(todo)
            asked.append(cfg)
    if pending:  # planned on the asked configuration: a resumed run's own threads do not count
        train_runs(pending, *plan_jobs(asked[0], len(pending), jobs), log=log)
    results: dict[str, dict] = {}
    for (name, seed), (cfg, same) in cfgs.items():
        run = Path(cfg.run.output_dir)
        if same is not None:
            log(f"[compare] {name} seed {seed}: the same run as {same.name}; linked")
            if not run.is_symlink():
                run.parent.mkdir(parents=True, exist_ok=True)
                run.symlink_to(same.name, target_is_directory=True)
        results.setdefault(name, {})[seed] = summarise(run)
    return results


def _to_train(label: str, cfg: TrainConfig, log) -> tuple | None:
    """What a run directory needs: None (finished with the configuration asked for: reused), or
    (label, configuration, the directory to resume or None). A run started (a config.yaml) and
    not finished resumes with its saved configuration and threads; one whose saved configuration
    is not `cfg`, or whose inputs changed since (its fingerprint: the gspo version, the files its options
    name; gspo.lab.jobs.saved_config), is set aside as `<run>.replaced-<k>` and trained again."""
    run = Path(cfg.run.output_dir)
    finished = (run / "summary.json").exists()
    if not finished and not (run / "config.yaml").exists() and ckpt.latest_checkpoint(run) is None:
        return label, cfg, None
    saved, why = saved_config(run, cfg)
    if why is not None:
        aside = set_aside(run)
        log(f"[compare] {label}: {run} {why}; set aside as {aside} and "
            f"{'trained again' if finished else 'trained from the start'}")
        return label, cfg, None
    if finished:
        log(f"[compare] {label}: already done, reusing {run}")
        return None
    return label, resumed(saved, cfg), run


def train_runs(runs: list[tuple[str, object, Path | None]], jobs: int, threads: int, log=print) -> None:
    """Train each (label, config, resume directory or None): in this process when jobs is 1,
    else up to `jobs` at once in spawned processes, each run with `threads` torch threads but a
    resumed one, which keeps its configuration's (the count it began with: it shapes the arithmetic).
    Either way each run's lines carry its label (`[gspo seed 0] step 8/80 (10%) ...`, a line per
    10% of its steps, never a bar) and `[compare] LABEL: done in N s` comes as that run ends."""
    log = flushing(log)  # a pipe's buffer would hold this process's lines back behind the jobs' own
    if jobs <= 1 or len(runs) <= 1:
        for label, cfg, resume in runs:
            log(f"[compare] {label}: done in {_train_one(label, cfg, resume, log):.0f} s")
        return
    log(f"[compare] {plural(len(runs), 'run')}, {jobs} at a time, {plural(threads, 'thread')} each "
        f"(each run equals `gspo train --threads {threads}` alone)")
    in_processes([(label, _train_one, (label, for_job(cfg, None if resume else threads), resume))
                  for label, cfg, resume in runs], jobs, log,
                 done=lambda label, s: log(f"[compare] {label}: done in {s:.0f} s"))


def ratio_variances(cfgs: list, responses: int, jobs: int, threads: int, log=print) -> list[dict]:
    """gspo.lab.variance.ratio_variance of each configuration (one per model), side by side as
    train_runs trains (each with `threads` threads) when jobs > 1; `[compare] MODEL: ratio variance
    done in N s` as each ends."""
    log = flushing(log)

    def said(model, result):
        log(f"[compare] {model}: ratio variance done in {result[1]:.0f} s")
        return result[0]

    if jobs <= 1 or len(cfgs) <= 1:
        return [said(cfg.policy.model, _variance_one(cfg, responses, log)) for cfg in cfgs]
    return [r for r, _ in in_processes([(cfg.policy.model, _variance_one, (for_job(cfg, threads), responses))
                                        for cfg in cfgs], jobs, log, done=said)]


def _train_one(label: str, cfg: TrainConfig, resume, log=None) -> float:
    """A run; its wall seconds. Its lines (its progress among them: lines, never a bar) carry its
    label, the one announcing it excepted. log None: a job's (in its own process), printed."""
    from gspo.io.reporting import progress_as_lines
    from gspo.train.trainer import train

    log = log or line_on_stdout
    t0 = time.time()
    what = "training" if resume is None else f"resuming {resume}"
    kept = "" if resume is None else f", threads={cfg.run.threads} as it began"  # whatever --jobs now (0: torch's)
    log(f"[compare] {label}: {what} ({cfg.loss.algorithm}, {plural(cfg.run.steps, 'step')}{kept})")
    with progress_as_lines():
        train(cfg, resume=resume, log=labelled(label, log))  # puts this process's thread count back
    return time.time() - t0


def _variance_one(cfg: TrainConfig, responses: int, log=None) -> tuple[dict, float]:
    """A ratio-variance measurement (gspo.lab.variance) and its wall seconds; its line names its model
    (`[variance] MODEL: ...`). log None: a job's (in its own process), printed."""
    from gspo.lab.variance import ratio_variance

    t0 = time.time()
    return ratio_variance(cfg, responses=responses, log=log or line_on_stdout), time.time() - t0
