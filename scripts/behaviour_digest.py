"""Behaviour digest: prove that a refactor of gspo leaves training byte-identical.

    python scripts/behaviour_digest.py run --tree DIR --out digest.json [--work WORKDIR] [--only NAME ...] [--jobs 1]
    python scripts/behaviour_digest.py compare A.json B.json

DIR is a source tree of gspo, e.g. the commit before a change: `git archive HEAD | tar -x -C /tmp/before`.
`run` trains every configuration in CONFIGS with the gspo package found in DIR (cwd=DIR and
PYTHONPATH=DIR prepended, the rest of the environment as it is; the imported gspo.__file__ is
recorded to prove which tree ran) into WORKDIR/<name>, and writes per configuration:
  metrics   sha256 of metrics.jsonl, timing keys removed from every row; its remaining keys; the
            last row, filtered (so a diff names the value that moved)
  summary   sha256 of summary.json, timing keys removed, the run dir / tree paths replaced
  config    sha256 of config.yaml without output_dir, the run dir / tree paths replaced
  samples   sha256 of samples.jsonl (prompts, completions, rewards, advantages)
  weights   sha256 over every tensor of every *.safetensors (and PPO's value_head.pt) of the newest
            checkpoints/step-N (file, name, dtype, shape, bytes in sorted order: metadata does not count)
  files     the run dir's files (relative, sorted; no tensorboard/, no lock files)
A failed run records its return code and the last 20 lines of stderr; the others still run.
`compare` prints `same` or what differs per configuration; exit 1 if anything differs or failed.
"""

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SMALL = ["--steps", "3", "--prompts-per-step", "4", "--group-size", "4", "--eval-size", "16", "--save-every", "0"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
# name -> (launcher: "1" or "torchrun", flags); resume: a first run to --steps 2, then --resume to 4
CONFIGS = {
    "default": ("1", []),
    "grpo-beta": ("1", SMALL + ["--algorithm", "grpo", "--beta", "0.04"]),
    "ppo-separate": ("1", SMALL + ["--algorithm", "ppo", "--critic", "separate"]),
    "ppo-shared": ("1", SMALL + ["--algorithm", "ppo", "--critic", "shared"]),
    "moe-replay": ("1", SMALL + ["--model", "tiny-moe", "--routing-replay"]),
    "moe-aux": ("1", SMALL + ["--model", "tiny-moe", "--router-aux-loss-coef", "0.01"]),
    "lora-beta": ("1", SMALL + ["--lora-r", "4", "--beta", "0.04"]),
    "bf16-sampler": ("1", SMALL + ["--rollout-dtype", "bfloat16"]),
    "gspo-token": ("1", SMALL + ["--algorithm", "gspo_token"]),
    "dataset": ("1", SMALL + ["--dataset", "examples/arithmetic.jsonl", "--prompt-column", "question",
                              "--reward", "exact_integer", "--max-new-tokens", "8"]),
    "ddp": ("torchrun", SMALL),
    "fsdp": ("torchrun", SMALL + ["--parallel", "fsdp"]),
    "calculator": ("1", SMALL + ["--task", "calculator", "--max-turns", "2"]),
    "chain-moe": ("1", SMALL + ["--task", "chain", "--model", "tiny-long-moe", "--max-new-tokens", "48"]),
    "packing": ("1", SMALL + ["--micro-batch-tokens", "32", "--packing"]),
    "corrections": ("1", SMALL + ["--rollout-dtype", "bfloat16", "--old-logp", "recompute",
                                  "--rollout-is", "token", "--opsm-delta", "0.5"]),
    "cispo": ("1", SMALL + ["--algorithm", "cispo"]),
    "sapo": ("1", SMALL + ["--algorithm", "sapo"]),
    "gmpo": ("1", SMALL + ["--algorithm", "gmpo"]),
    "bf16": ("1", SMALL + ["--dtype", "bfloat16"]),
    "eval-every": ("1", SMALL + ["--eval-every", "2"]),
    "turn-adv": ("1", SMALL + ["--task", "calculator", "--max-turns", "2", "--algorithm", "grpo",
                               "--turn-advantages"]),
    "mask-trunc": ("1", SMALL + ["--mask-truncated-completions", "--max-new-tokens", "3"]),
    "fsdp-lora": ("torchrun", SMALL + ["--parallel", "fsdp", "--lora-r", "4"]),
    "resume": ("1", [a if a != "3" else "2" for a in SMALL]),  # then: --resume RUN --steps 4
    # agents: an OpenAI-client agent through the endpoint, one whose calls run at once (forked
    # sequences), a TRL environment_factory class, a verifiers taskset (its harness provisioned)
    "agent-env": ("1", SMALL + ["--model", "tiny-tool", "--task", "calculator", "--max-turns", "2",
                                "--env", "examples/agents/calculator_agent.py:rollout"]),
    "agent-fork": ("1", SMALL + ["--max-new-tokens", "8", "--env", "examples/agents/best_of_two.py:rollout"]),
    "trl-env": ("1", SMALL + ["--model", "tiny-tool", "--task", "calculator", "--max-turns", "2",
                              "--env", "examples/agents/calculator_env.py:CalculatorToolEnv"]),
    "verifiers": ("1", SMALL + ["--model", "tiny-tool", "--task", "verifiers:gspo-calculator", "--max-turns", "2",
                                "--max-new-tokens", "32"]),
}
# extra PYTHONPATH entries (relative to the tree) per configuration
PATHS = {"verifiers": ["examples/verifiers"]}
RESUME_MORE = ["--steps", "4"]
# Timing: what is wall-clock time, not behaviour (metrics.jsonl: time/*_seconds; summary.json: wall_seconds)
TIMING = re.compile(r"(^|[/_])time([/_]|$)|seconds|wall|elapsed|throughput|tokens_per|_per_s(ec)?$|/s$|_s$")
HASHED = ("metrics_sha", "metrics_keys", "summary_sha", "config_sha", "samples_sha", "weights_sha", "files")


def sha(obj) -> str:
    data = obj if isinstance(obj, bytes) else json.dumps(obj, sort_keys=True, ensure_ascii=False).encode()
    return hashlib.sha256(data).hexdigest()


def scrub(obj, subs, removed):
    """obj without timing keys (their names added to `removed`), paths in strings replaced."""
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if TIMING.search(k):
                removed.add(k)
            else:
                out[k] = scrub(v, subs, removed)
        return out
    if isinstance(obj, list):
        return [scrub(v, subs, removed) for v in obj]
    if isinstance(obj, str):
        for path, mark in subs:
            obj = obj.replace(path, mark)
    return obj


def weights_digest(ckpt: Path) -> str:
    import torch
    from safetensors.torch import load_file
    h = hashlib.sha256()  # PPO's value heads are weights too, saved as value_head.pt (a state dict)
    for f in sorted([*ckpt.rglob("*.safetensors"), *ckpt.rglob("value_head.pt")]):
        tensors = load_file(str(f)) if f.suffix == ".safetensors" else torch.load(f, weights_only=True)
        for name in sorted(tensors):
            t = tensors[name]
            h.update(f"{f.relative_to(ckpt)}:{name}:{t.dtype}:{tuple(t.shape)}\n".encode())
            h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def digest_run(run: Path, tree: Path, removed: set) -> dict:
    import yaml
    subs = [(str(run.resolve()), "<RUN_DIR>"), (str(run), "<RUN_DIR>"), (str(tree), "<TREE>")]
    rows = [scrub(json.loads(x), subs, removed) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    summary = scrub(json.loads((run / "summary.json").read_text()), subs, removed)
    config = yaml.safe_load((run / "config.yaml").read_text())
    config.pop("output_dir", None)
    config = scrub(config, subs, set())  # config keys are options, not timings: nothing removed
    steps = sorted((run / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    files = sorted(str(p.relative_to(run)) for p in run.rglob("*") if p.is_file()
                   and p.relative_to(run).parts[0] != "tensorboard" and not p.name.endswith(".lock"))
    return {
        "metrics_sha": sha(rows), "metrics_keys": sorted({k for r in rows for k in r}),
        "last_row": rows[-1] if rows else None, "summary_sha": sha(summary), "summary": summary,
        "config_sha": sha(config), "samples_sha": sha((run / "samples.jsonl").read_bytes()),
        "checkpoint": steps[-1].name if steps else None,
        "weights_sha": weights_digest(steps[-1]) if steps else None, "files": files,
    }


def run_one(name: str, tree: Path, work: Path, env: dict, removed: set) -> dict:
    launcher, flags = CONFIGS[name]
    out = work / name
    shutil.rmtree(out, ignore_errors=True)
    base = TORCHRUN if launcher == "torchrun" else [sys.executable]
    cmds = [base + ["-m", "gspo", "train", *flags, "--no-progress", "--output-dir", str(out)]]
    if name == "resume":
        cmds.append(base + ["-m", "gspo", "train", "--resume", str(out), *RESUME_MORE, "--no-progress"])
    start = time.time()
    rec = {"commands": [" ".join(c[1:]) for c in cmds]}
    for cmd in cmds:
        extra = [str(tree / d) for d in PATHS.get(name, [])]
        run_env = {**env, "PYTHONPATH": os.pathsep.join([*extra, env["PYTHONPATH"]])} if extra else env
        p = subprocess.run(cmd, cwd=tree, env=run_env, capture_output=True, text=True)
        if p.returncode != 0:
            rec.update(rc=p.returncode, stderr_tail=p.stderr.splitlines()[-20:])
            break
    else:
        rec["rc"] = 0
        try:
            rec.update(digest_run(out, tree, removed))
        except Exception as e:  # a run that exits 0 but lacks its outputs is a failure too
            rec.update(rc=-1, stderr_tail=[f"digest failed: {type(e).__name__}: {e}"])
    rec["wall_s"] = round(time.time() - start, 1)
    status = "ok" if rec["rc"] == 0 else f"FAILED rc={rec['rc']}"
    print(f"{name:14s} {rec['wall_s']:7.1f}s  {status}", flush=True)
    if rec["rc"] != 0:
        print("    " + "\n    ".join(rec["stderr_tail"]), flush=True)
    return rec


def cmd_run(args) -> int:
    tree = Path(args.tree).resolve()
    work = Path(args.work or f"{args.out}.runs").resolve()
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    imported = subprocess.run([sys.executable, "-c", "import gspo;print(gspo.__file__)"], cwd=tree, env=env,
                              capture_output=True, text=True).stdout.strip()
    print(f"gspo imported from: {imported}")
    if not imported.startswith(str(tree) + os.sep):
        print(f"error: gspo is not imported from {tree}", file=sys.stderr)
        return 2
    names = args.only or list(CONFIGS)
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        print(f"error: unknown configuration(s) {unknown}; known: {list(CONFIGS)}", file=sys.stderr)
        return 2
    removed: set = set()
    start = time.time()
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = dict(zip(names, pool.map(lambda n: run_one(n, tree, work, env, removed), names)))
    total = round(time.time() - start, 1)
    failed = [n for n, r in results.items() if r["rc"] != 0]
    print(f"total {total}s; {len(names) - len(failed)} ok, {len(failed)} failed {failed or ''}")
    print(f"timing keys removed: {sorted(removed)}")
    meta = {"tree": str(tree), "gspo_file": imported, "python": sys.executable, "total_wall_s": total,
            "timing_keys_removed": sorted(removed), "timing_pattern": TIMING.pattern}
    Path(args.out).write_text(json.dumps({"meta": meta, "configs": results}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {args.out}")
    return 1 if failed else 0


def cmd_compare(args) -> int:
    a, b = (json.loads(Path(p).read_text()) for p in (args.a, args.b))
    print(f"A: {a['meta']['gspo_file']}  ({args.a})\nB: {b['meta']['gspo_file']}  ({args.b})")
    bad = 0
    for name in list(dict.fromkeys([*a["configs"], *b["configs"]])):
        ra, rb = a["configs"].get(name), b["configs"].get(name)
        if ra is None or rb is None:
            print(f"{name:14s} MISSING in {'A' if ra is None else 'B'}")
            bad += 1
            continue
        if ra["rc"] != 0 or rb["rc"] != 0:
            print(f"{name:14s} FAILED (rc A={ra['rc']}, B={rb['rc']})")
            for side, r in (("A", ra), ("B", rb)):
                print("".join(f"    {side}: {line}\n" for line in r.get("stderr_tail", [])[-5:]), end="")
            bad += 1
            continue
        diffs = [k for k in HASHED if ra.get(k) != rb.get(k)]
        if not diffs:
            print(f"{name:14s} same")
            continue
        bad += 1
        notes = []
        if "metrics_sha" in diffs and ra.get("last_row") and rb.get("last_row"):
            la, lb = ra["last_row"], rb["last_row"]
            moved = [k for k in sorted(set(la) | set(lb)) if la.get(k) != lb.get(k)]
            notes.append(f"last row: first differing key {moved[0]!r}: {la.get(moved[0])} vs {lb.get(moved[0])}"
                         if moved else "last row identical (an earlier row differs)")
        if "summary_sha" in diffs:
            sa, sb = ra.get("summary", {}), rb.get("summary", {})
            notes.append(f"summary keys differing: {[k for k in sorted(set(sa) | set(sb)) if sa.get(k) != sb.get(k)]}")
        if "files" in diffs:
            fa, fb = set(ra["files"]), set(rb["files"])
            notes.append(f"files only in A: {sorted(fa - fb)}, only in B: {sorted(fb - fa)}")
        print(f"{name:14s} DIFFERS: {', '.join(diffs)}" + "".join(f"\n    {n}" for n in notes))
    print("all identical" if not bad else f"{bad} configuration(s) differ or failed")
    return 1 if bad else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="train every configuration with the gspo of --tree and write a digest")
    r.add_argument("--tree", required=True, help="source tree whose gspo package is tested")
    r.add_argument("--out", required=True, help="digest JSON to write")
    r.add_argument("--work", help="directory for the run dirs (default: OUT.runs)")
    r.add_argument("--only", nargs="+", metavar="NAME", help=f"only these configurations: {', '.join(CONFIGS)}")
    r.add_argument("--jobs", type=int, default=1, help="configurations run at once (default 1)")
    c = sub.add_parser("compare", help="compare two digests; exit 1 if anything differs or failed")
    c.add_argument("a")
    c.add_argument("b")
    args = p.parse_args()
    return cmd_run(args) if args.cmd == "run" else cmd_compare(args)


if __name__ == "__main__":
    sys.exit(main())
