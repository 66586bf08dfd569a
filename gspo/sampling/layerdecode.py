"""A decode step for any decoder-only model: the model's own forward over gspo's KV cache and masks.

    dec = LayerDecoder(model, max_len)                    # eager: the CPU, or where graphs are off
    dec = LayerDecoder(model, max_len, static=True, graphs=Runner())   # CUDA: a static cache, graphs
    why = unsupported(model, max_len)                     # None when it serves the model

Why. gspo's hand-written step (gspo.sampling.fastdecode) knows the Llama family; Gemma 3, Phi-3,
OLMo 2, granite, SmolLM3 and the others each put their norms, multipliers, soft-caps and rotary
tables somewhere else. This step runs the model's own forward, so whatever the architecture
computes is what it computes, LoRA adapters and MoE routers included (a PEFT model's own modules;
gspo.models.moe's hooks on the routers), and replaces only what makes Hugging Face's decode
step slow: the KV cache grown by concatenation (gspo.sampling.kvcache.Columns writes in place)
and the causal mask rebuilt from the 2-D mask every step (gspo's 4-D masks, one per kind of
layer, passed as the model's forward takes them: a tensor, or a dict by layer type).

Layers. Each layer is full attention or a sliding window, as the model's forward masks it
(`layer_kinds`: a dict of masks by `config.layer_types`, or one mask for all, sliding when the
forward calls transformers' sliding-window mask and `config.sliding_window` is set). A window the
rollout cannot pass (max_len <= window) is full attention for it. Other kinds (chunked,
bidirectional, linear or state-space layers), a forward that builds its masks otherwise,
attention implementations other than sdpa and eager, and mixed kinds in a model whose forward
takes no dict of masks are refused with the reason.

Static mode (CUDA graphs, gspo.sampling.graphs). The cache has `max_len` columns from the start and
a batch bucket's rows (`bucket`: 1, 2, 4, 8, 16, 32, then steps of an eighth of the next power of
two); a step pads its rows to the bucket (token 0 at position 0, seeing column 0) and writes at a
column tensor, and a one-token step is captured once per decoder and replayed. The same code runs
on the CPU with `graphs=None` (every step eager), which is how the tests run it.

Checked. It is a gspo.sampling.hfdecode.Checked decoder: each rollout's first decode step is computed
both ways, and a disagreement sends the rollout to Hugging Face's forward.
"""

from __future__ import annotations

import torch

from gspo.sampling.hfdecode import CACHE, Checked
from gspo.sampling.kvcache import Columns, backbone_of, forward_source, layer_kinds, text_config, windows

Tensor = torch.Tensor


def _takes_mask_dict(backbone) -> bool:
    """Whether the backbone's forward takes a dict of masks by layer type (transformers' hybrid models:
    `if not isinstance(causal_mask_mapping := attention_mask, dict)`)."""
    return "attention_mask, dict)" in (forward_source(backbone) or "")


def unsupported(model, max_len: int) -> str | None:
    """Why the model's own forward over gspo's cache cannot decode `model` for rollouts of up to
    `max_len` columns; None when it can."""
    backbone = backbone_of(model)
    if backbone is None or not hasattr(backbone, "layers"):
        return "no decoder stack (a `layers` list under the base model) was found"
    kinds = layer_kinds(model)
    if isinstance(kinds, str):
        return kinds
    if len(kinds) != len(backbone.layers):
        return f"its config lists {len(kinds)} layer types for {len(backbone.layers)} layers"
    attn = getattr(text_config(model), "_attn_implementation", "sdpa")
    if attn not in ("sdpa", "eager"):
        return f"attention implementation {attn}"
    if len({w for w in windows(model, max_len)}) > 1 and not _takes_mask_dict(backbone):
        return "it mixes full and sliding-window layers, and its forward takes no dict of masks"
    return None


def bucket(n: int) -> int:
    """The batch bucket of n rows: the next power of two up to 32 (1, 2, 4, 8, 16, 32), then the next
    multiple of an eighth of the next power of two (33 -> 40, 100 -> 112, 257 -> 320): under a quarter of padding."""
    if n <= 32:
        return 1 << max(n - 1, 0).bit_length()
    eighth = (1 << (n - 1).bit_length()) // 8
    return -(-n // eighth) * eighth


class LayerDecoder(Checked):
    """Hugging Face's prefill, then decode steps through the model's own forward over a
    gspo.sampling.kvcache.Columns cache (module docstring)."""

    def __init__(self, model, max_len: int, *, static: bool = False, graphs=None):
        super().__init__(model, max_len)
        self.windows = windows(model, max_len)
        self.kinds = set(self.windows)
        w = [x for x in self.kinds if x is not None]
        self.window = w[0] if w else None
        self.additive = getattr(text_config(model), "_attn_implementation", "sdpa") == "eager"
        self.mask_dtype = None  # eager attention: additive masks in the computation's dtype (set at `expand`)
        self.static, self.graphs = static, graphs
        self.cols: Columns | None = None
        self.real = 0  # rows that are real (static mode: the rest of the bucket is padding)

    def expand(self, group_size: int) -> None:
        super().expand(group_size)  # Hugging Face's cache too: the fallback and the first step's reference
        self.real = self.cache.layers[0].keys.shape[0]
        if self.additive:  # the keys' dtype is the forward's (under FSDP, the MixedPrecisionPolicy's)
            self.mask_dtype = self.cache.layers[0].keys.dtype
        rows = bucket(self.real) if self.static else self.real
        self.cols = Columns.seed(self.cache, self.width, rows=rows, max_len=self.max_len, static=self.static)

    def select(self, rows: Tensor) -> None:
        if not self.fallback:
            self.cols.select(rows)
            self.real = rows.shape[0]
        if self.cache is not None:
            super().select(rows)

    def reach(self, max_len: int) -> bool:
        """A later turn's columns: past no sliding window (its masks count columns, holes included); a
        static cache too small for them is reallocated (and its graph captured again)."""
        if (self.fallback or self.cache is not None) and not super().reach(max_len):
            return False
        if self.fallback:
            return True
        window = getattr(text_config(self.model), "sliding_window", None)
        if "sliding_attention" in layer_kinds(self.model) and window is not None and max_len > window:
            return False
        if self.static and max_len > self.cols.capacity:  # new buffers: the graph over the old ones is dropped
            self.cols.resize(max_len)
            if self.graphs is not None:
                self.graphs.reset()
        self.max_len = max(self.max_len, max_len)
        self.cols.max_len = self.max_len
        return True

    def _masks(self, attn: Tensor, n: int):
        """The step's masks as the model's forward takes them: one tensor, or a dict by layer type."""
        m = self.cols.masks(attn, n, self.kinds, self.mask_dtype)
        if len(m) == 1:
            return m.popitem()[1]
        return {"full_attention": m[None], "sliding_attention": m[self.window]}

    def forward(self, ids: Tensor, pos: Tensor, masks) -> Tensor:
        """The model's forward for a step: ids, pos (R, S), masks as `_masks` gives them; logits (R, V)
        at the last column. Writes the step's columns of the cache."""
        out = self.model(input_ids=ids, attention_mask=masks, position_ids=pos, use_cache=True, logits_to_keep=1,
                         **{CACHE: self.cols})
        return out.logits[:, -1]

    def _fast_step(self, tok: Tensor, attn: Tensor, pos: Tensor) -> Tensor:
        ids, pos = (tok, pos) if tok.dim() == 2 else (tok[:, None], pos[:, None])  # (B, S): a chunk, or S = 1
        B, S = ids.shape
        cols = self.cols
        cols.reserve(S)
        if self.static:
            cols.point(S)
            pad = cols.rows - B
            if pad:  # the bucket's padding rows: token 0 at position 0
                ids = torch.cat([ids, ids.new_zeros((pad, S))])
                pos = torch.cat([pos, pos.new_zeros((pad, S))])
        masks = self._masks(attn, S)
        if self.graphs is not None and S == 1:
            logits = self.graphs.run(self, ids, pos, masks)
        else:
            logits = self.forward(ids, pos, masks)
        cols.advance(S)
        return logits[:B]  # (B, V)
