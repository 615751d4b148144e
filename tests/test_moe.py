"""MoE: equal to transformers' Kimi Linear / DeepSeek-V3 MoE and to a per-token loop; balancing."""

import pytest
import torch
from torch import nn

from gpt2kimi.accounting import moe_param_count
from gpt2kimi.backbone import BackboneConfig, LanguageModel, count_parameters
from gpt2kimi.configs import MoEConfig
from gpt2kimi.moe import (
    AuxLossWrapper,
    MoE,
    dense_equivalent,
    load_balancing_loss,
    moe_ffn,
    moe_reference,
    route,
)

transformers = pytest.importorskip("transformers")

# group-limited routing, a scaling factor and two shared experts: every option at once
GROUPED = dict(
    d_model=32,
    n_experts=16,
    top_k=4,
    expert_hidden=24,
    n_shared_experts=2,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
)


def random_moe(seed: int = 0, dtype=torch.float64, **overrides) -> MoE:
    """An MoE with random weights everywhere, a non-zero correction bias included."""
    torch.manual_seed(seed)
    moe = MoE(MoEConfig(**{**GROUPED, **overrides})).to(dtype)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.3)
        moe.gate.e_score_correction_bias.normal_(0.0, 0.1)
    return moe


def kimi_linear_moe(cfg: MoEConfig):
    from transformers import KimiLinearConfig
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearMoE

    hf_config = KimiLinearConfig(
        vocab_size=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        hidden_size=cfg.d_model,
        moe_intermediate_size=cfg.expert_hidden,
        num_experts=cfg.n_experts,
        num_experts_per_token=cfg.top_k,
        num_shared_experts=cfg.n_shared_experts,
        num_expert_group=cfg.n_group,
        topk_group=cfg.topk_group,
        routed_scaling_factor=cfg.routed_scaling_factor,
        moe_renormalize=cfg.norm_topk_prob,
    )
    return hf_config, KimiLinearMoE(hf_config)


def deepseek_v3_moe(cfg: MoEConfig):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    hf_config = DeepseekV3Config(
        vocab_size=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        hidden_size=cfg.d_model,
        moe_intermediate_size=cfg.expert_hidden,
        n_routed_experts=cfg.n_experts,
        num_experts_per_tok=cfg.top_k,
        n_shared_experts=cfg.n_shared_experts,
        n_group=cfg.n_group,
        topk_group=cfg.topk_group,
        routed_scaling_factor=cfg.routed_scaling_factor,
        norm_topk_prob=cfg.norm_topk_prob,
    )
    return hf_config, DeepseekV3MoE(hf_config)


@pytest.mark.parametrize("build", [kimi_linear_moe, deepseek_v3_moe])
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_equal_to_transformers_on_the_same_weights(build, norm_topk_prob):
    moe = random_moe(norm_topk_prob=norm_topk_prob)
    hf_config, hf_moe = build(moe.config)
    assert MoEConfig.from_hf(hf_config) == moe.config
    hf_moe = hf_moe.to(torch.float64)
    missing = hf_moe.load_state_dict(moe.state_dict(), strict=True)
    assert not missing.missing_keys and not missing.unexpected_keys
    assert set(hf_moe.state_dict()) == set(moe.state_dict())  # same names, same shapes
    x = torch.randn(3, 11, moe.config.d_model, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(moe(x), hf_moe(x), rtol=1e-10, atol=1e-10)
        # and the router agrees on the choice and the weights
        _, hf_weights, hf_experts = hf_moe.gate(x)
    routing = moe.gate(x.reshape(-1, moe.config.d_model))
    order, hf_order = routing.experts.sort(dim=-1), hf_experts.sort(dim=-1)
    assert torch.equal(order.values, hf_order.values)
    torch.testing.assert_close(
        routing.weights.gather(1, order.indices), hf_weights.gather(1, hf_order.indices)
    )


def test_loads_the_state_dict_of_transformers_as_is():
    cfg = MoEConfig(**GROUPED)
    _, hf_moe = kimi_linear_moe(cfg)
    with torch.no_grad():
        for p in hf_moe.parameters():
            p.normal_(0.0, 0.3)
        hf_moe.gate.e_score_correction_bias.normal_(0.0, 0.1)
    moe = MoE(cfg)
    moe.load_state_dict(hf_moe.state_dict())
    x = torch.randn(2, 9, cfg.d_model)
    with torch.no_grad():
        torch.testing.assert_close(moe(x), hf_moe(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        dict(router="softmax", n_group=1, topk_group=1, routed_scaling_factor=1.0),
        dict(n_shared_experts=0, top_k=1, n_group=1, topk_group=1),
        dict(norm_topk_prob=False, n_experts=8, top_k=8, n_group=1, topk_group=1),
    ],
)
def test_dispatch_equals_the_per_token_loop(overrides):
    moe = random_moe(**overrides)
    x = torch.randn(2, 13, moe.config.d_model, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(moe(x), moe_reference(moe, x), rtol=1e-12, atol=1e-12)


def test_bf16_autocast_runs_and_stays_close_to_fp32():
    """Under torch.autocast the experts compute in bf16 and the outputs accumulate in x's
    dtype (index_add_ of a bf16 expert output into an fp32 buffer used to raise)."""
    moe = random_moe().float()
    x = torch.randn(2, 13, moe.config.d_model)
    with torch.no_grad():
        expected = moe(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = moe(x)
    assert y.dtype == x.dtype
    torch.testing.assert_close(y, expected, atol=0.1, rtol=0.05)  # bf16 has 8 bits of mantissa


def test_experts_without_tokens_are_skipped_and_empty_input_works():
    moe = random_moe(n_experts=64, top_k=2, n_group=1, topk_group=1)
    x = torch.randn(1, 3, moe.config.d_model, dtype=torch.float64)  # 6 copies, 64 experts
    with torch.no_grad():
        y = moe(x)
        assert (moe.last_routing.tokens_per_expert == 0).sum() >= 58
        torch.testing.assert_close(y, moe_reference(moe, x))
        assert moe(x[:, :0]).shape == (1, 0, moe.config.d_model)


def test_a_tokens_output_depends_only_on_that_token():
    moe = random_moe()
    x = torch.randn(2, 10, moe.config.d_model, dtype=torch.float64)
    with torch.no_grad():
        y = moe(x)
        x2 = x.clone()
        x2[1, 4] += 1.0
        y2 = moe(x2)
        assert not torch.allclose(y2[1, 4], y[1, 4])
        # other tokens move by rounding at most (their expert's slice has another row count)
        changed = (y2 - y).abs().amax(dim=-1) > 1e-12
        assert changed.sum() == 1 and changed[1, 4]
        # the same token alone gives the same output as inside the batch (up to the rounding of
        # the fp32 router, whose matrix product sees another batch size)
        torch.testing.assert_close(moe(x[1:2, 4:5])[0, 0], y[1, 4], rtol=1e-5, atol=1e-5)


def test_gradients_reach_every_chosen_expert_and_the_router():
    moe = random_moe(n_group=1, topk_group=1)
    x = torch.randn(1, 5, moe.config.d_model, dtype=torch.float64)
    moe(x).square().sum().backward()
    chosen = set(moe.last_routing.experts.flatten().tolist())
    gate_up, down = moe.experts.gate_up_proj.grad, moe.experts.down_proj.grad
    for e in range(moe.config.n_experts):
        hit = gate_up[e].abs().sum() > 0 and down[e].abs().sum() > 0
        assert hit == (e in chosen)  # chosen experts learn, the others get exactly zero
    assert moe.gate.weight.grad.abs().sum() > 0  # through the weights of the chosen experts
    assert moe.shared_experts.down_proj.weight.grad.abs().sum() > 0


def test_the_bias_selects_but_never_weights():
    moe = random_moe(n_group=1, topk_group=1, n_experts=8, top_k=2)
    x = torch.randn(200, moe.config.d_model, dtype=torch.float64)
    a = route(x, moe.gate.weight, torch.zeros(8, dtype=torch.float64), moe.config)
    bias = torch.zeros(8, dtype=torch.float64)
    bias[3] = 0.05
    b = route(x, moe.gate.weight, bias, moe.config)
    same = (a.experts.sort(-1).values == b.experts.sort(-1).values).all(-1)
    assert 0 < same.sum() < 200  # a small bias changes some choices, not all
    sa, sb = a.experts.sort(-1), b.experts.sort(-1)
    wa, wb = a.weights.gather(1, sa.indices), b.weights.gather(1, sb.indices)
    torch.testing.assert_close(wa[same], wb[same], rtol=0, atol=0)  # same choice, same weights
    torch.testing.assert_close(a.scores, b.scores, rtol=0, atol=0)  # scores ignore the bias
    assert b.tokens_per_expert[3] > a.tokens_per_expert[3]  # a higher bias draws more tokens


def test_bias_update_moves_load_towards_balance_without_touching_weights():
    torch.manual_seed(0)
    moe = random_moe(n_group=1, topk_group=1, n_experts=8, top_k=2, dtype=torch.float32)
    with torch.no_grad():
        moe.gate.weight[0] += 0.3  # expert 0 scores high on inputs with a positive mean
        moe.gate.e_score_correction_bias.zero_()
    x = torch.randn(1, 512, moe.config.d_model) + 1.0
    params = {k: v.clone() for k, v in moe.named_parameters()}
    moe.train()

    def imbalance():
        load = moe.last_routing.tokens_per_expert.float()
        return (load.max() / load.mean()).item()

    with torch.no_grad():
        moe(x)
        before = imbalance()
        for _ in range(100):
            moe.update_bias(0.01)
            moe(x)
    after = imbalance()
    assert after < before - 0.5 and after < 1.5
    for k, v in moe.named_parameters():
        assert torch.equal(v, params[k])  # a bias update is not a gradient step
    assert moe.load.sum() == 512 * 2  # only the last pass is counted since the last update


def test_switch_loss_is_one_when_balanced_and_larger_when_not():
    E, N, k = 4, 8, 1
    from gpt2kimi.moe import Routing

    uniform = Routing(
        experts=torch.arange(N).remainder(E)[:, None],
        weights=torch.ones(N, k),
        scores=torch.full((N, E), 0.5),
        tokens_per_expert=torch.full((E,), N // E),
    )
    assert load_balancing_loss(uniform).item() == pytest.approx(1.0)
    scores = torch.full((N, E), 0.1)
    scores[:, 0] = 0.9
    collapsed = Routing(
        experts=torch.zeros(N, k, dtype=torch.long),
        weights=torch.ones(N, k),
        scores=scores,
        tokens_per_expert=torch.tensor([N, 0, 0, 0]),
    )
    # f = (1, 0, 0, 0), P_0 = 0.9 / 1.2 = 0.75: E · f_0 · P_0 = 3
    assert load_balancing_loss(collapsed).item() == pytest.approx(3.0)


def test_aux_loss_gradient_pushes_probability_away_from_the_crowded_expert():
    moe = random_moe(n_group=1, topk_group=1, n_experts=4, top_k=1, dtype=torch.float32)
    x = torch.randn(64, moe.config.d_model)
    moe(x)
    busiest = moe.last_routing.tokens_per_expert.argmax()
    moe.aux_loss().backward()
    # descending the loss lowers the busiest expert's router scores on average
    step = -moe.gate.weight.grad
    with torch.no_grad():
        before = torch.sigmoid(x @ moe.gate.weight.T)[:, busiest].mean()
        after = torch.sigmoid(x @ (moe.gate.weight + 0.1 * step).T)[:, busiest].mean()
    assert after < before


def test_wrapper_adds_aux_loss_in_training_and_updates_the_bias_once_per_step():
    torch.manual_seed(0)
    cfg = MoEConfig(d_model=16, n_experts=4, top_k=2, expert_hidden=8, n_shared_experts=1)
    model = LanguageModel(
        BackboneConfig(vocab_size=32, d_model=16, n_layer=2, n_head=2),
        mixer=lambda d, h: nn.Identity(),
        ffn=lambda d: MoE(cfg),
    )
    x = torch.randint(0, 32, (2, 12))
    plain = AuxLossWrapper(model, aux_alpha=0.0)
    _, loss = plain(x, x)
    wrapped = AuxLossWrapper(model, aux_alpha=0.1, bias_gamma=0.01)
    _, loss_aux = wrapped(x, x)
    aux = torch.stack([m.aux_loss() for m in wrapped.layers]).mean()
    torch.testing.assert_close(loss_aux, loss + 0.1 * aux)
    assert len(wrapped.load_history) == 1 and len(wrapped.load_history[0]) == 2
    bias = wrapped.layers[0].gate.e_score_correction_bias
    assert bias.abs().sum() == 0  # nothing to update before the first step
    wrapped(x, x)
    assert bias.abs().sum() > 0  # updated from the first step's load
    wrapped.eval()
    _, val_loss = wrapped(x, x)
    assert len(wrapped.load_history) == 2  # evaluation is not a training step
    with pytest.raises(ValueError, match="no MoE layer"):
        AuxLossWrapper(nn.Linear(2, 2))


def test_dense_equivalent_has_the_active_parameters_and_counts_match_the_module():
    cfg = MoEConfig(**GROUPED)
    moe = MoE(cfg)
    counts = moe_param_count(cfg)
    assert counts.total == count_parameters(moe)
    dense = dense_equivalent(cfg)
    router = cfg.n_experts * cfg.d_model
    assert count_parameters(dense) == counts.active - router
    assert dense.hidden == (cfg.top_k + cfg.n_shared_experts) * cfg.expert_hidden


def test_wrong_width_is_rejected():
    moe = MoE(MoEConfig(**GROUPED))
    with pytest.raises(ValueError, match="d_model=32"):
        moe(torch.randn(2, 3, 31))


def test_moe_ffn_in_the_backbone_through_the_zoo():
    from gpt2kimi.experiments.registry import FFNS, build_model

    assert FFNS["moe"] is moe_ffn
    torch.manual_seed(0)
    model = build_model("softmax", BackboneConfig(vocab_size=32, d_model=16, n_head=2), ffn="moe")
    layers = [block.ffn for block in model.blocks]
    assert all(isinstance(m, MoE) for m in layers)
    assert (layers[0].config.n_experts, layers[0].config.top_k) == (8, 2)
    idx = torch.randint(0, 32, (2, 10))
    _, loss = model(idx, idx)
    loss.backward()
    assert layers[0].experts.gate_up_proj.grad.abs().sum() > 0


def test_a_few_tokens_take_one_expert_call_per_pair_and_equal_the_dispatch(monkeypatch):
    """Fewer (token, expert) pairs than experts go through dispatch_pairs; a decoded batch (at
    most DECODE_TOKENS tokens, no autograd) with as many pairs as experts or more through
    dispatch_all; anything larger, or with autograd, through dispatch. All equal the sorted
    dispatch and the per-token definition."""
    import gpt2kimi.moe as moe_module
    from gpt2kimi.backbone import DECODE_TOKENS

    torch.manual_seed(0)
    config = MoEConfig(d_model=32, n_experts=16, top_k=2, expert_hidden=24, n_shared_experts=1)
    layer = MoE(config).double().eval()
    calls = []
    for name in ("dispatch", "dispatch_pairs", "dispatch_all"):
        original = getattr(moe_module, name)

        def spy(*args, original=original, name=name):
            calls.append(name)
            return original(*args)

        monkeypatch.setattr(moe_module, name, spy)
    experts = layer.experts
    weights = (experts.gate_up_proj, experts.down_proj)
    with torch.no_grad():
        for shape, path in [((1, 3, 32), "dispatch_pairs"),  # 6 pairs < 16 experts
                            ((2, 4, 32), "dispatch_all"),  # 16 pairs, 8 tokens: a decoded batch
                            ((1, DECODE_TOKENS + 1, 32), "dispatch")]:
            x = torch.randn(*shape, dtype=torch.float64)
            calls.clear()
            y = layer(x)
            assert calls == [path]
            torch.testing.assert_close(y, moe_reference(layer, x), atol=1e-12, rtol=1e-12)
            flat = x.reshape(-1, 32)
            routing = layer.gate(flat)
            if path != "dispatch":
                torch.testing.assert_close(getattr(moe_module, path)(flat, routing, *weights),
                                           moe_module.dispatch(flat, routing, *weights),
                                           atol=1e-12, rtol=1e-12)
    calls.clear()
    layer(torch.randn(2, 4, 32, dtype=torch.float64))  # with autograd: never the decode path
    assert calls == ["dispatch"]
