"""Bring your own model, data and reward: end to end through the CLI, as a user runs it."""

import json
import os
import subprocess
import sys

import pytest
import torch

from gspo.cli import main
from tests.conftest import build_chat_model
from tests.test_data import MALFORMED

REWARD_MODULE = '''
def topic_bonus(completions, topic, answer, **kwargs):
    """Uses an extra dataset column; fails loudly if it did not arrive."""
    assert len(topic) == len(completions) and all(t in ("math", "geo") for t in topic)
    assert all(isinstance(c, list) and c[0]["role"] == "assistant" for c in completions)  # chat prompts
    return [0.5 if t == "math" else 0.0 for t in topic]
'''


@pytest.fixture(scope="module")
def byo(tmp_path_factory):
    d = tmp_path_factory.mktemp("byo")
    build_chat_model(d / "model")
    rows = []
    for i in range(24):
        a, b = i % 7, i % 5
        rows.append({"messages": [{"role": "user", "content": f"What is {a}+{b}?"}], "solution": str(a + b),
                     "topic": "math" if i % 2 else "geo"})
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "rewards.py").write_text(REWARD_MODULE)
    return d


def gspo(*args, env=None):
    return subprocess.run([sys.executable, "-m", "gspo", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def common(byo, run):
    return ["--model", str(byo / "model"), "--dataset", str(byo / "train.jsonl"), "--prompt-column", "messages",
            "--answer-column", "solution", "--max-new-tokens", "6", "--prompts-per-step", "4", "--group-size", "4",
            "--eval-size", "4", "--no-progress", "--output-dir", str(run)]


@pytest.mark.slow
def test_train_with_own_model_dataset_and_reward(byo, tmp_path):
    run = tmp_path / "run"
    r = gspo("train", *common(byo, run), "--steps", "2", "--reward", "exact_match",
             "--reward", f"{byo / 'rewards.py'}:topic_bonus", "--reward-weights", "1.0", "2.0",
             "--report-to", "tensorboard")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in rows] == [1, 2]
    for m in rows:
        assert {"reward/exact_match/mean", "reward/topic_bonus/mean"} <= set(m)
        # half the prompts are "math" (0.5 each), weight 2: the bonus adds 0.5 to the mean reward
        assert m["reward/mean"] == pytest.approx(m["reward/exact_match/mean"] + 2.0 * m["reward/topic_bonus/mean"])
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("reward/mean")] == [1, 2]
    sample = json.loads((run / "samples.jsonl").read_text().splitlines()[0])
    assert sample["messages"][0]["role"] == "user"  # the row's messages, and the prompt as the model saw it:
    assert (sample["prompt"].startswith("<|im_start|>user\nWhat is ")
            and sample["prompt"].endswith("<|im_start|>assistant\n"))

    # gspo plot over this run
    png = tmp_path / "plot.png"
    r = gspo("plot", str(run), "--metrics", "reward/mean,clip/frac,eval/accuracy", "--output", str(png))
    assert r.returncode == 0, r.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_lora_adapter_trains_saves_reloads_and_resumes(byo, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run = tmp_path / "lora"
    # the length penalty varies within a group even for a random model, so the adapter gets a gradient
    args = [*common(byo, run), "--lora-r", "4", "--lora-alpha", "8", "--lora-target-modules", "q_proj", "v_proj",
            "--reward", "length", "--beta", "0.05", "--lr", "1e-3", "--save-every", "1", "--keep-checkpoints", "3"]
    r = gspo("train", *args, "--steps", "3")
    assert r.returncode == 0, r.stderr
    ckpt = run / "checkpoints" / "step-000003"
    assert (ckpt / "adapter_config.json").exists() and not (ckpt / "model.safetensors").exists()
    # the adapter reloads with plain PEFT onto the base model
    base = AutoModelForCausalLM.from_pretrained(byo / "model")
    model = PeftModel.from_pretrained(base, ckpt)
    weights = load_file(ckpt / "adapter_model.safetensors")
    lora_b = [v for k, v in weights.items() if "lora_B" in k]
    assert lora_b and any(v.abs().max() > 0 for v in lora_b)  # B starts at 0: it trained
    assert all("q_proj" in k or "v_proj" in k for k in weights)
    assert model.peft_config["default"].r == 4
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert all("kl/ref" in m for m in rows)  # beta > 0: reference = base model with the adapter off
    assert rows[0]["kl/ref"] == pytest.approx(0.0, abs=1e-6)  # nothing trained yet at the first update
    # gspo eval loads the adapter onto its base
    r = gspo("eval", "--model", str(ckpt), "--dataset", str(byo / "train.jsonl"), "--prompt-column", "messages",
             "--answer-column", "solution", "--eval-size", "4", "--max-new-tokens", "6", "--k", "0",
             "--reward", "length")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["n"] == 2  # 24 rows: holds out min(eval_size 4, 24 // 10) = 2

    # resume from step 2 reproduces step 3 exactly (LoRA state, optimizer and RNG restored)
    import shutil

    shutil.rmtree(ckpt)
    (run / "summary.json").unlink()
    r = gspo("train", "--resume", str(run))
    assert r.returncode == 0, r.stderr
    again = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    strip = lambda rs: [{k: v for k, v in m.items() if not k.startswith("time/")} for m in rs]  # noqa: E731
    assert strip(again) == strip(rows)
    assert all(torch.equal(load_file(ckpt / "adapter_model.safetensors")[k], weights[k]) for k in weights)


@pytest.mark.slow
def test_wandb_offline(byo, tmp_path):
    run = tmp_path / "wb"
    r = gspo("train", *common(byo, run), "--steps", "1", "--report-to", "wandb", "--wandb-project", "gspo-test",
             env={"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true"})
    assert r.returncode == 0, r.stderr
    assert list((run / "wandb").glob("offline-run-*"))
    assert (run / "wandb_id").read_text().strip()


@pytest.mark.parametrize("name,content,expected", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_dataset_through_the_cli(tmp_path, capsys, name, content, expected):
    p = tmp_path / name
    p.write_bytes(content if isinstance(content, bytes) else content.encode())
    out = tmp_path / "run"
    code = main(["train", "--dataset", str(p), "--output-dir", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("gspo train: error: ") and expected in err and "\n" not in err, err
    assert not out.exists()  # nothing created


@pytest.mark.parametrize("setup,expected", [
    ("distilbert", "model_type 'distilbert' is not a causal language model"),
    ("no_template", "prompts are chat messages but the tokenizer"),
    ("bad_reward", "unknown reward 'exactmatch'"),
    ("bad_reward_file", "no such file"),
    ("answer_missing", "no column 'answer'"),
])
def test_bad_model_and_reward_inputs(byo, tmp_path, capsys, setup, expected):
    model, extra = str(byo / "model"), ["--prompt-column", "messages", "--answer-column", "solution"]
    if setup == "distilbert":
        from transformers import DistilBertConfig, DistilBertModel

        DistilBertModel(DistilBertConfig(vocab_size=30, dim=32, n_layers=1, n_heads=2, hidden_dim=32)).save_pretrained(
            tmp_path / "m")
        model = str(tmp_path / "m")
    elif setup == "no_template":
        model = str(build_chat_model(tmp_path / "m", chat_template=False))
    elif setup == "bad_reward":
        extra += ["--reward", "exactmatch"]
    elif setup == "bad_reward_file":
        extra += ["--reward", str(tmp_path / "nope.py") + ":f"]
    elif setup == "answer_missing":
        extra = ["--prompt-column", "messages"]
    out = tmp_path / "run"
    capsys.readouterr()  # drop what building the fixtures printed
    code = main(["train", "--model", model, "--dataset", str(byo / "train.jsonl"), *extra, "--output-dir", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and expected in err and "\n" not in err, err
    assert not out.exists()


@pytest.mark.slow  # trains
def test_bad_input_never_touches_an_existing_run(byo, tmp_path, capsys):
    # a finished run; resuming it for more steps after its dataset went bad must not change a byte of it
    run = tmp_path / "run"
    data = tmp_path / "d.jsonl"
    data.write_text((byo / "train.jsonl").read_text())
    assert main(["train", *common(byo, run)[:-2], "--dataset", str(data), "--steps", "1",
                 "--output-dir", str(run)]) == 0
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    data.write_text('{"messages": 3, "solution": "1"}\n')
    assert main(["train", "--resume", str(run)]) == 0  # complete: nothing to do, the data is not even read
    assert main(["train", "--resume", str(run), "--steps", "2"]) == 2
    assert "field 'messages' must be" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


@pytest.mark.slow
def test_readme_worked_example_runs(tmp_path):
    # the README's worked example, shortened to 2 steps
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-m", "gspo", "train", "--dataset", "examples/arithmetic.jsonl",
                        "--prompt-column", "question", "--reward", "exact_match",
                        "--reward", "examples/rewards.py:digit_credit", "--reward-weights", "1.0", "0.5",
                        "--steps", "2", "--eval-size", "20", "--output-dir", str(tmp_path / "run"), "--no-progress"],
                       capture_output=True, text=True, cwd=root, timeout=300)
    assert r.returncode == 0, r.stderr
    m = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert m["reward/mean"] == pytest.approx(m["reward/exact_match/mean"] + 0.5 * m["reward/digit_credit/mean"])
    readme = open(os.path.join(root, "README.md")).read()
    assert "--reward examples/rewards.py:digit_credit --reward-weights 1.0 0.5" in readme
