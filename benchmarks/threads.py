"""`gspo train` alone and beside a competing CPU load, for several thread policies: which default holds up.

    python benchmarks/threads.py  # tiny model, 12 steps, every policy x every load (~10 min, 2 cores)
    python benchmarks/threads.py --model mid --steps 6 --policies all one auto

A policy is how many intra-op threads torch gets:
- `all`: every core (`--threads N`, N = the cores this process may use: torch's own default);
- `all-passive`: the same with `OMP_WAIT_POLICY=PASSIVE` (OpenMP threads sleep at once instead of
  spinning for the next parallel region);
- `one`: `--threads 1`;
- `auto`: gspo's default, `--threads 0` (gspo.processes.threads.auto_threads: the cores this process may use,
  less the load already on them when the run starts, at least 1).

A load is what else the machine runs at the same time:
- `quiet`: nothing;
- `busy`: one busy-looping process per core (a build, a browser tab's script, another job);
- `twin`: a second `gspo train` with the same policy, started together (two trainings side by side).

Each cell runs `gspo train --eval-size 0 --steps S` and reports the median `time/step_seconds` over
the steps after the first (the first warms up) and the wall time of the command; a cell is run
`--repeats` times, the median taken. The figures go to docs/performance.md ("Threads on a shared
machine").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, model_path

POLICIES = ("all", "all-passive", "one", "auto")
LOADS = ("quiet", "busy", "twin")
BUSY = "import time\nwhile True:\n    pass\n"


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def command(policy: str, model: str, steps: int, out: Path) -> tuple[list[str], dict]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    threads = {"all": cores(), "all-passive": cores(), "one": 1, "auto": 0}[policy]
    if policy == "all-passive":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    cmd = [sys.executable, "-m", "gspo", "train", "--model", model, "--steps", str(steps), "--eval-size", "0",
           "--save-every", "0", "--no-progress", "--threads", str(threads), "--output-dir", str(out)]
    return cmd, env


def one_run(policy: str, load: str, model: str, steps: int, tmp: Path) -> dict:
    """A cell's run: its median step seconds, wall seconds and the threads it used."""
    others = []
    if load == "busy":
        others = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(cores())]
        time.sleep(2.0)  # the load average starts to see them (auto reads it at start)
    try:
        runs = [command(policy, model, steps, tmp / f"{policy}-{load}-{i}") for i in range(2 if load == "twin" else 1)]
        t0 = time.perf_counter()
        procs = [subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for cmd, env in runs]
        errs = [p.communicate()[1] for p in procs]
        wall = time.perf_counter() - t0
    finally:
        for p in others:
            p.kill()
            p.wait()
    for p, err in zip(procs, errs):
        if p.returncode != 0:
            raise SystemExit(f"{policy}/{load}: gspo train failed: {err[-2000:]}")
    out = Path(runs[0][0][-1])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    cfg = (out / "config.yaml").read_text()
    used = next((line.split(":")[1].strip() for line in cfg.splitlines() if line.startswith("threads:")), "?")
    return {"step": statistics.median(r["time/step_seconds"] for r in rows[1:]), "wall": wall, "threads": used}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    ap.add_argument("--loads", nargs="+", default=list(LOADS), choices=LOADS)
    a = ap.parse_args()
    model = model_path(a.model) if a.model == "mid" else a.model
    print(f"# {cores()} cores, model {a.model}, {a.steps} steps, {a.repeats} repeats, load before: "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    results: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as d:
        for r in range(a.repeats):  # repeats outermost: every cell sees the machine's drift alike
            for load in a.loads:
                for policy in a.policies:
                    cell = one_run(policy, load, model, a.steps, Path(d) / f"r{r}")
                    results.setdefault((policy, load), []).append(cell)
                    print(f"{policy:12} {load:6} repeat {r}: step {cell['step']:.3f} s, wall {cell['wall']:.1f} s, "
                          f"threads {cell['threads']}", flush=True)
    print("\n| policy | " + " | ".join(f"{load}: median step s (wall s), threads" for load in a.loads) + " |")
    print("| --- | " + " | ".join("---" for _ in a.loads) + " |")
    for policy in a.policies:
        cells = []
        for load in a.loads:
            xs = results[(policy, load)]
            cells.append(f"{statistics.median(x['step'] for x in xs):.3f} "
                         f"({statistics.median(x['wall'] for x in xs):.1f}), {xs[0]['threads']}")
        print(f"| {policy} | " + " | ".join(cells) + " |")
    one = {load: statistics.median(x["step"] for x in results[("one", load)]) for load in a.loads} \
        if "one" in a.policies else None
    if one:
        print("\nslowdown against --threads 1 under the same load (median step):")
        for policy in a.policies:
            print(f"  {policy:12} " + "  ".join(
                f"{load} {statistics.median(x['step'] for x in results[(policy, load)]) / one[load]:.2f}x"
                for load in a.loads))


if __name__ == "__main__":
    main()
