"""gspo's KV cache for decode steps, and the attention masks that go with it.

    cols = Columns.seed(hf_cache, P, rows=B, max_len=L)      # from a Hugging Face prefill's cache of P columns
    cols.reserve(S)                                          # room for the next S columns (eager: it grows)
    masks = cols.masks(attn, S, windows)                     # {window: (B, 1, S, K) bool}, K the width attended
    k, v = cols.update(k_new, v_new, layer)                  # what a model's attention calls (a transformers Cache)
    cols.advance(S)

Why. Hugging Face's DynamicCache grows by concatenation: every decode step copies every layer's
whole cache (at SmolLM2's shapes, 16 rows and 512 columns, ~380 MB a step, as much as its weights),
and the model's forward rebuilds its causal mask from the 2-D attention mask every step. `Columns`
holds each layer's keys and values in buffers allocated ahead, (rows, kv heads, capacity, head dim),
writes a step's columns in place, and hands attention the columns written so far; its masks are
built once per step from the rollout's attention mask, the same for every layer of a kind.

Two modes.
- eager (the default): the capacity starts at the prompt width plus `BLOCK` columns and doubles
  when full (up to `max_len`), so rollouts that stop early never hold max_new_tokens columns for
  every row; attention reads the t + S columns written, and a Python int says where to write.
- static (CUDA graphs, gspo.sampling.graphs; on the CPU only in tests): the capacity is `max_len`
  from the start and never moves, `rows` may exceed the real rows (a batch bucket: the rest are
  padding), attention reads every column (the mask hides those not written yet), and the columns
  to write are a tensor (`col`; a one-token step's is always the same one, filled in place), so that a
  captured graph replays correctly.

Masks. A layer with window w (a sliding-window layer; None: full attention) lets the token at
column q see column j when j is a real token (`attn`), j <= q (causal, also within a chunk of
several tokens) and j > q - w: Hugging Face's rule (transformers.masking_utils,
`sliding_window_overlay`), on cache columns as its caches count them. For an `eager` attention
implementation the masks are additive (0 or the dtype's minimum), as transformers' eager masks are.
Padding rows of a bucket see column 0 only, so that no row's softmax is over nothing.

The layers report no sliding window and their full width to transformers (`get_mask_sizes`): the
masks gspo passes are 4-D, which transformers uses as given (`_preprocess_mask_arguments`).

Which layers slide (`layer_kinds`, `windows`) is read from what the model's forward does, not from
its config alone: transformers' own DynamicCache keeps only the last window-1 columns of a layer
whenever the config carries a `sliding_window`, even in a model whose forward never applies it (a
Llama config with `sliding_window` set: `generate` then drops context the training forward
attends to; gspo.sampling.hfdecode prefills into a plain DynamicCache for that reason).
"""

from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

Tensor = torch.Tensor

BLOCK = 64  # columns beyond the prompt at first (eager mode); the capacity doubles when full

KINDS = ("full_attention", "sliding_attention")


def text_config(model):
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def backbone_of(model):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    prefix = getattr(base, "base_model_prefix", None)
    return getattr(base, prefix, None) if prefix else None


# the mask builders of transformers.masking_utils a decoder's forward may call, and the two this step reproduces
MASKS = ("create_causal_mask", "create_sliding_window_causal_mask", "create_chunked_causal_mask",
         "create_bidirectional_mask", "create_bidirectional_sliding_window_mask", "create_masks_for_generate")
KNOWN = MASKS[:2]


def forward_source(backbone) -> str | None:
    try:
        return inspect.getsource(type(backbone).forward)
    except (OSError, TypeError):
        return None


def layer_kinds(model) -> list[str] | str:
    """Each decoder layer's kind, "full_attention" or "sliding_attention", as the model's forward masks it;
    a reason (str) when gspo cannot tell or it is another kind. What the forward does decides, not the
    config alone (a Llama config may carry a `sliding_window` its model never applies): read from the
    backbone's forward, which masks in one of transformers' two ways,
    - a dict of masks by layer type (`causal_mask_mapping`): each layer's `config.layer_types` entry;
    - one mask for every layer: sliding when it calls `create_sliding_window_causal_mask` and
      `config.sliding_window` is set (`mask_function = ... if self.config.sliding_window is None else ...`),
      else full."""
    cfg = text_config(model)
    n = cfg.num_hidden_layers
    declared = getattr(cfg, "layer_types", None) or []
    for i, kind in enumerate(declared):  # whatever the forward does with masks, these layers are not attention
        if kind not in KINDS:
            return f"layer {i} is a {kind} layer"
    why = bidirectional(cfg)
    if why is not None:
        return why
    src = forward_source(backbone_of(model))
    if src is None:
        return "its forward's source cannot be read (gspo reads how it masks its layers)"
    other = [name for name in MASKS[2:] if name in src]
    if other:
        return f"its forward masks with {other[0]}"
    if not any(name in src for name in KNOWN):
        return "its forward builds no mask with transformers' create_causal_mask"
    window = getattr(cfg, "sliding_window", None)
    if "causal_mask_mapping" in src:
        types = getattr(cfg, "layer_types", None) or ["full_attention"] * n
    else:
        sliding = KNOWN[1] in src and window is not None
        types = ["sliding_attention" if sliding else "full_attention"] * n
    for i, kind in enumerate(types):
        if kind not in KINDS:
            return f"layer {i} is a {kind} layer"
    return list(types)


def bidirectional(cfg) -> str | None:
    """A config that asks its forward for attention to later tokens (EmbeddingGemma's
    `use_bidirectional_attention`, `is_causal` false): the training forward then sees what no decode step
    can. None when it asks for none."""
    for name in sorted(vars(cfg)):
        if "bidirectional" in name and getattr(cfg, name):
            return f"its config asks for bidirectional attention ({name})"
    if getattr(cfg, "is_causal", True) is False:
        return "its config is not causal (is_causal false)"
    return None


def windows(model, max_len: int) -> list[int | None]:
    """Each layer's window for rollouts of up to max_len columns: None (full attention, or a window
    they cannot pass) or the sliding window. Assumes `layer_kinds` gave no reason."""
    w = getattr(text_config(model), "sliding_window", None)
    return [w if kind == "sliding_attention" and w is not None and max_len > w else None
            for kind in layer_kinds(model)]


class _Layer(CacheLayerMixin):
    """One layer of a `Columns` cache: writes go to the owner's buffers."""

    is_sliding = False  # gspo's 4-D masks carry the window; transformers never builds one for this cache
    is_compileable = True

    def __init__(self, owner: Columns, index: int):
        super().__init__()
        self.owner, self.index = owner, index
        self.is_initialized = True

    @property
    def keys(self) -> Tensor:  # (R, n_kv, cap, hd)
        return self.owner.k[self.index]

    @keys.setter
    def keys(self, value) -> None:  # CacheLayerMixin.__init__ sets None; the buffers are the owner's
        pass

    @property
    def values(self) -> Tensor:
        return self.owner.v[self.index]

    @values.setter
    def values(self, value) -> None:
        pass

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        pass

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        return self.owner.write(self.index, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.width(query_length), 0

    def get_seq_length(self) -> int:
        return self.owner.t

    def get_max_length(self) -> int:
        return self.owner.max_len


class Columns(Cache):
    """Per layer, keys and values (rows, n_kv, capacity, head_dim); columns 0..t-1 are written.

    rows: the buffers' rows (static mode: a bucket, the first `real` rows real). t: the next column
    to write. col: static mode's (S,) tensor of the columns the next step writes."""

    def __init__(self, k: list[Tensor], v: list[Tensor], t: int, max_len: int, static: bool = False):
        self.k, self.v, self.t, self.max_len, self.static = k, v, t, max_len, static
        # static mode: the one-token steps' column, one tensor for the cache's life (a graph reads it)
        self.one = torch.full((1,), t, dtype=torch.long, device=k[0].device) if static else None
        self.col = self.one
        super().__init__(layers=[_Layer(self, i) for i in range(len(k))])

    @classmethod
    def seed(cls, hf_cache, width: int, *, rows: int | None = None, max_len: int, static: bool = False) -> Columns:
        """A cache holding what `hf_cache` (a Hugging Face DynamicCache after a prefill of `width` columns: each
        layer's keys (B, n_kv, P', hd)) holds, at columns 0..width-1. A sliding-window layer that kept only its
        last P' < width columns gets them at the right end (the columns before, which no later token can see,
        are zeros). rows: the buffers' rows (>= B; static mode's bucket)."""
        layers = hf_cache.layers
        P = width
        B = layers[0].keys.shape[0]
        rows = rows or B
        cap = max_len if static else min(max_len, P + BLOCK)
        k, v = [], []
        for lay in layers:
            n = lay.keys.shape[2]
            kb = lay.keys.new_zeros((rows, lay.keys.shape[1], cap, lay.keys.shape[3]))  # (R, n_kv, cap, hd)
            vb = lay.values.new_zeros((rows, lay.values.shape[1], cap, lay.values.shape[3]))
            kb[:B, :, P - n:P] = lay.keys
            vb[:B, :, P - n:P] = lay.values
            k.append(kb)
            v.append(vb)
        return cls(k, v, P, max_len, static)

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    @property
    def rows(self) -> int:
        return self.k[0].shape[0]

    def width(self, query_length: int) -> int:
        """The columns attention reads for a step of `query_length` tokens."""
        return self.capacity if self.static else self.t + query_length

    def reserve(self, n: int) -> None:
        """Room for the next n columns: eager mode doubles the capacity (up to max_len; at least enough);
        static mode's capacity is fixed (ValueError past it)."""
        cap = self.capacity
        if self.t + n <= cap:
            return
        if self.static:
            raise ValueError(f"a static KV cache of {cap} columns cannot take {self.t + n}")
        more = max(self.t + n - cap, min(cap, self.max_len - cap))
        for buffers in (self.k, self.v):
            for i, b in enumerate(buffers):
                buffers[i] = torch.cat([b, b.new_zeros((*b.shape[:2], more, b.shape[3]))], 2)

    def resize(self, max_len: int) -> None:
        """Static mode: buffers of `max_len` columns in place of the current ones (a later turn that needs more;
        a graph captured over the old ones must be captured again)."""
        for buffers in (self.k, self.v):
            for i, b in enumerate(buffers):
                new = b.new_zeros((*b.shape[:2], max_len, b.shape[3]))
                new[:, :, : b.shape[2]] = b
                buffers[i] = new
        self.max_len = max_len

    def point(self, n: int) -> None:
        """Static mode: the next step writes columns t..t+n-1 (`col`). A one-token step's is `one`, always
        the same tensor, filled in place (a captured graph reads it); a chunk's is a tensor of its own."""
        if n == 1:
            self.one.fill_(self.t)
            self.col = self.one
        else:
            self.col = torch.arange(self.t, self.t + n, device=self.one.device)

    def write(self, i: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Layer i's new keys and values (rows, n_kv, S, hd) at the step's columns; the columns attention reads."""
        if self.static:
            self.k[i].index_copy_(2, self.col, k)
            self.v[i].index_copy_(2, self.col, v)
            return self.k[i], self.v[i]
        t, S = self.t, k.shape[2]
        self.k[i][:, :, t:t + S] = k
        self.v[i][:, :, t:t + S] = v
        return self.k[i][:, :, :t + S], self.v[i][:, :, :t + S]

    def advance(self, n: int) -> None:
        self.t += n

    def select(self, rows: Tensor) -> None:
        """Keep rows `rows` (R,), in that order. Static mode keeps its buffers (a graph reads them): the
        rows move to the front, the others are padding."""
        for buffers in (self.k, self.v):
            for i, b in enumerate(buffers):
                if self.static:
                    b[:rows.shape[0]] = b.index_select(0, rows)
                else:
                    buffers[i] = b.index_select(0, rows)

    def masks(self, attn: Tensor, n: int, windows: set, dtype: torch.dtype | None = None) -> dict:
        """{window: mask} for a step of n tokens per row at columns t..t+n-1. attn (B, >= t+n): 1 on the
        columns that hold real tokens (the rollout's mask; B <= rows, the rest padding rows). Masks are
        (rows, 1, n, K) bool, K = `width(n)`; additive in `dtype` when given (eager attention)."""
        t, K, R = self.t, self.width(n), self.rows
        B = attn.shape[0]
        if n == 1 and B == R and not self.static and windows == {None} and dtype is None:
            return {None: attn[:, None, None, : t + 1].bool()}  # (B, 1, 1, t+1) the common case, at once
        real = torch.zeros((R, K), dtype=torch.bool, device=attn.device)  # (R, K)
        real[:B, : t + n] = attn[:, : t + n].bool()
        real[B:, 0] = True  # padding rows see one column
        q = torch.arange(t, t + n, device=attn.device)[:, None]  # (n, 1) each query's column
        j = torch.arange(K, device=attn.device)[None]  # (1, K)
        out = {}
        for w in windows:
            seen = j <= q  # (n, K) causal
            if w is not None:
                seen = seen & (j > q - w)
            m = real[:, None, None, :] & seen[None, None]  # (R, 1, n, K)
            m[B:, :, :, 0] = True
            if dtype is not None:
                m = torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, torch.finfo(dtype).min)
            out[w] = m
        return out
