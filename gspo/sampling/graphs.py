"""CUDA graphs for gspo's decode step: captured once per decoder, replayed at every later one-token step.

    runner = Runner()                        # CUDA graphs (torch.cuda.CUDAGraph)
    runner = Runner(Recording())             # a CPU stand-in with the same protocol (tests)
    dec = LayerDecoder(model, max_len, static=True, graphs=runner)   # gspo.sampling.layerdecode
    why = why_not(model)                     # None when a graph can serve the model's decode step

Why. On a GPU a decode step at 0.5B shapes is a few hundred small kernels, each launched from
Python: about 20 ms a step for 256 rows on an H100 (docs/gpu.md), where the arithmetic and the
memory traffic take a few ms. A graph replays the whole step's kernels in one launch.

How. The first one-token step (a rollout's first decode step) copies its inputs into static
tensors (token ids, positions, masks), runs the step once eagerly on a side stream (the warm-up
CUDA asks for, and the reference), captures it, and replays it: the replay's logits must equal
the eager ones (to the first-step check's tolerance), or the decoder goes on eagerly (said once
per process). That replay is also what the rollout's first-step check compares with Hugging
Face's forward (gspo.sampling.hfdecode.Checked). Each later step copies its inputs into the static
tensors and replays.
The KV cache (gspo.sampling.kvcache.Columns, static mode) keeps its buffers for the decoder's life
and writes at its `col` tensor, which the decoder updates in place before each step; the
parameters are read where they lie (nothing reassigns them during a rollout; the next rollout's
decoder captures again, so an optimizer step, a weight sync or FSDP's gathering in between
cannot leave a graph reading stale memory).

What is not captured: a chunk of several tokens per row (a later turn's first step) runs eagerly;
a step whose shapes depend on the data (an MoE's expert dispatch) is refused before (`why_not`);
a forward that syncs with the host fails to capture, and the decoder goes on eagerly (said once).

Cost. One capture per rollout (the decoder's life); the graph's private memory pool holds the
step's intermediate tensors until the decoder is dropped. Left out: keeping graphs across
rollouts (it would hold a rollout's whole KV cache through the update).
"""

from __future__ import annotations

import torch

from gspo.io.reporting import warn
from gspo.models.moe import is_moe
from gspo.sampling.hfdecode import CHECK_TOL

Tensor = torch.Tensor


class Cuda:
    """torch.cuda's graphs: warm-up on a side stream, capture, replay."""

    def warm(self, fn):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out = fn()
        torch.cuda.current_stream().wait_stream(side)
        return out

    def capture(self, fn):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # another thread's CUDA work is its own
            out = fn()
        return graph, out

    def replay(self, graph) -> None:
        graph.replay()


class Recording:
    """A CPU stand-in for `Cuda`, for tests: `capture` runs nothing into its output (it starts as NaN,
    as a graph's output holds nothing before its first replay), `replay` computes it; both are counted.
    (To learn the output's shape, capture computes the step once and drops the result: the step's
    cache writes are the warm-up's again, the same values at the same columns.)"""

    def __init__(self):
        self.captures = 0
        self.replays = 0

    def warm(self, fn):
        return fn()

    def capture(self, fn):
        self.captures += 1
        out = torch.full_like(fn(), float("nan"))
        return (fn, out), out

    def replay(self, graph) -> None:
        self.replays += 1
        fn, out = graph
        out.copy_(fn())


def _flat(masks) -> list[Tensor]:
    return list(masks.values()) if isinstance(masks, dict) else [masks]


class Runner:
    """One decoder's graph (module docstring). `off`: the decoder's steps run eagerly from here on."""

    def __init__(self, backend=None):
        self.backend = backend or Cuda()
        self.graph = None
        self.off = False

    def reset(self) -> None:
        """The decoder's buffers moved (a larger cache for a later turn): capture again at the next step."""
        self.graph = None

    def run(self, dec, ids: Tensor, pos: Tensor, masks) -> Tensor:
        """dec.forward(ids, pos, masks), replayed from the graph (captured at the first call)."""
        if self.off:
            return dec.forward(ids, pos, masks)
        if self.graph is None:
            return self._capture(dec, ids, pos, masks)
        for static, new in zip(self.inputs, [ids, pos, *_flat(masks)]):
            static.copy_(new)
        self.backend.replay(self.graph)
        return self.out.clone()  # the next replay overwrites the static output

    def _capture(self, dec, ids: Tensor, pos: Tensor, masks) -> Tensor:
        s_ids, s_pos = ids.clone(), pos.clone()
        s_masks = {k: m.clone() for k, m in masks.items()} if isinstance(masks, dict) else masks.clone()
        self.inputs = [s_ids, s_pos, *_flat(s_masks)]

        def step():
            return dec.forward(s_ids, s_pos, s_masks)

        eager = self.backend.warm(step)
        try:
            self.graph, self.out = self.backend.capture(step)
            self.backend.replay(self.graph)
        except RuntimeError as e:
            self.off, self.graph = True, None
            _say(f"the decode step could not be captured ({str(e).splitlines()[0][:160]})")
            return eager
        tol = CHECK_TOL.get(eager.dtype, 0.25)
        if not torch.allclose(self.out.float(), eager.float(), atol=tol, rtol=0):
            diff = float((self.out.float() - eager.float()).abs().max())
            self.off, self.graph = True, None
            _say(f"the captured decode step's logits differ from the eager step's by {diff:.3g} (> {tol:g})")
            return eager
        return self.out.clone()


_said = []


def _say(what: str) -> None:
    if not _said:
        warn(f"cuda graphs: {what}; such rollouts decode eagerly (slower)")
        _said.append(True)


def why_not(model) -> str | None:
    """Why a CUDA graph cannot serve `model`'s decode step; None when it can."""
    cfg = model.config
    if is_moe(model) or any(getattr(cfg, a, None) for a in ("num_experts", "num_local_experts", "n_routed_experts")):
        return "an MoE model's expert dispatch depends on the data"
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        FSDPModule = ()
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        return "an FSDP-sharded model (its hooks run at every module call, outside any graph)"
    device = next(model.parameters()).device
    if device.type != "cuda":
        return f"the model is on {device.type}, not a CUDA device"
    if not hasattr(torch.cuda, "CUDAGraph"):
        return "this torch has no torch.cuda.CUDAGraph"
    return None
