"""The weights a vLLM sync streams (gspo.sampling.vllm_engine.checkpoint_weights), without vLLM.

The engine's `reload_weights` pulls (name, tensor) pairs from a generator one at a time. They
must be exactly what building the whole state dict gave (`whole_state_dict` below: gspo's code
before streaming; the tied LM head included: vLLM's CPU backend packs its own copy of it),
each in the engine's dtype, with no more than one made copy alive at a time: the consumer's.
Plain, LoRA-merged, MoE, and sharded by FSDP over 2 processes; the engine's sleep levels over
the fake engine of tests/test_engine_protocol.py. The real engine is in tests/test_vllm.py.
"""

import re
import weakref

import pytest
import torch

from gspo.models.loading import add_lora, load_policy, unwrap
from gspo.sampling.vllm_engine import checkpoint_weights
from tests.conftest import spawn


def whole_state_dict(policy) -> dict:
    """The weights as a sync built them before streaming: every one at once."""
    model = unwrap(policy)
    lora = {name: m for name, m in model.named_modules() if hasattr(m, "get_delta_weight") and hasattr(m, "base_layer")}
    out = {}
    for name, value in model.state_dict().items():
        if "lora_" in name:
            continue
        if hasattr(value, "full_tensor"):
            value = value.full_tensor()
        module = name.rsplit(".", 1)[0].removesuffix(".base_layer")
        if name.endswith(".base_layer.weight") and module in lora:
            with torch.no_grad():
                value = value + lora[module].get_delta_weight("default").to(value.dtype)
        out[re.sub(r"\.base_layer(?=\.)", "", name)] = value.detach()
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, out)


def lora_policy():
    torch.manual_seed(0)  # LoRA's A: the same on every process and in the reference
    policy = add_lora(load_policy("tiny")[0], r=4, alpha=8, dropout=0.0, target_modules=["all-linear"])
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if "lora_B" in n:  # B = 0 at initialisation: the merge would be the identity
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return policy


def streamed(policy, dtype=None, pairs=None) -> tuple[dict, int]:
    """Consume the generator (or `pairs`) as vLLM's loader does (a for loop, each tensor copied
    into the engine's weights, then dropped); also return the most made tensors (not
    parameters) alive at once, counted through weak references whenever a new one arrives."""
    params = {p.data_ptr() for p in unwrap(policy).parameters()}
    out, refs, most = {}, [], 0
    for name, t in pairs if pairs is not None else checkpoint_weights(policy, dtype):
        if t.data_ptr() not in params:
            refs.append(weakref.ref(t))
        most = max(most, sum(r() is not None for r in refs))
        out[name] = t.clone()  # the engine's copy: allocated apart from gspo's, not counted
    return out, most


def assert_same(got: dict, want: dict, dtype=None):
    # the same names (transformers' conversion sorted them; the stream keeps the model's order,
    # a layer's weights together, which vLLM's layerwise reload wants; it loads them by name)
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        v = v if dtype is None else v.to(dtype)
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


def test_plain_model_streams_its_state_dict():
    policy, _ = load_policy("tiny")
    want = whole_state_dict(policy)
    assert "lm_head.weight" in want and unwrap(policy).config.tie_word_embeddings  # the embedding, a second time
    got, most = streamed(policy)
    assert_same(got, want)
    assert most == 0  # float32 into float32: the parameters themselves, no copy
    got, most = streamed(policy, torch.bfloat16)
    assert_same(got, want, torch.bfloat16)
    assert most == 1  # each bf16 copy is freed once the consumer drops it


def test_lora_merged_per_module_in_float32():
    policy = lora_policy()
    want = whole_state_dict(policy)
    got, most = streamed(policy)
    assert_same(got, want)  # W + (alpha / r) B A, the same float32 arithmetic as the whole-dict merge
    assert most == 1
    q = unwrap(policy).model.layers[0].self_attn.q_proj
    merged = got["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(merged, q.base_layer.weight)  # merged out of place
    got, _ = streamed(policy, torch.bfloat16)
    assert_same(got, want, torch.bfloat16)  # merged in float32, then cast


def test_moe_experts_unfused_one_parameter_at_a_time():
    policy, _ = load_policy("tiny-moe")
    want = whole_state_dict(policy)
    assert any(".experts.0.gate_proj.weight" in k for k in want)  # per-expert checkpoint names
    got, _ = streamed(policy, torch.bfloat16)
    assert_same(got, want, torch.bfloat16)


def test_the_whole_state_dict_held_every_merged_copy_at_once():
    # what streaming removes: the dictionary kept every merged weight (7 a layer) alive to the last
    policy = lora_policy()
    _, most = streamed(policy, pairs=iter(whole_state_dict(policy).items()))
    assert most == 7 * unwrap(policy).config.num_hidden_layers


def _fsdp_worker(rank: int, init_file: str, out_dir: str):
    import torch.distributed as td
    from torch.distributed.device_mesh import init_device_mesh

    from gspo.processes.distributed import Dist
    from gspo.processes.parallel import wrap

    torch.set_num_threads(1)
    td.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    d = Dist(rank=rank, world=2, parallel="fsdp", mesh=init_device_mesh("cpu", (2,)))
    policy = lora_policy()  # adapted weights merged, and plain ones (embedding, norms) as they are
    wrap(policy, d)
    sharded = sum(hasattr(p, "placements") for p in unwrap(policy).parameters())
    res = {dtype: (*streamed(policy, dtype), sharded) for dtype in (None, torch.bfloat16)}
    torch.save(res, f"{out_dir}/{rank}.pt")
    td.destroy_process_group()


@pytest.mark.slow  # starts a process
def test_fsdp_gathers_one_parameter_at_a_time(tmp_path):
    spawn(_fsdp_worker, str(tmp_path / "init"), str(tmp_path))
    want = whole_state_dict(lora_policy())  # one process, unsharded
    for rank in (0, 1):
        res = torch.load(tmp_path / f"{rank}.pt", weights_only=False)
        for dtype, (got, most, sharded) in res.items():
            assert sharded > 10  # the parameters were DTensors: each one gathered
            assert_same(got, want, dtype)  # every process gets every whole weight
            assert most == 1, (dtype, most)  # one gathered (or merged) tensor alive at a time


def test_sleep_discards_the_weights_once_a_sync_put_the_policys_there(monkeypatch):
    # level 1 (offload) while the engine holds the checkpoint's weights; level 2 (discard) once
    # synced, since the next sync overwrites them all; a sample without that sync syncs again
    from gspo.config import VLLM
    from gspo.models.tiny import build_chat_tokenizer
    from gspo.sampling import vllm_engine
    from gspo.sampling.rollout import sampling_params
    from gspo.sampling.vllm_engine import VLLMSampler
    from tests.test_engine_protocol import fake_vllm

    tok, log = build_chat_tokenizer(), []
    monkeypatch.setattr(vllm_engine, "empty_cache", lambda device: None)
    vllm = fake_vllm(log, tok)
    real = vllm.LLM

    def llm(**kw):
        engine = real(**kw)
        sleep = engine.sleep
        engine.sleep = lambda level: (log.append(f"level {level}"), sleep(level))
        return engine

    vllm.LLM = llm
    sampler = VLLMSampler("model", VLLM(vllm_max_model_len=64), dtype="bfloat16", seed=0, vllm=vllm)
    params, policy = sampling_params(tok, group_size=2, max_new_tokens=4), torch.nn.Linear(2, 2)
    sampler.sample([[1, 2]], params)  # the checkpoint's weights, kept through a level-1 sleep
    sampler.end_rollout()
    assert log == ["level 1", "sleep", "wake_up", "generate", "level 1", "sleep"]
    del log[:]
    sampler.sync(policy)
    sampler.sample([[1, 2]], params)
    sampler.end_rollout()
    sampler.sample([[1, 2]], params)  # no sync: the discarded weights are the last synced policy's again
    sampler.end_rollout()
    assert log == ["wake_up", "reload_weights", "apply_model", "reset_prefix_cache", "generate", "level 2", "sleep",
                   "wake_up", "reload_weights", "apply_model", "reset_prefix_cache", "generate", "level 2", "sleep"]
