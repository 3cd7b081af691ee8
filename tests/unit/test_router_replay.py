"""Router replay's parts apart from the engine: an answer's routing over its segments and through a checkpoint
(rl/routing.py), its layout in a micro-batch (trainer/batching.py), and the replayed router
(trainer/router_replay.py) against transformers' own, on a tiny Qwen3-MoE."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from colocate.rl.routing import decode, encode, extend, sequence_routing
from colocate.rl.samples import Sequence
from colocate.trainer.batching import collate
from colocate.trainer.router_replay import RouterReplay


def rows(n: int, start: int = 0) -> np.ndarray:
    return (np.arange(start, start + n * 4).reshape(n, 2, 2) % 8).astype(np.uint16)


def test_a_continuation_adds_only_the_positions_the_answer_lacks():
    first = rows(5)
    again = rows(9, start=100)  # a continuation re-ran positions 0..4 (other rows: the new weights') and 5..8
    both = extend(first, again)
    assert np.array_equal(both[:5], first) and np.array_equal(both[5:], again[5:])
    assert extend(both, rows(3)) is both  # nothing new
    assert extend(None, first) is not None and extend(first, None) is first


def test_routing_survives_a_checkpoints_json():
    state = json.loads(json.dumps(encode(rows(7))))
    assert np.array_equal(decode(state), rows(7)) and decode(state).dtype == np.uint16
    assert encode(None) is None and decode(None) is None


def test_a_sequence_routes_freely_where_the_engine_gave_no_row():
    out = sequence_routing(rows(4), 5, 2, 2)
    assert np.array_equal(out[:4], rows(4)) and (out[4] == -1).all()
    with pytest.raises(AssertionError, match="the model routes"):
        sequence_routing(rows(4), 5, 3, 2)


@pytest.mark.parametrize("packed", [False, True])
def test_a_micro_batch_lays_each_sequences_routing_under_its_tokens(packed):
    a = Sequence([5, 6], [7, 8, 9], [-1.0] * 3, 1.0, routing=rows(4))
    b = Sequence([5], [7], [-1.0], 1.0)  # no routing: routes freely
    batch = collate([a, b], pad_id=0, device=torch.device("cpu"), packed=packed)
    assert batch.routing.shape == (*batch.input_ids.shape, 2, 2)
    got_a = batch.routing[0, :5]
    got_b = batch.routing[0, 5:7] if packed else batch.routing[1, :2]
    assert torch.equal(got_a[:4], torch.from_numpy(rows(4)).long()) and (got_a[4] == -1).all()
    assert (got_b == -1).all()
    if not packed:
        assert (batch.routing[1, 2:] == -1).all()  # padding
    assert collate([b], pad_id=0, device=torch.device("cpu")).routing is None


def tiny_moe(seed: int = 0):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(vocab_size=32, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
    model = Qwen3MoeForCausalLM(config).float()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return model


def test_replaying_the_models_own_choice_is_the_model_bit_for_bit():
    model, ids = tiny_moe(), torch.randint(0, 32, (2, 6))
    expected = model(input_ids=ids).logits
    expected.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    replay = RouterReplay(model)
    replay.record(True)
    with torch.no_grad():
        model(input_ids=ids)
    own, _ = replay.recorded(2, 6)
    replay.set(own.long())
    got = model(input_ids=ids).logits
    got.sum().backward()
    assert torch.equal(got, expected)
    for name, p in model.named_parameters():  # the routers' weights learn from the replayed probabilities alike
        assert torch.equal(p.grad, grads[name]), name


def test_replayed_experts_are_used_and_minus_one_routes_freely():
    model, ids = tiny_moe(), torch.randint(0, 32, (1, 5))
    replay = RouterReplay(model)
    forced = torch.full((1, 5, 2, 2), -1, dtype=torch.long)
    forced[0, :3, 0] = torch.tensor([[6, 7], [7, 6], [0, 6]])  # layer 0, the first three tokens
    replay.record(True)
    replay.set(forced)
    model(input_ids=ids).logits.sum().backward()
    own, used = replay.recorded(1, 5)
    assert torch.equal(used[0, :3, 0], forced[0, :3, 0])
    assert torch.equal(used[0, 3:, 0], own[0, 3:, 0]) and torch.equal(used[0, :, 1], own[0, :, 1])
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0  # the router still learns


def test_a_router_colocate_does_not_replay_is_refused():
    class MixtralTopKRouter(torch.nn.Module):
        pass

    model = tiny_moe()
    model.model.layers[0].mlp.gate = MixtralTopKRouter()
    with pytest.raises(ValueError, match="algo.router_replay: colocate replays Qwen3MoeTopKRouter, not Mixtral"):
        RouterReplay(model)


def test_the_flips_are_the_positions_routed_against_the_trainers_choice():
    model, ids = tiny_moe(), torch.randint(0, 32, (1, 4))
    replay = RouterReplay(model)
    replay.record(True)
    with torch.no_grad():
        model(input_ids=ids)
    own, _ = replay.recorded(1, 4)
    forced = own.long().clone()
    forced[0, 1, 1] = forced[0, 1, 1].flip(-1)  # the same experts in the other order: no flip
    others = torch.tensor([e for e in range(8) if e not in own[0, 2, 0].tolist()][:2])
    forced[0, 2, 0] = others  # another expert set in layer 0: a flip
    replay.set(forced)
    with torch.no_grad():
        model(input_ids=ids)
    flipped = replay.flipped(1, 4)[0].tolist()
    # positions 0 and 1 come before the change (causal) and keep their experts; position 3 may flip in layer 1
    assert flipped[:3] == [False, False, True], flipped
    replay.set(None)
    assert not replay.flipped(1, 4).any()
