"""Lossless weight deltas (sync/delta.py): a delta applied to the previous bits gives the current bits exactly,
fuzzed over masks from empty to full, clustered and scattered, gaps past the one-byte range, and the bits a
value comparison would miss (-0.0, NaN payloads)."""

from __future__ import annotations

import pytest
import torch

from colocate.sync.delta import apply, bits, changed, decode, encode


def masked_change(previous: torch.Tensor, mask: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(previous.shape, generator=g).to(previous.dtype)
    current = previous.clone()
    current[mask] = previous[mask] + noise[mask] * 0.01 + 1e-3
    return current


MASKS = {
    "empty": lambda n, g: torch.zeros(n, dtype=torch.bool),
    "full": lambda n, g: torch.ones(n, dtype=torch.bool),
    "sparse": lambda n, g: torch.rand(n, generator=g) < 0.01,
    "dense": lambda n, g: torch.rand(n, generator=g) < 0.6,
    "first_and_last": lambda n, g: torch.tensor([i in (0, n - 1) for i in range(n)]),
    "far_apart": lambda n, g: torch.arange(n) % 1000 == 999,  # every gap past 255: the 4-byte path
    "clustered": lambda n, g: (torch.arange(n) // 64) % 7 == 3,
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("kind", sorted(MASKS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_delta_reproduces_the_current_bits(dtype, kind, seed):
    g = torch.Generator().manual_seed(seed)
    n = 5000 + 37 * seed
    previous = (torch.randn(n, generator=g) * 0.02).to(dtype)
    mask = MASKS[kind](n, g)
    current = masked_change(previous, mask, seed)
    delta = encode(previous, current)
    target = previous.clone()
    apply(target, delta, current)
    assert torch.equal(bits(target), bits(current))
    assert delta.count == int((bits(previous) != bits(current)).sum())
    if not delta.full and delta.count:
        positions, _ = decode(delta)
        assert positions.tolist() == changed(previous, current).tolist()
    if kind == "empty":
        assert delta.count == 0 and delta.nbytes < 16 and not delta.full
    assert delta.nbytes <= n * previous.element_size()  # never more than the tensor whole
    if kind == "full":  # every element changed: whole, or compressed below the whole
        assert delta.full or delta.compressed
        assert encode(previous, current, compress=False).full


def test_bits_not_values_decide_what_changed():
    previous = torch.tensor([0.0, float("nan"), 1.0, 2.0], dtype=torch.float32)
    current = previous.clone()
    current[0] = -0.0  # equal as a value
    bits(current)[1] = bits(previous)[1] + 1  # another NaN payload
    delta = encode(previous, current)
    assert delta.count == 2 and changed(previous, current).tolist() == [0, 1]
    target = previous.clone()
    apply(target, delta)
    assert torch.equal(bits(target), bits(current))


def test_a_sparse_bf16_change_costs_about_three_bytes_a_weight():
    g = torch.Generator().manual_seed(0)
    n = 1_000_000
    previous = (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16)
    current = masked_change(previous, torch.rand(n, generator=g) < 0.02, 0)
    delta = encode(previous, current, compress=False)
    assert 0.015 < delta.density < 0.025
    assert delta.nbytes / delta.count < 3.2  # a one-byte gap and the 2-byte element, mostly
    assert delta.nbytes < 0.04 * n * 2  # under 4% of the tensor's bytes at 2% density


def test_bench_delta_classes_each_tensor_and_counts_every_encoding():
    from colocate.bench.delta import kind_of, measure_step

    assert [kind_of(n) for n in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.input_layernorm.weight",
                                 "model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight",
                                 "model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.gate.weight")] == \
        ["embeddings", "lm_head", "norms", "attention", "mlp", "experts", "router"]
    g = torch.Generator().manual_seed(0)
    previous = {"model.layers.0.self_attn.q_proj.weight": (torch.randn(100, 100, generator=g) * 0.02).bfloat16(),
                "model.norm.weight": torch.ones(100, dtype=torch.bfloat16)}
    current = {k: v.clone() for k, v in previous.items()}
    current["model.layers.0.self_attn.q_proj.weight"].view(-1)[::50] += 0.01  # 200 of 10,000
    row = measure_step(previous, current)
    attention, total = row["kinds"]["attention"], row["total"]
    assert attention["changed"] == int((bits(previous["model.layers.0.self_attn.q_proj.weight"])
                                        != bits(current["model.layers.0.self_attn.q_proj.weight"])).sum())
    assert row["kinds"]["norms"]["changed"] == 0 and total["numel"] == 10_100
    assert attention["index_bytes"] == attention["changed"] * 6  # a 4-byte index and a bf16 element each
    assert attention["gap_bytes"] < attention["index_bytes"] and total["sent_share"] <= total["gap_share"]
    assert total["density"] == pytest.approx(attention["changed"] / 10_100)
