import os

import pytest
import torch

# the fast loop's guard (tests/fastloop.py): an unmarked test that starts a process or takes over 5 s fails
from tests.fastloop import pytest_addoption, pytest_configure, pytest_runtest_makereport, pytest_runtest_setup  # noqa: F401

# Two cores: keep torch from oversubscribing them when pytest-xdist runs two workers.
THREADS = max(1, min(2, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
torch.set_num_threads(THREADS)
# and every run in the tests, here or in a subprocess, takes that count (gspo.processes.threads: OMP_NUM_THREADS is the
# user's choice), not one chosen by the load of the moment: runs compared bit for bit must compute alike
os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))


@pytest.fixture(scope="session")
def char_tokenizer():
    from gspo.models.tiny import build_char_tokenizer

    return build_char_tokenizer()


def random_tiny_model(tokenizer, seed=0, **overrides):
    """A randomly initialised 2-layer Qwen3 for fast tests (not the trained built-in)."""
    from transformers import Qwen3ForCausalLM

    from gspo.models.tiny import tiny_config

    torch.manual_seed(seed)
    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, head_dim=32)
    kw.update(overrides)
    return Qwen3ForCausalLM(tiny_config(len(tokenizer), **kw)).eval()


@pytest.fixture
def tiny_random(char_tokenizer):
    return random_tiny_model(char_tokenizer)


def _run_then_exit(rank, fn, *args):
    # gloo's threads can abort a finished process at interpreter exit ('terminate called
    # without an active exception', about 1 run in 3 here): the worker's results are written,
    # so it leaves with os._exit, as gspo's own torchrun workers do (gspo.cli.entry)
    import sys

    fn(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn, *args, nprocs=2):
    """torch.multiprocessing.spawn of `fn(rank, *args)`, each process ending with os._exit(0)
    once `fn` returns (an exception in `fn` is reported as spawn reports it)."""
    import torch.multiprocessing as mp

    mp.spawn(_run_then_exit, args=(fn, *args), nprocs=nprocs, join=True)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_chat_model(path, *, seed=0, chat_template=True):
    """A user's model as it would arrive: a tiny random Qwen3 and a tokenizer with a chat
    template, written with save_pretrained to `path`. Returns the path."""
    import string

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3ForCausalLM

    from gspo.models.tiny import tiny_config

    special = ["<pad>", "<|im_end|>", "<unk>", "<|im_start|>"]
    vocab = {t: i for i, t in enumerate(special)}
    for c in string.printable:
        vocab.setdefault(c, len(vocab))
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"<\|im_(?:start|end)\|>|."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<|im_end|>", unk_token="<unk>",
                                  additional_special_tokens=["<|im_start|>"])
    if chat_template:
        tok.chat_template = CHAT_TEMPLATE
    torch.manual_seed(seed)
    cfg = tiny_config(len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=32, max_position_embeddings=256, eos_token_id=1, pad_token_id=0)
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path
