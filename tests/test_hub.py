"""Models and datasets by Hugging Face Hub id, offline: a cache under a temporary HF_HOME built as
a download leaves it (tests/hubcache.py), read with HF_HUB_OFFLINE=1.

The cache: Qwen/Qwen2.5-0.5B-Instruct (a tiny Qwen2; branch main has 256 positions, branch v2
200 and other weights), Qwen/Qwen3-0.6B (a tiny Qwen3), openai/gsm8k (config main: 20 train
rows, 4 test rows). Failures the cache cannot stage (not on the Hub, gated, no such revision)
come from patching the huggingface_hub call to raise what the library raises.
"""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from gspo.cli import main
from gspo.config import Data
from gspo.io.hub import HubError, looks_like_hub_id, model_dir, model_files
from tests.hubcache import cache_dataset, cache_model, offline_env, offline_hub, tiny_qwen2_dir, tiny_qwen3_dir

QWEN2, QWEN3, GSM8K = "Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen3-0.6B", "openai/gsm8k"
ROWS = [{"question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(24)]
FAST = ["--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "4", "--eval-size", "4", "--no-progress"]
GSM8K_ARGS = ["--dataset", GSM8K, "--dataset-config", "main", "--prompt-column", "question", "--eval-split", "test"]


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    home = root / "hf"
    commits = {"main": cache_model(home, QWEN2, tiny_qwen2_dir(root / "q2")),
               "v2": cache_model(home, QWEN2, tiny_qwen2_dir(root / "q2v2", seed=1, max_position_embeddings=200),
                                 revision="v2"),
               "qwen3": cache_model(home, QWEN3, tiny_qwen3_dir(root / "q3")),
               "gsm8k": cache_dataset(home, GSM8K, {"train": ROWS[:20], "test": ROWS[20:]}, config="main")}
    return SimpleNamespace(home=home, commits=commits)


@pytest.fixture
def offline(hub, monkeypatch):
    offline_hub(monkeypatch, hub.home)
    return hub


def error_line(capsys, command: str) -> str:
    """The one error line `gspo COMMAND` printed (library warnings on stderr aside)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith(f"gspo {command}: error:")]
    assert len(lines) == 1, err
    return lines[0]


# ----------------------------------------------------------------------------------------------
# The cache helpers themselves: the layout huggingface_hub and datasets read
# ----------------------------------------------------------------------------------------------


def test_model_cache_has_the_download_layout(hub):
    storage = hub.home / "hub" / "models--Qwen--Qwen2.5-0.5B-Instruct"
    assert (storage / "refs" / "main").read_text() == hub.commits["main"]
    assert (storage / "refs" / "v2").read_text() == hub.commits["v2"] != hub.commits["main"]
    weights = storage / "snapshots" / hub.commits["main"] / "model.safetensors"
    assert weights.is_symlink() and os.readlink(weights).startswith("../../blobs/")
    import hashlib

    assert weights.resolve().name == hashlib.sha256(weights.read_bytes()).hexdigest()  # LFS blobs: sha256
    tree = json.loads((storage / "trees" / f"{hub.commits['main']}.json").read_text())
    assert tree["files"]["model.safetensors"]["lfs_sha256"] == weights.resolve().name


def test_gsm8k_loads_offline_with_only_that_hf_home(offline):
    import datasets

    test = datasets.load_dataset(GSM8K, "main", split="test")
    assert test.num_rows == 4 and test[0] == ROWS[20]
    assert datasets.load_dataset(GSM8K, "main", split="train").num_rows == 20


# ----------------------------------------------------------------------------------------------
# Ids, the files a model needs, revisions
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,expected", [
    (QWEN2, True), ("gpt2", True), ("openai/gsm8k", True),
    ("./nope", False), ("/abs/path", False), ("~/models/x", False), ("a/b/c", False), ("org/na me", False),
    ("org--x/y", False), ("../up", False),
])
def test_looks_like_hub_id(name, expected):
    assert looks_like_hub_id(name) is expected


@pytest.mark.parametrize("files,expected", [
    # safetensors present: no .bin, no ONNX / GGUF / subfolders, no README
    (["config.json", "generation_config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
      "model.safetensors.index.json", "pytorch_model.bin", "onnx/model.onnx", "model.gguf", "README.md",
      "tokenizer.json", "tokenizer_config.json", "merges.txt", "vocab.json", "chat_template.jinja"],
     ["chat_template.jinja", "config.json", "generation_config.json", "merges.txt", "model-00001-of-00002.safetensors",
      "model-00002-of-00002.safetensors", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
      "vocab.json"]),
    # no safetensors: the PyTorch .bin weights (not the trainer's training_args.bin)
    (["config.json", "pytorch_model.bin", "training_args.bin", "tf_model.h5", "tokenizer.model"],
     ["config.json", "pytorch_model.bin", "tokenizer.model"]),
    (["config.json", "additional_chat_templates/tools.jinja", "original/consolidated.pth"],
     ["additional_chat_templates/tools.jinja", "config.json"]),
])
def test_model_files_are_what_loading_needs(files, expected):
    assert model_files(files) == expected


def test_revision_picks_the_branch_snapshot(offline):
    from gspo.models.loading import load_policy

    snapshots = offline.home / "hub" / "models--Qwen--Qwen2.5-0.5B-Instruct" / "snapshots"
    assert model_dir(QWEN2) == snapshots / offline.commits["main"]
    assert model_dir(QWEN2, revision="v2") == snapshots / offline.commits["v2"]
    assert model_dir(QWEN2, revision=offline.commits["v2"]) == snapshots / offline.commits["v2"]  # a commit hash
    main_model, tok = load_policy(QWEN2)
    v2_model, _ = load_policy(QWEN2, revision="v2")
    assert main_model.config.max_position_embeddings == 256 and v2_model.config.max_position_embeddings == 200
    assert type(main_model).__name__ == "Qwen2ForCausalLM" and tok.chat_template
    assert v2_model.name_or_path == QWEN2  # as transformers records a model loaded by id


@pytest.mark.filterwarnings("ignore:Could not find a config file")  # PEFT, saving offline: cannot ask the Hub
def test_lora_adapter_records_the_hub_base_and_revision(offline, tmp_path):
    from gspo.models.loading import add_lora, load_policy

    model, _ = load_policy(QWEN2, revision="v2")
    add_lora(model, r=2, alpha=4, dropout=0.0, target_modules=["q_proj"], revision="v2").save_pretrained(tmp_path)
    recorded = json.loads((tmp_path / "adapter_config.json").read_text())
    assert (recorded["base_model_name_or_path"], recorded["revision"]) == (QWEN2, "v2")
    loaded, tok = load_policy(str(tmp_path))  # the base comes from the cache, at the recorded revision
    assert loaded.get_base_model().config.max_position_embeddings == 200 and tok.eos_token == "<|im_end|>"


# ----------------------------------------------------------------------------------------------
# The user's path: train, resume, evaluate by ids
# ----------------------------------------------------------------------------------------------


@pytest.mark.slow  # trains
def test_train_resume_and_eval_by_hub_ids(offline, tmp_path, capsys):
    run = tmp_path / "run"
    # PPO with a KL term: the policy, the frozen reference and the separate critic all from the id at v2
    assert main(["train", "--model", QWEN2, "--revision", "v2", "--algorithm", "ppo", "--beta", "0.01",
                 "--steps", "1", "--output-dir", str(run), *GSM8K_ARGS, *FAST]) == 0
    saved = (run / "config.yaml").read_text()
    assert f"model: {QWEN2}\n" in saved and "revision: v2\n" in saved and "dataset: openai/gsm8k\n" in saved
    assert "dataset_config: main\n" in saved
    step1 = run / "checkpoints" / "step-000001"
    assert json.loads((step1 / "config.json").read_text())["max_position_embeddings"] == 200  # v2's
    assert (step1 / "critic" / "value_head.pt").exists()
    assert main(["train", "--resume", str(run), "--steps", "2", "--no-progress"]) == 0  # resolves the ids again
    assert (run / "checkpoints" / "step-000002").is_dir()
    capsys.readouterr()
    assert main(["eval", "--model", str(run), "--k", "0", "--no-progress"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["task"] == GSM8K and res["n"] == 4  # the run's 4 test rows
    assert main(["eval", "--model", QWEN3, "--k", "0", "--max-new-tokens", "4", "--eval-size", "4",
                 *GSM8K_ARGS, "--no-progress"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (res["model"], res["n"]) == (QWEN3, 4)


@pytest.mark.slow  # trains
def test_api_takes_a_hub_id_and_a_dataset_dict(offline, tmp_path):
    import datasets

    import gspo
    from gspo.tasks.data import load_dataset_task

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:20]),
                               "test": datasets.Dataset.from_list(ROWS[20:])})
    task = load_dataset_task(dd, Data(prompt_column="question", dataset_split="train", eval_split="test"))
    assert (len(task.train), len(task.eval)) == (20, 4)  # the test split, not a held-out slice of train
    assert task.eval[0].source == "train_dataset[test] row 1"
    cfg = gspo.TrainConfig(steps=1, eval_split="test", prompt_column="question", output_dir=str(tmp_path / "r"),
                           prompts_per_step=2, group_size=2, max_new_tokens=4, eval_size=4, progress=False)
    summary = gspo.Trainer(cfg, model=QWEN3, train_dataset=dd).train(log=lambda *a: None)
    assert summary["steps"] == 1
    assert f"model: {QWEN3}\n" in (tmp_path / "r" / "config.yaml").read_text()
    with pytest.raises(gspo.tasks.data.DataError,
                       match=r"train_dataset: no split 'validation' \(splits: train, test\)"):
        load_dataset_task(dd, Data(prompt_column="question", dataset_split="validation"))


@pytest.mark.slow  # trains
@pytest.mark.filterwarnings("ignore:Could not find a config file")  # PEFT, saving offline: cannot ask the Hub
def test_lora_run_on_a_hub_id_exports_merged_offline(offline, tmp_path):
    """Train LoRA on a Hub id at a revision, then `gspo export`: the base is resolved again from
    the cache (offline), merged, and from_pretrained gives the trained policy's log-probs; the
    card names the id as base_model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import gspo
    from gspo.models.loading import load_policy

    cfg = gspo.TrainConfig(model=QWEN2, revision="v2", lora_r=2, lr=1e-2, warmup_steps=0, steps=1, dataset=GSM8K,
                           dataset_config="main",
                           prompt_column="question", eval_split="test", prompts_per_step=2, group_size=2,
                           max_new_tokens=4, eval_size=4, progress=False, output_dir=str(tmp_path / "run"))
    def alternate(completions, **kw):  # differs within every group, so the update moves the adapter
        return [float(i % 2) for i in range(len(completions))]

    trainer = gspo.Trainer(cfg, reward_funcs=[alternate])
    trainer.train(log=lambda *a: None)
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "out")]) == 0
    out, policy = tmp_path / "out", trainer.model
    model, tok = AutoModelForCausalLM.from_pretrained(out), AutoTokenizer.from_pretrained(out)
    assert not (out / "adapter_config.json").exists() and model.config.max_position_embeddings == 200  # v2's
    ids = torch.tensor([tok("What is 3 + 3?")["input_ids"]])  # (1, T)
    with torch.no_grad():
        got, want = (m(input_ids=ids).logits[0].log_softmax(-1) for m in (model, policy.cpu()))  # (T, V)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    with torch.no_grad():  # the adapter moved the policy: an export without it would fail above
        base = load_policy(QWEN2, revision="v2")[0](input_ids=ids).logits[0].log_softmax(-1)  # (T, V)
    assert float((base - want).abs().max()) > 1e-3
    assert f"base_model: {QWEN2}" in (out / "README.md").read_text()


def test_hub_rows_are_named_by_id_config_split_and_row(offline):
    from gspo.tasks.data import DataError, load_dataset_task

    task = load_dataset_task(GSM8K, Data(dataset_config="main", prompt_column="question", eval_split="test"))
    assert task.eval[0].source == "openai/gsm8k[main] test row 1" and len(task.train) == 20
    with pytest.raises(DataError, match=r"^openai/gsm8k\[main\]: no column 'prompt' \(columns: question, answer\)"):
        load_dataset_task(GSM8K, Data(dataset_config="main"))
    with pytest.raises(DataError, match=r"^openai/gsm8k\[main\]: no split 'validation' \(splits: train, test\)"):
        load_dataset_task(GSM8K, Data(dataset_config="main", prompt_column="question", dataset_split="validation"))


@pytest.mark.slow  # starts a process
def test_cli_in_a_subprocess_offline(hub, tmp_path):
    """The real user path: a fresh process that reads HF_HOME and HF_HUB_OFFLINE from its environment."""
    r = subprocess.run([sys.executable, "-m", "gspo", "train", "--model", QWEN2, *GSM8K_ARGS, *FAST, "--steps", "1",
                        "--threads", "1", "--output-dir", str(tmp_path / "run")],
                       env=offline_env(hub.home), capture_output=True, text=True, cwd=Path(__file__).parents[1])
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "run" / "checkpoints" / "step-000001" / "model.safetensors").exists()


# ----------------------------------------------------------------------------------------------
# One line for each way an id can be missing
# ----------------------------------------------------------------------------------------------


def test_not_in_the_offline_cache(offline, tmp_path, capsys):
    home = offline.home
    offline_line = f"not in the local Hugging Face cache (HF_HOME={home}) and HF_HUB_OFFLINE=1: download it once " \
                   "with network access"
    assert main(["train", "--model", "Qwen/Nope", "--output-dir", str(tmp_path / "a")]) == 2
    assert error_line(capsys, "train") == f"gspo train: error: model Qwen/Nope: {offline_line}"
    assert main(["train", "--dataset", "openai/nope", "--output-dir", str(tmp_path / "b")]) == 2
    assert error_line(capsys, "train") == f"gspo train: error: dataset openai/nope: {offline_line}"
    with pytest.raises(HubError, match=r"^model Qwen/Qwen2.5-0.5B-Instruct \(revision v9\): not in the local"):
        model_dir(QWEN2, revision="v9")
    assert main(["train", "--model", QWEN2, *GSM8K_ARGS, "--dataset-config", "socratic",
                 "--output-dir", str(tmp_path / "c")]) == 2
    assert ("dataset openai/gsm8k: config 'socratic' is not in the local Hugging Face cache"
            in error_line(capsys, "train"))
    assert not any((tmp_path / d).exists() for d in "abc")


def _http_error(cls, status: int, url: str):
    import httpx2
    from huggingface_hub.errors import Response  # the response type huggingface_hub's errors carry

    return cls(f"{status} Client Error", response=Response(status, request=httpx2.Request("GET", url)))


@pytest.mark.parametrize("error,status,expected", [
    ("RepositoryNotFoundError", 404, "model Qwen/Nope: no such model on the Hugging Face Hub (check the id, or log in "
                                     "if it is private: hf auth login / HF_TOKEN)"),
    ("GatedRepoError", 403, "model Qwen/Nope: gated: accept its terms on huggingface.co/Qwen/Nope and log in "
                            "(HF_TOKEN)"),
    ("RevisionNotFoundError", 404, "model Qwen/Nope (revision v3): no such revision on the Hugging Face Hub (a branch, "
                                   "tag or commit hash of huggingface.co/Qwen/Nope)"),
])
def test_hub_refusals_of_a_model(error, status, expected, tmp_path, monkeypatch):
    import huggingface_hub
    from huggingface_hub import errors

    offline_hub(monkeypatch, tmp_path / "empty-hf", offline=False)  # online, nothing cached

    def refuse(self, repo_id, *args, **kwargs):
        raise _http_error(getattr(errors, error), status, f"https://huggingface.co/api/models/{repo_id}")

    for method in ("repo_info", "model_info"):  # snapshot_download's call, and the file listing's
        monkeypatch.setattr(huggingface_hub.HfApi, method, refuse)
    with pytest.raises(HubError) as e:
        model_dir("Qwen/Nope", revision="v3" if "Revision" in error else None)
    assert str(e.value) == expected


@pytest.mark.parametrize("error,status,expected", [
    ("RepositoryNotFoundError", 404, "dataset openai/nope: no such dataset on the Hugging Face Hub (check the id, or "
                                     "log in if it is private: hf auth login / HF_TOKEN)"),
    ("GatedRepoError", 403, "dataset openai/nope: gated: accept its terms on huggingface.co/datasets/openai/nope and "
                            "log in (HF_TOKEN)"),
])
def test_hub_refusals_of_a_dataset(error, status, expected, tmp_path, monkeypatch):
    import huggingface_hub
    from huggingface_hub import errors

    from gspo.io.hub import load_dataset_dict

    offline_hub(monkeypatch, tmp_path / "empty-hf", offline=False)

    def refuse(self, repo_id, *args, **kwargs):
        raise _http_error(getattr(errors, error), status, f"https://huggingface.co/datasets/{repo_id}/README.md")

    monkeypatch.setattr(huggingface_hub.HfApi, "hf_hub_download", refuse)  # datasets' first call: the card
    with pytest.raises(HubError) as e:
        load_dataset_dict("openai/nope")
    assert str(e.value) == expected


# ----------------------------------------------------------------------------------------------
# Local paths keep their messages; directories that are not causal LMs
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("args,expected", [
    (["--model", "./nope"], "model ./nope: no such directory"),
    (["--model", "/abs/nope"], "model /abs/nope: no such directory"),
    (["--dataset", "./nope.jsonl"], "nope.jsonl: no such file or directory"),
    (["--dataset", "data/train.jsonl"], "data/train.jsonl: no such file or directory"),
])
def test_missing_local_paths_say_so(args, expected, offline, tmp_path, capsys):
    assert main(["train", *args, "--output-dir", str(tmp_path / "out")]) == 2
    assert expected in error_line(capsys, "train")


def test_a_directory_without_tokenizer_files_is_one_line(tmp_path, capsys):
    model = tiny_qwen3_dir(tmp_path / "m")
    for f in model.iterdir():
        if "token" in f.name or f.suffix == ".jinja":
            f.unlink()
    assert main(["train", "--model", str(model), "--output-dir", str(tmp_path / "out"), *FAST]) == 2
    assert error_line(capsys, "train").startswith(f"gspo train: error: model {model}: no tokenizer files "
                                                  "(tokenizer.json / tokenizer_config.json")


def test_an_encoder_is_not_a_causal_lm(tmp_path, capsys):
    from transformers import BertConfig

    model = tiny_qwen3_dir(tmp_path / "bert")  # its tokenizer, a BERT config
    (model / "config.json").write_text(BertConfig(vocab_size=120, hidden_size=32, num_hidden_layers=1,
                                                  num_attention_heads=2, intermediate_size=64).to_json_string())
    assert main(["train", "--model", str(model), "--output-dir", str(tmp_path / "out"), *FAST]) == 2
    assert error_line(capsys, "train") == (f"gspo train: error: model {model}: model_type 'bert' is an encoder, "
                                           "not a causal (decoder) language model")


def test_a_dataset_with_several_configs_needs_one(tmp_path, monkeypatch):
    from gspo.io.hub import load_dataset_dict

    home = tmp_path / "hf"
    cache_dataset(home, GSM8K, {"train": ROWS[:4]}, config="main")
    cache_dataset(home, GSM8K, {"train": ROWS[4:6]}, config="socratic")  # a second config: a new commit with both
    offline_hub(monkeypatch, home)
    assert load_dataset_dict(GSM8K, "socratic")["train"].num_rows == 2
    with pytest.raises(HubError, match=r"^dataset openai/gsm8k: has several configs \(main, socratic\); choose one "
                                       r"with --dataset-config$"):
        load_dataset_dict(GSM8K)


def test_absolute_paths_keeps_hub_ids(offline):
    from gspo.config import TrainConfig
    from gspo.train.resolve import absolute_paths

    cfg = absolute_paths(TrainConfig(model=QWEN2, revision="v2", dataset=GSM8K, eval_dataset=GSM8K))
    assert (cfg.model, cfg.revision, cfg.dataset, cfg.eval_dataset) == (QWEN2, "v2", GSM8K, GSM8K)


def test_absolute_paths_makes_a_reward_model_directory_absolute(tmp_path, monkeypatch):
    """A reward model given as a relative directory must still be found by --resume from another
    working directory; a hub id, a built-in reward and a file:function keep their meaning."""
    from gspo.config import TrainConfig
    from gspo.train.resolve import absolute_paths

    (tmp_path / "rm").mkdir()
    (tmp_path / "rewards.py").write_text("def f(completions, **kw): return [0.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    cfg = absolute_paths(TrainConfig(reward=("rm", "Org/some-rm", "exact_match", "rewards.py:f")))
    assert cfg.reward == (str(tmp_path / "rm"), "Org/some-rm", "exact_match", f"{tmp_path / 'rewards.py'}:f")


def test_a_snapshot_needs_only_what_loading_reads(tmp_path, monkeypatch):
    """The cached tree lists files a selective download leaves out (ONNX): still complete; a
    weights file gone from the snapshot is an incomplete copy, said in one line."""
    home = tmp_path / "hf"
    commit = cache_model(home, QWEN3, tiny_qwen3_dir(tmp_path / "m"))
    storage = home / "hub" / "models--Qwen--Qwen3-0.6B"
    tree_file = storage / "trees" / f"{commit}.json"
    tree = json.loads(tree_file.read_text())
    tree["files"]["onnx/model.onnx"] = {"size": 10, "blob_id": "0" * 40, "lfs_sha256": "1" * 64, "lfs_size": 10}
    tree_file.write_text(json.dumps(tree))
    offline_hub(monkeypatch, home)
    assert model_dir(QWEN3) == storage / "snapshots" / commit
    (storage / "snapshots" / commit / "model.safetensors").unlink()
    with pytest.raises(HubError, match=r"^model Qwen/Qwen3-0.6B: the cached copy is incomplete \(.*\); download it "
                                       r"again with network access$"):
        model_dir(QWEN3)


def test_online_download_fetches_only_what_a_model_needs(tmp_path, monkeypatch):
    """A simulated Hub (the listing calls and the per-file download patched): the files fetched
    are model_files' choice, and afterwards the same id resolves offline from that partial
    snapshot (the tree listing snapshot_download cached agrees with the choice)."""
    import hashlib

    import huggingface_hub
    from huggingface_hub import _snapshot_download
    from huggingface_hub.hf_api import RepoFile

    src = tiny_qwen3_dir(tmp_path / "m")
    files = {p.name: p.read_bytes() for p in src.iterdir()}
    files.update({"pytorch_model.bin": b"pt", "onnx/model.onnx": b"onnx", "model.gguf": b"gguf", "README.md": b"#"})
    commit = "c" * 40
    offline_hub(monkeypatch, tmp_path / "hf", offline=False)
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda self, repo_id, **kw: SimpleNamespace(
        sha=commit, siblings=[SimpleNamespace(rfilename=f) for f in files]))
    monkeypatch.setattr(huggingface_hub.HfApi, "repo_info", lambda self, repo_id, **kw: SimpleNamespace(sha=commit))
    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_tree", lambda self, repo_id, **kw: [
        RepoFile(path=f, size=len(d), oid=hashlib.sha1(d).hexdigest()) for f, d in files.items()])
    fetched = []

    def download(repo_id, filename, *, cache_dir, revision, **kw):
        fetched.append(filename)
        target = Path(cache_dir) / "models--Qwen--Qwen3-0.6B" / "snapshots" / revision / filename
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(files[filename])
        return str(target)

    monkeypatch.setattr(_snapshot_download, "hf_hub_download", download)
    path = model_dir(QWEN3)
    assert sorted(fetched) == model_files(list(files)) and "model.safetensors" in fetched
    assert not {"pytorch_model.bin", "onnx/model.onnx", "model.gguf", "README.md"} & set(fetched)
    offline_hub(monkeypatch, tmp_path / "hf")
    assert model_dir(QWEN3) == path
