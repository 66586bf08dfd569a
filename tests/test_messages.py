"""Refusals as a newcomer meets them: one line of gspo's own that names the option and its value,
exit status 2, no traceback, nothing written.

- Options that cannot act in this launch are refused, not ignored (`--parallel fsdp` in one
  process, `--lora-alpha` without `--lora-r`, PPO's value-model options with another algorithm,
  `--eval-every` with `--eval-size 0`, ...: gspo.train.resolve.unused, checked by gspo.train.run.build_run);
  a value a config file passes that equals the default, or what gspo derives, is no refusal (a run's
  own config.yaml trains again).
- A mistyped local model path says "no such directory" with a did-you-mean, before any Hub
  look-up (gspo.io.hub.path_like, gspo.models.loading.resolve_model_path); only `ORG/NAME` (and a bare legacy
  name far from every built-in) goes to the Hub.
- Bounds messages give the bound enforced, plurals agree, `gspo export` usage errors are gspo's.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gspo.cli import main

TOY = ["--steps", "1", "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "4", "--eval-size", "0",
       "--num-minibatches", "2", "--no-progress"]


@pytest.fixture
def place(tmp_path, monkeypatch):
    """A working directory a newcomer might have: a file, runs/ with one run-like directory, a
    non-empty directory; no torchrun, no Hub (a look-up fails the test)."""
    (tmp_path / "afile").write_text("x")
    (tmp_path / "runs" / "gspo-20250101").mkdir(parents=True)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep").write_text("x")
    monkeypatch.chdir(tmp_path)
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "GSPO_DEBUG"):
        monkeypatch.delenv(var, raising=False)

    def no_hub(*a, **k):
        raise AssertionError("the Hugging Face Hub was asked")

    monkeypatch.setattr("gspo.io.hub.model_dir", no_hub)
    return tmp_path


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def refused(command: str, args: list[str], place: Path, capsys) -> str:
    """Run `gspo COMMAND ARGS` in `place`: exit 2, one line `gspo COMMAND: error: ...` on stderr and
    nothing else, no traceback, nothing written. Returns the line."""
    before = tree(place)
    capsys.readouterr()
    full = [command, *TOY, "--output-dir", "run", *args] if command == "train" else [command, *args]
    code = main(full)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2, (code, err)
    assert "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith(f"gspo {command}: error: "), err
    assert tree(place) == before, tree(place) - before  # nothing written (no run directory)
    return lines[0]


CASES = [  # command, arguments, what the line must hold (the option, and its value where it has one)
    # options that cannot act in this launch
    ("train", ["--parallel", "fsdp"], "--parallel fsdp: needs several processes started by torchrun"),
    ("train", ["--parallel", "ddp"], "--parallel ddp: needs several processes started by torchrun"),
    ("train", ["--lora-alpha", "32"], "--lora-alpha 32: shapes LoRA adapters, and --lora-r is 0"),
    ("train", ["--lora-target-modules", "q_proj", "v_proj"], "--lora-target-modules q_proj v_proj: shapes LoRA"),
    ("train", ["--critic", "shared"], "--critic shared: sets PPO's value model; --algorithm gspo has none"),
    ("train", ["--gamma", "0.9", "--algorithm", "grpo"], "--gamma 0.9: sets PPO's value model; --algorithm grpo has"),
    ("train", ["--no-whiten-advantages"], "--no-whiten-advantages: sets PPO's value model"),
    ("train", ["--reward-kl-coef", "0.1"], "--reward-kl-coef 0.1: sets PPO's value model"),
    ("train", ["--algorithm", "ppo", "--vf-coef", "0.1"], "--vf-coef 0.1: weighs the value loss of --critic shared"),
    ("train", ["--algorithm", "ppo", "--adv-scale", "none"], "--adv-scale none: PPO's advantages are GAE's"),
    ("train", ["--eval-size", "0", "--eval-every", "5"], "--eval-every 5: --eval-size is 0"),
    ("train", ["--algorithm", "grpo", "--turn-advantages"], "--turn-advantages: applies to multi-turn episodes"),
    ("train", ["--dataset-config", "main"], "--dataset-config main: applies to a --dataset; the built-in task"),
    ("train", ["--sapo-tau-pos", "2"],
     "--sapo-tau-pos 2: is SAPO's option (--algorithm sapo); --algorithm gspo has none"),
    ("train", ["--lora-dropout", "0.1"], "--lora-dropout 0.1: shapes LoRA adapters"),
    ("train", ["--ctpo-power", "0.3"], "--ctpo-power 0.3: is CTPO's option (--algorithm ctpo); --algorithm gspo has"),
    ("train", ["--algorithm", "ctpo", "--cppo-budget", "0.05"], "--cppo-budget 0.05: is CPPO's option (--algorithm"),
    ("train", ["--algorithm", "sapo", "--target-clip-frac", "0.1"],
     "--target-clip-frac 0.1: --algorithm sapo gates instead of clipping"),
    ("train", ["--target-clip-frac", "1.5"], "target_clip_frac: must be in (0, 1) (got 1.5)"),
    ("train", ["--rollout-is-mode", "mask"], "--rollout-is-mode mask: shapes the --rollout-is weights"),
    ("train", ["--rollout-is", "token", "--rollout-is-low", "0.2"], "--rollout-is-low 0.2: is the lower bound of"),
    ("train", ["--resample-rounds", "3"], "--resample-rounds 3: applies with --drop-uniform-groups"),
    ("train", ["--kl-estimator", "k2"], "--kl-estimator k2: estimates the --beta KL penalty, and --beta is 0"),
    ("train", ["--format-pattern", "<a>.*"], "--format-pattern <a>.*: is the format reward's"),
    ("train", ["--wandb-project", "mine"], "--wandb-project mine: applies with --report-to wandb"),
    ("train", ["--reward-model-device", "cpu"], "--reward-model-device cpu: applies to learned reward models"),
    ("train", ["--revision", "v2"], "--revision v2: picks a Hugging Face Hub revision, and --model tiny is local"),
    ("train", ["--eval-dataset", "afile.jsonl"], "--eval-dataset afile.jsonl: applies to a --dataset"),
    ("train", ["--prompt-column", "question"], "--prompt-column question: applies to a --dataset"),
    ("train", ["--rollout-devices", "cpu"], "rollout_devices: places rollout workers, and --rollout-workers is 0"),
    # a mistyped model: no such directory, a did-you-mean, no Hub look-up (`no_hub`)
    ("train", ["--model", "tiny_moe"], "model tiny_moe: no such directory; did you mean tiny-moe?"),
    ("train", ["--model", "tinymoe"], "model tinymoe: no such directory; did you mean tiny-moe?"),
    ("train", ["--model", "runs/gspo-20250102"], "model runs/gspo-20250102: no such directory; did you mean "
                                                 "runs/gspo-20250101?"),
    ("train", ["--model", "afile"], "afile: a file, not a model directory"),
    ("eval", ["--model", "runs/nosuch"], "model runs/nosuch: no such directory"),
    ("eval", ["--model", "./tiny-mo"], "model ./tiny-mo: no such directory; did you mean tiny-moe?"),
    ("eval", ["--model", "model.safetensors"], "model model.safetensors: no such directory"),
    ("eval", ["--model", "nowhere/a/b"], "model nowhere/a/b: no such directory (nowhere does not exist)"),
    # messages that name the option, with bounds and plurals right
    ("train", ["--output-dir", "afile"], "afile: it is a file, not a directory"),
    ("train", ["--output-dir", "afile/run"], "--output-dir"),
    ("train", ["--output-dir", "full"], "full: exists and is not empty (use --resume"),
    ("train", ["--group-size", "-3"], "group_size: must be >= 2 (advantages are relative to the group) (got -3)"),
    ("train", ["--group-size", "1"], "group_size: must be >= 2 (advantages are relative to the group) (got 1)"),
    ("train", ["--algorithm", "ppo", "--group-size", "0"], "group_size: must be >= 1 (got 0)"),
    ("train", ["--adam-betas", "0.9", "1.5"], "adam_betas: each must be in [0, 1) (got (0.9, 1.5))"),
    ("train", ["--reward", "exact_match", "--reward-weights", "1", "2"], "(1 reward given)"),
    ("train", ["--rollout-workers", "1", "--rollout-devices", "cpu", "cpu"],
     "rollout_devices: needs 1 device, one per"),
    ("train", ["--resume", "nosuch"], "--resume "),
    ("export", ["runs/gspo-20250101"], "gspo export: error: OUT: missing (usage: gspo export RUN_DIR|CHECKPOINT OUT"),
    ("export", [], "RUN_DIR|CHECKPOINT and OUT: missing"),
    ("export", ["runs/gspo-20250101", "out", "extra"], "unexpected argument 'extra' (usage: gspo export"),
    ("export", ["--step", "x", "runs/gspo-20250101", "out"], "--step: expected an integer, got 'x'"),
    ("export", ["runs/gspo-20250101", "out", "--step"], "--step: needs a value"),
    ("export", ["runs/nosuch", "out"], "RUN_DIR|CHECKPOINT runs/nosuch: no such directory"),
    ("export", ["runs/gspo-20250101", "out"], "RUN_DIR|CHECKPOINT runs/gspo-20250101: not a gspo run directory"),
    ("export", ["runs/gspo-20250101", "out", "--private"], "--private applies to the repository --push-to-hub creates"),
]


@pytest.mark.parametrize("command,args,says", CASES, ids=[f"{c}{i:02d}" for i, (c, *_) in enumerate(CASES)])
def test_a_refusal_is_one_line_naming_the_option(command, args, says, place, capsys):
    assert says in refused(command, args, place, capsys)


@pytest.mark.parametrize("reward,says", [
    ("reward.py:digit_credit", "no such file reward.py; did you mean rewards.py:digit_credit?"),
    ("rewards.py:digit_credt", "rewards.py has no function 'digit_credt'; did you mean "),  # the path made absolute
    ("exact_matc", "unknown reward 'exact_matc' (did you mean exact_match?): expected a built-in"),
])
def test_a_mistyped_reward_gets_a_did_you_mean(reward, says, place, capsys):
    (place / "rewards.py").write_text("def digit_credit(completions, **kw):\n    return [0.0 for _ in completions]\n")
    line = refused("train", ["--reward", reward], place, capsys)
    assert says in line and line.endswith("?" if "(" not in says else "org/name)")
    if "digit" in reward:
        assert line.endswith("rewards.py:digit_credit?")


def test_the_table_is_long_enough():
    assert len(CASES) >= 20 and {c for c, *_ in CASES} == {"train", "eval", "export"}


# ----------------------------------------------------------------------------------------------
# What is not refused: a value equal to the default or to what gspo derives, and the documented
# cases that are said in a warning instead
# ----------------------------------------------------------------------------------------------


@pytest.mark.slow  # trains
def test_a_runs_own_config_file_trains_again(place, capsys):
    # config.yaml sets every option, derived values included (grpo's clip range, critic_lr = 10 x lr):
    # none is refused as given
    assert main(["train", *TOY, "--algorithm", "grpo", "--output-dir", "a"]) == 0, capsys.readouterr().err
    saved = (place / "a" / "config.yaml").read_text()
    assert "critic_lr: 0.001" in saved and "lora_alpha: 16.0" in saved and "parallel: ddp" in saved
    assert main(["train", "--config", "a/config.yaml", "--output-dir", "b"]) == 0, capsys.readouterr().err
    # a resumed run is checked on what the resume changes: the saved eval_size is 0
    line = refused("train", ["--resume", "b", "--eval-every", "1", "--steps", "2"], place, capsys)
    assert "--eval-every 1: --eval-size is 0" in line


def test_what_a_config_file_may_hold_is_said_not_refused(place, capsys):
    # a recipe's vLLM settings stay when a flag samples with hf (tests/test_recipes.py); --task is
    # documented as ignored with --dataset; a saved config.yaml holds derived values (critic_lr = 10 x
    # lr, the clip range, a multi-turn episode budget) that another --lr, --algorithm or task leaves idle:
    # each is a warning in the plan
    examples = Path(__file__).resolve().parent.parent / "examples" / "arithmetic.jsonl"
    code = main(["train", *TOY, "--steps", "0", "--output-dir", "a", "--vllm-max-model-len", "32",
                 "--task", "chain", "--dataset", str(examples), "--prompt-column", "question", "--critic-lr", "0.01",
                 "--algorithm", "sapo", "--clip-low", "0.2", "--max-episode-tokens", "30"])
    err = capsys.readouterr().err
    assert code == 0, err
    for said in ["--vllm-max-model-len 32: not used: they set the vLLM engine, and this run samples with "
                 "--rollout-engine hf", "--task chain: not used: --dataset gives the prompts",
                 "--critic-lr 0.01: not used: sets PPO's value model; --algorithm sapo has none",
                 "--clip-low 0.2: not used: --algorithm sapo gates instead of clipping",
                 "--max-episode-tokens 30: not used: applies to multi-turn episodes"]:
        assert f"gspo: warning: {said}" in err, (said, err)


def test_plurals_agree(capsys):
    from gspo.cli import _print_summary
    from gspo.io.words import plural
    from gspo.train.run import AlreadyComplete

    assert (plural(1, "step"), plural(2, "step"),
            plural(1, "process", "processes")) == ("1 step", "2 steps", "1 process")
    _print_summary({"algorithm": "gspo", "task": "t", "steps": 1, "wall_seconds": 3, "eval_before": {},
                    "eval_after": {"n": 0}})
    assert "gspo on t: 1 step in 3s" in capsys.readouterr().out
    assert str(AlreadyComplete({"steps": 1})) == "the run is complete (1 step)"
    import torch

    from gspo.algo.advantages import group_advantages
    from gspo.rewards.builtin import apply_rewards, load_rewards
    from gspo.tasks.scoring import RewardError

    with pytest.raises(ValueError, match=r"batch of 1 reward is not a whole number of groups of size 2"):
        group_advantages(torch.tensor([1.0]), 2)
    with pytest.raises(RewardError, match=r"1 weight for 2 rewards;"):
        load_rewards(["exact_match", "length"], [1.0])

    def short(completions, **kw):
        return []

    with pytest.raises(RewardError, match=r"returned 0 values for 1 completion; expected a list of 1 float$"):
        apply_rewards(load_rewards([short], None), ["4"], {"answer": ["4"], "completion_ids": [[7]]}, ["row 1"])


# ----------------------------------------------------------------------------------------------
# A mistyped local model, as a user meets it: a fresh process, offline, an empty Hugging Face cache
# ----------------------------------------------------------------------------------------------


def gspo(*args, cwd, hf_home):
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_TOKEN",
                                                             "WORLD_SIZE", "RANK", "GSPO_DEBUG")}
    env.update(HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "gspo", *args], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=300)


@pytest.mark.parametrize("args,says", [
    (["eval", "--model", "runs/nosuch"], "gspo eval: error: model runs/nosuch: no such directory (built-in models: "),
    (["train", "--model", "tiny_moe", "--output-dir", "run"],
     "gspo train: error: model tiny_moe: no such directory; did you mean tiny-moe? (built-in models: "),
    # an ORG/NAME that is no local path is a Hub id, as before: offline, the cache is asked
    (["eval", "--model", "Org/NoSuchModel"], "gspo eval: error: model Org/NoSuchModel: not in the local Hugging Face "
                                              "cache"),
], ids=["eval-path", "train-builtin-typo", "hub-id"])
@pytest.mark.slow  # starts a process
def test_a_mistyped_model_in_a_fresh_process(args, says, tmp_path):
    (tmp_path / "work" / "runs").mkdir(parents=True)
    (tmp_path / "hf").mkdir()
    r = gspo(*args, cwd=tmp_path / "work", hf_home=tmp_path / "hf")
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(says), r.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "work").iterdir()) == ["runs"]  # nothing written


@pytest.mark.parametrize("name,path_like", [
    ("Qwen/Qwen2.5-0.5B-Instruct", False), ("gpt2", False), ("./m", True), ("/abs/m", True), ("~/m", True),
    ("a/b/c", True), ("org/na me", True), ("model.safetensors", True), ("runs/x", True), ("checkpoint.pt", True),
])
def test_path_like(name, path_like, place):
    from gspo.io.hub import looks_like_hub_id
    from gspo.io.hub import path_like as is_path

    assert is_path(name) is path_like  # runs/ exists in `place`
    assert looks_like_hub_id(name) is not path_like
