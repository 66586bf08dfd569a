"""gspo export, gspo.Trainer.save_model / push_to_hub: a run as a plain Hugging Face model.

Two tiny runs (full weights with a --stop-token, and LoRA) are trained once for the module;
every export is then loaded with transformers alone and compared with the run's own policy.
"""

import dataclasses
import json
import shlex
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import gspo
from gspo.cli import main
from gspo.commands.argv import list_flags as _list_flags
from gspo.commands.argv import merge_repeated as _merge_repeated
from gspo.commands.argv import parse as _parse
from gspo.commands.train_command import NOT_IN_COMMAND, applies, train_command
from gspo.config import TrainConfig, options
from gspo.config.yamlfile import load_yaml
from gspo.export import ExportError, from_run, hub_id, load_trained, write
from gspo.train.resolve import checked, resolve

TINY = dict(steps=2, prompts_per_step=2, group_size=2, max_new_tokens=4, eval_size=4, progress=False)
STANDARD = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "README.md"}
SEQUENCES = ["12+34=46", "397+48=445", "100-15=85", "7*(3+4)=49"]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("full") / "run"
    trainer = gspo.Trainer(gspo.TrainConfig(output_dir=str(run), stop_token=("1",), **TINY))
    trainer.train(log=lambda *a: None)
    return trainer, run


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("lora") / "run"
    trainer = gspo.Trainer(gspo.TrainConfig(output_dir=str(run), lora_r=4, **TINY))
    trainer.train(log=lambda *a: None)
    return trainer, run


def token_logprobs(model, tokenizer) -> list[torch.Tensor]:
    """log p(token t | tokens < t) of each sequence, float32."""
    out = []
    with torch.no_grad():
        for text in SEQUENCES:
            ids = torch.tensor([tokenizer(text)["input_ids"]])  # (1, T)
            logits = model(input_ids=ids).logits.float()  # (1, T, V)
            out.append(logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0])  # (T-1,)
    return out


def model_tok(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gspo export: error: "), err
    return err[0]


@pytest.mark.slow  # uses full_run, which trains
def test_export_loads_with_transformers_and_gives_the_runs_logprobs(full_run, tmp_path):
    trainer, run = full_run
    assert main(["export", str(run), str(tmp_path / "out")]) == 0
    out = tmp_path / "out"
    assert {p.name for p in out.iterdir()} == STANDARD  # no trainer_state.pt, optimizer.pt, config.yaml
    model, tok = AutoModelForCausalLM.from_pretrained(out), model_tok(out)  # transformers alone
    assert model.dtype == torch.float32
    for got, want in zip(token_logprobs(model, tok), token_logprobs(trainer.model, tok)):  # the run's final policy
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert not list(tmp_path.glob(".out.tmp-*"))  # the temporary directory was renamed
    base = load_file(gspo.models.loading.BUILTIN_MODELS["tiny"] / "model.safetensors")
    assert any(not torch.equal(w, base[k]) for k, w in load_file(out / "model.safetensors").items())  # trained


@pytest.mark.slow  # uses lora_run, which trains
def test_lora_export_is_merged_and_matches_the_peft_policy(lora_run, tmp_path):
    trainer, run = lora_run
    assert main(["export", str(run), str(tmp_path / "out")]) == 0
    out = tmp_path / "out"
    assert {p.name for p in out.iterdir()} == STANDARD  # no adapter_config.json
    assert not [k for k in load_file(out / "model.safetensors") if "lora" in k]
    model, tok = AutoModelForCausalLM.from_pretrained(out), model_tok(out)
    assert hasattr(trainer.model, "peft_config")  # the trained policy: the PEFT model, adapters trained
    for got, want in zip(token_logprobs(model, tok), token_logprobs(trainer.model, tok)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # the adapter changed something
    base = AutoModelForCausalLM.from_pretrained(gspo.models.loading.BUILTIN_MODELS["tiny"])
    assert any((a - b).abs().max() > 1e-6 for a, b in zip(token_logprobs(model, tok), token_logprobs(base, tok)))


@pytest.mark.slow  # uses lora_run, which trains
def test_merged_model_is_a_plain_copy_with_the_policys_logprobs(lora_run):
    trainer, _ = lora_run
    merged = trainer.merged_model()
    assert not hasattr(merged, "peft_config") and hasattr(trainer.model, "peft_config")  # a copy; the policy keeps LoRA
    tok = trainer._trained.tokenizer
    for got, want in zip(token_logprobs(merged, tok), token_logprobs(trainer.model, tok)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert trainer.merged_model("bfloat16").model.embed_tokens.weight.dtype == torch.bfloat16


@pytest.mark.slow  # uses full_run, which trains
def test_bfloat16_export_and_the_runs_dtype_by_default(full_run, tmp_path):
    _, run = full_run
    assert main(["export", str(run), str(tmp_path / "bf16"), "--dtype", "bfloat16"]) == 0
    for d in (tmp_path / "bf16",):
        assert {t.dtype for t in load_file(d / "model.safetensors").values()} == {torch.bfloat16}
        cfg = json.loads((d / "config.json").read_text())
        assert cfg["dtype"] == cfg["torch_dtype"] == "bfloat16"
        assert AutoModelForCausalLM.from_pretrained(d, dtype="auto").dtype == torch.bfloat16
    # a run trained with --dtype bfloat16 exports bfloat16 weights unless told otherwise
    trained = load_trained(run / "checkpoints" / "step-000002", dtype="float32")
    trained.cfg = dataclasses.replace(trained.cfg, dtype="bfloat16")
    write(trained, tmp_path / "default")
    assert {t.dtype for t in load_file(tmp_path / "default" / "model.safetensors").values()} == {torch.bfloat16}


@pytest.mark.slow  # uses full_run, which trains
def test_generation_config_stops_where_the_run_stopped(full_run, tmp_path):
    trainer, run = full_run
    assert main(["export", str(run), str(tmp_path / "out")]) == 0
    tok = model_tok(tmp_path / "out")
    one = tok.convert_tokens_to_ids("1")
    gen = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [tok.eos_token_id, one] and gen["pad_token_id"] == tok.pad_token_id == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    cut = 0
    for prompt in ["100+15=", "510+301=", "91+20=", "61-10="]:
        ids = tok(prompt, return_tensors="pt")["input_ids"]
        free = model.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=tok.eos_token_id)[0, ids.shape[1]:]
        stopped = model.generate(ids, max_new_tokens=4, do_sample=False)[0, ids.shape[1]:].tolist()
        free = free.tolist()
        end = free.index(one) + 1 if one in free else len(free)
        assert stopped[:end] == free[:end] and all(t == tok.pad_token_id for t in stopped[end:])
        cut += end < len(free) and free[end - 1] == one
    assert cut >= 1  # at least one completion went on past a "1" without the run's stop token


@pytest.mark.slow  # uses full_run, which trains
def test_model_card(full_run, tmp_path):
    _, run = full_run
    assert main(["export", str(run), str(tmp_path / "out")]) == 0
    card = (tmp_path / "out" / "README.md").read_text()
    meta = yaml.safe_load(card.split("---")[1])
    assert meta["library_name"] == "transformers" and meta["tags"] == ["gspo", "reinforcement-learning"]
    assert "base_model" not in meta  # "tiny" is no hub id; the hub accepts only ids there
    summary = json.loads((run / "summary.json").read_text())
    b, a = summary["eval_before"]["accuracy"], summary["eval_after"]["accuracy"]
    assert f"| accuracy | {100 * b:.1f}% | {100 * a:.1f}% |" in card
    assert "`tiny` fine-tuned with GSPO" in card and "for 2 steps" in card and "`arithmetic` task" in card
    command = card.split("```bash\n")[1].split("\n```")[0]
    # what the run was given (TINY, --stop-token 1), less where it ran: no resolved default
    assert command == "gspo train --prompts-per-step 2 --group-size 2 --max-new-tokens 4 --stop-token 1 " \
                      "--eval-size 4 --steps 2"
    assert_reproduces(command, load_yaml(run / "config.yaml"))
    config = yaml.safe_load(card.split("```yaml\n")[1].split("\n```")[0])  # the whole configuration is there
    assert config == {k: v for k, v in yaml.safe_load((run / "config.yaml").read_text()).items()
                      if k not in ("output_dir", "progress", "threads")}  # less where it ran
    assert "from_pretrained(" in card and "vllm serve" in card


def recorded(args: list[str]) -> TrainConfig:
    """The configuration a run given these `gspo train` flags records (its config.yaml: resolved)."""
    return resolve(_parse(TrainConfig, _merge_repeated(args, _list_flags(TrainConfig)), "gspo train"))


def assert_reproduces(command: str, cfg: TrainConfig) -> None:
    """`command`, parsed with gspo's own parser and resolved, is `cfg` in every option its algorithm reads."""
    args = shlex.split(command)
    assert args[:2] == ["gspo", "train"]
    again, cfg = recorded(args[2:]), checked(cfg)
    for f in options():
        if f.name not in NOT_IN_COMMAND and applies(f.name, cfg):
            assert getattr(again, f.name) == getattr(cfg, f.name), (f.name, command)


@pytest.mark.parametrize("given, command", [
    ("--lr 3e-5 --steps 3", "--lr 3e-05 --steps 3"),
    ("--lr 1e-4 --steps 3", "--steps 3"),  # 1e-4 is the default
    ("--algorithm grpo --lr 3e-5 --critic-lr 1e-3", "--algorithm grpo --lr 3e-05"),  # GRPO has no critic
    ("--algorithm ppo --critic-lr 5e-3 --steps 3", "--algorithm ppo --critic-lr 0.005 --steps 3"),
    ("--algorithm ppo --lr 3e-5 --gamma 0.99", "--algorithm ppo --gamma 0.99 --lr 3e-05"),  # critic-lr: 10 x lr
    ("--algorithm ppo --lr 5e-5 --critic-lr 5e-4", "--algorithm ppo --lr 5e-05"),  # given, but what 10 x lr makes
    ("--algorithm grpo --clip-low 0.2 --clip-high 0.28", "--algorithm grpo --clip-high 0.28"),  # 0.2: the preset
    ("--algorithm sapo --clip-low 0.1 --sapo-tau-neg 1.2", "--algorithm sapo --sapo-tau-neg 1.2"),  # a gate, no clip
    ("--model tiny-moe --lora-r 8 --task chain --max-new-tokens 240", "--model tiny-moe --lora-r 8 --task chain"),
    ("--task chain --model tiny-long", "--task chain"),  # the chain task's own model
    ("--num_generations 4 --learning_rate 3e-5 --loss_type dr_grpo --min-new-tokens 10 --max-new-tokens 20",
     "--loss-agg seq-mean-token-sum-norm --group-size 4 --max-new-tokens 20 --min-new-tokens 10 --lr 3e-05"),
    ("--rollout-dtype bfloat16 --rollout-is token --old-logp recompute", "--rollout-is token --rollout-dtype bfloat16"),
    ("--old-logp recompute", "--old-logp recompute"),  # auto would sample it here
])
def test_card_command_names_only_what_differs_and_gives_the_run_back(given, command):
    cfg = recorded(shlex.split(given))
    assert train_command(cfg) == f"gspo train {command}"
    assert_reproduces(train_command(cfg), cfg)


def test_hub_ids_in_the_card():
    assert hub_id("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    assert hub_id("/cache/hub/models--Qwen--Qwen2.5-0.5B/snapshots/abc123") == "Qwen/Qwen2.5-0.5B"
    assert hub_id("tiny") is None and hub_id("<model object>") is None and hub_id("/no/such/dir") is None


def files(d: Path) -> dict:
    return {p.name: p for p in d.iterdir()}


@pytest.mark.slow  # uses full_run and lora_run, which train
@pytest.mark.parametrize("which", ["full_run", "lora_run"])
def test_save_model_writes_what_export_writes(which, request, tmp_path):
    trainer, run = request.getfixturevalue(which)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    a, b = trainer.save_model(tmp_path / "a" / "m"), tmp_path / "b" / "m"
    assert main(["export", str(run), str(b)]) == 0
    assert files(a).keys() == files(b).keys() == STANDARD
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (a / name).read_text() == (b / name).read_text(), name
    assert (a / "README.md").read_text().replace(str(a), "OUT") == (b / "README.md").read_text().replace(str(b), "OUT")
    after = list(trainer.model.parameters())  # the trained policy is left as it was (not merged, not cast)
    assert len(after) == len(before) and all(torch.equal(x, y) for x, y in zip(before, after))


@pytest.mark.slow  # uses full_run, which trains
def test_trainer_model_before_training_and_after_fsdp(full_run, tmp_path):
    model = torch.nn.Linear(2, 2)
    assert gspo.Trainer(gspo.TrainConfig(**TINY)).model is None
    tok = gspo.models.loading.build_char_tokenizer()
    assert gspo.Trainer(gspo.TrainConfig(**TINY), model=model, tokenizer=tok).model is model
    with pytest.raises(ExportError, match="call trainer.train\\(\\) first"):
        gspo.Trainer(gspo.TrainConfig(**TINY)).save_model(tmp_path / "x")
    fsdp = type("Run", (), {"dist": type("Dist", (), {"enabled": True, "parallel": "fsdp"})})()
    assert from_run(fsdp) is None  # sharded: the final checkpoint holds the gathered weights
    _, run = full_run
    t = gspo.Trainer(gspo.TrainConfig(**TINY))
    t._final = str(run / "checkpoints" / "step-000002")
    assert t.model is None and {p.name for p in t.save_model(tmp_path / "m").iterdir()} == STANDARD


class Hub:
    """HfApi.create_repo and upload_folder, recorded instead of sent (bound methods: no HfApi self)."""

    def __init__(self, monkeypatch, fail=None):
        from huggingface_hub import HfApi

        self.calls, self.fail = [], fail
        monkeypatch.setenv("HF_TOKEN", "hf_test")
        monkeypatch.setattr(HfApi, "create_repo", self.create_repo)
        monkeypatch.setattr(HfApi, "upload_folder", self.upload_folder)

    def create_repo(self, repo_id, *, private=False, exist_ok=False, repo_type=None):
        self.calls.append(("create_repo", repo_id, private, exist_ok))
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(self, *, repo_id, folder_path, commit_message=None, repo_type=None):
        if self.fail is not None:
            raise self.fail
        folder = Path(folder_path)
        self.calls.append(("upload_folder", repo_id, folder, commit_message, sorted(p.name for p in folder.iterdir()),
                           (folder / "README.md").read_text()))


@pytest.mark.slow  # uses full_run, which trains
def test_push_to_hub_from_the_cli(full_run, tmp_path, monkeypatch, capsys):
    _, run = full_run
    hub = Hub(monkeypatch)
    out = tmp_path / "tiny-gspo"
    assert main(["export", str(run), str(out), "--push-to-hub", "me/tiny-gspo", "--private"]) == 0
    create, upload = hub.calls
    assert create == ("create_repo", "me/tiny-gspo", True, True)
    assert upload[:4] == ("upload_folder", "me/tiny-gspo", out, "gspo export: tiny-gspo")
    assert set(upload[4]) == STANDARD and "from_pretrained('me/tiny-gspo')" in upload[5]
    assert "pushed to https://huggingface.co/me/tiny-gspo" in capsys.readouterr().out


@pytest.mark.slow  # uses lora_run, which trains
def test_push_to_hub_from_the_trainer(lora_run, monkeypatch):
    trainer, _ = lora_run
    hub = Hub(monkeypatch)
    assert trainer.push_to_hub("me/tiny-lora", commit_message="first") == "https://huggingface.co/me/tiny-lora"
    create, upload = hub.calls
    assert create == ("create_repo", "me/tiny-lora", False, True)
    assert upload[1] == "me/tiny-lora" and upload[2].name == "tiny-lora" and upload[3] == "first"
    assert set(upload[4]) == STANDARD and not upload[2].exists()  # a temporary directory, gone


@pytest.mark.slow  # uses full_run, which trains
@pytest.mark.parametrize("fail, says", [
    (type("ConnectError", (Exception,), {})("[Errno -2] Name or service not known"),
     "cannot reach the Hugging Face Hub"),
    (type("HfHubHTTPError", (Exception,), {"response": type("R", (), {"status_code": 403})()})("Forbidden"),
     "not allowed (HTTP 403)"),
])
def test_push_failures_are_one_line(full_run, tmp_path, monkeypatch, capsys, fail, says):
    _, run = full_run
    Hub(monkeypatch, fail=fail)
    assert main(["export", str(run), str(tmp_path / "o"), "--push-to-hub", "me/x"]) == 2
    assert one_error_line(capsys).startswith(f"gspo export: error: --push-to-hub me/x: {says}")


@pytest.mark.slow  # uses full_run, which trains
def test_no_token_or_bad_repo_id_fails_before_any_work(full_run, tmp_path, monkeypatch, capsys):
    import huggingface_hub

    _, run = full_run
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    assert main(["export", str(run), str(tmp_path / "o"), "--push-to-hub", "me/x"]) == 2
    assert "no Hugging Face token; run `hf auth login` or set HF_TOKEN" in one_error_line(capsys)
    assert main(["export", str(run), str(tmp_path / "o"), "--push-to-hub", "a/b/c"]) == 2
    assert "'a/b/c' is not a hub repository id" in one_error_line(capsys)
    assert main(["export", str(run), str(tmp_path / "o"), "--private"]) == 2
    assert "--private applies to the repository --push-to-hub creates" in one_error_line(capsys)
    assert not (tmp_path / "o").exists()


@pytest.mark.slow  # uses full_run and lora_run, which train
def test_errors_are_one_line(full_run, lora_run, tmp_path, capsys):
    _, run = full_run
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    cases = [([str(run), str(tmp_path / "full")], "exists and is not empty; an export is never overwritten"),
             ([str(tmp_path / "full"), str(tmp_path / "o")], "not a gspo run directory or checkpoint"),
             ([str(tmp_path / "nope"), str(tmp_path / "o")], "no such directory"),
             ([str(run), str(tmp_path / "o"), "--step", "7"], "has no checkpoint of step 7 (it has 2)"),
             ([str(run / "checkpoints" / "step-000002"), str(tmp_path / "o"), "--step", "2"],
              "is a checkpoint already")]
    for args, says in cases:
        assert main(["export", *args]) == 2
        assert says in one_error_line(capsys), args
    assert not (tmp_path / "o").exists() and (tmp_path / "full" / "x").exists()


@pytest.mark.slow  # uses lora_run, which trains
def test_lora_from_a_model_object_needs_the_base(lora_run, tmp_path, capsys):
    import shutil

    _, run = lora_run
    ckpt = tmp_path / "run" / "checkpoints" / "step-000002"
    shutil.copytree(run / "checkpoints" / "step-000002", ckpt)
    (ckpt / "config.yaml").write_text(
        (ckpt / "config.yaml").read_text().replace("model: tiny", "model: <model object>"))
    assert main(["export", str(ckpt), str(tmp_path / "o")]) == 2
    assert "trained from a model object (<model object>): its base is not recorded; pass --base-model DIR|ID" \
        in one_error_line(capsys)
    assert main(["export", str(ckpt), str(tmp_path / "o"), "--base-model", "tiny"]) == 0
    assert not (tmp_path / "o" / "adapter_config.json").exists()


@pytest.mark.slow  # uses full_run, which trains
def test_a_failed_export_leaves_nothing(full_run, tmp_path, monkeypatch, capsys):
    import gspo.export

    _, run = full_run

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gspo.export, "_stamp_dtype", full_disk)
    assert main(["export", str(run), str(tmp_path / "o")]) == 2
    assert one_error_line(capsys).endswith("o: cannot write the export (No space left on device)")
    assert list(tmp_path.iterdir()) == []  # neither OUT nor its temporary directory


def _have_vllm() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


@pytest.mark.slow  # uses full_run, which trains
@pytest.mark.vllm
@pytest.mark.skipif(not _have_vllm(), reason="vLLM is not installed (see docs/vllm.md)")
def test_vllm_serves_the_export_as_is_and_stops_where_the_run_stopped(full_run, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    import vllm

    _, run = full_run
    assert main(["export", str(run), str(tmp_path / "out")]) == 0
    llm = vllm.LLM(model=str(tmp_path / "out"), max_model_len=64, enforce_eager=True, seed=0)
    model, tok = AutoModelForCausalLM.from_pretrained(tmp_path / "out"), model_tok(tmp_path / "out")
    prompts = ["100+15=", "510+301=", "91+20=", "61-10="]
    outs = llm.generate(prompts, vllm.SamplingParams(temperature=0, max_tokens=4))
    for prompt, o in zip(prompts, outs):  # vLLM's stop tokens: the tokenizer's EOS and generation_config's list
        ids = tok(prompt, return_tensors="pt")["input_ids"]
        want = [t for t in model.generate(ids, max_new_tokens=4, do_sample=False)[0, ids.shape[1]:].tolist()
                if t != tok.pad_token_id]
        assert list(o.outputs[0].token_ids) == want
    assert any(o.outputs[0].token_ids[-1] == tok.convert_tokens_to_ids("1") for o in outs)


FSDP_SCRIPT = """
import os, sys
import gspo
out = sys.argv[1]
t = gspo.Trainer(gspo.TrainConfig(steps=1, prompts_per_step=2, group_size=2, max_new_tokens=4, eval_size=0,
                                  progress=False, output_dir=out + "/run", parallel="fsdp"))
t.train(log=lambda *a: None)
assert t.model is None  # sharded: no process holds the whole policy
t.save_model(out + "/model")  # rank 0 exports the final checkpoint, which holds the gathered weights
"""


@pytest.mark.slow
def test_save_model_under_fsdp_exports_the_gathered_weights(tmp_path):
    import os
    import subprocess
    import sys

    (tmp_path / "script.py").write_text(FSDP_SCRIPT)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                        str(tmp_path / "script.py"), str(tmp_path)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "exported")]) == 0
    a, b = load_file(tmp_path / "model" / "model.safetensors"), load_file(tmp_path / "exported" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) and len(a) > 10
