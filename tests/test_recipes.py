"""The recipes in examples/recipes/ run as written, and `--system-prompt`.

Each recipe runs ONE step on CPU with its own `model:` and `dataset:` lines: their hub ids
resolve, offline (HF_HUB_OFFLINE=1), to a temporary Hugging Face cache holding a tiny random
model of the same architecture under the same id (Qwen2 for Qwen2.5, Qwen3 for Qwen3) and a
GSM8K-shaped dataset (question; answer ending in `#### N`) as openai/gsm8k, config main
(tests/hubcache.py). The tiny models keep the real ones' max_position_embeddings, so length
checks and vLLM's max_model_len see what they would on a GPU.

What the test changes, and nothing else (`OVERRIDES`; the resolved config.yaml must equal the
recipe everywhere else, and the run must start without a warning): one step, smaller sizes,
the output directory, no progress bar, `device: cpu` (no GPU here), and in the main suite
`rollout_engine: hf` (vLLM is not installed there; tests/test_vllm.py runs the Qwen2.5 recipe
on its vLLM engine in the vLLM environment). The FSDP recipe runs under torchrun with 2
processes (gloo) and is marked slow like the other torchrun tests.

Also here: `--system-prompt` (gspo.tasks.base.SystemPrompt), the exact prompt string the chat
template renders, with and without a system turn of the prompt's own.
"""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gspo.io.files import read_jsonl
from gspo.tasks.base import SystemPrompt, with_system
from gspo.tasks.data import Example
from tests.hubcache import cache_dataset, cache_model, offline_env, offline_hub, tiny_qwen2_dir, tiny_qwen3_dir

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "examples" / "recipes").glob("*.yaml"))
ONE_GPU = [r for r in RECIPES if "fsdp" not in r.stem]
FSDP = [r for r in RECIPES if "fsdp" in r.stem]

# the stand-in for each hub model a recipe names: its architecture and the real model's positions
STAND_INS = {
    "Qwen/Qwen2.5-0.5B-Instruct": ("qwen2", 32768),
    "Qwen/Qwen3-0.6B": ("qwen3", 40960),
    "Qwen/Qwen3-1.7B": ("qwen3", 40960),
}

# what a test may change in a recipe, and nothing else
OVERRIDES = {"steps": 1, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 8, "eval_size": 4,
             "micro_batch_tokens": 512, "progress": False, "device": "cpu"}
MAIN_SUITE = {"rollout_engine": "hf"}  # vLLM is not installed in the main test environment


def gsm8k_rows(n: int, start: int = 0) -> list[dict]:
    """GSM8K-shaped rows: a word problem and a worked answer ending in `#### N`."""
    rows = []
    for k in range(start, start + n):
        a, b = 3 + k % 7, 2 + k % 5
        rows.append({"question": f"Ann has {a} pens and buys {b} more. How many pens has she?",
                     "answer": f"She has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} pens.\n#### {a + b}"})
    return rows


def build_hub(hf_home: Path, work: Path) -> Path:
    """The Hugging Face cache every recipe reads: each model id it names, and openai/gsm8k (main)."""
    for repo_id in sorted({load(r)["model"] for r in RECIPES}):
        arch, positions = STAND_INS[repo_id]
        src = work / repo_id.replace("/", "--")
        if arch == "qwen3":
            tiny_qwen3_dir(src, max_position_embeddings=positions)
        else:
            tiny_qwen2_dir(src)
            cfg = json.loads((src / "config.json").read_text())
            (src / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": positions}, indent=2))
        cache_model(hf_home, repo_id, src)
    cache_dataset(hf_home, "openai/gsm8k", {"train": gsm8k_rows(24), "test": gsm8k_rows(8, start=100)}, config="main")
    return hf_home


def load(recipe: Path) -> dict:
    return yaml.safe_load(recipe.read_text())


def recipe_args(recipe: Path, run_dir: Path, extra: dict) -> list[str]:
    """`gspo train --config RECIPE` with the overrides as flags (flags win over the file)."""
    args = ["train", "--config", str(recipe), "--output-dir", str(run_dir)]
    for key, value in {**OVERRIDES, **extra}.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            args.append(flag if value else "--no-" + key.replace("_", "-"))
        else:
            args += [flag, str(value)]
    return args


def check_run(recipe: Path, run_dir: Path, stderr: str, extra: dict) -> None:
    """The run did what the recipe says, with only the overrides changed and no warning."""
    # gspo says nothing at startup (no capped length, no fallback), except what the main suite's
    # own `rollout_engine: hf` brings: under FSDP, how gspo's sampler gathers the policy. (vLLM's
    # own log has WARNING lines of its own: engine chatter, e.g. float32 weights cast to bfloat16.)
    said = [line for line in stderr.splitlines() if line.startswith("gspo: warning:")]
    expected = [line for line in said if extra.get("rollout_engine") == "hf" and (
        load(recipe).get("parallel") == "fsdp"
        and line.startswith("gspo: warning: parallel: fsdp samples with the sharded policy itself")
        # ... and that the recipe's vLLM settings do not act when it samples with hf
        or line.startswith("gspo: warning: --vllm-")
        and line.endswith("not used: they set the vLLM engine, and this run samples with --rollout-engine hf"))]
    assert said == expected, said
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    changed = {**OVERRIDES, **extra}
    for key, value in load(recipe).items():
        if key in changed or key == "output_dir":
            continue
        value = list(value) if isinstance(value, (list, tuple)) else value
        assert saved[key] == value, (key, saved[key], value)
    for key, value in changed.items():
        assert saved[key] == value, (key, saved[key], value)
    assert saved["clip_low"] == 3e-4 and saved["clip_high"] == 4e-4  # GSPO's preset (paper §5.1)
    [row] = read_jsonl(run_dir / "metrics.jsonl")
    assert row["step"] == 1 and "reward/math_verify/mean" in row and "mismatch/token_abs" in row
    sample = read_jsonl(run_dir / "samples.jsonl")[0]
    system = load(recipe)["system_prompt"]
    assert sample["messages"][0] == {"role": "system", "content": system}
    # what the model saw: the chat template's system turn, then the question as the user's turn
    # (compared without whitespace: the Qwen2 stand-in's tokenizer loads as transformers'
    # Qwen2Tokenizer, whose pre-tokenizer drops the char vocabulary's spaces and newlines)
    seen, expected = (sample["prompt"], f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\nAnn has ")
    assert "".join(seen.split()).startswith("".join(expected.split())), seen
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval_after"]["n"] == OVERRIDES["eval_size"] and summary["eval_after"]["metric"] == "math_verify"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    return build_hub(tmp_path_factory.mktemp("hf"), tmp_path_factory.mktemp("models"))


# ---------------------------------------------------------------------------------------------
# The recipes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_recipe_options_are_real_and_models_have_stand_ins(recipe):
    from gspo.config.yamlfile import load_yaml
    from gspo.train.resolve import resolve

    cfg = resolve(load_yaml(recipe))  # an unknown key or a bad value raises here
    assert cfg.model in STAND_INS, f"{recipe.name}: add a tiny stand-in for {cfg.model} to STAND_INS"
    assert cfg.dataset == "openai/gsm8k" and cfg.dataset_config == "main" and cfg.reward == ("math_verify",)
    assert cfg.algorithm == "gspo" and cfg.clip_low == 3e-4 and cfg.clip_high == 4e-4 and cfg.beta == 0
    assert cfg.dtype == "bfloat16" and cfg.param_dtype == "float32" and cfg.old_logp == "recompute"
    assert resolve(dataclasses.replace(load_yaml(recipe), old_logp="auto")).old_logp == "recompute"  # what auto gives
    assert cfg.lr == 1e-6 and cfg.num_minibatches == 4 and cfg.device == "cuda" and cfg.rollout_engine == "vllm"
    assert cfg.prompts_per_step % (8 if recipe in FSDP else 1) == 0
    assert (cfg.parallel == "fsdp") == (recipe in FSDP)


@pytest.mark.slow  # trains
@pytest.mark.parametrize("recipe", ONE_GPU, ids=[r.stem for r in ONE_GPU])
def test_recipe_runs_one_step(recipe, hub, tmp_path, monkeypatch, capsys):
    from gspo.cli import main

    offline_hub(monkeypatch, hub)
    run_dir = tmp_path / "run"
    assert main(recipe_args(recipe, run_dir, MAIN_SUITE)) == 0, capsys.readouterr().err
    check_run(recipe, run_dir, capsys.readouterr().err, MAIN_SUITE)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", FSDP, ids=[r.stem for r in FSDP])
def test_fsdp_recipe_runs_one_step_on_two_processes(recipe, hub, tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "gspo.cli",
           *recipe_args(recipe, run_dir, MAIN_SUITE)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                       env={**offline_env(hub), "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    check_run(recipe, run_dir, r.stderr, MAIN_SUITE)


# ---------------------------------------------------------------------------------------------
# --system-prompt
# ---------------------------------------------------------------------------------------------

# Qwen2.5's chat template without its tools branch: a default system turn when the messages have none
QWEN25_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if message.role == 'user' or (message.role == 'system' and not loop.first)"
    " or message.role == 'assistant' %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


class Rows:
    """A task over fixed rows (train_batch cycles through them)."""

    name = "rows"
    default_rewards = ("exact_match",)
    default_max_new_tokens = 16
    notes = ["a note"]

    def __init__(self, rows):
        self.rows = rows

    def train_batch(self, step, n, seed=0):
        return [self.rows[(step * n + i) % len(self.rows)] for i in range(n)]

    def test_set(self, n=None):
        return self.rows[: n or len(self.rows)]


TEXT = Example("2+2=", "4", {"answer": "4", "level": "easy"}, "rows line 1")
CHAT = Example([{"role": "user", "content": "3+3="}], "6", {"answer": "6"}, "rows line 2")
OWN = Example([{"role": "system", "content": "Mine."}, {"role": "user", "content": "4+4="}], "8", {}, "rows line 3")


@pytest.fixture(scope="module")
def qwen_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tiny_qwen3_dir(tmp_path_factory.mktemp("tok"))
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = QWEN25_TEMPLATE
    return tok


def test_system_prompt_renders_exactly(qwen_tokenizer):
    from gspo.sampling.rollout import encode_prompts

    task = SystemPrompt(Rows([TEXT, CHAT, OWN]), "Be brief.")
    ids = encode_prompts(qwen_tokenizer, [ex.prompt for ex in task.test_set()])
    texts = [qwen_tokenizer.decode(x) for x in ids]
    assert texts == [
        # a string prompt: our system turn, then the prompt as the user's turn (the template's
        # default "You are Qwen ..." system turn is replaced)
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2=<|im_end|>\n<|im_start|>assistant\n",
        # chat messages without a system turn: ours first
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n3+3=<|im_end|>\n<|im_start|>assistant\n",
        # chat messages with their own system turn: kept, ours not added
        "<|im_start|>system\nMine.<|im_end|>\n<|im_start|>user\n4+4=<|im_end|>\n<|im_start|>assistant\n",
    ]
    # without --system-prompt the string prompt is plain text (no template) and the chat one gets Qwen's default
    plain = [qwen_tokenizer.decode(x) for x in encode_prompts(qwen_tokenizer, [TEXT.prompt, CHAT.prompt])]
    assert plain[0] == "2+2=" and plain[1].startswith("<|im_start|>system\nYou are Qwen")


def test_system_prompt_keeps_answers_columns_and_the_task():
    inner = Rows([TEXT, CHAT, OWN])
    task = SystemPrompt(inner, "Be brief.")
    for before, after in zip(inner.train_batch(2, 5, seed=3), task.train_batch(2, 5, seed=3)):  # the same rows
        assert (after.answer, after.columns, after.source) == (before.answer, before.columns, before.source)
        assert after.is_chat and after.prompt[0]["role"] == "system"
    assert TEXT.prompt == "2+2=" and len(CHAT.prompt) == 1  # the wrapped task's examples are not changed
    assert (task.name, task.default_rewards, task.default_max_new_tokens, task.notes) == \
        ("rows", ("exact_match",), 16, ["a note"])
    with pytest.raises(AttributeError):
        _ = task.no_such_attribute
    assert with_system([], "S") == [{"role": "system", "content": "S"}]


def test_system_prompt_reaches_training_evaluation_and_gspo_eval(tmp_path):
    from gspo.agents.side import task_and_rewards
    from gspo.config import TrainConfig
    from gspo.train.resolve import resolve

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1), "level": i % 2}) + "\n"
                            for i in range(20)))
    cfg = resolve(TrainConfig(dataset=str(data), system_prompt="Be brief.", output_dir=str(tmp_path / "r")))
    task, rewards = task_and_rewards(cfg)  # what build_run and `gspo eval` call
    ex = task.test_set(1)[0]
    assert ex.prompt[0] == {"role": "system", "content": "Be brief."} and ex.prompt[1]["role"] == "user"
    assert ex.columns["level"] in (0, 1) and ex.answer == str(int(ex.prompt[1]["content"].split("+")[0]) + 1)
    assert rewards[0].name == "exact_match"
    plain, _ = task_and_rewards(resolve(TrainConfig(dataset=str(data), output_dir=str(tmp_path / "r"))))
    assert isinstance(plain.test_set(1)[0].prompt, str)


def test_system_prompt_needs_a_chat_template(tmp_path, capsys):
    from gspo.cli import main

    code = main(["train", "--system-prompt", "Be brief.", "--steps", "1", "--eval-size", "4", "--no-progress",
                 "--output-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == ("gspo train: error: task arithmetic: --system-prompt makes prompts chat messages "
                                 "but the tokenizer of tiny has no chat template")
    assert not (tmp_path / "r").exists()
