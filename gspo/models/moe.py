"""Mixture-of-Experts routing: record it, replay it, measure how far it drifts.

    routing = Routing(model)                  # finds the router modules; raises if there are none
    with routing.capture() as cap:            # record the experts every token activates
        model(input_ids, ...)
    old = cap.indices(B, S)                   # (B, S, L, k) top-k expert ids, per token and layer
    with routing.capture(forced=old) as cap:  # Routing Replay: force the recorded experts
        model(input_ids, ...)
    drift(cap.natural(B, S), old, mask)       # share of (token, layer) top-k sets that changed
    with NO_ROUTING.capture() as cap:         # a dense model's: records nothing (cap.indices(...) is None)
    with held() as records:                   # what forwards here route is held back from the capture ...
        model(input_ids, ...)
    keep(records)                             # ... until kept (a step computed twice records once)

A run holds a `Routing` for an MoE model and `NO_ROUTING` (a `NoRouting`, the null object)
for a dense one, so its forwards capture unconditionally; `routing.moe` says which, and
`routing.terms` is what an update adds (drift metrics, the balance loss; none when dense).

Routers. Hugging Face MoE models whose routing is a module named `*TopKRouter` that returns
`(router_logits, router_scores, router_indices)` (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE and
others in transformers ≥ 5). Replay swaps in the recorded indices and recomputes the gates
from the *current* router logits over the forced experts (softmax over all experts, gathered
at the forced ones, renormalised when the router renormalises), so the router still gets
gradients. That gating rule is checked at run time on every router: with the router's own
choice it must reproduce the router's own scores, else `MoEError` names the router as
unsupported. Nothing is replayed with a rule the model does not use.

Recorded ids are int8 for up to 128 experts (Qwen3-30B-A3B has 128), else int16: -1 = not
recorded (that position routes freely). A rollout of 8k tokens through 48 layers with top-8
then holds 3 MiB of routing per completion.

The load-balancing auxiliary loss (Switch Transformer): num_experts · Σ_e f_e · P_e, with
f_e the share of routing slots that went to expert e and P_e the mean router probability of
e, over real tokens, averaged over layers. f_e and P_e are those of the whole (global)
minibatch (global-batch balancing, arXiv 2501.11873): f_e is counted first (`expert_counts`,
no gradient) and each micro-batch adds its tokens' share of P_e (`balance_loss`), so a
minibatch split into micro-batches or processes gets the unsplit loss and gradient.

Left out: expert parallelism, capacity factors, routers that are not modules.
"""

from __future__ import annotations

import contextlib

import torch

from gspo.algo.metrics import Mean

Tensor = torch.Tensor


class MoEError(ValueError):
    """An MoE feature asked of a model that cannot provide it; one line naming the model."""


def find_routers(model) -> list[tuple[str, torch.nn.Module]]:
    """Router modules in model order (one per MoE layer)."""
    return [(name, m) for name, m in model.named_modules() if type(m).__name__.endswith("TopKRouter")]


def is_moe(model) -> bool:
    return bool(find_routers(model))


_held: list | None = None  # inside `held()`: the records its forwards made, not yet in their captures


@contextlib.contextmanager
def held():
    """Routing recorded by the forwards in this block is held back from its capture: yields the
    list of records, which `keep` adds to their captures (or nothing does). A decode step that is
    computed twice, to check one way against the other (gspo.sampling.fastdecode), records only one."""
    global _held
    previous, _held = _held, []
    try:
        yield _held
    finally:
        _held = previous


def keep(records: list) -> None:
    """Record what a `held()` block held back (into an enclosing `held()` block's, if any)."""
    for target, entry in records:
        _record(target, entry)


def _record(target: list, entry: Tensor) -> None:
    if _held is None:
        target.append(entry)
    else:
        _held.append((target, entry))


def _gates(logits: Tensor, indices: Tensor, normalise: bool) -> Tensor:
    """softmax(logits) at `indices`, renormalised over the k chosen experts when `normalise`."""
    probs = torch.softmax(logits.float(), dim=-1)  # (N, E)
    g = probs.gather(-1, indices)  # (N, k)
    return g / g.sum(-1, keepdim=True) if normalise else g


class Capture:
    """What one forward pass (or several, e.g. a generation loop) routed."""

    def __init__(self, n_layers: int, forced: Tensor | None, keep_logits: bool, dtype: torch.dtype = torch.int16):
        self.natural: list[list[Tensor]] = [[] for _ in range(n_layers)]  # the router's own top-k
        self.used: list[list[Tensor]] = [[] for _ in range(n_layers)]  # what the experts actually got
        self.logits: list[list[Tensor]] = [[] for _ in range(n_layers)]
        self.forced = forced  # (N, L, k) flattened rows, or None
        self.keep_logits = keep_logits
        self.dtype = dtype  # of recorded ids
        self.calls = 0

    def _stack(self, per_layer: list[list[Tensor]], call: int | None) -> Tensor:
        if call is None:
            return torch.stack([torch.cat(x) for x in per_layer], 1)  # (N, L, k)
        return torch.stack([x[call] for x in per_layer], 1)  # (N_call, L, k)

    def indices(self, B: int, S: int, *, call: int | None = None) -> Tensor:
        """Experts used, (B, S, L, k)."""
        return self._stack(self.used, call).view(B, S, len(self.used), -1).to(self.dtype)

    def natural_indices(self, B: int, S: int) -> Tensor:
        """The router's own top-k (what it would pick without replay), (B, S, L, k)."""
        return self._stack(self.natural, None).view(B, S, len(self.natural), -1).to(self.dtype)

    def call_indices(self, call: int) -> Tensor:
        """Experts used in the `call`-th forward pass, (rows, L, k) (generation loops)."""
        return self._stack(self.used, call).to(self.dtype)


class Routing:
    """Hooks on every router of `model`: record, force (replay) and check the gating rule."""

    def __init__(self, model, name: str = "model"):
        self.routers = find_routers(model)
        if not self.routers:
            raise MoEError(f"{name}: not a Mixture-of-Experts model with router modules (expected *TopKRouter "
                           "modules as in Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE); MoE features need one")
        self.current: Capture | None = None
        self.checked: set[int] = set()
        self.handles = [m.register_forward_hook(self._hook(i)) for i, (_, m) in enumerate(self.routers)]

    moe = True  # a Mixture-of-Experts model (NoRouting: a dense one)

    @property
    def n_layers(self) -> int:
        return len(self.routers)

    @property
    def top_k(self) -> int:
        return int(self.routers[0][1].top_k)

    @property
    def num_experts(self) -> int:
        return int(self.routers[0][1].num_experts)

    def _normalises(self, i: int, module, logits: Tensor, scores: Tensor, indices: Tensor) -> bool:
        """Which gating rule this router uses (checked once per router): renormalised or not."""
        norm = bool(getattr(module, "norm_topk_prob", True))
        if i not in self.checked:
            with torch.no_grad():
                ok = torch.allclose(_gates(logits, indices, norm).to(scores.dtype), scores, rtol=1e-3, atol=1e-5)
            if not ok:
                raise MoEError(f"router {self.routers[i][0]} ({type(module).__name__}): its gates are not "
                               "softmax-then-top-k (optionally renormalised); routing replay would compute "
                               "different gates than the model, so this architecture is not supported")
            self.checked.add(i)
        return norm

    def _hook(self, i: int):
        def hook(module, inputs, output):
            cap = self.current
            if cap is None:
                return None
            logits, scores, indices = output
            norm = self._normalises(i, module, logits, scores, indices)
            _record(cap.natural[i], indices.detach())
            if cap.keep_logits:
                _record(cap.logits[i], logits)
            if cap.forced is None:
                _record(cap.used[i], indices.detach())
                return None
            forced = cap.forced[:, i].to(indices.device).long()  # (N, k)
            if forced.shape != indices.shape:
                raise MoEError(f"routing replay: recorded routing has {tuple(forced.shape)} slots for layer {i}, "
                               f"the forward pass routes {tuple(indices.shape)}")
            forced = torch.where(forced < 0, indices, forced)  # unrecorded rows route freely
            _record(cap.used[i], forced)
            return logits, _gates(logits, forced, norm).to(scores.dtype), forced

        return hook

    @contextlib.contextmanager
    def capture(self, forced: Tensor | None = None, keep_logits: bool = False):
        """Record routing during the block; with `forced` (B, S, L, k), replay it instead."""
        if forced is not None:
            forced = forced.reshape(-1, forced.shape[-2], forced.shape[-1])  # (B·S, L, k)
        cap = Capture(self.n_layers, forced, keep_logits, torch.int8 if self.num_experts <= 128 else torch.int16)
        previous, self.current = self.current, cap
        try:
            yield cap
        finally:
            self.current = previous

    def terms(self, cap: Capture, old_routing: Tensor | None, tokens: Tensor, aux_coef: float, *,
              load: tuple[Tensor, float] | None = None, dist=None) -> tuple[Tensor | float, dict]:
        """What an update adds on an MoE model: expert drift of this forward against the old
        policy's routing (when it is known: not for an inference engine's sampling pass), and
        (aux_coef > 0) the weighted load-balancing loss. tokens: (b, P+T) attention mask.

        The balance loss is this micro-batch's part of the global minibatch's (`balance_loss`):
        `load` = the minibatch's (expert counts (L, E), real tokens) over every process; None: this
        forward is the whole minibatch on this process, its counts are summed over processes
        (`dist`: a gspo.processes.distributed.Dist; None: one process), whose gradient average the loss undoes."""
        b, S = tokens.shape
        n = float(tokens.sum())
        metrics = {}
        if old_routing is not None:
            metrics = {"moe/drift": Mean(drift(cap.natural_indices(b, S), old_routing, tokens), n),  # the router's pick
                       "moe/drift_in_ratio": Mean(drift(cap.indices(b, S), old_routing, tokens), n)}  # what experts got
        if aux_coef == 0:
            return 0.0, metrics
        logits = [torch.cat(x) for x in cap.logits]  # (b·S, E) per layer
        load = load or _aux_load(logits, tokens, self.top_k, dist.all_sum if dist is not None else (lambda t: t))
        aux = balance_loss(logits, tokens, load[0], load[1], self.top_k)
        # logged as the global minibatch's loss: each micro-batch reports E·Σ f_e^minibatch·P_e^its own
        metrics["moe/aux_loss"] = Mean(aux.detach() * max(load[1], 1.0) / max(n, 1.0), n)
        return aux_coef * (dist.world if dist is not None else 1) * aux, metrics

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class NullCapture:
    """What a dense model's forward routed: nothing."""

    logits: list = []

    def indices(self, *shape, call: int | None = None) -> None:
        return None

    def natural_indices(self, *shape) -> None:
        return None


class NoRouting:
    """A dense model's routing (the null object): its capture records nothing, its update terms
    are none, so callers run `with run.routing.capture() as cap:` whatever the model."""

    moe = False

    @contextlib.contextmanager
    def capture(self, forced: Tensor | None = None, keep_logits: bool = False):
        yield NullCapture()

    def terms(self, cap, old_routing: Tensor | None, tokens: Tensor, aux_coef: float, *, load=None,
              dist=None) -> tuple[float, dict]:
        return 0.0, {}

    def remove(self) -> None:
        pass


NO_ROUTING = NoRouting()


@torch.no_grad()
def drift(current: Tensor, old: Tensor, mask: Tensor) -> float:
    """Share of (token, layer) routing decisions whose top-k expert *set* differs.

    current, old: (B, S, L, k) expert ids (order within the k does not matter; -1 in `old`
    means not recorded and is not counted); mask: (B, S) real tokens.
    """
    a = current.long().sort(-1).values  # (B, S, L, k)
    b = old.long().sort(-1).values
    recorded = (old >= 0).all(-1)  # (B, S, L)
    valid = recorded & (mask > 0)[..., None]  # (B, S, L)
    n = valid.sum()
    if n == 0:
        return 0.0
    differs = (a != b).any(-1) & valid  # (B, S, L)
    return float(differs.sum() / n)


@torch.no_grad()
def expert_counts(logits_per_layer: list[Tensor], mask: Tensor, top_k: int) -> Tensor:
    """The routing slots each expert got over the real tokens, per layer: (L, E), no gradient.
    A sum: over micro-batches (and processes) it adds up to the whole minibatch's counts."""
    flat = mask.reshape(-1).float()  # (B·S,)
    rows = []
    for logits in logits_per_layer:
        probs = torch.softmax(logits.float(), -1)  # (B·S, E)
        chosen = torch.zeros_like(probs).scatter_(-1, probs.topk(top_k, -1).indices, 1.0)  # (B·S, E)
        rows.append((chosen * flat[:, None]).sum(0))  # (E,)
    return torch.stack(rows)  # (L, E)


def balance_loss(logits_per_layer: list[Tensor], mask: Tensor, counts: Tensor, tokens: float, top_k: int) -> Tensor:
    """This micro-batch's part of the minibatch's load-balancing loss, averaged over layers:

        E · Σ_e f_e · (Σ_{t in this micro-batch} p_{t,e}) / n,   f_e = counts_e / (n · k)

    with counts (L, E) and n = `tokens` those of the whole minibatch (global-batch balancing,
    arXiv 2501.11873). f carries no gradient and P_e = Σ_t p_{t,e} / n is a mean over tokens, so
    the parts of the micro-batches add up to the unsplit E · Σ_e f_e P_e, gradient included.
    logits (B·S, E) per layer, mask (B, S)."""
    flat = mask.reshape(-1).float()  # (B·S,)
    n = max(float(tokens), 1.0)
    f = counts.float() / (n * top_k)  # (L, E) share of the minibatch's routing slots
    losses = []
    for f_l, logits in zip(f, logits_per_layer):
        probs = torch.softmax(logits.float(), -1)  # (B·S, E)
        p_sum = (probs * flat[:, None]).sum(0)  # (E,) this micro-batch's router probability mass
        losses.append(probs.shape[-1] * (f_l.to(p_sum.device) * p_sum).sum() / n)
    return torch.stack(losses).mean()


def load_balancing_loss(logits_per_layer: list[Tensor], mask: Tensor, top_k: int) -> Tensor:
    """Switch-style auxiliary loss E · Σ_e f_e P_e over one batch, averaged over layers;
    logits (B·S, E) per layer, mask (B, S)."""
    return balance_loss(logits_per_layer, mask, expert_counts(logits_per_layer, mask, top_k), float(mask.sum()), top_k)


def _aux_load(logits: list[Tensor], tokens: Tensor, top_k: int, all_sum) -> tuple[Tensor, float]:
    """This forward's (expert counts (L, E), real tokens), summed over processes by `all_sum`."""
    counts = expert_counts(logits, tokens, top_k)  # (L, E)
    both = all_sum(torch.cat([counts.flatten(), counts.new_tensor([float(tokens.sum())])]))
    return both[:-1].view_as(counts), float(both[-1])
