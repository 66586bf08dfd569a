"""The configuration matrix: every combination of the options that combine runs, or is refused in
one line before anything is written (docs/matrix.md).

The full product of the factors below is 3·3·2·3·2·2·2·11·2·4·2·3 = 228,096 runs; a covering array
of strength 2 (every pair of levels of every two factors in at least one cell) has 44: 36 run
in this process, 8 under torchrun (printed by `python tests/test_matrix.py`). It is built here
by a small greedy algorithm (AETG-style: each new cell is the best of a few seeded random
candidates, each candidate filled factor by factor with the level that covers the most pairs not
yet covered, ties to the cheaper level), deterministic for its seed.

Two kinds of pairs are not asked of the array:
- pairs that are refused (REFUSED: the calculator's chat episodes on the MoE model, which has
  no chat template; --target-clip-frac with SAPO's gate, which has no clip range). The array
  never holds one; each is run on its own as a refusal cell, which
  must exit 2 with the table's one-line message and create nothing (so is each refusal in
  ALSO_REFUSED, of an option next to the factors);
- pairs of the process layout with the loss and its corrections (algorithm, --rollout-is,
  --opsm-delta): those are per-token functions of the same tensors on every process, and the
  process-count invariance of the loss normalisation is tested on its own (test_distributed.py,
  gspo and ppo, 2 processes = 1 process to 1e-5). Asking for them would make two thirds of the
  cells torchrun runs; without them the 2-process cells are the few that cover the layout's
  pairs with precision, episodes, model, LoRA, micro-batches and packing.

A cell that runs must exit 0, write its checkpoint and log a finite loss, and its resolved plan
(summary.json's "plan", gspo.train.plan) must be what it asked for. One-process cells run in this
process through gspo.cli.main; 2-process cells (DDP and FSDP, gloo) through torchrun and are
marked slow.
"""

import itertools
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

FACTORS = {  # factor -> its levels; the first level is the cheapest, which ties prefer
    "layout": ["1", "ddp", "fsdp"],
    "precision": ["fp32", "bf16", "bf16-pure"],
    "turns": ["single", "calculator"],
    "model": ["dense", "moe", "moe-replay"],
    "lora": ["off", "on"],
    "micro": ["off", "on"],
    "packing": ["off", "on"],
    "algorithm": ["gspo", "grpo", "gspo_token", "ppo", "cispo", "sapo", "gmpo", "dppo_tv", "dppo_kl", "cppo", "ctpo"],
    "clip": ["fixed", "target"],  # --target-clip-frac 0.2: the clip range adapted between steps
    "rollout_is": ["off", "token", "sequence", "geometric"],
    "opsm": ["off", "on"],
    "rollouts": ["sync", "lag", "workers"],  # --max-staleness 1, without and with a rollout worker
}
NOT_PAIRED = {("layout", "algorithm"), ("layout", "rollout_is"), ("layout", "opsm")}  # see the docstring
REFUSED = [  # (the levels that are refused together, a fragment of the one-line message)
    ({"turns": "calculator", "model": "moe"}, "the tokenizer of tiny-moe has no chat template"),
    ({"turns": "calculator", "model": "moe-replay"}, "the tokenizer of tiny-moe has no chat template"),
    ({"algorithm": "sapo", "clip": "target"}, "--target-clip-frac 0.2: --algorithm sapo gates instead of clipping"),
]
ALSO_REFUSED = [  # refusals of an option next to the factors: (a base cell, the extra flags, the message fragment)
    ({"model": "moe-replay"}, ["--gradient-checkpointing"],
     "routing_replay: cannot be combined with --gradient-checkpointing"),
    ({"model": "dense"}, ["--routing-replay"], "--routing-replay: tiny is not a Mixture-of-Experts model"),
    ({"rollout_is": "token"}, ["--old-logp", "sampling"], "old_logp: sampling cannot be combined with --rollout-is"),
    ({"opsm": "on"}, ["--old-logp", "sampling"], "old_logp: sampling cannot be combined with --rollout-is or --opsm"),
    ({"turns": "calculator", "algorithm": "gspo"}, ["--turn-advantages"], "turn_advantages: needs a token-level loss"),
]
XFAIL = {}  # cell index -> the defect, in one line (none today)
SEED, CANDIDATES = 0, 20


def refused(cell: dict) -> str | None:
    """The expected refusal's message fragment, or None when the cell should run."""
    for levels, fragment in REFUSED:
        if all(cell.get(f) == v for f, v in levels.items()):
            return fragment
    return None


def required_pairs() -> set:
    pairs = set()
    for f, g in itertools.combinations(FACTORS, 2):
        if (f, g) in NOT_PAIRED or (g, f) in NOT_PAIRED:
            continue
        for a, b in itertools.product(FACTORS[f], FACTORS[g]):
            if refused({f: a, g: b}) is None:
                pairs.add(((f, a), (g, b)))
    return pairs


def pairs_of(cell: dict) -> set:
    items = [(f, cell[f]) for f in FACTORS if f in cell]
    return set(itertools.combinations(items, 2))


def covering_array(seed: int = SEED) -> list[dict]:
    """A strength-2 covering array of FACTORS (less NOT_PAIRED), no cell refused: greedy, seeded."""
    rng = random.Random(seed)
    todo = required_pairs()
    cells = []
    while todo:
        best, best_key = None, None
        for _ in range(CANDIDATES):
            (f, a), (g, b) = rng.choice(sorted(todo))  # start from a pair still to cover
            cell = {f: a, g: b}
            rest = [h for h in FACTORS if h not in cell]
            rng.shuffle(rest)
            for h in rest:
                options = []
                for i, v in enumerate(FACTORS[h]):
                    trial = {**cell, h: v}
                    if refused(trial) is None:
                        options.append((-len(pairs_of(trial) & todo), i, rng.random(), v))
                cell[h] = min(options)[3]
            key = (-len(pairs_of(cell) & todo), sum(FACTORS[h].index(cell[h]) for h in ("layout",)))
            if best_key is None or key < best_key:
                best, best_key = cell, key
        todo -= pairs_of(best)
        cells.append({f: best[f] for f in FACTORS})
    return cells


CELLS = covering_array()
TOY = ["--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "4", "--eval-size", "0",
       "--num-minibatches", "2", "--no-progress", "--seed", "0"]


def flags(cell: dict) -> list[str]:
    """The cell's `gspo train` options (less the toy sizes and the output directory)."""
    out = []
    if cell["layout"] != "1":
        out += ["--parallel", cell["layout"]]
    out += {"fp32": [], "bf16": ["--dtype", "bfloat16"],
            "bf16-pure": ["--dtype", "bfloat16", "--param-dtype", "bfloat16"]}[cell["precision"]]
    if cell["turns"] == "calculator":
        out += ["--task", "calculator", "--max-turns", "2"]  # its model: tiny-tool
    if cell["model"] != "dense":
        out += ["--model", "tiny-moe"] + (["--routing-replay"] if cell["model"] == "moe-replay" else [])
    out += ["--lora-r", "4"] if cell["lora"] == "on" else []
    out += ["--micro-batch-tokens", "32"] if cell["micro"] == "on" else []
    out += ["--packing"] if cell["packing"] == "on" else []
    out += ["--algorithm", cell["algorithm"]]
    out += ["--target-clip-frac", "0.2"] if cell["clip"] == "target" else []
    out += ["--rollout-is", cell["rollout_is"]] if cell["rollout_is"] != "off" else []
    out += ["--opsm-delta", "0.5"] if cell["opsm"] == "on" else []
    out += {"sync": [], "lag": ["--max-staleness", "1"],
            "workers": ["--max-staleness", "1", "--rollout-workers", "1"]}[cell["rollouts"]]
    return out


def toy(cell: dict) -> list[str]:
    """The toy sizes: 2 steps when batches are stale (step 2 trains a batch of version 0)."""
    return [*TOY, "--steps", "2"] if cell["rollouts"] != "sync" else [*TOY, "--steps", "1"]


def nproc(cell: dict) -> int:
    """Processes to start: 2 trainers under torchrun, plus the rollout rank of a workers cell."""
    return 1 if cell["layout"] == "1" else 3 if cell["rollouts"] == "workers" else 2


def command(cell: dict, out: Path) -> str:
    launcher = (f"torchrun --standalone --nproc-per-node={nproc(cell)} -m gspo train" if cell["layout"] != "1"
                else "gspo train")
    return " ".join([launcher, *flags(cell), *toy(cell), "--output-dir", str(out)])


def check_ran(cell: dict, run: Path, err: str):
    """A cell that ran: its checkpoint, a finite loss, and the plan it asked for."""
    name = " ".join(flags(cell))
    assert "Traceback" not in err, f"{name}: {err[-3000:]}"
    steps = 1 if cell["rollouts"] == "sync" else 2
    assert (run / "checkpoints" / f"step-{steps:06d}").is_dir(), name
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), name
    assert all(r["loss/policy"] is not None and math.isfinite(r["loss/policy"]) for r in rows), name
    if cell["rollouts"] != "sync":  # step 2 trains with version 1 the batch version 0 sampled
        assert [r["async/staleness_max"] for r in rows] == [0.0, 1.0], name
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    dtype = "float32" if cell["precision"] == "fp32" else "bfloat16"
    weights = "bfloat16" if cell["precision"] == "bf16-pure" else "float32"
    moe = cell["model"] != "dense"
    assert (cfg["dtype"], cfg["param_dtype"]) == (dtype, weights), name
    assert cfg["algorithm"] == cell["algorithm"] and cfg["rollout_is"] == cell["rollout_is"], name
    target = cell["clip"] == "target"
    assert cfg["target_clip_frac"] == (0.2 if target else None), name
    assert all(("clip/eps_high" in r) == target for r in rows), name  # the range each step used, when it moves
    assert cfg["model"] == ("tiny-moe" if moe else "tiny-tool" if cell["turns"] == "calculator" else "tiny"), name
    assert cfg["lora_r"] == (4 if cell["lora"] == "on" else 0), name
    corrects = cell["rollout_is"] != "off" or cell["opsm"] == "on"
    if corrects or dtype != "float32" or cell["rollouts"] != "sync":
        assert cfg["old_logp"] == "recompute", name  # auto resolves so: the corrections need both log-probs,
        # and stale batches take the proximal policy's
    plan = json.loads((run / "summary.json").read_text()).get("plan")
    if plan is None:  # gspo.train.plan not yet in summary.json: what config.yaml says is all there is
        return
    want = {
        "engine": "hf",
        "processes": 1 if cell["layout"] == "1" else 2,  # the trainer processes (a rollout rank is not one)
        "parallel": "none" if cell["layout"] == "1" else cell["layout"],
        "weights_dtype": weights,
        "compute_dtype": dtype,
        "micro_batch_tokens": 32 if cell["micro"] == "on" else 0,
        "moe": moe,
        "routing_replay": cell["model"] == "moe-replay",
        "packing": cell["packing"] == "on" and not moe,  # MoE routing is recorded in the padded layout
    }
    assert {k: plan.get(k) for k in want} == want, name
    assert (plan["lora"] or {}).get("r") == (4 if cell["lora"] == "on" else None), name
    assert (plan["env"] is not None) == (cell["turns"] == "calculator"), name
    mode = {"sync": "this process", "lag": "this process",
            "workers": "processes" if cell["layout"] == "1" else "ranks"}[cell["rollouts"]]
    assert plan["rollouts"]["mode"] == mode and plan["rollouts"]["max_staleness"] == (cell["rollouts"] != "sync"), name
    if corrects:
        assert plan["old_logp"] == "recompute", name
    if cell["packing"] == "on" and moe:  # asked and refused: a reason, and said as a warning
        assert plan["packing_why"].startswith("asked") and plan["packing_why"] != "asked", (name, plan["packing_why"])
        assert any("packing" in w for w in plan["warnings"]), (name, plan["warnings"])
    elif cell["packing"] == "off":
        assert plan["packing_why"] == "not asked", name


def check_refused(cell: dict, rc: int, err: str, run: Path, fragment: str):
    name = " ".join(flags(cell))
    lines = [line for line in err.splitlines() if line.startswith("gspo train: error: ")]
    assert rc == 2 and "Traceback" not in err, f"{name}: exit {rc}: {err[-3000:]}"
    assert len(lines) == 1 and fragment in lines[0], f"{name}: expected a refusal with {fragment!r}, got {err!r}"
    assert not run.exists(), f"{name}: refused, yet {run} was created"


def run_in_process(cell: dict, run: Path, capsys, extra=()) -> tuple[int, str]:
    from gspo.cli import main

    capsys.readouterr()
    rc = main(["train", *flags(cell), *extra, *toy(cell), "--output-dir", str(run)])
    return rc, capsys.readouterr().err


def expect(cell: dict, rc: int, err: str, run: Path):
    fragment = refused(cell)
    if fragment is not None:
        check_refused(cell, rc, err, run, fragment)
        return
    lines = [line for line in err.splitlines() if "error" in line]
    assert rc == 0, f"unexpected exit {rc} of: {command(cell, run)}\n" + "\n".join(lines or [err[-3000:]])
    check_ran(cell, run, err)


def marks(i: int):
    return [pytest.mark.xfail(strict=True, reason=XFAIL[i])] if i in XFAIL else []


# every cell trains, so each is slow: the fast loop (CONTRIBUTING.md) runs the refusal cells only
ONE = [pytest.param(c, id=f"cell{i:02d}", marks=[pytest.mark.slow, *marks(i)])
       for i, c in enumerate(CELLS) if c["layout"] == "1"]
TWO = [pytest.param(c, id=f"cell{i:02d}-{c['layout']}", marks=[pytest.mark.slow, *marks(i)])
       for i, c in enumerate(CELLS) if c["layout"] != "1"]
BASE = {"layout": "1", "precision": "fp32", "turns": "single", "model": "dense", "lora": "off", "micro": "off",
        "packing": "off", "algorithm": "gspo", "clip": "fixed", "rollout_is": "off", "opsm": "off", "rollouts": "sync"}
REFUSALS = [pytest.param({**BASE, **levels}, [], fragment, id="refused-" + "-".join(levels.values()))
            for levels, fragment in REFUSED]
REFUSALS += [pytest.param({**BASE, **levels}, extra, fragment, id="refused" + "".join(extra))
             for levels, extra, fragment in ALSO_REFUSED]


def test_the_array_covers_every_pair_and_holds_no_refused_cell():
    assert not required_pairs() - set().union(*map(pairs_of, CELLS))
    assert not any(refused(c) for c in CELLS)
    assert covering_array() == CELLS  # deterministic for its seed
    assert (len(CELLS), len(TWO)) == (44, 8)  # docs/matrix.md; the product of the levels is 228,096
    # every refused pair is run on its own (as a refusal cell), so every pair of levels is exercised
    assert all(refused(c) for c in [p.values[0] for p in REFUSALS][:len(REFUSED)])


@pytest.mark.parametrize("cell", ONE)
def test_one_process_cell(cell, tmp_path, capsys):
    run = tmp_path / "run"
    try:
        rc, err = run_in_process(cell, run, capsys)
    except Exception as e:  # a crash: say which cell, and the command that reproduces it
        raise AssertionError(f"crash ({type(e).__name__}: {e}) of: {command(cell, run)}") from e
    expect(cell, rc, err, run)


@pytest.mark.parametrize("cell,extra,fragment", REFUSALS)
def test_refused_cell(cell, extra, fragment, tmp_path, capsys):
    """A refused pair of levels (or a level and an option next to the factors), each on its own."""
    run = tmp_path / "run"
    rc, err = run_in_process(cell, run, capsys, extra)
    check_refused(cell, rc, err, run, fragment)


@pytest.mark.parametrize("cell", TWO)
def test_two_process_cell(cell, tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc(cell)}",
           "-m", "gspo", "train", *flags(cell), *toy(cell), "--output-dir", str(run)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    expect(cell, res.returncode, res.stderr, run)


GPU = [pytest.param(c, id=f"cell{i:02d}-cuda", marks=[pytest.mark.gpu, pytest.mark.slow, *marks(i)])
       for i, c in enumerate(CELLS) if c["layout"] == "1"]


@pytest.mark.parametrize("cell", GPU)
def test_one_process_cell_on_cuda(cell, tmp_path, capsys):
    """The same cells on a CUDA device (skipped without one; scripts/gpu_check.sh runs them):
    CUDA autocast, the compact decode step and bf16 kernels are what only a GPU shows."""
    run = tmp_path / "run"
    rc, err = run_in_process(cell, run, capsys, ["--device", "cuda"])
    expect(cell, rc, err, run)
    assert yaml.safe_load((run / "config.yaml").read_text())["device"] == "cuda"


if __name__ == "__main__":  # print the array: python tests/test_matrix.py
    print(f"{len(CELLS)} cells cover {len(required_pairs())} pairs ({len(TWO)} with 2 processes); "
          f"{len(REFUSALS)} refusal cells")
    for i, c in enumerate(CELLS):
        print(f"cell{i:02d}", " ".join(flags(c)) or "(defaults)")
