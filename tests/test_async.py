"""Asynchronous RL (gspo.sampling.pipeline, gspo.sampling.produce): a fixed lag of K versions, rollout workers, resume.

The equalities here are exact (bit for bit on CPU), not within a tolerance: a worker samples
batch t with exactly the weights of version max(0, t-1-K), as the trainer's own process does,
and the prompts and the sampling uniforms are functions of (seed, step) alone. Any slip (a
worker sent the wrong version, a batch requested one step late or early, a pending batch lost
or re-sampled on resume) changes the sampled tokens or the log-probs and so every metric after.

Staleness by hand, for a run of 4 steps: step t trains with version t-1 a batch sampled by
version max(0, t-1-K), so it is min(t-1, K) versions stale:
    K=1: steps 1..4 -> 0, 1, 1, 1          K=2: steps 1..4 -> 0, 1, 2, 2
"""

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gspo.io.files import read_jsonl
from gspo.train import checkpoint as ckpt
from tests.test_distributed import ENV, metrics, weights

pytestmark = pytest.mark.slow

# 4 steps of 8 prompts x 4 completions, a checkpoint at steps 2 and 4 (resume tests reuse them)
BASE = ["--prompts-per-step", "8", "--group-size", "4", "--eval-size", "8", "--no-progress", "--seed", "3",
        "--steps", "4", "--save-every", "2", "--keep-checkpoints", "3"]
TIMING = ("async/trainer_idle_seconds", "async/sample_seconds", "async/worker_idle_seconds", "async/overlap",
          "async/weight_sync_seconds", "async/ready_batches")

SLOW_REWARD = '''
import time

def slow(completions, answer, **kwargs):
    time.sleep({sleep})  # slows the process that scores: a rollout worker, or the trainer
    return [1.0 if str(c).strip() == str(a) else 0.0 for c, a in zip(completions, answer)]
'''


def gspo(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "gspo", "train", *args], capture_output=True, text=True, env=ENV,
                          timeout=300, cwd=cwd)


def popen(*args):
    return subprocess.Popen([sys.executable, "-m", "gspo", "train", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=ENV)


def train(run: Path, *args):
    r = gspo(*BASE, *args, "--output-dir", str(run))
    assert r.returncode == 0, r.stderr[-3000:]
    return run


def same(a: list[dict], b: list[dict], ignore=TIMING):
    """Exactly equal rows (time/ keys dropped by `metrics`), but for `ignore`d keys."""
    strip = lambda rows: [{k: v for k, v in r.items() if k not in ignore} for r in rows]  # noqa: E731
    assert len(a) == len(b)
    for ra, rb in zip(strip(a), strip(b)):
        assert ra == rb, {k: (ra.get(k), rb.get(k)) for k in set(ra) | set(rb) if ra.get(k) != rb.get(k)}


def same_weights(wa: dict, wb: dict):
    assert set(wa) == set(wb)
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def staleness(rows: list[dict]) -> list[float]:
    return [r["async/staleness_max"] for r in rows]


def slow_reward(tmp: Path, sleep: float) -> str:
    path = tmp / "slow_reward.py"
    path.write_text(SLOW_REWARD.format(sleep=sleep))
    return f"{path}:slow"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The runs several tests compare, made once: synchronous, K=0, fixed lag K=1 and K=2 in one
    process, and in worker mode K=1 with 1 worker and K=2 with 2 workers."""
    tmp = tmp_path_factory.mktemp("async")
    spec = {"sync": [], "k0": ["--max-staleness", "0"], "k1": ["--max-staleness", "1"],
            "k2": ["--max-staleness", "2"], "k1w1": ["--max-staleness", "1", "--rollout-workers", "1"],
            "k2w2": ["--max-staleness", "2", "--rollout-workers", "2"]}
    return {name: train(tmp / name, *args) for name, args in spec.items()}


def test_k0_is_the_synchronous_run(runs):
    a, b = metrics(runs["sync"]), metrics(runs["k0"])
    assert len(a) == 4
    same(a, b, ignore=())
    same_weights(weights(runs["sync"]), weights(runs["k0"]))
    assert not [k for r in a + b for k in r if k.startswith("async/")]  # K=0, no workers: no async metrics
    # the run trained: the policy moved (else equal weights prove nothing)
    from safetensors.torch import load_file

    from gspo.models.loading import BUILTIN_MODELS

    w0 = load_file(BUILTIN_MODELS["tiny"] / "model.safetensors")
    assert any(not torch.equal(w0[k], v) for k, v in weights(runs["k0"]).items())


@pytest.mark.parametrize("k", [1, 2])
def test_fixed_lag_staleness_is_exact(runs, k):
    rows = metrics(runs[f"k{k}"])
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        t, want = r["step"], min(r["step"] - 1, k)  # K=1: 0,1,1,1; K=2: 0,1,2,2
        assert r["async/staleness_mean"] == r["async/staleness_max"] == want, (t, r)
        assert r[f"async/staleness_hist/{want}"] == 1.0
        assert sum(r[f"async/staleness_hist/{j}"] for j in range(k + 1)) == 1.0
        assert f"async/staleness_hist/{k + 1}" not in r
        # asked for ahead of this batch at its step: batches t+1 .. min(t+K, 4)
        assert r["async/queue_depth"] == min(t + k, 4) - t, (t, r)
        assert r["async/overlap"] == 0.0  # the trainer's process samples: no overlap
    # step 1's batch is sampled by version 0 in every mode: the synchronous run's step 1
    sync = read_jsonl(runs["sync"] / "samples.jsonl")
    lag = read_jsonl(runs[f"k{k}"] / "samples.jsonl")

    def first(rows):
        return [{x: r[x] for x in ("prompt", "completion", "reward")} for r in rows if r["step"] == 1]

    assert first(sync) and first(sync) == first(lag)
    # ... and later batches are not (step 2 is sampled by version 0 too, trained by version 1):
    # the lagged run is not the synchronous run relabelled
    assert metrics(runs[f"k{k}"])[1]["ratio/mean"] != metrics(runs["sync"])[1]["ratio/mean"]


def test_fixed_lag_requests_each_batch_from_the_right_version(tmp_path, monkeypatch):
    # in process, recording what the pipeline asks gspo.sampling.produce for: K=1, 4 steps. At the start
    # of step t (version t-1) batches t .. min(t+1, 4) not yet asked for are sampled:
    #   step 1 (v0): batches 1, 2;  step 2 (v1): 3;  step 3 (v2): 4;  step 4 (v3): nothing
    # so batch t comes from version max(0, t-2): 0, 0, 1, 2
    from gspo.config import TrainConfig
    from gspo.sampling import pipeline
    from gspo.train.trainer import train as train_in_process

    calls, real = [], pipeline.produce

    def recording(side, step, version):
        calls.append((step, version))
        return real(side, step, version)

    monkeypatch.setattr(pipeline, "produce", recording)
    cfg = TrainConfig(steps=4, prompts_per_step=4, group_size=4, eval_size=8, save_every=0, seed=3, max_staleness=1,
                      output_dir=str(tmp_path / "run"))
    train_in_process(cfg, log=lambda *a, **k: None)
    assert calls == [(1, 0), (2, 0), (3, 1), (4, 2)]
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["async/staleness_max"] for r in rows] == [0, 1, 1, 1]


def test_workers_equal_the_fixed_lag_run_bit_for_bit(runs):
    # K=1 with one worker; K=2 with two (batch s from worker s mod 2: 1, 0, 1, 0)
    for lagged, workers in (("k1", "k1w1"), ("k2", "k2w2")):
        a, b = metrics(runs[lagged]), metrics(runs[workers])
        same(a, b)
        same_weights(weights(runs[lagged]), weights(runs[workers]))
        for r in b:
            assert 0.0 <= r["async/overlap"] <= 1.0 and r["async/sample_seconds"] > 0
            assert r["async/trainer_idle_seconds"] >= 0 and r["async/worker_idle_seconds"] >= 0


@pytest.fixture(scope="module")
def slow_runs(tmp_path_factory):
    """K=1 with a reward that sleeps 0.5 s a call: in one process, and with one rollout worker.
    The worker is the bottleneck: each batch takes >= 0.5 s to score, while a training step takes
    ~0.1 s, so the trainer waits on it every step."""
    tmp = tmp_path_factory.mktemp("slow")
    reward = slow_reward(tmp, 0.5)
    args = ["--max-staleness", "1", "--reward", reward]
    return {"k1": train(tmp / "k1", *args), "k1w1": train(tmp / "k1w1", *args, "--rollout-workers", "1"),
            "reward": reward}


def test_a_slow_worker_keeps_the_bound_and_the_results(slow_runs):
    a, b = metrics(slow_runs["k1"]), metrics(slow_runs["k1w1"])
    assert staleness(b) == [0, 1, 1, 1]  # min(t-1, 1): never more than K=1, however slow the worker
    assert all(r["async/staleness_mean"] == r["async/staleness_max"] for r in b)
    # the trainer waited for the sleeping worker: at least one step it sat idle for most of 0.5 s
    assert max(r["async/trainer_idle_seconds"] for r in b) > 0.3
    assert min(r["async/sample_seconds"] for r in b) >= 0.5
    same(a, b)  # sleeping changes timing, never results
    same_weights(weights(slow_runs["k1"]), weights(slow_runs["k1w1"]))


def _truncated_copy(src: Path, dst: Path, step: int) -> Path:
    """`src` as a run killed just after its checkpoint at `step`: later checkpoints and the summary gone
    (the logs' later rows stay: the resume must trim them)."""
    shutil.copytree(src, dst)
    for s, d in ckpt.checkpoint_dirs(dst):
        if s > step:
            shutil.rmtree(d)
    (dst / "summary.json").unlink()
    return dst


@pytest.mark.parametrize("name", ["k2", "k2w2"])
def test_resume_keeps_the_bound_and_the_batches(runs, tmp_path, name):
    # the checkpoint at step 2 of a K=2 run holds batches 3 and 4, sampled by versions 0 and 1
    # (not trained yet); a resume trains those, so it ends where the uninterrupted run did
    state = torch.load(ckpt.checkpoint_dirs(runs[name])[0][1] / "trainer_state.pt", weights_only=False)
    assert state["step"] == state["policy_version"] == 2
    pending = state["pending_per_rank"][0]
    assert [(p.step, p.version) for p in pending] == [(3, 0), (4, 1)]
    for p in pending:  # every completion token tagged with its batch's version, -1 on padding only
        v = p.versions
        assert v[v >= 0].unique().tolist() == [p.version] and torch.equal(v >= 0, p.rollout.completion_mask.cpu() > 0)
    run = _truncated_copy(runs[name], tmp_path / "b", 2)
    r = gspo("--resume", str(run))
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = metrics(runs[name]), metrics(run)
    assert staleness(b) == [0, 1, 2, 2]
    same(a, b)
    same_weights(weights(runs[name]), weights(run))


def test_a_run_extended_with_more_steps_keeps_the_bound(runs, tmp_path):
    # --steps 2, then --resume --steps 4: the 2-step run never asked for batches 3 and 4 (past its
    # end), so its continuation samples them with version 2 on resume: staleness 0 then 1, never
    # more than K; its first 2 steps are those of the 4-step run (the last 2 are not: a run cut
    # short by --steps is not an interrupted run; an interrupted one is the test above)
    run = tmp_path / "b"
    r = gspo(*BASE[:-6], "--steps", "2", "--save-every", "2", "--max-staleness", "2", "--output-dir", str(run))
    assert r.returncode == 0, r.stderr[-3000:]
    r = gspo("--resume", str(run), "--steps", "4")
    assert r.returncode == 0, r.stderr[-3000:]
    b = metrics(run)
    assert [x["step"] for x in b] == [1, 2, 3, 4]
    # step 3 (version 2): batches 3, 4 sampled now by version 2 -> staleness 0; step 4 (version 3): 1
    assert staleness(b) == [0, 1, 0, 1]
    same(metrics(runs["k2"])[:2], b[:2], ignore=TIMING + ("async/queue_depth",))


def _children(pid: int) -> list[int]:
    """The rollout workers of trainer `pid`: its spawned children (not the resource tracker)."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            cmd = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid and b"spawn_main" in cmd:
            out.append(int(proc.name))
    return out


def _wait_for(cond, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_killed_worker_stops_the_run_in_one_line(tmp_path):
    run = tmp_path / "run"
    p = popen(*BASE[:-6], "--steps", "200", "--save-every", "0", "--max-staleness", "1", "--rollout-workers", "1",
              "--output-dir", str(run))
    try:
        worker = _wait_for(lambda: _children(p.pid), 120, "the rollout worker")
        assert len(worker) == 1
        _wait_for(lambda: read_jsonl(run / "metrics.jsonl") if (run / "metrics.jsonl").exists() else None,
                  120, "a first step")
        os.kill(worker[0], signal.SIGKILL)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode != 0
    assert len(read_jsonl(run / "metrics.jsonl")) < 200
    last = err.strip().splitlines()[-1]
    assert "rollout worker 0" in last and f"pid {worker[0]}" in last and "died (killed by SIGKILL)" in last, err
    assert "--resume" in last and str(run) in last, last
    assert "Traceback" not in err, err


def test_sigterm_checkpoints_stops_the_workers_and_resumes(slow_runs, tmp_path):
    # the slow reward (0.5 s a batch, in the worker) makes the 4 steps last >= 2 s: SIGTERM
    # after step 1 lands mid-run
    run = tmp_path / "run"
    p = popen(*BASE[:-4], "--save-every", "0", "--max-staleness", "1", "--rollout-workers", "1",
              "--reward", slow_runs["reward"], "--output-dir", str(run))
    try:
        worker = _wait_for(lambda: _children(p.pid), 120, "the rollout worker")
        _wait_for(lambda: read_jsonl(run / "metrics.jsonl") if (run / "metrics.jsonl").exists() else None,
                  120, "a first step")
        os.kill(p.pid, signal.SIGTERM)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert "Traceback" not in err, err
    done = len(read_jsonl(run / "metrics.jsonl"))
    assert 1 <= done < 4 and not (run / "summary.json").exists(), "the signal must land mid-run"
    assert p.returncode != 0
    assert ckpt.latest_checkpoint(run).name == f"step-{done:06d}"  # the step under way, checkpointed
    _wait_for(lambda: not Path(f"/proc/{worker[0]}").exists() or
              Path(f"/proc/{worker[0]}/stat").read_text().split(") ")[1].startswith("Z"), 15, "the worker to exit")
    r = gspo("--resume", str(run))
    assert r.returncode == 0, r.stderr[-3000:]
    # the resumed run is the uninterrupted one: the pending batch came back with its version
    same(metrics(slow_runs["k1w1"]), metrics(run))
    same_weights(weights(slow_runs["k1w1"]), weights(run))


def test_drop_uniform_groups_reports_each_step(tmp_path):
    run = train(tmp_path / "run", "--drop-uniform-groups", "--steps", "3")
    rows = metrics(run)
    assert len(rows) == 3
    for r in rows:
        dropped, resampled, rounds = r["groups/dropped"], r["groups/resampled"], r["groups/rounds"]
        assert 0 <= dropped <= 8 and 0 <= resampled <= 8 and 1 <= rounds <= 3  # 8 prompts, --resample-rounds 2
        assert dropped == int(dropped) and resampled == int(resampled) and rounds == int(rounds)
        if rounds == 1:  # no uniform group in the first round: nothing to replace or drop
            assert dropped == resampled == 0
        # what is left uniform is what the batch's own flat-group count says
        assert dropped == pytest.approx(r["reward/flat_group_frac"] * 8)
    assert any(r["groups/rounds"] > 1 for r in rows)  # the tiny model leaves ~3/4 of groups flat: refills ran


def _rollout(P: int, T: int, base: int, B: int = 4, G: int = 2):
    from gspo.models.sequences import Rollout

    ids = torch.arange(B * P).view(B, P) + base + 1
    comp = torch.arange(B * T).view(B, T) + base + 101
    return Rollout(prompt_ids=ids, prompt_mask=torch.ones(B, P, dtype=torch.long), completion_ids=comp,
                   completion_mask=torch.ones(B, T), logp=-torch.ones(B, T) * (base + 1),
                   lengths=torch.full((B,), T), truncated=torch.tensor([False, True, False, True]), group_size=G)


def test_gather_groups_pads_and_picks_by_hand():
    from gspo.sampling.produce import _gather_groups, _pad, uniform_groups
    from gspo.tasks.scoring import Scored

    # uniform_groups: G=2, rewards (1,1) (0,1) (0.5,0.5) -> flat, signal, flat
    assert uniform_groups(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5]), 2).tolist() == [True, False, True]
    # round 0: 2 groups of 2 rows, prompts 3 wide, completions 2; round 1: prompts 2, completions 4
    r0, r1 = _rollout(3, 2, 0), _rollout(2, 4, 1000)
    s0 = Scored(torch.tensor([1.0, 1.0, 0.0, 1.0]), {"a": [1.0, 1.0, 0.0, 1.0]}, ["e00", "e01"],
                ["c0", "c1", "c2", "c3"])
    s1 = Scored(torch.tensor([0.0, 1.0, 2.0, 2.0]), {"a": [0.0, 1.0, 2.0, 2.0]}, ["e10", "e11"],
                ["d0", "d1", "d2", "d3"])
    # _pad: left-pad prompts to 3 (one 0 column in front), right-pad completions to 4
    p = _pad(r1, 3, 4)
    assert p.prompt_ids[0].tolist() == [0, 1001, 1002] and p.prompt_mask[0].tolist() == [0, 1, 1]
    assert torch.equal(p.completion_ids, r1.completion_ids)  # already 4 wide
    q = _pad(r0, 3, 4)
    assert q.completion_ids[1].tolist() == [103, 104, 0, 0] and q.completion_mask[1].tolist() == [1, 1, 0, 0]
    assert q.logp[1].tolist() == [-1, -1, 0, 0] and torch.equal(q.prompt_ids, r0.prompt_ids)
    assert _pad(r0, 3, 2) is r0
    # group 0 of round 0 (flat) replaced by group 0 of round 1 (signal); group 1 of round 0 kept
    ro, sc = _gather_groups([(r0, s0), (r1, s1)], [(1, 0), (0, 1)], 2)
    assert ro.prompt_ids.shape == (4, 3) and ro.completion_ids.shape == (4, 4)
    assert ro.prompt_ids.tolist() == [[0, 1001, 1002], [0, 1003, 1004], [7, 8, 9], [10, 11, 12]]
    assert ro.prompt_mask.tolist() == [[0, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1]]
    assert ro.completion_ids.tolist() == [[1101, 1102, 1103, 1104], [1105, 1106, 1107, 1108],
                                          [105, 106, 0, 0], [107, 108, 0, 0]]
    assert ro.completion_mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 0, 0]]
    assert ro.logp.tolist() == [[-1001] * 4, [-1001] * 4, [-1, -1, 0, 0], [-1, -1, 0, 0]]
    assert ro.lengths.tolist() == [4, 4, 2, 2] and ro.truncated.tolist() == [False, True, False, True]
    assert ro.group_size == 2
    assert sc.rewards.tolist() == [0.0, 1.0, 0.0, 1.0] and sc.parts == {"a": [0.0, 1.0, 0.0, 1.0]}
    assert sc.examples == ["e10", "e01"] and sc.completions == ["d0", "d1", "c2", "c3"]


@pytest.mark.parametrize("args,name", [
    (["--drop-uniform-groups", "--group-size", "1", "--algorithm", "ppo"], "drop_uniform_groups"),
    (["--rollout-workers", "2", "--rollout-devices", "cpu"], "rollout_devices"),
    (["--rollout-workers", "1", "--rollout-devices", "tpu"], "rollout_devices"),
])
def test_async_config_errors_are_one_line(tmp_path, args, name):
    r = gspo("--prompts-per-step", "4", "--steps", "1", "--eval-size", "8", *args, "--output-dir", str(tmp_path / "r"))
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gspo train: error:") and f"{name}:" in lines[0], r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "r").exists()


def test_the_api_refuses_objects_with_workers(tmp_path, char_tokenizer):
    from gspo import Trainer
    from gspo.config import ConfigError, TrainConfig
    from gspo.sampling.samplers import Inputs
    from gspo.train.run import build_run
    from tests.conftest import random_tiny_model

    cfg = dict(steps=1, prompts_per_step=4, group_size=4, eval_size=8, rollout_workers=1)
    model = random_tiny_model(char_tokenizer)
    with pytest.raises(ConfigError, match=r"^rollout_workers: .*model"):
        Trainer(TrainConfig(**cfg, output_dir=str(tmp_path / "a")), model=model, tokenizer=char_tokenizer).train()
    with pytest.raises(ConfigError, match=r"^rollout_workers: .*reward_funcs"):
        build_run(TrainConfig(**cfg, output_dir=str(tmp_path / "b")),
                  inputs=Inputs(reward_funcs=[lambda completions, **kw: [0.0] * len(completions)]))
    # the same objects without workers (--max-staleness alone) are fine
    build_run(TrainConfig(**{**cfg, "rollout_workers": 0}, max_staleness=1, output_dir=str(tmp_path / "c")),
              inputs=Inputs(reward_funcs=[lambda completions, **kw: [0.0] * len(completions)]))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


# --- a torchrun world whose last ranks are rollout workers -------------------------------------


def test_fsdp_run_resumes_with_a_rollout_rank_added(tmp_path):
    # --rollout-workers is safe to change on resume (the batches are the same): an FSDP run of 2
    # processes, checkpointed at step 2 (its pending batch 3, sampled by version 1, saved), resumed
    # as 2 trainers + 1 rollout rank (torchrun's 3rd: it samples each trainer's share of batch 4
    # with the version it was sent; the trainers' collectives and the optimizer states go over a
    # group of their own) is the uninterrupted run, bit for bit
    from tests.test_distributed import torchrun

    args = [*BASE[:-6], "--steps", "3", "--save-every", "2", "--max-staleness", "1", "--parallel", "fsdp"]
    whole = torchrun(*args, "--output-dir", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr[-3000:]
    cut = _truncated_copy(tmp_path / "whole", tmp_path / "cut", 2)
    r = torchrun("--resume", str(cut), "--rollout-workers", "1", nproc=3)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "sampled by the torchrun world's last 1 rank(s)" in r.stdout
    same(metrics(tmp_path / "whole"), metrics(cut))
    same_weights(weights(tmp_path / "whole"), weights(cut))
    assert staleness(metrics(cut)) == [0.0, 1.0, 1.0]  # min(t-1, 1)
    summary = json.loads((cut / "summary.json").read_text())
    assert summary["world_size"] == 2  # the trainer processes; the rollout rank is not one


def test_a_resume_on_another_number_of_processes_says_it_samples_again(runs, tmp_path):
    # the k1 run's step-2 checkpoint holds batch 3 (version 1), one process's; resumed by 2
    # processes, that batch cannot be split as theirs: it is sampled again, and the run says so
    from tests.test_distributed import torchrun

    cut = _truncated_copy(runs["k1"], tmp_path / "cut", 2)
    r = torchrun("--resume", str(cut))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "the checkpoint's 1 sampled batches were split over another number of processes" in r.stderr
    # batch 3 is sampled again by version 2 at step 3 (staleness 0), batch 4 by version 2 (1)
    assert staleness(metrics(cut)) == [0.0, 1.0, 0.0, 1.0]


def test_a_bf16_worker_samples_what_the_trainers_bf16_copy_samples(tmp_path):
    # the trainer keeps float32 master weights and samples with a bf16 copy; a worker holds its
    # policy in bf16 itself (with LoRA it keeps the trainer's float32 + bf16 copy, as PEFT keeps a
    # bf16 base's adapters in float32, checked by hand): the same bf16 values, the same batches
    args = ["--prompts-per-step", "4", "--group-size", "4", "--eval-size", "0", "--no-progress", "--steps", "2",
            "--save-every", "0", "--max-staleness", "1", "--dtype", "bfloat16"]
    for name, more in (("lag", []), ("worker", ["--rollout-workers", "1"])):
        r = gspo(*args, *more, "--output-dir", str(tmp_path / name))
        assert r.returncode == 0, r.stderr[-3000:]
    same(metrics(tmp_path / "lag"), metrics(tmp_path / "worker"))
    same_weights(weights(tmp_path / "lag"), weights(tmp_path / "worker"))


class PicklingEnd:
    """A worker's link end in this process: the requests given, each result pickled as the real end
    pickles it (gspo.processes.links) and read back."""

    def __init__(self, *requests):
        self.requests, self.results = list(requests), []

    def start(self):
        pass

    def next(self, timeout):
        return self.requests.pop(0)

    def put(self, msg, dest=None):
        import pickle

        self.results.append(pickle.loads(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)))


def test_a_worker_sends_episodes_of_an_environment_class_from_a_file():
    # --env file.py:Class loads the class as a module no other process can import; its instances
    # score the batch in the worker (`environments=`) and must not travel to the trainer with it
    from gspo.agents.side import sampling_side
    from gspo.config import TrainConfig
    from gspo.sampling.pipeline import worker_main
    from gspo.sampling.produce import produce
    from gspo.train.resolve import absolute_paths, resolve

    env = Path(__file__).parents[1] / "examples" / "agents" / "calculator_env.py"
    cfg = absolute_paths(resolve(TrainConfig(task="calculator", model="tiny-tool", env=f"{env}:CalculatorToolEnv",
                                             prompts_per_step=2, group_size=2, max_new_tokens=8, eval_size=0,
                                             rollout_workers=1, max_staleness=1)))
    end = PicklingEnd(("sample", 1, 0), ("stop",))
    with contextlib.suppress(SystemExit):  # a worker's error: its last result says it
        worker_main(0, cfg, "cpu", [(0, 1, None)], (1, sampling_side), end)
    [(kind, index, produced)] = end.results
    assert kind == "done", produced
    assert produced.scored.episodes.turns.shape == (4,)
    # in the trainer's process a batch sampled ahead (--max-staleness) is saved with a checkpoint
    torch.save(produce(sampling_side(cfg, torch.device("cpu")), 2, 0), io.BytesIO())


@pytest.mark.parametrize("task", ["calculator", "verifiers:gspo-calculator"])
def test_drop_uniform_groups_refuses_a_task_that_plays_episodes(task):
    # a refill round's groups are joined without their episodes: an agent's failed episodes would
    # enter their group's baseline, its later sequences and --turn-advantages be lost, all silently
    from gspo.config import ConfigError, TrainConfig
    from gspo.train.resolve import resolve

    with pytest.raises(ConfigError, match="^drop_uniform_groups: cannot be combined with multi-turn episodes"):
        resolve(TrainConfig(task=task, model="tiny-tool", drop_uniform_groups=True))


def test_drop_uniform_groups_refuses_episodes_it_was_not_told_of():
    # a side built by hand (gspo.train.run.build_run given an environment object) reaches the refill
    # rounds with episodes: refused there, not joined without them
    from types import SimpleNamespace

    from gspo.config import ConfigError, TrainConfig
    from gspo.sampling.produce import _drop_uniform
    from gspo.tasks.scoring import Scored

    side = SimpleNamespace(cfg=TrainConfig(group_size=2), dist=None, env=SimpleNamespace(__name__="Mine"))
    first = (None, Scored(torch.zeros(2), {}, ["e"], ["a", "b"], episodes=object()))
    with pytest.raises(ConfigError, match="^drop_uniform_groups: .*multi-turn episodes.*env Mine"):
        _drop_uniform(side, 1, first, None)
