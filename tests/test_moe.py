"""MoE routing: record/replay round trips on four MoE families, drift by hand, the gating
check, the load-balancing loss, and drift in real updates."""

import pytest
import torch

from gspo.models.logprobs import completion_logprobs
from gspo.models.moe import MoEError, Routing, drift, find_routers, load_balancing_loss
from gspo.sampling.rollout import generate, sampling_params

ARCHS = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"]


def tiny_moe(arch: str, vocab: int = 24, seed: int = 0):
    """A randomly initialised 2-layer MoE (4 experts, top-2) of the given family."""
    import transformers as tf

    common = dict(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                  max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    cfg = {
        "qwen3_moe": lambda: tf.Qwen3MoeConfig(**common, intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                                               num_experts_per_tok=2, head_dim=32, norm_topk_prob=True),
        "qwen2_moe": lambda: tf.Qwen2MoeConfig(**common, intermediate_size=64, moe_intermediate_size=32,
                                               shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                               norm_topk_prob=False),
        "mixtral": lambda: tf.MixtralConfig(**common, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2),
        "olmoe": lambda: tf.OlmoeConfig(**common, intermediate_size=32, num_experts=4, num_experts_per_tok=2),
    }[arch]()
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # routers start at zero in some families: give them real preferences
        for _, r in find_routers(model):
            r.weight.normal_(0, 1.0)
    return model


def batch(vocab=24, B=3, S=7, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[0, :2] = 0  # a left-padded row
    return ids, mask


@pytest.mark.parametrize("arch", ARCHS)
def test_record_replay_round_trip(arch):
    model = tiny_moe(arch)
    routing = Routing(model, arch)
    assert routing.n_layers == 2 and routing.top_k == 2
    ids, mask = batch()
    B, S = ids.shape
    with routing.capture() as cap:
        logits = model(input_ids=ids, attention_mask=mask).logits
    recorded = cap.indices(B, S)  # (B, S, L, k)
    assert recorded.shape == (B, S, 2, 2) and recorded.dtype == torch.int8  # 8 experts fit int8
    # replaying the model's own routing changes nothing, to the bit
    with routing.capture(forced=recorded) as cap:
        replayed = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(replayed, logits)
    assert torch.equal(cap.indices(B, S), recorded)
    # an "update" that moves the routers: the router now picks other experts ...
    with torch.no_grad():
        for _, r in routing.routers:
            r.weight.add_(torch.randn_like(r.weight))
    with routing.capture() as cap:
        model(input_ids=ids, attention_mask=mask)
    assert drift(cap.indices(B, S), recorded, mask) > 0
    # ... but under replay the forward uses exactly the recorded experts: drift 0 in the ratio
    with routing.capture(forced=recorded) as cap:
        model(input_ids=ids, attention_mask=mask)
    assert drift(cap.indices(B, S), recorded, mask) == 0.0
    assert drift(cap.natural_indices(B, S), recorded, mask) > 0  # the router still would have moved
    routing.remove()


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_replayed_gates_carry_gradient_to_the_router(arch):
    model = tiny_moe(arch).train()
    routing = Routing(model)
    ids, mask = batch()
    with routing.capture() as cap:
        model(input_ids=ids, attention_mask=mask)
    forced = cap.indices(*ids.shape)
    with torch.no_grad():
        for _, r in routing.routers:
            r.weight.add_(torch.randn_like(r.weight))
    with routing.capture(forced=forced):
        model(input_ids=ids, attention_mask=mask).logits.square().mean().backward()
    for _, r in routing.routers:
        assert r.weight.grad is not None and r.weight.grad.abs().sum() > 0


def test_drift_by_hand():
    # one sequence of 3 tokens, 2 layers, top-2. old / current expert sets per (token, layer):
    #   token 0: L0 {0,1} / {1,0} same set;  L1 {2,3} / {2,3} same
    #   token 1: L0 {4,5} / {4,6} DIFFERENT; L1 {6,7} / {6,7} same
    #   token 2: masked out (padding), whatever it says
    # -> 1 differing decision out of 4 counted: 0.25
    old = torch.tensor([[[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[0, 2], [1, 3]]]])  # (1, 3, 2, 2)
    cur = torch.tensor([[[[1, 0], [2, 3]], [[4, 6], [6, 7]], [[5, 6], [5, 6]]]])
    mask = torch.tensor([[1, 1, 0]])
    assert drift(cur, old, mask) == 0.25
    # unrecorded (-1) decisions are not counted: make token 1's layer 0 unrecorded -> 0 of 3
    old[0, 1, 0] = -1
    assert drift(cur, old, mask) == 0.0
    assert drift(cur, old, torch.zeros(1, 3)) == 0.0


def test_load_balancing_loss_by_hand():
    E, k = 4, 1
    # balanced: uniform router probabilities and the 4 tokens spread over the 4 experts
    # f_e = 1/4, P_e = 1/4 -> E · Σ_e f_e P_e = 4 · 4 · (1/16) = 1
    logits = torch.zeros(4, E)
    logits[torch.arange(4), torch.arange(4)] = 1e-4  # break the ties: token i prefers expert i
    assert load_balancing_loss([logits], torch.ones(1, 4), k).item() == pytest.approx(1.0, abs=1e-3)
    # collapsed: every token sends everything to expert 0 -> f_0 = 1, P_0 ≈ 1 -> loss ≈ E = 4
    collapsed = torch.tensor([[50.0, 0, 0, 0]]).repeat(4, 1)
    assert load_balancing_loss([collapsed], torch.ones(1, 4), k).item() == pytest.approx(4.0, abs=1e-3)
    # masked tokens do not count: only the 2 real tokens, both on expert 0
    mixed = torch.cat([collapsed[:2], logits[2:]])
    assert load_balancing_loss([mixed], torch.tensor([[1, 1, 0, 0]]), k).item() == pytest.approx(4.0, abs=1e-3)


class SigmoidTopKRouter(torch.nn.Module):
    """A router with a different gating rule (sigmoid scores, as in DeepSeek-V3)."""

    def __init__(self):
        super().__init__()
        self.top_k, self.num_experts = 2, 4
        self.weight = torch.nn.Parameter(torch.randn(4, 8))

    def forward(self, h):
        logits = h @ self.weight.T
        scores, idx = torch.sigmoid(logits).topk(2, -1)
        return logits, scores, idx


def test_other_gating_rules_are_refused_not_replayed_wrongly():
    model = torch.nn.Sequential(SigmoidTopKRouter())
    routing = Routing(model)
    with pytest.raises(MoEError, match="not supported"):
        with routing.capture():
            model(torch.randn(5, 8))


def test_dense_models_are_refused(tiny_random):
    with pytest.raises(MoEError, match="not a Mixture-of-Experts model"):
        Routing(tiny_random, "tiny")


@pytest.mark.parametrize("arch", ["qwen3_moe", "olmoe"])
def test_sampling_routing_matches_teacher_forced_routing(arch, char_tokenizer):
    # fp32: the experts recorded token by token while sampling (KV cache) are the experts a full
    # forward pass over the same sequence picks; the never-fed last token is unrecorded (-1)
    tok = char_tokenizer
    model = tiny_moe(arch, vocab=len(tok))
    routing = Routing(model)
    prompts = [tok(p)["input_ids"] for p in ["12+7=", "999-123=", "5+5="]]
    ro = generate(model, prompts, sampling_params(tok, group_size=2, max_new_tokens=5, min_new_tokens=5),
                  generator=torch.Generator().manual_seed(0), routing=routing)
    B, S = ro.input_ids.shape
    assert ro.routing.shape == (B, S, 2, 2)
    assert (ro.routing[:, -1] == -1).all() and (ro.routing[:, :-1] >= 0).all()
    with routing.capture() as cap, torch.no_grad():
        lp = completion_logprobs(model, ro.input_ids, ro.attention_mask, ro.completion_mask)
    full = cap.indices(B, S)
    real = ro.attention_mask.bool()
    real[:, -1] = False
    assert drift(full, ro.routing, real) == 0.0
    torch.testing.assert_close(lp, ro.logp, rtol=1e-5, atol=1e-5)


def test_balance_loss_by_hand_with_the_minibatch_f():
    # two micro-batches of one token each, E = 2 experts, top-1, one layer.
    # token a: p = (0.8, 0.2) -> expert 0;  token b: p = (0.4, 0.6) -> expert 1
    # unsplit: f = (1/2, 1/2), P = ((0.8+0.4)/2, (0.2+0.6)/2) = (0.6, 0.4)
    #   loss = E · Σ f P = 2 · (0.5·0.6 + 0.5·0.4) = 1.0
    # each micro-batch alone (the old rule, added once per micro-batch): f = (1, 0), P = (0.8, 0.2)
    #   -> 2·0.8 = 1.6, and f = (0, 1), P = (0.4, 0.6) -> 2·0.6 = 1.2: 2.8 in all, not 1.0.
    # with the minibatch's f (counts (1, 1) over n = 2 tokens): a's part is 2·(0.5·0.8 + 0.5·0.2)/2
    #   = 0.5, b's is 2·(0.5·0.4 + 0.5·0.6)/2 = 0.5: they add up to the unsplit 1.0
    from gspo.models.moe import balance_loss, expert_counts

    a = torch.log(torch.tensor([[0.8, 0.2]], dtype=torch.float64))  # (1, E) logits
    b = torch.log(torch.tensor([[0.4, 0.6]], dtype=torch.float64))
    one = torch.ones(1, 1)
    assert load_balancing_loss([torch.cat([a, b])], torch.ones(1, 2), 1).item() == pytest.approx(1.0, rel=1e-12)
    counts = expert_counts([a], one, 1) + expert_counts([b], one, 1)  # (L, E) summed over micro-batches
    assert counts.tolist() == [[1.0, 1.0]]
    parts = [balance_loss([x], one, counts, 2.0, 1).item() for x in (a, b)]
    assert parts == pytest.approx([0.5, 0.5], rel=1e-12)


@pytest.mark.slow  # trains
@pytest.mark.parametrize("replay", [False, True])
def test_micro_batched_update_with_the_balance_loss_equals_one_pass(tmp_path, replay):
    # the built-in tiny MoE: one minibatch's accumulated gradient (policy loss + 0.5 ×
    # balance loss) in >= 3 micro-batches of <= 40 tokens equals the unsplit one, router weights
    # included, with and without routing replay. The balance loss is not a sum over tokens
    # (f_e · P_e), so adding it in full per micro-batch nearly doubled the router's gradient
    # (norm 0.720 -> 1.415 here, before the fix).
    # float32 (its grouped expert matmul has no float64): each tensor's gradient within 1e-5 of
    # its norm (rounding leaves <= 7e-6), metrics within 1e-5.
    import dataclasses

    from gspo.algo.aggregation import agg_count
    from gspo.config import TrainConfig
    from gspo.models.logprobs import micro_batches
    from gspo.sampling.produce import rollout, score
    from gspo.tasks.scoring import Scored
    from gspo.train.batch import prepare
    from gspo.train.resolve import resolve
    from gspo.train.run import build_run
    from gspo.train.trainer import Totals, accumulate

    cfg = resolve(TrainConfig(model="tiny-moe", prompts_per_step=4, group_size=4, max_new_tokens=6,
                              num_minibatches=1, router_aux_loss_coef=0.5, output_dir=str(tmp_path / "run"),
                              progress=False, routing_replay=replay))
    run = build_run(cfg)
    examples = run.task.train_batch(1, cfg.prompts_per_step, cfg.seed)
    ro, texts, ids, _ = rollout(run, examples, step=1)
    rewards, parts = score(run.rewards, examples, texts, ids, cfg.group_size)
    batch = prepare(run, ro, Scored(rewards=rewards, parts=parts, examples=examples, completions=texts))
    mask = batch.rollout.completion_mask  # (B, T)
    idx = torch.arange(mask.shape[0])
    total = Totals(float(agg_count(mask, cfg.loss_agg)), float(mask.sum()))

    def one_minibatch(budget):
        run.cfg = dataclasses.replace(cfg, micro_batch_tokens=budget)
        m = accumulate(run, batch, idx, total)
        g = {n: p.grad.clone() for n, p in run.policy.named_parameters() if p.grad is not None}
        run.optimizer.zero_grad(set_to_none=True)
        return m, g

    base, g0 = one_minibatch(0)
    assert len(micro_batches(ro, idx, 40)) >= 3
    m, g = one_minibatch(40)
    routers = [n for n in g0 if "router" in n or "gate.weight" in n]
    assert routers and base["moe/aux_loss"] >= 1.0 - 1e-6
    norm = [float(torch.stack([x[n].norm() for n in routers]).norm()) for x in (g0, g)]
    assert norm[1] == pytest.approx(norm[0], rel=1e-5)  # 0.720 both (1.415 split, before)
    for k in base:
        assert m[k] == pytest.approx(base[k], rel=1e-5, abs=1e-7), k
    assert g.keys() == g0.keys()
    for n in g0:
        assert float((g[n] - g0[n]).norm()) <= 1e-5 * float(g0[n].norm()), n  # float32 rounding: <= 7e-6


def test_packing_refused_for_moe_says_so_once(tmp_path):
    # routing is recorded in the padded layout: an MoE model trains padded, and the run says so
    from gspo.config import TrainConfig
    from gspo.train.resolve import resolve
    from gspo.train.run import build_run

    run = build_run(resolve(TrainConfig(model="tiny-moe", packing=True, micro_batch_tokens=40,
                                        output_dir=str(tmp_path / "run"), progress=False)))
    assert not run.packed
    assert [n for n in run.notes if "--packing" in n] == [
        "--packing: off for this MoE model (its routing is recorded in the padded layout); micro-batches are padded"]


@pytest.mark.slow
def test_balance_loss_over_processes_and_micro_batches_matches_one_process(tmp_path):
    # 2 processes (DDP) in micro-batches of <= 40 tokens vs 1 process unsplit, tiny MoE with the
    # balance loss: the expert counts are summed over micro-batches and processes, so every
    # metric and weight agree (before: per-process, per-micro-batch f made step 1's grad_norm
    # 0.89 against 0.49, moe/aux_loss 2.300 against 2.234)
    from tests.test_distributed import (
        ARGS,
        assert_same_metrics,
        assert_same_weights,
        metrics,
        one_process,
        torchrun,
        weights,
    )

    args = [*ARGS, "--model", "tiny-moe", "--steps", "2", "--old-logp", "recompute", "--save-every", "0",
            "--router-aux-loss-coef", "0.5"]
    r1 = one_process(*args, "--output-dir", str(tmp_path / "one"))
    assert r1.returncode == 0, r1.stderr[-3000:]
    r2 = torchrun(*args, "--micro-batch-tokens", "40", "--parallel", "ddp", "--output-dir", str(tmp_path / "two"))
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert_same_metrics(metrics(tmp_path / "one"), metrics(tmp_path / "two"))
    assert_same_weights(weights(tmp_path / "one"), weights(tmp_path / "two"))
