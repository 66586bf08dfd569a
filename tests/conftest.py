import os

import pytest
import torch

# Two cores: keep torch from oversubscribing them when pytest-xdist runs two workers.
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))))


@pytest.fixture(scope="session")
def char_tokenizer():
    from gspo.models import build_char_tokenizer

    return build_char_tokenizer()


def random_tiny_model(tokenizer, seed=0, **overrides):
    """A randomly initialised 2-layer Qwen3 for fast tests (not the trained built-in)."""
    from transformers import Qwen3ForCausalLM

    from gspo.models import tiny_config

    torch.manual_seed(seed)
    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, head_dim=32)
    kw.update(overrides)
    return Qwen3ForCausalLM(tiny_config(len(tokenizer), **kw)).eval()


@pytest.fixture
def tiny_random(char_tokenizer):
    return random_tiny_model(char_tokenizer)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
