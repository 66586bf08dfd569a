"""--packing under FSDP: the training forwards pack (observed: one packed row of real tokens
per micro-batch), and the 2-process run equals the 1-process packed run. `supports_packing`
used to run after sharding, see a DTensor LM head and turn packing off without a word."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_distributed import ARGS, ENV, assert_same_metrics, assert_same_weights, metrics, weights

pytestmark = pytest.mark.slow

# `gspo train` with the packed backbone call counted: (sequences, real tokens) per packed row
SCRIPT = """
import json, os, sys
import gspo.models.logprobs as lp
from gspo.cli import main

rows, real = [], lp._packed_hidden
def counting(backbone, mb):
    rows.append([len(mb.lengths), int(mb.prompt_mask.sum() + mb.lengths.sum())])
    return real(backbone, mb)
lp._packed_hidden = counting
code = main(["train", *sys.argv[2:]])
json.dump(rows, open(os.path.join(sys.argv[1], os.environ.get("RANK", "0") + ".json"), "w"))
sys.exit(code)
"""


def _run(tmp_path: Path, name: str, args: list[str], nproc: int):
    script = tmp_path / "count_packed.py"
    script.write_text(SCRIPT)
    out = tmp_path / name
    out.mkdir()
    launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
              if nproc > 1 else [sys.executable])
    r = subprocess.run([*launch, str(script), str(out), *args, "--output-dir", str(out / "run")], capture_output=True,
                       text=True, env={**ENV, "PYTHONPATH": os.getcwd()}, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r, out, [json.loads((out / f"{rank}.json").read_text()) for rank in range(nproc)]


def test_fsdp_packs_and_matches_one_process(tmp_path):
    args = [*ARGS, "--steps", "2", "--old-logp", "recompute", "--save-every", "0", "--micro-batch-tokens", "60",
            "--packing"]
    r1, one, (rows1,) = _run(tmp_path, "one", args, 1)
    r2, two, rows2 = _run(tmp_path, "two", [*args, "--parallel", "fsdp"], 2)
    for r in (r1, r2):
        assert "--packing: off" not in r.stderr
    for rows in (rows1, *rows2):  # every rank packed: rows of several sequences within the budget
        assert rows and max(n for n, _ in rows) > 1 and max(t for _, t in rows) <= 60, rows
    assert_same_metrics(metrics(one / "run"), metrics(two / "run"))
    assert_same_weights(weights(one / "run"), weights(two / "run"))
