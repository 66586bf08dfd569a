"""The cost of a teacher's pass (on-policy distillation, gspo.train.distill): step time and peak memory
of a `gspo train` run without a teacher, with a float32 teacher and with a bfloat16 copy, on the
same model shapes (the teacher is the student's own weights: the pass costs the same as any teacher of
that shape).

    python benchmarks/teacher_pass.py                       # tiny and mid, 4 steps each
    python benchmarks/teacher_pass.py --configs mid --steps 6

Each variant is one `gspo train` process (benchmarks/common.train_variant); its figures are the means
over its steps after the first: time/step_seconds, time/prepare_seconds (the old-policy pass and the
teacher's), time/teacher_seconds (the teacher's pass alone), and the process's own peak RSS (its
ru_maxrss, written by the process into its run directory as it ends).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from common import mean_of, model_path, train_variant, variant_dir

# `gspo train` in this process, then its peak RSS (MB) written to <run>/peak_rss_mb
WRAP = ("import resource, sys; from pathlib import Path; from gspo.cli import main; code = main(sys.argv[1:]); "
        "Path(sys.argv[sys.argv.index('--output-dir') + 1], 'peak_rss_mb').write_text("
        "str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)); sys.exit(code)")

VARIANTS = {"no teacher": [], "teacher float32": ["--teacher-dtype", "float32"],
            "teacher bfloat16": ["--teacher-dtype", "bfloat16"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="tiny,mid")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="teacher-pass-"))
    print("| model | variant | s/step | prepare s/step | teacher s/step | peak RSS MB |")
    print("| --- | --- | --- | --- | --- | --- |")
    for config in args.configs.split(","):
        model = "tiny" if config == "tiny" else model_path(config)
        for name, extra in VARIANTS.items():
            run = variant_dir(out, f"{config}-{name}")
            teacher = ["--teacher", model, *extra] if extra else []
            cmd = [sys.executable, "-c", WRAP, "train", "--model", model, "--steps", str(args.steps),
                   "--eval-size", "0", "--no-progress", "--algorithm", "grpo", "--output-dir", str(run), *teacher]
            got = train_variant(f"{config} {name}", cmd, run)
            if got is None:
                continue
            _, rows, _ = got
            rows = rows[1:] or rows
            rss = float((run / "peak_rss_mb").read_text())
            teacher_s = mean_of(rows, "time/teacher_seconds")
            print(f"| {config} | {name} | {mean_of(rows, 'time/step_seconds'):.2f} | "
                  f"{mean_of(rows, 'time/prepare_seconds'):.2f} | "
                  f"{'' if teacher_s is None else f'{teacher_s:.2f}'} | {rss:.0f} |", flush=True)


if __name__ == "__main__":
    main()
