"""`gspo compare` given the same --output-dir again: a run directory is reused (finished) or resumed
(interrupted) only when its saved configuration is the one asked for; otherwise it is set aside
as `<run>.replaced-<k>` and trained again. A resumed run keeps the thread count it began with."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest

from gspo.cli import main
from gspo.config import RESUME_SAFE, TrainConfig
from gspo.io.files import json_clean
from gspo.lab.compare import summarise
from gspo.lab.jobs import NOT_THE_RUN, differences, saved_config, set_aside
from gspo.train import checkpoint as ckpt
from gspo.train.resolve import resolve
from tests.test_cli import gspo
from tests.test_jobs import _steps

SMALL = ["--model", "tiny", "--eval-size", "8", "--prompts-per-step", "4", "--group-size", "2",
         "--num-minibatches", "1", "--no-progress"]


def _files(run):
    return {name: (run / name).read_bytes() for name in ("config.yaml", "metrics.jsonl", "summary.json")}


def test_what_is_not_the_run_is_what_a_resume_may_change():
    # a resumed run takes these from the configuration asked for: gspo.train.resolve.resume_config must allow it
    assert set(NOT_THE_RUN) - {"output_dir"} <= set(RESUME_SAFE)


def test_differences_are_between_resolved_configurations():
    asked = TrainConfig(model="tiny", steps=None, lr=1e-4)
    saved = resolve(dataclasses.replace(asked, output_dir="/elsewhere/run", threads=1, progress=False,
                                        save_every=1, samples_per_step=0))
    assert differences(saved, asked) == []  # defaults resolved the same; threads chosen by --jobs; logging
    assert differences(saved, dataclasses.replace(asked, threads=2)) == [("threads", 1, 2)]  # asked for: counts
    assert differences(saved, dataclasses.replace(asked, steps=60)) == []  # the task's default, resolved
    assert differences(saved, dataclasses.replace(asked, steps=3)) == [("steps", 60, 3)]
    # max_new_tokens left to the task's default (8) may have been capped to the model's positions
    assert differences(dataclasses.replace(saved, max_new_tokens=5), asked) == []
    assert differences(dataclasses.replace(saved, max_new_tokens=12), asked) == [("max_new_tokens", 12, 8)]


def test_the_reason_names_the_options_asked_for(tmp_path):
    asked = TrainConfig(model="tiny", steps=1, lr=1e-4)
    (tmp_path / "config.yaml").write_text(ckpt.config_yaml(resolve(asked)))
    saved, why = saved_config(tmp_path, asked)
    assert saved.run.steps == 1 and why is None
    _, why = saved_config(tmp_path, dataclasses.replace(asked, steps=3, lr=1e-2))
    assert why == "was trained with lr=0.0001, steps=1; asked: lr=0.01, steps=3"  # not critic_lr, derived from lr
    saved, why = saved_config(tmp_path / "nothing", asked)
    assert saved is None and why.startswith("has no configuration to compare (")


def test_set_aside_never_overwrites_an_earlier_one(tmp_path):
    run = tmp_path / "gspo-seed0"
    for d in (run, tmp_path / "gspo-seed0.replaced-1", tmp_path / "gspo-seed0.replaced-3"):
        d.mkdir()
        (d / "summary.json").write_text(d.name)
    assert set_aside(run) == tmp_path / "gspo-seed0.replaced-4"
    assert not run.exists() and (tmp_path / "gspo-seed0.replaced-4" / "summary.json").read_text() == "gspo-seed0"
    assert (tmp_path / "gspo-seed0.replaced-3" / "summary.json").read_text() == "gspo-seed0.replaced-3"


@pytest.mark.slow
def test_a_run_trained_with_other_options_is_set_aside_and_trained_again(tmp_path, capsys):
    out, run = tmp_path / "cmp", tmp_path / "cmp" / "runs" / "gspo-seed0"
    args = ["compare", "--configs", "gspo", "--seeds", "0", *SMALL, "--output-dir", str(out)]
    assert main([*args, "--steps", "1"]) == 0  # in this process (quicker); the user's command is the next one
    old = _files(run)

    r = gspo(*args, "--steps", "2", "--lr", "1e-2")
    assert r.returncode == 0, r.stderr
    aside = run.with_name("gspo-seed0.replaced-1")
    said = [line for line in r.stdout.splitlines() if "set aside" in line]
    assert said == [f"[compare] gspo seed 0: {run} was trained with lr=0.0001, steps=1; asked: lr=0.01, steps=2; "
                    f"set aside as {aside} and trained again"]
    assert _files(aside) == old  # moved, not deleted, nothing in it changed
    assert json.loads((run / "summary.json").read_text())["steps"] == 2
    assert "lr: 0.01" in (run / "config.yaml").read_text()
    report = json.loads((out / "compare.json").read_text())["gspo"]["seeds"]["0"]
    assert report == json.loads(json.dumps(json_clean(summarise(run))))  # the new run's figures
    assert report != json.loads(json.dumps(json_clean(summarise(aside))))  # the check can fail

    new, _ = _files(run), capsys.readouterr()
    assert main([*args, "--steps", "2", "--lr", "1e-2"]) == 0  # the same again: reused, not trained
    said = capsys.readouterr().out
    assert f"[compare] gspo seed 0: already done, reusing {run}" in said and "training (" not in said
    assert _files(run) == new and not run.with_name("gspo-seed0.replaced-2").exists()


def _compare(*args):
    """The CLI without test_cli's OMP_NUM_THREADS=1: a run resumed with threads 0 then takes torch's
    default (the cores), not the one thread it began with."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # (tests/conftest.py sets it)
    return subprocess.run([sys.executable, "-m", "gspo", "compare", *args], capture_output=True, text=True, timeout=300,
                          env=env)


@pytest.mark.slow
def test_an_interrupted_run_resumes_with_the_threads_it_began_with(tmp_path, capsys):
    out, run = tmp_path / "cmp", tmp_path / "cmp" / "runs" / "gspo-seed0"
    args = ["--configs", "gspo", "grpo", "--seeds", "0", "--jobs", "2", *SMALL, "--steps", "2", "--save-every", "1",
            "--output-dir", str(out)]
    assert main(["compare", *args]) == 0  # each run in a process of its own, of one thread
    assert "2 runs, 2 at a time, 1 thread each" in capsys.readouterr().out
    assert "threads: 1" in (run / "config.yaml").read_text()
    whole, evals = _steps(run), json.loads((run / "summary.json").read_text())["evals"]
    # interrupted after step 1: its checkpoint is the newest, no summary
    (run / "summary.json").unlink()
    shutil.rmtree(run / "checkpoints" / "step-000002")

    r = _compare(*args)  # one run left: it trains in the compare's own process, yet keeps its one thread
    assert r.returncode == 0, r.stderr
    assert f"[compare] gspo seed 0: resuming {run} (gspo, 2 steps, threads=1 as it began)" in r.stdout
    assert f"[compare] grpo seed 0: already done, reusing {out / 'runs' / 'grpo-seed0'}" in r.stdout
    assert "threads: 1" in (run / "checkpoints" / "step-000002" / "config.yaml").read_text()
    assert _steps(run) == whole  # bit for bit the uninterrupted run
    assert json.loads((run / "summary.json").read_text())["evals"] == evals
