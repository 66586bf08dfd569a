"""Learned reward models (gspo.rewards.model): scores equal the model run by hand on the text TRL builds.

The reward model is a 2-layer Qwen2ForSequenceClassification (hidden 32, num_labels=1) with
its own character tokenizer (no pad token) and a chat template unlike the policy's.
"""

import functools
import json
import string

import pytest
import torch

from gspo.config import ConfigError
from gspo.rewards.builtin import load_reward, load_rewards, score_completions
from gspo.tasks.data import Example
from gspo.tasks.scoring import RewardError

# the reward model's template; the policy's (tests/conftest.py CHAT_TEMPLATE) uses <|im_start|>role\n...<|im_end|>
RM_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]


def _tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<|endoftext|>", "<unk>"])}
    for c in string.printable:
        vocab.setdefault(c, len(vocab))
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"<\|endoftext\|>|."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>", unk_token="<unk>")  # no pad token
    tok.chat_template = RM_TEMPLATE
    return tok


def save_reward_model(path, *, num_labels=1, seed=0, dtype=torch.float32):
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    tok = _tokenizer()
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256, num_labels=num_labels)
    Qwen2ForSequenceClassification(cfg).to(dtype).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    return save_reward_model(tmp_path_factory.mktemp("rm") / "my-rm")


@functools.lru_cache
def _plain(rm_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    return AutoTokenizer.from_pretrained(rm_dir), AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()


def by_hand(rm_dir, text: str) -> float:
    """The model run on one unpadded text: the score head on the last token's hidden state."""
    tok, model = _plain(rm_dir)
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])  # (1, T)
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state  # (1, T, 32)
        return float(model.score(hidden[0, -1]))  # (1,) -> the reward


def test_scores_equal_the_model_on_the_text_gspo_builds(rm_dir):
    rm = load_reward(str(rm_dir)).fn
    prompts, completions = ["2+2=", "The capital of France is", "x"], [" 4", " Paris.", " y z w"]
    scores = rm(completions=completions, prompts=prompts)
    # plain text rows: the reward model reads prompt + completion, as TRL's _calculate_rewards
    expected = [by_hand(rm_dir, p + c) for p, c in zip(prompts, completions)]
    assert scores == pytest.approx(expected, abs=1e-6)
    assert len(set(scores)) == 3  # three different texts, three different scores


def test_conversational_rows_are_rendered_with_the_reward_models_template(rm_dir):
    from tests.conftest import CHAT_TEMPLATE

    rm = load_reward(str(rm_dir)).fn
    completion = [{"role": "assistant", "content": "4"}]
    text = rm.texts([CHAT], [completion])[0]
    assert text == "[system] Be brief.\n[user] 2+2?\n[assistant] 4\n"
    assert "<|im_start|>" in CHAT_TEMPLATE and "<|im_start|>" not in text  # not the policy's template
    ex = Example(CHAT, "4", {"answer": "4"}, "chat.jsonl line 1")
    _, per = score_completions([load_reward(str(rm_dir))], [ex], ["4", "5"], [[1], [2]], group_size=2)
    assert per["my-rm"] == pytest.approx([by_hand(rm_dir, text), by_hand(rm_dir, text.replace("4\n", "5\n"))],
                                         abs=1e-6)


def test_batching_and_padding_do_not_change_a_score(rm_dir):
    prompts, completions = ["a", "bb", "ccc"], ["1", "22222222", "3"]  # lengths 2, 10, 4: batches are padded
    one = load_reward(str(rm_dir), batch_size=1).fn
    two = load_reward(str(rm_dir), batch_size=2).fn
    singles = one(completions=completions, prompts=prompts)
    assert two(completions=completions, prompts=prompts) == pytest.approx(singles, abs=1e-6)  # batches [0, 1], [2]
    # "a1" (2 tokens) padded to 10 next to "bb22222222" scores as it does alone
    assert two(completions=completions[:2][::-1], prompts=prompts[:2][::-1])[1] == pytest.approx(singles[0], abs=1e-6)


def test_loaded_as_trl_does(rm_dir):
    rm = load_reward(str(rm_dir)).fn
    # no pad token: EOS pads (TRL), and the model is told which id pads (it reads the last non-pad token)
    assert rm.tokenizer.pad_token == "<|endoftext|>" and rm.model.config.pad_token_id == 0
    assert not rm.model.training and not any(p.requires_grad for p in rm.model.parameters())
    assert rm.model.dtype == torch.float32 and rm.device == torch.device("cpu")


def test_dtype_follows_the_config_on_a_gpu_and_is_float32_on_the_cpu(tmp_path):
    from types import SimpleNamespace

    from gspo.rewards.model import load_dtype

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert load_dtype(SimpleNamespace(dtype="bfloat16"), cuda) == torch.bfloat16
    assert load_dtype(SimpleNamespace(dtype=torch.float16), cuda) == torch.float16
    assert load_dtype(SimpleNamespace(dtype=None), cuda) == torch.float32
    assert load_dtype(SimpleNamespace(dtype="bfloat16"), cpu) == torch.float32
    bf16 = save_reward_model(tmp_path / "bf16", dtype=torch.bfloat16)
    assert json.loads((bf16 / "config.json").read_text())["dtype"] == "bfloat16"
    assert load_reward(str(bf16)).fn.model.dtype == torch.float32  # on the CPU


def test_weights_combine_with_a_builtin_reward(rm_dir):
    rewards = load_rewards([str(rm_dir), "exact_match"], [0.5, 2.0])
    ex = Example("2+2=", "4", {"answer": "4"}, "d.jsonl line 1")
    total, per = score_completions(rewards, [ex], ["4", "5"], [[1], [2]], group_size=2)
    s4, s5 = by_hand(rm_dir, "2+2=4"), by_hand(rm_dir, "2+2=5")
    # "4": 0.5·s4 + 2.0·1;  "5": 0.5·s5 + 2.0·0
    assert total == pytest.approx([0.5 * s4 + 2.0, 0.5 * s5], abs=1e-6)
    assert per["exact_match"] == [1.0, 0.0] and list(per) == ["my-rm", "exact_match"]


def test_a_hub_id_is_resolved_by_gspo_hub(rm_dir, monkeypatch):
    from gspo.io import hub

    monkeypatch.setattr(hub, "model_dir", lambda repo_id, revision=None: rm_dir)
    r = load_reward("Org/Skywork-Reward-Tiny")
    assert r.name == "Skywork-Reward-Tiny"  # reward/Skywork-Reward-Tiny/mean

    def missing(repo_id, revision=None):
        raise hub.HubError(f"model {repo_id}: not found on the Hugging Face Hub")

    monkeypatch.setattr(hub, "model_dir", missing)
    with pytest.raises(RewardError) as e:
        load_reward("Org/none")
    assert str(e.value) == ("reward 'Org/none': no such directory, and as a Hugging Face Hub id: model Org/none: "
                            "not found on the Hugging Face Hub")


def test_bad_reward_models_are_one_line(rm_dir, tmp_path):
    from tests.conftest import build_chat_model

    two = save_reward_model(tmp_path / "two-labels", num_labels=2)
    causal = build_chat_model(tmp_path / "causal")
    (tmp_path / "empty").mkdir()
    cases = {
        str(two): f"reward '{two}': num_labels is 2; a reward model scores with one logit (num_labels=1)",
        str(causal): f"reward '{causal}': {causal} is not a reward model (config.json architectures "
                     "['Qwen3ForCausalLM']; a learned reward is an AutoModelForSequenceClassification)",
        str(tmp_path / "empty"): "has no config.json, not a Hugging Face model directory",
        "nope": "unknown reward 'nope': expected a built-in (exact_match, exact_integer",
    }
    for spec, msg in cases.items():
        with pytest.raises(RewardError) as e:
            load_reward(spec)
        assert msg in str(e.value) and "\n" not in str(e.value), str(e.value)
    with pytest.raises(RewardError, match="pass a reward model as its directory"):  # TRL takes objects; gspo a path
        load_reward(load_reward(str(rm_dir)).fn.model)


@pytest.mark.parametrize("device", ["cuda0", "cuda:x", "tpu"])
def test_bad_reward_model_device_is_one_line(device):
    with pytest.raises(ConfigError) as e:
        load_rewards(["exact_match"], None, reward_model_device=device)
    assert str(e.value) == f"reward_model_device: must be cpu, cuda, cuda:N, mps or auto (got {device!r})"


@pytest.mark.slow  # trains
def test_a_training_run_logs_the_reward_models_metric(rm_dir, tmp_path):
    import gspo
    from tests.conftest import build_chat_model

    policy = build_chat_model(tmp_path / "policy")
    rows = [{"prompt": [{"role": "user", "content": f"{a}+1?"}], "answer": str(a + 1)} for a in range(20)]
    cfg = gspo.TrainConfig(model=str(policy), steps=1, prompts_per_step=2, group_size=2, max_new_tokens=4,
                           eval_size=2, reward_model_batch_size=3, output_dir=str(tmp_path / "run"), progress=False)
    summary = gspo.Trainer(cfg, train_dataset=rows, reward_funcs=[str(rm_dir)]).train()
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert isinstance(row["reward/my-rm/mean"], float) and summary["eval_after"]["metric"] == "my-rm"
    assert summary["eval_after"]["n_scored"] == 2 and not summary["eval_after"]["binary"]
