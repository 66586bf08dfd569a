"""The run-time integrity check (gspo.sampling.integrity, gspo.train.integrity): a trained row whose
tokens no sampler drew in that context, or a first on-policy minibatch whose log-probs are not
the sampler's, stops the step before its update (or, with --integrity warn, is said in one line).

The faults are injected where real ones come from: a layout that lays calls into the wrong row
(the endpoint's old rule for concurrent calls), and a sampler that keeps sampling the first
step's weights (a weight sync that silently failed).
"""

import copy

import pytest
import torch

from gspo.config import TrainConfig
from gspo.models.sequences import Rollout
from gspo.sampling.integrity import DIFFERENT, LOGPROBS, NOT_DRAWN, Receipts, Tolerance, check_rows, tolerance
from gspo.sampling.rollout import PolicySampler
from gspo.train.integrity import IntegrityError
from gspo.train.run import build_run
from gspo.train.trainer import train_step

FORK = '''
import asyncio

async def rollout(client, example):
    """An answer, then two continuations of it at once (a critique next to a retry)."""
    msgs = [{"role": "user", "content": example.prompt}]
    r = await client.chat.completions.create(model="policy", messages=msgs)
    msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
    await asyncio.gather(*[client.chat.completions.create(model="policy", messages=msgs) for _ in range(2)])
    return 1.0
'''


def _rollout(prompts, rows, logps, mask=None) -> Rollout:
    """A Rollout of `rows` (completion ids) after `prompts`, every token trained unless `mask`."""
    T = max(map(len, rows))
    ids = torch.tensor([r + [0] * (T - len(r)) for r in rows])
    m = torch.tensor(mask, dtype=torch.float32) if mask is not None else (ids != 0).float()
    lp = torch.tensor([x + [0.0] * (T - len(x)) for x in logps])
    P = max(map(len, prompts))
    pids = torch.tensor([[0] * (P - len(p)) + p for p in prompts])
    return Rollout(pids, (pids != 0).long(), ids, m, lp, torch.tensor([len(r) for r in rows]),
                   torch.zeros(len(rows), dtype=torch.bool), 1)


def _receipts(*samples) -> Receipts:
    """Receipts of (prompt, completion, log-probs) samples."""
    r = Receipts()
    for prompt, ids, lps in samples:
        r.by_prompt.setdefault(hash(tuple(prompt)), []).append((tuple(ids), torch.tensor(lps)))
    return r


def test_a_row_is_one_or_more_samples_each_in_the_context_it_was_drawn_in():
    # a two-turn row: prompt [1, 2]; turn 0 drew [3]; the environment's [7] (context: mask 0); turn 1
    # drew [5, 6, 8] after [1, 2, 3, 7], cut to [5, 6] (a stop string, a budget)
    receipts = _receipts(([1, 2], [3], [-0.1]), ([1, 2, 3, 7], [5, 6, 8], [-0.3, -0.4, -0.5]))
    good = _rollout([[1, 2]], [[3, 7, 5, 6]], [[-0.1, 0.0, -0.3, -0.4]], mask=[[1, 0, 1, 1]])
    assert check_rows(good, receipts) == ([], 1)
    # turn 1's tokens laid right after turn 0's (the environment's token not there): never drawn there
    moved = _rollout([[1, 2]], [[3, 5, 6]], [[-0.1, -0.3, -0.4]])
    (b,), _ = check_rows(moved, receipts)
    assert (b.row, b.column, b.why) == (0, 1, NOT_DRAWN)
    # a token changed: not what was drawn; a log-prob changed: not what the sampler returned
    (b,), _ = check_rows(_rollout([[1, 2]], [[4]], [[-0.1]]), receipts)
    assert (b.column, b.why) == (0, DIFFERENT)
    (b,), _ = check_rows(_rollout([[1, 2]], [[3]], [[-0.15]]), receipts)
    assert (b.column, b.why) == (0, LOGPROBS)
    # two samples back to back with no environment token between (an agent's completions call on the
    # exact prompt + completion): the second drawn after the first
    both = _receipts(([1, 2], [3, 4], [-0.1, -0.2]), ([1, 2, 3, 4], [5], [-0.5]))
    assert check_rows(_rollout([[1, 2]], [[3, 4, 5]], [[-0.1, -0.2, -0.5]]), both) == ([], 1)
    # untrained rows (a failed episode, a masked group) are not checked
    assert check_rows(_rollout([[1, 2]], [[9]], [[0.0]], mask=[[0]]), receipts) == ([], 0)


def test_the_tolerance_is_checked_only_where_sampler_and_trainer_share_a_precision():
    assert tolerance("hf", "float32", "float32") == Tolerance(row=1e-3, mean=1e-4)
    assert tolerance("hf", "bfloat16", "float32") is None  # a precision gap: measured (mismatch/*), not checked
    assert tolerance("vllm", "bfloat16", "bfloat16") == Tolerance(row=2.0, mean=0.25)


def test_tf32_is_read_from_either_of_torchs_apis(monkeypatch):
    # torch.backends.fp32_precision (the newer API, transformers' enable_tf32 on torch >= 2.9) makes
    # torch.get_float32_matmul_precision raise ("a mix of the legacy and new APIs"): a float32 run on
    # CUDA then crashed at its first step
    from gspo.sampling import integrity

    def mixed():
        raise RuntimeError("you have used mix of the legacy and new APIs to set the TF32 status")

    def torch_with(precision):  # torch as such a process sees it: the newer API set, the older getter raising
        from types import SimpleNamespace

        matmul = SimpleNamespace(fp32_precision=precision)
        return SimpleNamespace(get_float32_matmul_precision=mixed, backends=SimpleNamespace(cuda=SimpleNamespace(
            matmul=matmul)))

    monkeypatch.setattr(integrity, "torch", torch_with("tf32"))
    assert integrity.tf32_matmuls() is True
    monkeypatch.setattr(integrity, "torch", torch_with("ieee"))
    assert integrity.tf32_matmuls() is False


def _config(tmp_path, **kw):
    (tmp_path / "fork.py").write_text(FORK)
    base = dict(model="tiny-tool", task="arithmetic", env=f"{tmp_path / 'fork.py'}:rollout", prompts_per_step=2,
                group_size=2, max_new_tokens=6, num_minibatches=1, eval_size=0, progress=False,
                output_dir=str(tmp_path / "run"))
    return TrainConfig(**{**base, **kw})


def test_rows_laid_out_of_their_context_stop_the_step_before_its_update(tmp_path, monkeypatch):
    from gspo.agents import runner

    # the endpoint's old rule: every call joins the episode's one row, in the order calls finished
    monkeypatch.setattr(runner, "sequences", lambda calls: [(list(range(len(calls))), list(calls))])
    run = build_run(_config(tmp_path))
    before = {k: v.clone() for k, v in run.policy.state_dict().items()}
    with pytest.raises(IntegrityError) as e:
        train_step(run, 1)
    line = str(e.value)
    assert line.startswith("integrity: step 1: row ") and "\n" not in line
    assert "completion column " in line and NOT_DRAWN in line and "likely cause: an agent's calls" in line
    assert "the step's update was not made" in line
    assert all(torch.equal(v, run.policy.state_dict()[k]) for k, v in before.items())  # no weight moved


@pytest.mark.slow  # trains
def test_with_warn_the_breach_is_said_and_its_rows_left_out(tmp_path, monkeypatch, capsys):
    from gspo.agents import runner

    monkeypatch.setattr(runner, "sequences", lambda calls: [(list(range(len(calls))), list(calls))])
    run = build_run(_config(tmp_path, integrity="warn"))
    metrics, batch = train_step(run, 1)
    err = capsys.readouterr().err
    assert "gspo: warning: integrity: step 1: row" in err and "left out of the loss" in err
    assert metrics["integrity/breaches"] == 4 and metrics["integrity/rows_checked"] == 4
    assert batch.rollout.completion_mask.sum() == 0  # every row breached: none trained


@pytest.mark.slow  # trains
def test_a_sampler_that_kept_old_weights_fails_the_on_policy_check(tmp_path):
    # a weight sync that silently failed: the sampler keeps the initial weights while the policy moves
    run = build_run(TrainConfig(model="tiny", task="arithmetic", prompts_per_step=4, group_size=4, lr=1e-2,
                                num_minibatches=1, eval_size=0, progress=False, output_dir=str(tmp_path / "r")))
    stale = PolicySampler(copy.deepcopy(run.policy))
    stale.sync = lambda policy, version=None: None
    run.sampler = stale
    metrics, _ = train_step(run, 1)  # the same weights still: within 1e-3 a row, 1e-4 on average
    assert metrics["integrity/log_ratio_row_max"] < 1e-4 and metrics["integrity/log_ratio_mean"] < 1e-5
    with pytest.raises(IntegrityError) as e:
        train_step(run, 2)
    line = str(e.value)
    assert line.startswith("integrity: step 2: the first on-policy minibatch's log-probs are not the sampler's: row")
    assert "past the tolerance 0.001 (hf, float32)" in line and "a weight sync that failed" in line


@pytest.mark.slow  # starts a process
def test_gspo_train_stops_in_one_line_and_writes_nothing_of_the_step(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "fork.py").write_text(FORK)
    broken = tmp_path / "broken.py"  # the old layout, installed before gspo runs
    broken.write_text("import runpy, sys\nfrom gspo.agents import runner\n"
                      "runner.sequences = lambda calls: [(list(range(len(calls))), list(calls))]\n"
                      "sys.argv = ['gspo'] + sys.argv[1:]\nfrom gspo.cli import entry\nsys.exit(entry())\n")
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, str(broken), "train", "--model", "tiny-tool", "--task", "arithmetic", "--env",
                        f"{tmp_path / 'fork.py'}:rollout", "--steps", "2", "--prompts-per-step", "2", "--group-size",
                        "2", "--max-new-tokens", "6", "--eval-size", "0", "--no-progress", "--output-dir", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[1])
    assert p.returncode == 2, p.stderr[-2000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("gspo train: error: integrity: step 1: row ") and "Traceback" not in p.stderr
    assert not (out / "metrics.jsonl").exists() or (out / "metrics.jsonl").read_text() == ""  # nothing of step 1


def test_the_log_ratio_check_skips_where_vllm_renormalises_its_logprobs():
    # vLLM's recorded log-probs are renormalised over what top-p/top-k keep and without the stop tokens
    # --min-new-tokens bans: not the policy's (a real server measured a 5.98 row gap with --min-new-tokens 4)
    from gspo.config import TrainConfig
    from gspo.sampling.integrity import renormalises

    plain = TrainConfig().sampling
    assert not renormalises("vllm-server", plain) and not renormalises("vllm", plain)
    for change in ({"min_new_tokens": 2}, {"top_p": 0.9}, {"top_k": 5}):
        s = TrainConfig(**change).sampling
        assert renormalises("vllm", s) and renormalises("vllm-server", s)
        assert not renormalises("hf", s)  # gspo's sampler records the full distribution's log-probs
