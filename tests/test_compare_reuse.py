"""`gspo compare` given the same --output-dir again: a run directory is reused (finished) or resumed
(interrupted) only when its saved configuration is the one asked for and it was trained from the
same files with the same gspo (its fingerprint.json); otherwise it is set aside as
`<run>.replaced-<k>` and trained again. A resumed run keeps the thread count it began with."""

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import gspo as gspo_package
from gspo.cli import main
from gspo.config import RESUME_SAFE, TrainConfig
from gspo.io.files import json_clean
from gspo.lab.compare import _to_train, summarise
from gspo.lab.jobs import NOT_THE_RUN, differences, saved_config, set_aside
from gspo.train import checkpoint as ckpt
from gspo.train.fingerprint import FILE, write_fingerprint
from gspo.train.resolve import absolute_paths, resolve
from gspo.train.trainer import train
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
    saved, why = saved_config(tmp_path, asked)  # an older gspo's run: the same options, but no fingerprint
    assert saved.run.steps == 1 and why == (f"has no {FILE} (made by an older gspo: what it was trained from cannot "
                                            "be checked)")
    write_fingerprint(tmp_path, absolute_paths(resolve(asked)))
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


def _write_inputs(where):
    """A project's own files: a reward, training data, a held-out dataset directory, an environment."""
    (where / "rewards.py").write_text("def brevity(completions, **kwargs):\n"
                                      "    return [1.0 / (1 + len(c)) for c in completions]\n")
    rows = [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(10, 50)]
    (where / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (where / "held-out").mkdir()
    (where / "held-out" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:8]))
    (where / "env.py").write_text("class Env:\n    def step(self, text):\n        return '', 0.0, True\n")


def _finished(cfg):
    """A finished run of `cfg` as gspo train leaves one, untrained: its configuration and fingerprint as
    gspo.train.checkpoint.start_run writes them (resolved, paths absolute), and a summary."""
    run, started = Path(cfg.run.output_dir), absolute_paths(resolve(cfg))
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(ckpt.config_yaml(started))
    write_fingerprint(run, started)
    (run / "summary.json").write_text("{}")
    return run


def _asked(where):
    return TrainConfig(model="tiny", steps=1, dataset="data.jsonl", eval_dataset="held-out",
                       reward=("rewards.py:brevity",), env="env.py:Env",
                       output_dir=str(where / "cmp" / "runs" / "gspo-seed0"))


@pytest.mark.parametrize("edited, named", [
    ("rewards.py", "--reward file rewards.py"),
    ("data.jsonl", "--dataset file data.jsonl"),
    ("held-out/more.jsonl", "--eval-dataset directory held-out"),  # a file added to a dataset directory
    ("env.py", "--env file env.py"),
])
def test_a_finished_run_is_reused_only_while_its_files_are_unchanged(tmp_path, monkeypatch, edited, named):
    monkeypatch.chdir(tmp_path)  # the files are named as given, from the working directory
    _write_inputs(tmp_path)
    cfg, said = _asked(tmp_path), []
    run = _finished(cfg)
    assert _to_train("gspo seed 0", cfg, said.append) is None  # nothing changed: reused
    assert said == [f"[compare] gspo seed 0: already done, reusing {run}"]

    with open(tmp_path / edited, "a") as f:
        f.write("\n")  # one byte more
    said.clear()
    assert _to_train("gspo seed 0", cfg, said.append) == ("gspo seed 0", cfg, None)  # trained from the start
    aside = run.with_name("gspo-seed0.replaced-1")
    assert said == [f"[compare] gspo seed 0: {run} was trained before {named} changed; set aside as {aside} and "
                    "trained again"]
    assert not run.exists() and (aside / "summary.json").exists()


def test_a_run_of_another_gspo_or_without_a_fingerprint_is_set_aside(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _write_inputs(tmp_path)
    cfg, said, made = _asked(tmp_path), [], gspo_package.__version__
    run = _finished(cfg)
    monkeypatch.setattr(gspo_package, "__version__", "9.9.9")
    assert _to_train("gspo seed 0", cfg, said.append) == ("gspo seed 0", cfg, None)
    assert said == [f"[compare] gspo seed 0: {run} was trained with gspo {made} (now 9.9.9); set aside as "
                    f"{run.with_name('gspo-seed0.replaced-1')} and trained again"]

    run, said = _finished(cfg), []  # this version's run, but made before runs had a fingerprint
    (run / FILE).unlink()
    assert _to_train("gspo seed 0", cfg, said.append) == ("gspo seed 0", cfg, None)
    assert said == [f"[compare] gspo seed 0: {run} has no {FILE} (made by an older gspo: what it was trained from "
                    f"cannot be checked); set aside as {run.with_name('gspo-seed0.replaced-2')} and trained again"]


def _sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.slow
def test_a_trained_run_is_reused_until_its_reward_file_changes(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    _write_inputs(tmp_path)
    out, run = tmp_path / "cmp", tmp_path / "cmp" / "runs" / "gspo-seed0"
    reward, data = tmp_path.resolve() / "rewards.py", tmp_path.resolve() / "data.jsonl"
    args = ["compare", "--configs", "gspo", "--seeds", "0", *SMALL, "--steps", "1", "--dataset", "data.jsonl",
            "--reward", "rewards.py:brevity", "--output-dir", str(out)]
    assert main(args) == 0
    made = json.loads((run / FILE).read_text())  # written by the run as it started
    assert made["gspo"] == gspo_package.__version__ and made["inputs"] == {
        "--model": {"tiny": None}, "--dataset": {str(data): _sha256(data)},
        "--reward": {f"{reward}:brevity": _sha256(reward)}}

    capsys.readouterr()
    assert main(args) == 0  # nothing changed: reused, not trained
    said = capsys.readouterr().out
    assert f"[compare] gspo seed 0: already done, reusing {run}" in said and "training (" not in said

    reward.write_text(reward.read_text().replace("1.0 /", "2.0 /"))  # the same size, other content
    assert main(args) == 0
    aside = run.with_name("gspo-seed0.replaced-1")
    assert [line for line in capsys.readouterr().out.splitlines() if "set aside" in line] == [
        f"[compare] gspo seed 0: {run} was trained before --reward file rewards.py changed; set aside as {aside} and "
        "trained again"]
    assert json.loads((run / FILE).read_text())["inputs"]["--reward"] == {f"{reward}:brevity": _sha256(reward)}
    assert json.loads((aside / FILE).read_text()) == made


@pytest.mark.slow
def test_a_resume_says_when_its_files_changed_and_goes_on(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    _write_inputs(tmp_path)
    run = tmp_path / "run"
    cfg = TrainConfig(model="tiny", steps=2, save_every=1, prompts_per_step=4, group_size=2, num_minibatches=1,
                      eval_size=8, progress=False, dataset="data.jsonl", reward=("rewards.py:brevity",),
                      output_dir=str(run))
    train(cfg, log=lambda *a, **k: None)
    (run / "summary.json").unlink()  # interrupted after step 1
    shutil.rmtree(run / "checkpoints" / "step-000002")
    capsys.readouterr()
    train(resume=run, log=lambda *a, **k: None)  # nothing changed: nothing said
    assert "--resume" not in capsys.readouterr().err

    (run / "summary.json").unlink()
    shutil.rmtree(run / "checkpoints" / "step-000002")
    (tmp_path / "rewards.py").write_text((tmp_path / "rewards.py").read_text() + "# edited\n")
    assert train(resume=run, log=lambda *a, **k: None)["steps"] == 2  # said, not refused
    assert (f"gspo: warning: --resume: {run} was trained before --reward file rewards.py changed; it continues with "
            "this gspo and these files") in capsys.readouterr().err.splitlines()


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
