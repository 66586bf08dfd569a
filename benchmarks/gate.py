"""The performance gate: the default step's parts timed against a matmul measured in the same process.

    python benchmarks/gate.py                       # compare with benchmarks/gate_baseline.json (75-100 s)
    python benchmarks/gate.py --only tiny           # the tiny model's figures alone (~35 s)
    python benchmarks/gate.py --write-baseline benchmarks/gate_baseline.json --runs 6   # refresh it (~9 min)
    python benchmarks/gate.py --plant decode=3      # every decode step 3x as long: the gate must fail

What it times. The default `gspo train` configuration (`TrainConfig()`'s defaults: GSPO, the
arithmetic task, 32 prompts x 8 completions, 4 minibatches, seed 0), built in this process with
`resolve` and `build_run` as `gspo train` builds it, on one CPU thread, on two models:

- `tiny`, the built-in model (0.8M parameters), with those defaults unchanged;
- `mid`, benchmarks/common.py's 35M Qwen3 with a 32k vocabulary (built into ~/.cache/gspo-bench on
  first use, a few seconds), with 16 prompts instead of 32: a step of 32 takes ~19 s on one thread,
  16 take ~9 s and keep the 4 minibatches (of 32 rows each).

Each model runs one warm-up step and then `STEPS` timed steps (`train_step`, the trainer's own), split
as the trainer splits them: the rollout (`time/rollout_seconds`: sampling and scoring) and the update
(`time/prepare_seconds` + `time/update_seconds`: old log-probs, advantages, the minibatches' forward,
backward and optimizer steps). Before and after every step the reference runs: `REF_REPEATS` fp32
matmuls (512 x 512) @ (512 x 2048) (1.07 GFLOP each) on the same thread. A figure is the part's time in
reference matmuls, each step's seconds over the mean of the references right before and right after it
(so that a change of the machine's speed within the run moves both), median over the steps: `tiny
rollout` 8.2 means the rollout costs as much as 8.2 such matmuls.

Both are timed in this process's CPU time (time.process_time; the trainer's clock is swapped for it
while the gate runs, `cpu_clock`), not wall time: on a shared machine another job takes turns on our
core, which wall time counts and CPU time does not (with a second job loading the 2-core machine, the
mid step's ratio spread 14% over 6 runs in wall time, 7% in CPU time). What that leaves, the cache and
memory another job shares and the machine's speed that day, the ratio to the matmul takes out.

What it compares. benchmarks/gate_baseline.json holds each figure's ratio (the median of `--runs`
separate processes), its tolerance and the runs it was set from, with the machine, date, commit and
command. A figure more than its tolerance above its baseline fails the gate (exit 1, one line each:
`gate: tiny rollout 1.62x its baseline (ratio 13.4 against 8.2; tolerance 1.27x)`); more than its
tolerance below it passes with a note to refresh the baseline. The tolerance is set when the baseline is
written, from the run-to-run spread measured then (`tolerance_for`: 1 + 2 x (max - min) / median of the
runs, at least `--min-tolerance`, 1.25); docs/performance.md says the spread measured and why.

`--plant decode=X` is for the gate's own test (tests/test_gate.py): in this process only, every decode
step of every decoder class (gspo.sampling.hfdecode.HFDecoder and its subclasses) takes X times as long
(the step runs, then the thread spins for X - 1 times the CPU time it took). gspo's code is not changed.

What it leaves out: multi-process runs, vLLM, GPUs, evaluation and checkpoints (`gspo train` does them,
the default step does not); a regression that waits rather than computes (CPU time does not count a
sleep: the default step has none); and any machine but this kind: the ratio to a matmul takes out most
of a machine's speed, not the balance between its matmul units and its Python, so a machine of another
kind needs a baseline of its own (`--write-baseline`).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import ROOT, model_path

BASELINE = Path(__file__).with_name("gate_baseline.json")
CONFIGS = {"tiny": {}, "mid": {"prompts_per_step": 16}}  # over TrainConfig()'s defaults (32 prompts)
STEPS = {"tiny": 10, "mid": 3}  # timed steps after the warm-up step
PARTS = ("rollout", "update", "step")
GATED = ("rollout", "update")  # the step is printed, not gated: it is the two parts' sum
REF_SHAPE, REF_REPEATS = (512, 512, 2048), 48  # ~0.8 s a reference on this machine
MIN_TOLERANCE = 1.25  # no figure's tolerance is tighter (--min-tolerance): CI's machine is another of this kind, often
# loaded (docs/performance.md#the-performance-gate: the same code read up to 1.23x its quiet baseline beside other jobs)
SPREAD_FACTOR = 2.0


# ----------------------------------------------------------------------------------------------
# Measuring
# ----------------------------------------------------------------------------------------------


class Reference:
    """REF_REPEATS fp32 matmuls (m x k) @ (k x n), on torch's current threads: `seconds()` is one matmul's."""

    def __init__(self):
        import torch

        m, k, n = REF_SHAPE
        g = torch.Generator().manual_seed(0)
        self.a, self.b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
        self.out = torch.empty(m, n)
        self.mm = torch.mm
        for _ in range(3):
            self.mm(self.a, self.b, out=self.out)

    def seconds(self) -> tuple[float, float]:
        """One matmul's seconds: (CPU time, wall time), each the mean of REF_REPEATS."""
        t, wall = time.process_time(), time.perf_counter()
        for _ in range(REF_REPEATS):
            self.mm(self.a, self.b, out=self.out)
        return (time.process_time() - t) / REF_REPEATS, (time.perf_counter() - wall) / REF_REPEATS

    @staticmethod
    def gflop() -> float:
        m, k, n = REF_SHAPE
        return 2 * m * k * n / 1e9


def build(name: str):
    """The default `gspo train` run on model `name`, one thread, written nowhere."""
    from gspo.config import TrainConfig
    from gspo.train.resolve import resolve
    from gspo.train.run import build_run

    cfg = resolve(TrainConfig(model=model_path(name), output_dir="-", progress=False, threads=1, seed=0,
                              **CONFIGS[name]))
    return build_run(cfg)


class _CPUClock:
    """The `time` module as gspo.train.trainer sees it while the gate times a step: `perf_counter` is this
    process's CPU time (time.process_time), so the trainer's own split of the step (time/rollout_seconds,
    ...) counts the CPU our process used, not the turns another job took on its core."""

    perf_counter = staticmethod(time.process_time)

    def __getattr__(self, name):
        return getattr(time, name)


@contextlib.contextmanager
def cpu_clock(module):
    """`module`'s clock (its `time`) is _CPUClock within the block."""
    saved = module.time
    module.time = _CPUClock()
    try:
        yield
    finally:
        module.time = saved


def measure(name: str) -> dict:
    """Model `name`'s figures: {"rollout": ratio, ..., "seconds": {part: median CPU s}, "ref_seconds": ...}."""
    import torch

    from gspo.train import trainer

    run = build(name)
    torch.set_num_threads(1)  # build_run set it from threads=1; the reference runs on the same one
    ref = Reference()
    trainer.train_step(run, 1)  # warm-up: the first step pays for first calls and allocations
    refs = [ref.seconds()]
    seconds = {part: [] for part in (*PARTS, "wall")}
    for step in range(2, 2 + STEPS[name]):
        wall = time.perf_counter()
        with cpu_clock(trainer):
            m, _ = trainer.train_step(run, step)
        seconds["wall"].append(time.perf_counter() - wall)
        refs.append(ref.seconds())
        seconds["rollout"].append(m["time/rollout_seconds"])
        seconds["update"].append(m["time/prepare_seconds"] + m["time/update_seconds"])
        seconds["step"].append(m["time/step_seconds"])
    cpu = [(b[0] + a[0]) / 2 for b, a in zip(refs, refs[1:])]  # each step's reference: before and after it
    wall_ref = [(b[1] + a[1]) / 2 for b, a in zip(refs, refs[1:])]
    out = {part: statistics.median(s / r for s, r in zip(seconds[part], cpu)) for part in PARTS}
    out["wall"] = statistics.median(s / r for s, r in zip(seconds["wall"], wall_ref))  # the step in wall time
    out["seconds"] = {part: statistics.median(seconds[part]) for part in seconds}
    out["ref_seconds"] = statistics.median(r[0] for r in refs)
    out["raw"] = {"steps": seconds, "refs": refs}  # every step's seconds, every reference's (one matmul's)
    return out


def measure_all(names: list[str]) -> dict:
    """{"figures": {"tiny rollout": ratio, ...}, "detail": {name: measure(name)}, "load": at the start}."""
    load = os.getloadavg()[0]
    detail = {name: measure(name) for name in names}
    figures = {f"{name} {part}": detail[name][part] for name in names for part in GATED}
    return {"figures": figures, "detail": detail, "load": load}


# ----------------------------------------------------------------------------------------------
# The planted slowdown (tests/test_gate.py)
# ----------------------------------------------------------------------------------------------


def _decoders() -> list[type]:
    """Every decoder class: gspo.sampling.hfdecode.HFDecoder and its subclasses, wherever defined (the
    hand-written step's, the layer step's, any added later), once each the decoding modules are imported."""
    from gspo.sampling import fastdecode, hfdecode, layerdecode  # noqa: F401  (their classes, subclassed)

    out, todo = [], [hfdecode.HFDecoder]
    while todo:
        cls = todo.pop()
        if cls not in out:
            out.append(cls)
            todo.extend(cls.__subclasses__())
    return out


def plant_decode(factor: float) -> list[str]:
    """Make every decode step `factor` times as long, in this process: the `step` method of every decoder
    class that defines one (`_decoders`) runs, then the thread spins for (factor - 1) times the CPU time
    it took. A step that calls another class's (a compact step's first step checks itself against
    HFDecoder's; FastDecoder and LayerDecoder inherit Checked's) is slowed once, as a whole. Returns the
    names of the classes patched."""
    inside = threading.local()
    patched = []
    for cls in sorted(_decoders(), key=lambda c: c.__name__):
        if "step" in vars(cls):
            cls.step = _slowed(vars(cls)["step"], factor, inside)
            patched.append(cls.__name__)
    if not patched:
        raise SystemExit("gate: --plant decode: no decoder class defines a step method")
    return patched


def _slowed(step, factor: float, inside: threading.local):
    @functools.wraps(step)
    def slowed(self, *args, **kwargs):
        if getattr(inside, "busy", False):  # called from another decoder's step: the outer one is timed
            return step(self, *args, **kwargs)
        inside.busy = True
        t = time.process_time()
        try:
            out = step(self, *args, **kwargs)
        finally:
            inside.busy = False
        _burn((factor - 1) * (time.process_time() - t))
        return out

    return slowed


def _burn(seconds: float) -> None:
    """Keep this thread busy for `seconds` of CPU time, as slower code would (a sleep would not count)."""
    until = time.process_time() + seconds
    while time.process_time() < until:
        pass


# ----------------------------------------------------------------------------------------------
# Comparing
# ----------------------------------------------------------------------------------------------


def compare(figures: dict[str, float], baseline: dict) -> tuple[list[str], list[str]]:
    """(failures, notes): a line per figure above its baseline ratio by more than its tolerance, and a
    note per figure below it by more than that, or measured with no baseline (which fails)."""
    failures, notes = [], []
    known = baseline["figures"]
    for name, ratio in figures.items():
        if name not in known:
            failures.append(f"gate: {name} has no baseline in {baseline.get('path', 'the baseline')} "
                            f"(write one: python benchmarks/gate.py --write-baseline FILE)")
            continue
        base, tol = known[name]["ratio"], known[name]["tolerance"]
        factor = ratio / base
        if factor > tol:
            failures.append(f"gate: {name} {factor:.2f}x its baseline (ratio {ratio:.1f} against {base:.1f}; "
                            f"tolerance {tol:.2f}x)")
        elif factor < 1 / tol:
            notes.append(f"gate: {name} is {1 / factor:.2f}x faster than its baseline (ratio {ratio:.1f} against "
                         f"{base:.1f}; tolerance {tol:.2f}x): refresh the baseline (python benchmarks/gate.py "
                         f"--write-baseline benchmarks/gate_baseline.json) so that it gates the new speed")
    return failures, notes


def table(measured: dict, baseline: dict | None) -> str:
    """Every figure: its seconds, its ratio to the reference and, with a baseline, its baseline and factor."""
    known = (baseline or {}).get("figures", {})
    lines = ["| figure | median CPU seconds | ratio (reference matmuls) | baseline ratio | x baseline | tolerance |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, d in measured["detail"].items():
        for part in PARTS:
            figure = f"{name} {part}"
            row = [figure, f"{d['seconds'][part]:.3f}", f"{d[part]:.1f}"]
            if figure in known:
                b = known[figure]
                row += [f"{b['ratio']:.1f}", f"{d[part] / b['ratio']:.2f}x", f"{b['tolerance']:.2f}x"]
            else:
                row += ["-", "-", "-" if part not in GATED else "(none)"]
            lines.append("| " + " | ".join(row) + " |")
    detail = measured["detail"].items()
    refs = ", ".join(f"{name} {d['ref_seconds'] * 1e3:.1f} ms ({Reference.gflop() / d['ref_seconds']:.0f} GFLOP/s)"
                     for name, d in detail)
    walls = ", ".join(f"{name} {d['seconds']['wall']:.2f} s" for name, d in detail)
    lines.append(f"reference: one fp32 matmul {REF_SHAPE[0]}x{REF_SHAPE[1]} @ {REF_SHAPE[1]}x{REF_SHAPE[2]} on 1 "
                 f"thread, CPU time, the median of each model's: {refs}; a step's wall time: {walls}; load average "
                 f"at the start {measured['load']:.2f} on {os.cpu_count()} cores")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Writing the baseline
# ----------------------------------------------------------------------------------------------


def tolerance_for(runs: list[float], floor: float = MIN_TOLERANCE) -> float:
    """A figure's tolerance from its ratio in separate runs: 1 + SPREAD_FACTOR x (max - min) / median, at
    least `floor`. Six runs' range is about 2.5 standard deviations of one run, so twice it is about 5: a
    run of unchanged code that far above the median is rare enough not to fail CI by chance, and the
    range, unlike a standard deviation, widens with the one slow run a loaded machine gives.

    >>> tolerance_for([10.0, 11.0, 12.0])   # range 2.0 of median 11.0: 1 + 2 x 0.182
    1.36
    >>> tolerance_for([10.0, 10.5])         # a tight spread gets the floor
    1.25
    """
    spread = (max(runs) - min(runs)) / statistics.median(runs)
    return round(max(floor, 1 + SPREAD_FACTOR * spread), 2)


def write_baseline(path: Path, args: argparse.Namespace) -> dict:
    """Measure `args.runs` separate processes (each `--measure-json`), one after another; write the baseline."""
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            out = Path(tmp) / f"run{i}.json"
            cmd = [sys.executable, str(Path(__file__).resolve()), "--only", ",".join(args.names),
                   "--measure-json", str(out)]
            t = time.perf_counter()
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"gate: baseline run {i + 1} failed (exit code {proc.returncode}):\n"
                                 f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
            results.append(json.loads(out.read_text()))
            print(f"run {i + 1}/{args.runs}: {time.perf_counter() - t:.0f} s, load {results[-1]['load']:.2f}, "
                  + ", ".join(f"{k} {v:.2f}" for k, v in results[-1]["figures"].items()), flush=True)
    baseline = baseline_from(results, args)
    path.write_text(dump(baseline))
    return baseline


def dump(baseline: dict) -> str:
    """The baseline as JSON: indented, each of its runs on one line."""
    head = json.dumps({k: v for k, v in baseline.items() if k != "each_run"}, indent=2)[:-2]
    runs = ",\n    ".join(json.dumps(r) for r in baseline.get("each_run", []))
    return f'{head},\n  "each_run": [\n    {runs}\n  ]\n}}\n'


def baseline_from(results: list[dict], args: argparse.Namespace) -> dict:
    """The baseline of separate runs' figures (measure_all's), with what they were measured on."""
    figures = {}
    for figure in results[0]["figures"]:
        xs = [r["figures"][figure] for r in results]
        figures[figure] = {"ratio": round(statistics.median(xs), 3), "tolerance": tolerance_for(xs, args.min_tolerance),
                           "spread": round((max(xs) - min(xs)) / statistics.median(xs), 4),
                           "min": round(min(xs), 3), "max": round(max(xs), 3), "runs": [round(x, 3) for x in xs]}
    return {
        "about": "benchmarks/gate.py's baseline: each figure's ratio to the reference matmul (the median of the "
                 "runs, CPU time over CPU time) and its tolerance (1 + 2 x (max - min) / median of the runs, "
                 f"at least {args.min_tolerance})",
        "command": shlex.join(["python", "benchmarks/gate.py", *sys.argv[1:]]),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "commit": _commit(),
        "machine": {"platform": platform.platform(), "processor": _cpu(), "cores": os.cpu_count(),
                    "python": platform.python_version(), "torch": _torch_version()},
        "note": args.note,
        "load_at_each_start": [round(r["load"], 2) for r in results],
        "configs": {name: {**CONFIGS[name], "timed_steps": STEPS[name]} for name in args.names},
        "reference": f"{REF_REPEATS} fp32 matmuls ({REF_SHAPE[0]}x{REF_SHAPE[1]}) @ ({REF_SHAPE[1]}x{REF_SHAPE[2]}), "
                     "1 thread; a ratio is CPU seconds per one of them",
        "figures": figures,
        "cpu_seconds": {f"{n} {p}": round(statistics.median(r["detail"][n]["seconds"][p] for r in results), 4)
                        for n in args.names for p in (*PARTS, "wall")},
        "each_run": _rounded(results),  # every run's figures, seconds, references and load (measure_all's)
    }


def _rounded(x, digits: int = 5):
    """`x` with every float in it rounded to `digits` significant digits (the baseline's runs, kept short)."""
    if isinstance(x, float):
        return float(f"{x:.{digits}g}")
    if isinstance(x, dict):
        return {k: _rounded(v, digits) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_rounded(v, digits) for v in x]
    return x


def _commit() -> str:
    git = ["git", "-C", str(ROOT)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "--", "gspo"], capture_output=True, text=True).stdout
    return (head or "unknown") + (" with uncommitted changes under gspo/" if dirty.strip() else "")


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _torch_version() -> str:
    import torch

    return torch.__version__


# ----------------------------------------------------------------------------------------------
# The command
# ----------------------------------------------------------------------------------------------


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", type=Path, default=BASELINE, help="the baseline to compare with")
    ap.add_argument("--only", default="tiny,mid", help=f"comma-separated models, of: {', '.join(CONFIGS)}")
    ap.add_argument("--write-baseline", type=Path, metavar="FILE", help="measure --runs processes, write FILE")
    ap.add_argument("--runs", type=int, default=6, help="separate processes measured by --write-baseline")
    ap.add_argument("--min-tolerance", type=float, default=MIN_TOLERANCE,
                    help="--write-baseline: no figure's tolerance below this factor")
    ap.add_argument("--note", default="", help="--write-baseline: a line kept in the baseline (who shared the machine)")
    ap.add_argument("--plant", metavar="decode=X", help="for the gate's test: every decode step X times as long")
    ap.add_argument("--measure-json", type=Path, metavar="FILE", help=argparse.SUPPRESS)  # a --write-baseline run
    args = ap.parse_args(argv)
    args.names = [n.strip() for n in args.only.split(",") if n.strip()]
    if not args.names or any(n not in CONFIGS for n in args.names):
        ap.error(f"--only {args.only}: choose from {', '.join(CONFIGS)}")
    if args.plant is not None:
        what, _, x = args.plant.partition("=")
        try:
            args.plant = float(x)
        except ValueError:
            args.plant = None
        if what != "decode" or args.plant is None or args.plant < 1:
            ap.error(f"--plant {what}={x}: the one plant is decode=X, X a factor of at least 1 (e.g. decode=3)")
        if args.write_baseline:
            ap.error("--plant and --write-baseline: a baseline is measured on unchanged code")
    if args.runs < 2 and args.write_baseline:
        ap.error("--runs: at least 2 (the tolerance is set from their spread)")
    if args.min_tolerance < 1:
        ap.error(f"--min-tolerance {args.min_tolerance}: a factor of at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.write_baseline:
        baseline = write_baseline(args.write_baseline, args)
        for figure, b in baseline["figures"].items():
            print(f"{figure}: ratio {b['ratio']:.2f} (runs {b['min']:.2f}-{b['max']:.2f}, spread {b['spread']:.1%}), "
                  f"tolerance {b['tolerance']:.2f}x")
        print(f"wrote {args.write_baseline}")
        return 0
    if args.plant is not None:
        patched = plant_decode(args.plant)
        steps = ", ".join(f"{name}.step" for name in patched)
        print(f"gate: planted: every decode step {args.plant:g}x as long ({steps})", flush=True)
    t = time.perf_counter()
    measured = measure_all(args.names)
    if args.measure_json:
        args.measure_json.write_text(json.dumps(measured))
        return 0
    if not args.baseline.exists():
        raise SystemExit(f"gate: no baseline {args.baseline} (write one: python benchmarks/gate.py "
                         f"--write-baseline {args.baseline})")
    baseline = {**json.loads(args.baseline.read_text()), "path": str(args.baseline)}
    print(table(measured, baseline))
    print(f"baseline: {args.baseline} ({baseline.get('date', '?')}, commit {baseline.get('commit', '?')}); "
          f"measured in {time.perf_counter() - t:.0f} s")
    failures, notes = compare(measured["figures"], baseline)
    for line in notes + failures:
        print(line)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
