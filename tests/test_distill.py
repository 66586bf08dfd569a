"""On-policy distillation (gspo.train.distill, gspo.algo.advantages.distill_advantages): the teacher's
term and the loss against hand arithmetic, the exact context a teacher reads, the refusals, a run with
each kind of teacher, and resume exactness."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from gspo.algo.advantages import distill_advantages, distill_metrics, with_distill
from gspo.algo.losses import policy_loss
from gspo.cli import main
from gspo.config import Loss, TrainConfig
from gspo.models.loading import load_policy
from gspo.models.logprobs import Split
from gspo.models.sequences import Rollout
from gspo.processes.distributed import Dist
from gspo.tasks.data import Example
from gspo.train.distill import Teacher, Teachers, check_vocabulary, task_name
from gspo.train.trainer import train

ASSETS = Path(__file__).resolve().parents[1] / "gspo" / "assets"
FAST = ["--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "8", "--eval-size", "8", "--no-progress"]


# ----------------------------------------------------------------------------------------------
# The term and the loss, by hand (float64, padding)
# ----------------------------------------------------------------------------------------------

T_LOGP = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-0.25, -3.0, 0.0, 0.0]], dtype=torch.float64)
S_LOGP = torch.tensor([[-1.5, -1.0, -0.5, -7.0], [-1.25, -1.0, -9.0, -9.0]], dtype=torch.float64)
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]], dtype=torch.float64)  # row 0: 3 tokens, row 1: 2


def test_the_per_token_term_is_lambda_times_the_log_ratio_and_zero_on_padding():
    # λ = 0.5: row 0: 0.5·(-1+1.5), 0.5·(-2+1), 0.5·(-0.5+0.5), padding 0 (not 0.5·7)
    #          row 1: 0.5·(-0.25+1.25), 0.5·(-3+1), padding 0, 0
    got = distill_advantages(T_LOGP, S_LOGP, MASK, 0.5)
    assert got.dtype == torch.float64
    assert torch.equal(got, torch.tensor([[0.25, -0.5, 0.0, 0.0], [0.5, -1.0, 0.0, 0.0]], dtype=torch.float64))


def test_the_sequence_term_is_the_mean_over_the_responses_own_tokens():
    # row 0: 0.5·(0.5 - 1 + 0)/3 = -1/12; row 1: 0.5·(1 - 2)/2 = -0.25 (its 2 tokens, not T = 4)
    got = distill_advantages(T_LOGP, S_LOGP, MASK, 0.5, per_token=False)
    assert torch.allclose(got, torch.tensor([-1 / 12, -0.25], dtype=torch.float64), atol=1e-15, rtol=0)
    empty = distill_advantages(T_LOGP, S_LOGP, torch.zeros_like(MASK), 0.5, per_token=False)
    assert torch.equal(empty, torch.zeros(2, dtype=torch.float64))  # no token: 0, not NaN


def test_the_term_is_detached():
    s = S_LOGP.clone().requires_grad_(True)
    assert not distill_advantages(T_LOGP, s, MASK, 1.0).requires_grad


def test_group_advantages_add_to_the_term_in_both_shapes():
    group = torch.tensor([1.0, -1.0], dtype=torch.float64)
    per_token = distill_advantages(T_LOGP, S_LOGP, MASK, 0.5)
    assert torch.equal(with_distill(group, per_token)[0], torch.tensor([1.25, 0.5, 1.0, 1.0], dtype=torch.float64))
    seq = distill_advantages(T_LOGP, S_LOGP, MASK, 0.5, per_token=False)
    assert torch.allclose(with_distill(group, seq), torch.tensor([1 - 1 / 12, -1.25], dtype=torch.float64))
    assert with_distill(None, seq) is seq
    with pytest.raises(ValueError, match="per-token group advantages"):
        with_distill(per_token, seq)


def test_the_losses_with_the_term_against_hand_arithmetic():
    # at the first update logp = old_logp: every ratio is 1, nothing clipped, so the loss is -mean of
    # the advantages as the aggregation weighs them (seq-mean-token-mean: each response counts once)
    adv = distill_advantages(T_LOGP, S_LOGP, MASK, 0.5)  # rows [0.25, -0.5, 0] (3 tokens), [0.5, -1] (2)
    loss, _ = policy_loss(S_LOGP, S_LOGP, adv, MASK, Loss(algorithm="grpo", clip_low=0.2, clip_high=0.28))
    # -( (0.25 - 0.5 + 0)/3 + (0.5 - 1)/2 ) / 2 = -(-1/12 - 1/4)/2 = 1/6
    assert loss.item() == pytest.approx(1 / 6, abs=1e-12)
    seq = distill_advantages(T_LOGP, S_LOGP, MASK, 0.5, per_token=False)  # [-1/12, -1/4]
    loss, _ = policy_loss(S_LOGP, S_LOGP, seq, MASK, Loss(algorithm="gspo", clip_low=3e-4, clip_high=4e-4))
    # GSPO: -mean_i(s_i·A_i) with s_i = 1: -(-1/12 - 1/4)/2 = 1/6, the same as per token here
    assert loss.item() == pytest.approx(1 / 6, abs=1e-12)
    # and the gradient of the per-token loss moves each token by its own term: d loss / d logp_t = -A_t / (|y_i|·B)
    logp = S_LOGP.clone().requires_grad_(True)
    policy_loss(logp, S_LOGP, adv, MASK, Loss(algorithm="grpo", clip_low=0.2, clip_high=0.28))[0].backward()
    want = -torch.tensor([[0.25 / 3, -0.5 / 3, 0.0, 0.0], [0.5 / 2, -1 / 2, 0.0, 0.0]], dtype=torch.float64) / 2
    assert torch.allclose(logp.grad, want, atol=1e-15, rtol=0)


def test_the_metrics_by_hand():
    term = distill_advantages(T_LOGP, S_LOGP, MASK, 0.5)
    m = distill_metrics(T_LOGP, S_LOGP, term, MASK)
    # student - teacher over the 5 tokens: 0.5·... no: (-1.5+1) + (-1+2) + 0 + (-1.25+0.25) + (-1+3) = -0.5+1-1+2 = 1.5
    assert m["distill/reverse_kl"] == pytest.approx(1.5 / 5) and m["distill/reverse_kl"].count == 5
    assert m["distill/teacher_logp"] == pytest.approx((-1 - 2 - 0.5 - 0.25 - 3) / 5)
    assert (m["distill/advantage_min"], m["distill/advantage_max"]) == (-1.0, 0.5)
    assert m["distill/advantage_mean"] == pytest.approx((0.25 - 0.5 + 0 + 0.5 - 1) / 5)


# ----------------------------------------------------------------------------------------------
# What a teacher reads
# ----------------------------------------------------------------------------------------------


class Recorder:
    """Records what a model's backbone is called with."""

    def __init__(self, model):
        self.calls = []
        model.get_decoder().register_forward_pre_hook(self.hook, with_kwargs=True)

    def hook(self, module, args, kwargs):
        self.calls.append((kwargs["input_ids"].clone(), kwargs["attention_mask"].clone()))


def fake_run(policy, tokenizer):
    cfg = TrainConfig()
    return SimpleNamespace(cfg=cfg, tokenizer=tokenizer, dist=Dist(), policy=policy, train_model=policy,
                           autocast=lambda: torch.autocast("cpu", enabled=False))


def rollout_with_env_tokens(tokenizer):
    """2 rows: left-padded prompts; completions whose columns 2..3 of row 0 are an environment's tokens."""
    ids = tokenizer("12+3=", add_special_tokens=False)["input_ids"]
    P = len(ids) + 1
    prompt_ids = torch.tensor([[tokenizer.pad_token_id] + ids, [tokenizer.pad_token_id, *ids[:-1], ids[-1]]])
    prompt_mask = torch.tensor([[0] + [1] * len(ids), [0] + [1] * len(ids)])
    comp = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"] for text in ("15+12", "3=1+2")])
    cmask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0, 0.0]])
    env = torch.tensor([[0.0, 0.0, 1.0, 1.0, 0.0], [0.0] * 5])
    return Rollout(prompt_ids, prompt_mask, comp, cmask, torch.zeros(2, 5), torch.tensor([5, 3]),
                   torch.tensor([False, False]), group_size=2, env_mask=env), P


def test_a_teacher_reads_the_students_exact_context_environment_tokens_included():
    student, tokenizer = load_policy("tiny")
    teacher, _ = load_policy("tiny")
    rec = Recorder(teacher)
    ro, P = rollout_with_env_tokens(tokenizer)
    ex = Example(prompt="12+3=", answer=15)
    logp, served = Teachers([Teacher("tiny", None, model=teacher)]).logprobs(fake_run(student, tokenizer), ro,
                                                                           [ex, ex], Split())
    (ids, attn), = rec.calls
    assert torch.equal(ids, ro.input_ids) and torch.equal(attn, ro.attention_mask)  # env tokens attended
    assert attn[0, P + 2] == 1 and attn[0, P + 3] == 1
    assert served.tolist() == [True, True]
    assert (logp[0, 2:4] == 0).all() and (logp[0, :2] < 0).all()  # env tokens: context, not scored
    # and the term on them is 0 while the model tokens get theirs
    term = distill_advantages(logp, torch.full_like(logp, -1.0), ro.completion_mask, 1.0)
    assert (term[0, 2:4] == 0).all() and (term[0, [0, 1, 4]] != 0).all()


def test_the_privileged_context_is_appended_to_the_prompt_and_the_completion_is_unchanged():
    student, tokenizer = load_policy("tiny")
    rec = Recorder(student)
    ro, P = rollout_with_env_tokens(tokenizer)
    ro.env_mask = None
    exs = [Example(prompt="12+3=", answer=15), Example(prompt="1+2=", answer=3)]
    Teachers([Teacher("self", None)], context="{answer}=").logprobs(fake_run(student, tokenizer), ro, exs, Split())
    (ids, attn), = rec.calls
    T = ro.completion_ids.shape[1]
    assert torch.equal(ids[:, -T:], ro.completion_ids)  # the student's tokens, as sampled
    for b, text in enumerate(["12+3=15=", "1+2=3="]):  # the prompt with the context after it
        want = tokenizer(text)["input_ids"]
        assert ids[b, :-T][attn[b, :-T].bool()].tolist() == want


def test_rows_go_to_their_tasks_teacher_and_the_rest_to_the_unnamed_one():
    def ex(name):
        return Example(prompt="q", answer=1, columns={"entry": {"metadata": {"source_dataset": name}}})

    teachers = Teachers([Teacher("a", "chain_sum"), Teacher("b", None), Teacher("c", "basic_arithmetic")])
    rows = [ex("basic_arithmetic"), ex("chain_sum"), ex("leg_counting"), Example(prompt="q", answer=1)]
    assert teachers.assign(rows) == [2, 0, 1, 1]
    assert Teachers([Teacher("a", "chain_sum")]).assign(rows) == [-1, 0, -1, -1]  # no default: no term
    assert task_name(rows[3]) is None


def test_a_teacher_with_another_vocabulary_is_refused_naming_both():
    _, tiny = load_policy("tiny")
    _, tool = load_policy("tiny-tool")
    with pytest.raises(Exception, match=r"its tokenizer is not the student's: the teacher's vocabulary has 60 tokens "
                                        r"\(.*tiny-tool.*\), the student's 20 \(.*tiny.*\); token id \d+ is"):
        check_vocabulary("tiny-tool", tool, tiny)
    check_vocabulary("tiny-long", load_policy("tiny-long")[1], tiny)  # the same vocabulary passes


# ----------------------------------------------------------------------------------------------
# Refusals: one line, nothing written
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("args, message", [
    (["--teacher", "tiny-tool"], "teacher tiny-tool: its tokenizer is not the student's"),
    (["--teacher", "tiny", "--algorithm", "ppo"], "teacher: cannot be combined with --algorithm ppo"),
    (["--reward", "none"], "reward: none trains on nothing without a teacher"),
    (["--reward", "none", "exact_integer", "--teacher", "tiny"], "reward: none cannot be combined"),
    (["--teacher", "self"], "teacher_context: is needed by --teacher self"),
    (["--teacher", "self", "--teacher-context", "{solution}"], "teacher_context: names the field 'solution'"),
    (["--teacher-context", "{answer}"], "teacher_context: is the teacher's, and no --teacher is given"),
    (["--teacher", "self", "--teacher-context", "{answer}", "--max-prompt-length", "8"],
     "teacher_context: cannot be combined with --max-prompt-length"),
    (["--teacher", "tiny", "--teacher", "tiny-long"], "teacher: 2 teachers without a task name"),
    (["--teacher", "chain_sum=tiny"], "teacher: chain_sum= names a task that is not in --task arithmetic"),
    (["--teacher", "no/such-dir-or-hub-id-xyz"], "no/such-dir-or-hub-id-xyz"),
    (["--teacher", "http://127.0.0.1:9", "--temperature", "0.7"], "a served teacher returns raw log-probs"),
    (["--teacher", "tiny", "--reward", "none", "--drop-uniform-groups"], "would drop every group"),
    (["--teacher", "tiny", "--teacher-url", "http://127.0.0.1:9"], "teacher_url: names the served teacher"),
])
def test_the_cli_refuses_in_one_line_and_writes_nothing(args, message, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run = tmp_path / "run"
    assert main(["train", *args, "--steps", "1", "--output-dir", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gspo train: error: ") and message in err[0], err
    assert not run.exists()


# ----------------------------------------------------------------------------------------------
# Runs
# ----------------------------------------------------------------------------------------------


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # trains
def test_a_student_distilled_from_itself_gets_a_zero_term(tmp_path):
    # the teacher is the student's own initial weights (the same float32 forward on the same tokens as
    # the recomputed old log-probs): every per-token term is exactly 0, so is the reverse KL
    out = tmp_path / "run"
    assert main(["train", *FAST, "--steps", "1", "--teacher", "tiny", "--reward", "none", "--algorithm", "grpo",
                 "--old-logp", "recompute", "--output-dir", str(out)]) == 0
    row, = rows(out)
    assert row["distill/reverse_kl"] == 0.0 and row["distill/advantage_min"] == row["distill/advantage_max"] == 0.0
    assert row["reward/mean"] == 0.0 and "reward/exact_integer/mean" in row  # none: weighted 0, still measured


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A checkpoint 8 steps of GSPO away from tiny: a teacher that differs from the student."""
    out = tmp_path_factory.mktemp("teacher") / "run"
    train(TrainConfig(steps=8, prompts_per_step=4, group_size=4, max_new_tokens=8, eval_size=0, lr=1e-3,
                      output_dir=str(out), progress=False, save_every=0), log=lambda *a: None)
    return out / "checkpoints" / "step-000008"


@pytest.mark.slow  # trains
def test_distillation_alone_moves_the_student_toward_the_teacher(trained, tmp_path):
    out = tmp_path / "run"
    assert main(["train", *FAST, "--steps", "6", "--teacher", str(trained), "--reward", "none", "--lr", "1e-3",
                 "--algorithm", "grpo", "--output-dir", str(out)]) == 0
    kl = [r["distill/reverse_kl"] for r in rows(out)]
    assert kl[0] > 0.05  # the teacher differs
    assert sum(kl[-2:]) / 2 < kl[0] / 2, kl  # the student's reverse KL to it halves in 6 steps


@pytest.mark.slow  # trains
def test_gspo_takes_the_sequence_mean_and_gspo_token_the_per_token_term(trained, tmp_path, capsys):
    for algorithm, shape in (("gspo", "one per response"), ("gspo_token", "per token")):
        out = tmp_path / algorithm
        assert main(["train", *FAST, "--steps", "1", "--teacher", str(trained), "--algorithm", algorithm,
                     "--output-dir", str(out)]) == 0
        line, = [x for x in capsys.readouterr().out.splitlines() if "distillation:" in x]
        assert f"(log π_teacher − log π_student) {shape}" in line and "plus the reward's group advantages" in line
        row, = rows(out)
        assert row["distill/reverse_kl"] > 0


@pytest.mark.slow  # trains
def test_self_distillation_with_the_answer_as_privileged_context_runs(tmp_path):
    out = tmp_path / "run"
    assert main(["train", *FAST, "--steps", "2", "--teacher", "self", "--teacher-context", "{answer}",
                 "--algorithm", "grpo", "--output-dir", str(out)]) == 0
    assert all(r["distill/reverse_kl"] != 0 for r in rows(out))  # the context changes the teacher's log-probs


@pytest.mark.slow  # trains
def test_two_teachers_for_a_reasoning_gym_mix(trained, tmp_path):
    pytest.importorskip("reasoning_gym")
    out = tmp_path / "run"
    mix = "reasoning_gym:basic_arithmetic,chain_sum"
    assert main(["train", *FAST, "--steps", "1", "--model", "tiny", "--task", mix, "--max-prompt-length", "40",
                 "--teacher", f"chain_sum={trained}", "--teacher", "basic_arithmetic=tiny",
                 "--output-dir", str(out)]) == 0
    assert "distill/reverse_kl" in rows(out)[0]


@pytest.mark.slow  # trains
def test_resume_with_a_teacher_is_exact(trained, tmp_path):
    args = [*FAST, "--teacher", str(trained), "--algorithm", "grpo", "--save-every", "2"]
    assert main(["train", *args, "--steps", "4", "--output-dir", str(tmp_path / "straight")]) == 0
    assert main(["train", *args, "--steps", "2", "--output-dir", str(tmp_path / "split")]) == 0
    assert main(["train", "--resume", str(tmp_path / "split"), "--steps", "4"]) == 0
    a, b = rows(tmp_path / "straight"), rows(tmp_path / "split")
    keys = [k for k in a[0] if k.startswith(("distill/", "reward/", "loss", "clip/"))]
    assert len(keys) > 8
    for x, y in zip(a, b, strict=True):
        assert {k: x[k] for k in keys} == {k: y[k] for k in keys}


@pytest.mark.slow  # trains
def test_a_lora_student_with_a_low_precision_teacher(trained, tmp_path):
    out = tmp_path / "run"
    assert main(["train", *FAST, "--steps", "1", "--teacher", str(trained), "--teacher-dtype", "bfloat16",
                 "--lora-r", "4", "--algorithm", "grpo", "--output-dir", str(out)]) == 0
    assert rows(out)[0]["distill/reverse_kl"] > 0


# ----------------------------------------------------------------------------------------------
# A served teacher (the fake vLLM server: prompt token t scores token_logp(t) = -0.1·(t % 7 + 1))
# ----------------------------------------------------------------------------------------------


@pytest.mark.slow  # trains
def test_a_served_teacher_scores_each_rows_prompt_and_completion(tmp_path):
    from tests.fakevllm import FakeVLLM, token_logp

    _, tokenizer = load_policy("tiny")
    out = tmp_path / "run"
    with FakeVLLM(tokenizer=tokenizer, vocab=len(tokenizer), max_model_len=128) as fake:
        assert main(["train", *FAST, "--steps", "1", "--teacher", fake.url, "--algorithm", "grpo",
                     "--samples-per-step", "16", "--output-dir", str(out)]) == 0
        asked = [r.body["prompt"] for r in fake.asked("/v1/completions")]
    row, = rows(out)
    step = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert len(step) == 16
    # each of the step's 16 rows is one request: its prompt's tokens, then its completion's (the start's
    # check sends a probe text, not a prompt)
    prompts = {tuple(tokenizer(s["prompt"])["input_ids"]) for s in step}
    batch = [(p, seq) for seq in asked for p in prompts if tuple(seq[:len(p)]) == p]
    assert len(batch) == 16
    # the teacher's log-prob over the completion tokens is the mean of token_logp over every row's completion
    scored = [token_logp(t) for p, seq in batch for t in seq[len(p):]]
    assert row["distill/teacher_logp"] == pytest.approx(sum(scored) / len(scored), abs=1e-6)
    assert row["distill/teacher_logp"] != pytest.approx(row["distill/student_logp"], abs=1e-3)


def test_a_dead_served_teacher_is_one_line_before_anything_is_written(tmp_path, capsys):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = tmp_path / "run"
    assert main(["train", *FAST, "--steps", "1", "--teacher", f"http://127.0.0.1:{port}",
                 "--output-dir", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"teacher http://127.0.0.1:{port}" in err[0], err
    assert not run.exists()


@pytest.mark.slow  # trains
def test_a_served_teacher_that_fails_mid_run_stops_it_with_a_resume_line(tmp_path):
    from gspo.sampling.vllm_server import ServerError
    from tests.fakevllm import FakeVLLM

    _, tokenizer = load_policy("tiny")
    run = tmp_path / "run"
    with FakeVLLM(tokenizer=tokenizer, vocab=len(tokenizer), max_model_len=128) as fake:
        def after(step, metrics):  # step 1 scored; the server then answers 500
            fake.status["/v1/completions"] = 500
            return False

        cfg = TrainConfig(steps=3, prompts_per_step=4, group_size=4, max_new_tokens=8, eval_size=0, progress=False,
                          teacher=(fake.url,), save_every=1, output_dir=str(run))
        with pytest.raises(ServerError) as e:  # a TeacherError, with the line to continue
            train(cfg, log=lambda *a: None, callbacks=[after])
    text = str(e.value)
    assert "\n" not in text and text.startswith(f"teacher {fake.url}") and "answered 500" in text, text
    assert f"--resume {run}" in text and "from its last checkpoint" in text
    assert len(rows(run)) == 1  # step 1 kept, nothing of step 2 written


def test_a_runs_config_records_teachers_and_judges_by_absolute_path(tmp_path, monkeypatch):
    from gspo.train.resolve import absolute_paths

    (tmp_path / "ckpt").mkdir()
    monkeypatch.chdir(tmp_path)
    cfg = absolute_paths(TrainConfig(teacher=("ckpt", "chain_sum=ckpt", "self", "http://h:1", "tiny"),
                                     reward=("judge:ckpt", "exact_integer")))
    here = str(tmp_path.resolve() / "ckpt")
    assert cfg.teacher == (here, f"chain_sum={here}", "self", "http://h:1", "tiny")  # resumable from anywhere
    assert cfg.reward == (f"judge:{here}", "exact_integer")
