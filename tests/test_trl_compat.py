"""What a TRL user trips on: TRL's option names, did-you-mean, typed flag errors, runs trained
from Python with objects (eval, resume), the chain task's model, messages and warnings."""

import json
import warnings

import pytest

import gspo
from gspo.cli import main
from gspo.commands.argv import parse as _parse
from gspo.config import ConfigError, TrainConfig, options
from gspo.config.trl import to_gspo
from gspo.config.yamlfile import load_yaml
from gspo.models.loading import load_policy
from gspo.train.resolve import resolve

TINY = dict(prompts_per_step=2, group_size=2, max_new_tokens=4, eval_size=4, progress=False)


def rows(n=40):
    return [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in zip(range(100, 100 + n), range(300, 300 + n))]


def exact(completions, answer, **kw):
    return [float(c.strip() == a) for c, a in zip(completions, answer)]


@pytest.mark.parametrize("trl,gspo_values", [
    ({"num_generations": 16, "learning_rate": 1e-5, "max_completion_length": 64},
     {"group_size": 16, "lr": 1e-5, "max_new_tokens": 64}),
    ({"loss_type": "dr_grpo"}, {"loss_agg": "seq-mean-token-sum-norm"}),
    ({"loss_type": "dapo"}, {"loss_agg": "token-mean"}),
    ({"loss_type": "bnpo"}, {"loss_agg": "token-mean"}),
    ({"loss_type": "grpo"}, {"loss_agg": "seq-mean-token-mean"}),
    ({"importance_sampling_level": "sequence"}, {"algorithm": "gspo"}),
    ({"importance_sampling_level": "token"}, {"algorithm": "grpo"}),
    ({"scale_rewards": False}, {"adv_scale": "none"}),  # TRL's bools
    ({"scale_rewards": True}, {"adv_scale": "group"}),
    ({"scale_rewards": "batch"}, {"adv_scale": "batch"}),
    ({"epsilon": 0.2}, {"clip_low": 0.2, "clip_high": 0.2}),  # as in TRL, epsilon_high defaults to epsilon
    ({"epsilon": 3e-4, "epsilon_high": 4e-4}, {"clip_low": 3e-4, "clip_high": 4e-4}),
    ({"bf16": True, "use_vllm": True, "vllm_mode": "colocate"}, {"dtype": "bfloat16", "rollout_engine": "vllm"}),
    ({"bf16": False}, {}),  # changes nothing
    ({"steps_per_generation": 4, "gradient_accumulation_steps": 1, "num_iterations": 2},
     {"num_minibatches": 4, "epochs": 2}),
    ({"model_name_or_path": "tiny", "dataset_name": "openai/gsm8k", "dataset_config": "main",
      "dataset_train_split": "train", "dataset_test_split": "test"},
     {"model": "tiny", "dataset": "openai/gsm8k", "dataset_config": "main", "dataset_split": "train",
      "eval_split": "test"}),
    ({"lr_scheduler_type": "constant_with_warmup", "warmup_steps": 2}, {"lr_schedule": "constant", "warmup_steps": 2}),
    ({"num_generations": 8, "group_size": 8}, {"group_size": 8}),  # both names, one value: fine
])
def test_trl_names_map_to_gspo(trl, gspo_values):
    assert to_gspo(trl) == gspo_values
    assert TrainConfig.from_trl(**trl) == TrainConfig(**gspo_values)


@pytest.mark.parametrize("trl,msg", [
    ({"max_steps": 10}, "max_steps: TRL's option has no gspo equivalent: TRL counts optimizer updates"),
    ({"per_device_train_batch_size": 8}, "per_device_train_batch_size: TRL's option has no gspo equivalent"),
    ({"num_train_epochs": 3}, "num_train_epochs: TRL's option has no gspo equivalent"),
    ({"loss_type": "cispo"}, "loss_type: 'cispo' does not map to gspo's loss_agg: cispo and sapo are losses"),
    ({"scale_rewards": "mean"}, "scale_rewards: 'mean' does not map"),
    ({"vllm_mode": "server"}, "vllm_mode: 'server' does not map to gspo's rollout_engine: gspo runs vLLM colocated"),
    ({"gradient_accumulation_steps": 2}, "gradient_accumulation_steps: 2 does not map"),
    ({"num_generations": 8, "group_size": 4},
     "num_generations is TRL's name for group_size: both given (num_generations 8, group_size 4); give one"),
    ({"bf16": True, "fp16": True}, "bf16 and fp16 both set dtype, to 'bfloat16' and 'float16'; give one"),
    ({"num_generations": "eight"}, "num_generations: expected an integer, got 'eight'"),
    ({"stepz": 3}, "unknown option stepz; did you mean steps?"),
])
def test_what_does_not_map_is_one_line(trl, msg):
    with pytest.raises(ConfigError) as e:
        TrainConfig.from_trl(**trl)
    assert msg in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_the_docs_page_names_every_entry_of_the_table():
    from pathlib import Path

    from gspo.config.trl import NOT_MAPPED, TRL_NAMES, TRL_VALUES

    page = (Path(__file__).resolve().parents[1] / "docs" / "trl.md").read_text()
    missing = [n for n in [*TRL_NAMES, *TRL_NAMES.values(), *TRL_VALUES, *NOT_MAPPED] if f"`{n}`" not in page]
    assert not missing, f"docs/trl.md does not name {missing}"


def test_train_help_says_near_its_top_that_trls_names_work():
    from gspo.commands.help import train_help
    from gspo.config.trl import TRL_NAMES

    top = "\n".join(train_help(width=100).splitlines()[:16])  # before the algorithms and the 300 lines of options
    assert "TRL's GRPOConfig option names are accepted" in top and "docs/trl.md" in top
    for flag in ("--num_generations", "--learning_rate", "--max_completion_length"):
        assert flag in top and TRL_NAMES[flag[2:]]  # names the table has
    assert "--device is cpu unless given" in top
    args = ["--num_generations", "4", "--learning_rate", "3e-5", "--max_completion_length", "9",
            "--loss_type", "dr_grpo"]
    cfg = _parse(TrainConfig, args, "gspo train")  # what the help says works, works
    assert (cfg.group_size, cfg.lr, cfg.max_new_tokens, cfg.loss_agg) == (4, 3e-5, 9, "seq-mean-token-sum-norm")


def test_the_docs_defaults_table_lists_the_device_and_what_trl_sets_otherwise():
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "trl.md").read_text()
    table = page.split("## Defaults that differ")[1]
    rows = [line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    for row in ("device", "seed", "completion length", "learning rate", "precision", "MoE load-balancing loss",
                "vLLM sampler correction", "dropout"):
        assert row in rows, row
    device = next(line for line in table.splitlines() if line.startswith("| device |"))
    assert "`cpu` unless `--device` is given" in device and "accelerator" in device
    assert TrainConfig().device == "cpu" and TrainConfig().seed == 0  # what the table says of gspo


def test_trl_names_in_yaml_and_did_you_mean(tmp_path):
    p = tmp_path / "run.yaml"
    p.write_text("num_generations: 4\nlearning_rate: 1e-5\nloss_type: dr_grpo\nsteps: 3\n")
    cfg = load_yaml(p)
    assert (cfg.group_size, cfg.lr, cfg.loss_agg, cfg.steps) == (4, 1e-5, "seq-mean-token-sum-norm", 3)
    cases = {"step: 5\n": "unknown option 'step'; did you mean steps?",
             "num_generations: 4\ngroup_size: 8\n": "num_generations is TRL's name for group_size",
             "per_device_train_batch_size: 4\n": "per_device_train_batch_size: TRL's option has no gspo"}
    for text, msg in cases.items():
        p.write_text(text)
        with pytest.raises(ConfigError) as e:
            load_yaml(p)
        assert str(e.value).startswith(f"{p}: ") and msg in str(e.value), str(e.value)


def test_trl_flags_on_the_command_line():
    cfg = _parse(TrainConfig, ["--num-generations", "4", "--learning_rate", "2e-5", "--bf16", "--scale-rewards",
                               "false", "--use-vllm", "--steps", "3"], "gspo train", default=TrainConfig())
    changed = {f.name: getattr(cfg, f.name) for f in options() if getattr(cfg, f.name) != getattr(
        TrainConfig(), f.name)}
    assert changed == {"group_size": 4, "lr": 2e-5, "dtype": "bfloat16", "adv_scale": "none",
                       "rollout_engine": "vllm", "steps": 3}
    with pytest.raises(ConfigError, match="--num-generations is TRL's name for --group-size: both given"):
        _parse(TrainConfig, ["--num-generations", "4", "--group-size", "8"], "gspo train", default=TrainConfig())


@pytest.mark.parametrize("args,line", [
    (["train", "--step", "5"], "gspo train: error: unknown option --step; did you mean --steps?"),
    (["train", "--num-generation", "8"], "gspo train: error: unknown option --num-generation; did you mean "
                                         "--num-generations?"),
    (["train", "--steps", "five"], "gspo train: error: --steps: expected an integer, got 'five'"),
    (["train", "--lr=fast"], "gspo train: error: --lr: expected a number, got 'fast'"),
    (["train", "--reward-weights", "1", "x"], "gspo train: error: --reward-weights: expected numbers, got '1 x'"),
    (["train", "--max-steps", "10"], "gspo train: error: --max-steps: TRL's option has no gspo equivalent"),
    (["eval", "--model", "tiny", "--kk", "2"], "gspo eval: error: unknown option --kk; did you mean --k?"),
    (["eval", "--model", "tiny", "--k", "many"], "gspo eval: error: --k: expected an integer, got 'many'"),
])
def test_flag_errors_are_one_line(args, line, capsys, tmp_path):
    assert main([*args, *(["--output-dir", str(tmp_path / "r")] if args[0] == "train" else [])]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(line) and "\n" not in err, err
    assert not (tmp_path / "r").exists()


def test_trainer_takes_trls_argument_names():
    t = gspo.Trainer(args=TrainConfig(steps=3), processing_class="tok")
    assert t.config.steps == 3 and t.inputs.tokenizer == "tok"
    for kw, msg in [(dict(config=TrainConfig(), args=TrainConfig(steps=2)), "config and args (TRL's name for it) "
                                                                            "both given: pass one"),
                    (dict(tokenizer="a", processing_class="b"), "tokenizer and processing_class"),
                    (dict(args=type("GRPOConfig", (), {})()), "args: expected a gspo.TrainConfig, got GRPOConfig "
                                                             "(TRL's options: gspo.TrainConfig.from_trl(**options))"),
                    (dict(config=TrainConfig(steps="2")), "steps: expected an integer, got '2'")]:
        with pytest.raises(ConfigError) as e:
            gspo.Trainer(**kw)  # at construction, where the mistake is, not at .train()
        assert msg in str(e.value), str(e.value)


def test_the_chain_task_picks_its_model():
    assert resolve(TrainConfig(task="chain")).model == "tiny-long"
    assert resolve(TrainConfig(task="chain", model="tiny-long-moe")).model == "tiny-long-moe"
    assert resolve(TrainConfig(task="chain", dataset="x.jsonl")).model == "tiny"  # a dataset is not the task


@pytest.mark.slow  # trains
def test_a_run_trained_from_python_evaluates_and_resumes(tmp_path, capsys):
    model, tok = load_policy("tiny")
    run = str(tmp_path / "run")
    gspo.Trainer(TrainConfig(steps=1, output_dir=run, **TINY), model=model, tokenizer=tok, train_dataset=rows(),
                 reward_funcs=[exact]).train(log=lambda *a: None)
    for args, msg in [([], f"{run} was trained on an in-memory dataset (<train_dataset>): pass --dataset FILE|ID or "
                           "--task NAME"),
                      (["--task", "arithmetic"], f"{run}: reward <exact> was a Python callable: pass --reward "
                                                 "NAME|file.py:fn")]:
        capsys.readouterr()
        assert main(["eval", "--model", run, *args]) == 2
        assert capsys.readouterr().err.strip() == f"gspo eval: error: {msg}"
    assert main(["eval", "--model", run, "--task", "arithmetic", "--reward", "exact_integer", "--eval-size", "4",
                 "--k", "0", "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["n"] == 4
    assert main(["train", "--resume", run, "--steps", "2"]) == 2
    assert "was trained from Python on objects (<train_dataset>, <exact>): resume it from Python" in \
        capsys.readouterr().err
    # from Python, without a config: the run's own (it was refused: "--prompts-per-step ... cannot change")
    with pytest.raises(ConfigError, match=r"pass train_dataset= \(<train_dataset>\), reward_funcs= \(<exact>\)"):
        gspo.Trainer(model=model, tokenizer=tok).train(resume=run)
    t = gspo.Trainer(model=model, processing_class=tok, train_dataset=rows(), reward_funcs=[exact])
    t.config.steps = 2  # an option set on the trainer's config applies over the saved one
    s = t.train(resume=run, log=lambda *a: None)
    assert s["steps"] == 2 and [e["step"] for e in s["evals"]] == [0, 1, 2]


@pytest.mark.slow  # trains
def test_a_resumed_run_keeps_the_final_evaluation_of_the_first(tmp_path):
    from gspo.train.trainer import train

    run = str(tmp_path / "run")
    train(TrainConfig(steps=1, output_dir=run, **TINY), log=lambda *a: None)
    s = train(TrainConfig(steps=2, output_dir=run, **TINY), resume=run, log=lambda *a: None)
    # step 0 (before), step 1 (the first run's final evaluation, made after its last checkpoint), step 2
    assert [e["step"] for e in s["evals"]] == [0, 1, 2]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["evals"] == s["evals"]


def test_the_dataset_length_note_names_the_dataset(tmp_path):
    from gspo.sampling.samplers import Inputs
    from gspo.train.run import build_run

    cfg = TrainConfig(output_dir=str(tmp_path / "r"), dataset="<train_dataset>", **{**TINY, "max_new_tokens": None})
    run = build_run(cfg, inputs=Inputs(train_dataset=rows(), reward_funcs=[exact]))  # as gspo.Trainer makes it
    note = next(n for n in run.notes if n.startswith("max_new_tokens"))
    assert note.startswith("max_new_tokens: the default for a dataset (<train_dataset>), 256, capped to"), note
    assert "task" not in note


@pytest.mark.slow  # trains
def test_lora_and_checkpointing_runs_and_eval_leak_no_future_warning(tmp_path, capsys):
    pytest.importorskip("peft")
    from gspo.train.trainer import train

    run = str(tmp_path / "run")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # over pyproject's filter, which hides one in tests only
        train(TrainConfig(steps=1, lora_r=4, gradient_checkpointing=True, output_dir=run, **TINY), log=lambda *a: None)
        assert main(["eval", "--model", run, "--eval-size", "4", "--k", "0", "--no-progress"]) == 0
    assert "Warning" not in capsys.readouterr().err
