"""Several processes (torchrun, gloo on CPU) give the run one process gives, and resume.

The equivalence tests compare a 2-process run with a 1-process run of the same seed and global
batch: every logged metric and every final weight within 1e-5. They can fail: a loss
normalised per process (a mean of per-process means, not the global minibatch mean) changes
`loss/policy` and `grad_norm` (the gradient before clipping) by far more than 1e-5, since the
two processes hold different numbers of rows of each global minibatch; so does any other
weighting slip. What is left between the runs is float rounding: sampling a 16-row batch in
two 8-row halves rounds differently in the last bits.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gspo.algo.metrics import Max, Mean, Min, reduce_across
from gspo.io.files import read_jsonl
from gspo.processes.distributed import Dist
from gspo.train import checkpoint as ckpt
from tests.conftest import spawn

pytestmark = pytest.mark.slow

ARGS = ["--prompts-per-step", "8", "--group-size", "4", "--eval-size", "16", "--no-progress", "--seed", "3"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def one_process(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "gspo", "train", *args], capture_output=True, text=True, env=ENV,
                          timeout=300, cwd=cwd)


def torchrun(*args, nproc=2, popen=False):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "gspo", "train", *args]
    if popen:
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV)
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=300)


def metrics(run: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in read_jsonl(run / "metrics.jsonl")]


def weights(run: Path, sub: str = "") -> dict:
    return load_file(ckpt.latest_checkpoint(run) / sub / "model.safetensors")


def assert_same_weights(wa: dict, wb: dict):
    """Equal to float rounding. Adam's first steps move every weight by about ±lr whatever the
    size of its gradient, so a weight whose gradient is ~0 up to rounding may step either way
    (up to 2·lr): a handful of the 790k weights can differ by more than 1e-5, never many."""
    assert set(wa) == set(wb)
    diff = torch.cat([(wa[k] - wb[k]).abs().flatten() for k in wa])
    assert float((diff > 1e-5).float().mean()) < 5e-5, int((diff > 1e-5).sum())  # at most ~40 weights
    assert float((diff > 1e-6).float().mean()) < 5e-4, int((diff > 1e-6).sum())
    assert float(diff.max()) < 2e-4


def assert_same_metrics(a: list[dict], b: list[dict], tol=1e-5):
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        assert set(ra) == set(rb)
        for k in ra:
            if ra[k] is None or rb[k] is None:  # NaN is written as null
                assert ra[k] == rb[k], k
            else:
                assert abs(ra[k] - rb[k]) <= tol * max(1.0, abs(ra[k])), (ra["step"], k, ra[k], rb[k])


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The 1-process reference run (gspo, 3 steps) and the initial weights."""
    run = tmp_path_factory.mktemp("single") / "run"
    r = one_process(*ARGS, "--steps", "3", "--save-every", "1", "--keep-checkpoints", "5", "--output-dir", str(run))
    assert r.returncode == 0, r.stderr
    return run


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_processes_match_one(tmp_path, single, parallel):
    run = tmp_path / parallel
    r = torchrun(*ARGS, "--steps", "3", "--save-every", "1", "--parallel", parallel, "--output-dir", str(run))
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = metrics(single), metrics(run)
    assert len(a) == 3
    assert_same_metrics(a, b)
    # the updates were real: the policy moved by much more than the tolerance
    from gspo.models.loading import BUILTIN_MODELS

    w0 = load_file(BUILTIN_MODELS["tiny"] / "model.safetensors")
    wa, wb = weights(single), weights(run)
    moved = torch.cat([(wa[k] - w0[k]).abs().flatten() for k in wa])
    assert float((moved > 1e-5).float().mean()) > 0.5  # most weights moved by more than the tolerance
    assert_same_weights(wa, wb)
    # eval ran sharded (8 rows per process) and counts the same 16 rows
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (single, run))
    assert sa["eval_before"] == sb["eval_before"] and sb["eval_before"]["n"] == 16
    assert sb["world_size"] == 2 and sb["parallel"] == parallel
    # logged once, by rank 0; the checkpoint is a plain Hugging Face model
    assert len(read_jsonl(run / "samples.jsonl")) == 3 * 4
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(ckpt.latest_checkpoint(run))


def test_ppo_two_processes_match_one(tmp_path):
    # PPO: GAE advantages whitened over the global batch, a separate critic (FSDP-sharded),
    # the value loss normalised by global token counts; --loss-agg token-mean and a KL term.
    args = [*ARGS, "--steps", "2", "--algorithm", "ppo", "--loss-agg", "token-mean", "--beta", "0.02",
            "--save-every", "0"]
    r1 = one_process(*args, "--output-dir", str(tmp_path / "one"))
    assert r1.returncode == 0, r1.stderr
    r2 = torchrun(*args, "--parallel", "fsdp", "--output-dir", str(tmp_path / "two"))
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert_same_metrics(metrics(tmp_path / "one"), metrics(tmp_path / "two"))
    for sub in ("", "critic"):
        assert_same_weights(weights(tmp_path / "one", sub), weights(tmp_path / "two", sub))


def _kill_run(run: Path) -> None:
    """SIGKILL the torchrun agent and its workers (they run in their own sessions)."""
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(run).encode() in cmd and proc.name.isdigit():
            try:
                os.kill(int(proc.name), signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.parametrize("parallel", ["fsdp"])
def test_distributed_run_killed_and_resumed(tmp_path, single, parallel):
    # reference: the 1-process run (3 steps); a 2-process run killed after step 1 or 2 resumes
    # from its checkpoint (FSDP: gathered model and optimizer state) and ends where it should
    run = tmp_path / "killed"
    p = torchrun(*ARGS, "--steps", "3", "--save-every", "1", "--parallel", parallel, "--output-dir", str(run),
                 popen=True)
    deadline = time.time() + 240
    while time.time() < deadline and p.poll() is None:
        if ckpt.latest_checkpoint(run) is not None:  # step 1 is saved
            break
        time.sleep(0.02)
    _kill_run(run)
    p.wait(timeout=60)
    done = len(read_jsonl(run / "metrics.jsonl"))
    assert 1 <= done < 3 and not (run / "summary.json").exists(), "the kill must land mid-run"
    r = torchrun("--resume", str(run))
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same_metrics(metrics(single), metrics(run))
    assert_same_weights(weights(single), weights(run))


def test_a_failure_is_said_once_and_a_ranks_own_failure_too(monkeypatch, capsys):
    # rank 0 says a failure at once; rank 1 says it only after the grace period, in which
    # torchrun stops it when rank 0 failed alike (so one line), and with its rank when it did not
    from gspo.processes import distributed

    monkeypatch.setattr(distributed.time, "sleep", lambda s: waited.append(s))
    waited = []
    monkeypatch.setenv("RANK", "0")
    distributed.say_once("gspo train: error: x")
    monkeypatch.setenv("RANK", "1")
    distributed.say_once("gspo train: error: y")
    assert (capsys.readouterr().err == "gspo train: error: x\ngspo train: error: y (rank 1)\n"
            and waited == [distributed.RANK_GRACE_S])


def test_batch_that_does_not_split_is_one_line_error(tmp_path):
    r = torchrun("--prompts-per-step", "3", "--group-size", "4", "--steps", "1", "--output-dir", str(tmp_path / "r"))
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("gspo train: error:")]
    assert lines == ["gspo train: error: prompts_per_step: must be divisible by the number of processes, 2, so "
                     "that each process samples whole groups (got 3)"]
    assert not (tmp_path / "r").exists()


# --- the reduction arithmetic, in one process ----------------------------------------------


def test_single_process_identity():
    d = Dist()
    h = [{"clip/frac": Mean(0.25, 4), "ratio/min": Min(0.9)}]
    assert reduce_across(h, d) is h
    assert d.loss_scales(torch.tensor([[3.0, 5.0]])).tolist() == [[1.0, 1.0]]
    # shares: 10 rows over 4 processes -> 3, 3, 3, 1
    assert [Dist(rank=r, world=4).share(10) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]


def _reduce_worker(rank: int, init_file: str, out_dir: str):
    import torch.distributed as td

    td.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    d = Dist(rank=rank, world=2, parallel="ddp")
    # rank 0: 1 of its 2 tokens clipped, loss/policy 0.3 over 1 response, ratio in [0.9, 1.2]
    # rank 1: 0 of 6 tokens clipped,      loss/policy 0.1 over 3 responses, ratio in [0.95, 1.1]
    h = [{"clip/frac": Mean(0.5, 2), "loss/policy": Mean(0.3, 1), "ratio/min": Min(0.9), "ratio/max": Max(1.2),
          "grad_norm": Mean(2.0)},
         {"clip/frac": Mean(0.0, 6), "loss/policy": Mean(0.1, 3), "ratio/min": Min(0.95), "ratio/max": Max(1.1),
          "grad_norm": Mean(2.0)}][rank:rank + 1]
    out = {k: (type(v).__name__, float(v)) for k, v in reduce_across(h, d)[0].items()}
    scales = d.loss_scales(torch.tensor([[1.0, 2.0], [3.0, 6.0]][rank], dtype=torch.float64)).tolist()
    torch.save({"metrics": out, "scales": scales}, f"{out_dir}/{rank}.pt")
    td.destroy_process_group()


def test_reduce_metrics_and_loss_scales_by_hand(tmp_path):
    spawn(_reduce_worker, str(tmp_path / "init"), str(tmp_path))
    r0, r1 = (torch.load(tmp_path / f"{r}.pt") for r in (0, 1))
    assert r0["metrics"] == r1["metrics"]
    kinds = {k: kind for k, (kind, _) in r0["metrics"].items()}
    m = {k: v for k, (_, v) in r0["metrics"].items()}
    assert m["clip/frac"] == pytest.approx(1 / 8, abs=1e-12)  # (0.5·2 + 0·6) / 8 tokens; not (0.5 + 0) / 2
    assert m["loss/policy"] == pytest.approx((0.3 * 1 + 0.1 * 3) / 4, abs=1e-12)  # 0.15 over 4 responses
    assert (m["ratio/min"], m["ratio/max"], m["grad_norm"]) == (0.9, 1.2, 2.0)
    assert kinds == {"clip/frac": "Mean", "loss/policy": "Mean", "ratio/min": "Min", "ratio/max": "Max",
                     "grad_norm": "Mean"}  # still declared, for the step's averaging
    # loss scale = world · local / global: responses 1 of 4 and 3 of 4, tokens 2 of 8 and 6 of 8
    assert (r0["scales"] == pytest.approx([2 * 1 / 4, 2 * 2 / 8])
            and r1["scales"] == pytest.approx([2 * 3 / 4, 2 * 6 / 8]))


@pytest.mark.parametrize("parallel,extra", [("ddp", ["--micro-batch-tokens", "60", "--packing"]),
                                            ("fsdp", ["--micro-batch-tokens", "60"])])
def test_micro_batches_across_processes_match_one_process(tmp_path, parallel, extra):
    # micro-batches within a token budget: each process runs its own number of them (stand-ins
    # keep FSDP's collectives in step), gradients reduced once per minibatch; the old-policy
    # pass runs in micro-batches too. Equal to one process without micro-batches.
    args = [*ARGS, "--steps", "2", "--old-logp", "recompute", "--save-every", "0"]
    r1 = one_process(*args, "--output-dir", str(tmp_path / "one"))
    assert r1.returncode == 0, r1.stderr
    r2 = torchrun(*args, *extra, "--parallel", parallel, "--output-dir", str(tmp_path / "two"))
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert_same_metrics(metrics(tmp_path / "one"), metrics(tmp_path / "two"))
    assert_same_weights(weights(tmp_path / "one"), weights(tmp_path / "two"))


def test_four_processes_with_one_group_each(tmp_path):
    # 4 processes x 1 prompt x G=2 and 4 minibatches: 2 rows per process, fewer than the
    # minibatches; the old-policy pass used to split its 2 rows into chunks of 2 // 4 = 0 and crash
    r = torchrun("--prompts-per-step", "4", "--group-size", "2", "--num-minibatches", "4", "--steps", "1",
                 "--old-logp", "recompute", "--eval-size", "8", "--no-progress", "--output-dir", str(tmp_path / "r"),
                 nproc=4)
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(read_jsonl(tmp_path / "r" / "metrics.jsonl")) == 1


def _head_worker(rank: int, init_file: str, out_dir: str, parallel: str):
    import torch.distributed as td
    from torch.distributed.device_mesh import init_device_mesh

    import gspo.models.logprobs as lp
    from gspo.models.tiny import build_char_tokenizer
    from gspo.processes import parallel as par
    from gspo.sampling.rollout import generate, sampling_params
    from tests.conftest import random_tiny_model

    td.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,)) if parallel == "fsdp" else None
    d = Dist(rank=rank, world=2, parallel=parallel, mesh=mesh)
    tok = build_char_tokenizer()
    model = random_tiny_model(tok)
    ro = generate(model, [tok("12+7=")["input_ids"]], sampling_params(tok, group_size=2, max_new_tokens=4),
                  generator=torch.Generator().manual_seed(0))
    seen = []  # (tokens, vocabulary) of every chunked head call, and of any full-logits forward
    real = lp.chunked_logprobs

    def counting(h, w, *a, **k):
        seen.append(("chunked", tuple(h.shape), type(w).__name__))
        return real(h, w, *a, **k)

    lp.chunked_logprobs = counting
    wrapped = par.wrap(lp.TokenLogprobs(model), d)
    logp, _, _ = wrapped(ro, temperature=1.0)
    logp.sum().backward()
    torch.save({"seen": seen, "logp": logp.detach()}, f"{out_dir}/{rank}.pt")
    td.destroy_process_group()


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_chunked_lm_head_under_ddp_and_fsdp(tmp_path, parallel):
    # the training forward under DDP and FSDP goes through the chunked LM head (no tokens x
    # vocabulary logits), with the head's full weight (a plain tensor, not an FSDP shard)
    spawn(_head_worker, str(tmp_path / "init"), str(tmp_path), parallel)
    for r in (0, 1):
        out = torch.load(tmp_path / f"{r}.pt")
        # 2 rows x 4 tokens
        assert out["seen"] in ([("chunked", (8, 64), "Tensor")], [("chunked", (8, 64), "Parameter")])


def test_sigterm_to_one_process_stops_every_process_at_the_same_step(tmp_path, single):
    # a preemption notice that reaches one worker only: the flag is all-reduced after each step,
    # so both processes finish the same step, checkpoint it and exit; the run then resumes
    run = tmp_path / "run"
    p = torchrun(*ARGS, "--steps", "3", "--save-every", "0", "--output-dir", str(run), popen=True)
    deadline = time.time() + 240
    rank1 = None
    while time.time() < deadline and p.poll() is None and rank1 is None:
        for proc in Path("/proc").iterdir():
            try:
                cmd, env = (proc / "cmdline").read_bytes(), (proc / "environ").read_bytes()
            except OSError:
                continue
            if str(run).encode() in cmd and b"\0RANK=1\0" in b"\0" + env and b"torch.distributed.run" not in cmd:
                rank1 = int(proc.name)
        time.sleep(0.05)
    while time.time() < deadline and not read_jsonl(run / "metrics.jsonl"):
        time.sleep(0.02)
    os.kill(rank1, signal.SIGTERM)
    p.wait(timeout=300)
    assert p.returncode != 0
    done = len(read_jsonl(run / "metrics.jsonl"))
    assert 1 <= done <= 3 and ckpt.latest_checkpoint(run).name == f"step-{done:06d}"
    r = torchrun("--resume", str(run))
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same_metrics(metrics(single), metrics(run))
    assert_same_weights(weights(single), weights(run))


def test_a_torchrun_worker_exits_with_its_status_and_its_output_flushed():
    # under torchrun a worker ends with os._exit (no interpreter finalization, where gloo's
    # threads could abort a run that succeeded): the status and buffered output must survive
    code = ("import sys; from gspo.processes.distributed import exit_process; print('out', end=''); "
            "print('err', end='', file=sys.stderr); exit_process(3)")
    for env in ({**ENV, "TORCHELASTIC_RUN_ID": "x"}, ENV):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
        assert (r.returncode, r.stdout, r.stderr) == (3, "out", "err")
