"""The co-located runtime on the real stack: generation with logprobs, weight sync verified bit for bit against
vLLM's TP layout, sleep/wake that frees memory and gives identical generations, the switching order; the driver
sets the job up once, however many controllers run on it."""

from __future__ import annotations

import pytest
import ray
import torch

from colocate.job.controller import Controller
from colocate.job.runtime import Runtime
from colocate.sync.tp_layout import TPLayout, engine_tensor
from tests.e2e.conftest import assert_nothing_left, colocate_processes, shm_segments, small_job
from tests.unit.test_setup import count_set_up

pytestmark = pytest.mark.e2e

PROMPTS = [[5, 6, 7, 16], [8, 9, 16]]
SAMPLING = {"n": 3, "temperature": 1.0, "top_p": 1.0, "max_tokens": 5, "seed": 1234}


@pytest.fixture(scope="module")
def set_up_calls():
    """Every call in this process, the module's tests through, of what sets a job up (tests/unit/test_setup.py)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        yield count_set_up(monkeypatch)


@pytest.fixture(scope="module")
def runtime(tmp_path_factory, set_up_calls):
    before = (colocate_processes(), shm_segments())
    with Runtime(small_job(tmp_path_factory.mktemp("job"))) as rt:
        yield rt
    assert_nothing_left(*before)


def hf_config(rt):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(rt.model_path)


def assert_engine_equals_trainer(rt) -> None:
    assert rt.sync.verify_full(rt.cfg.engine.dtype) == []


def test_generation_returns_sampled_token_logprobs(runtime):
    results = ray.get(runtime.engines[0].generate.remote(PROMPTS, SAMPLING))
    assert len(results) == 2 and all(len(group) == 3 for group in results)
    for completion in results[0]:
        assert len(completion["logprobs"]) == len(completion["token_ids"]) > 0
        assert all(lp <= 0 for lp in completion["logprobs"])


def test_plan_matches_vllm_layout_for_tp2(runtime):
    """The reshard plan reproduces the shape of every parameter of each real TP worker (fused qkv and gate_up,
    row-parallel o/down, vocabulary-padded embeddings and lm_head)."""
    trainer_state = ray.get([t.full_state_dict.remote("bfloat16") for t in runtime.trainers])[0]
    layouts = ray.get(runtime.engines[0].param_layouts.remote())
    assert sorted(layout["tp_rank"] for layout in layouts) == [0, 1]
    for layout in layouts:
        tp = TPLayout.from_hf_config(hf_config(runtime), tp_rank=layout["tp_rank"], tp_size=layout["tp_size"])
        for name, shape, _ in layout["params"]:
            expected = engine_tensor(name, trainer_state, tp)
            if name.endswith(("embed_tokens.weight", "lm_head.weight")):
                assert shape[1:] == expected.shape[1:] and shape[0] >= expected.shape[0], name
            else:
                assert tuple(expected.shape) == shape, name


def test_every_sync_makes_each_worker_equal_to_the_trainer(runtime):
    controller = Controller(runtime.cfg, runtime)
    initial = ray.get(runtime.engines[0].state_dicts.remote())[0]
    for step in range(2):
        record = controller.step(step)
        assert record["sync_bytes"] > 0
        assert_engine_equals_trainer(runtime)
    after = ray.get(runtime.engines[0].state_dicts.remote())[0]
    assert any(not torch.equal(initial[n], after[n]) for n in initial), "training changed no engine weight"


def test_the_sync_benchs_replay_of_the_writes_covers_every_engine_byte_and_leaves_the_engine_synced(runtime):
    """`colocate bench sync`'s breakdown (TrainerActor.profile_sync_write): the ranks replay their in-place copies
    at once, as in a sync; between them they write each engine weight byte once, and the engine still holds
    exactly the trainer's weights."""
    runtime.sync.run()
    profiles = ray.get([t.profile_sync_write.remote(runtime.sync.key, repeats=2) for t in runtime.trainers])
    worker_bytes = sum(w["weight_bytes"] for w in ray.get(runtime.engines[0].memory.remote()))
    written = sum(p["contiguous_bytes"] + p["strided_bytes"] for p in profiles)
    assert runtime.sync.plan.in_place and 0.9 * worker_bytes <= written <= worker_bytes  # less vocab padding
    assert all(p["num_strided_copies"] > 0 and p["strided_s"] > 0 for p in profiles)  # o_proj, down_proj
    assert_engine_equals_trainer(runtime)


def test_switching_order_never_holds_both_sides(runtime):
    controller = Controller(runtime.cfg, runtime)
    controller.step(0)
    assert list(controller.events) == [
        "rollout", "score",
        "engine.sleep", "trainer.onload",          # engine memory released before the trainer needs its own
        "train", "trainer.release_grads",          # gradients gone before the engine's weights come back
        "engine.wake.weights", "sync", "trainer.offload",
        "engine.wake.kv_cache",                    # the KV cache returns last, after the trainer offloaded
    ]


def test_sleep_frees_weights_and_kv_cache_and_wake_generates_identically(runtime):
    # A fresh engine holds its whole KV cache resident (vLLM zero-fills it); after a wake, pages come back only as
    # rollouts touch them, so only a first sleep shows the full drop.
    runtime.restart_engines()
    runtime.sync.run()  # the fresh engine loaded the checkpoint; give it the trainer's current weights
    engine = runtime.engines[0]
    before = ray.get(engine.generate.remote(PROMPTS, SAMPLING))
    awake = ray.get(engine.memory.remote())
    ray.get(engine.sleep.remote(2))
    asleep = ray.get(engine.memory.remote())
    for worker_awake, worker_asleep in zip(awake, asleep):
        held = worker_awake["weight_bytes"] + worker_awake["kv_cache_bytes"]
        dropped = worker_awake["rss_bytes"] - worker_asleep["rss_bytes"]
        # Small tensors go back to the allocator's free lists rather than the OS: allow 2% of what is held.
        assert dropped >= 0.98 * held, (dropped, held)
    ray.get(engine.wake.remote(["weights"]))
    runtime.sync.run()  # level 2 discarded the weights: the sync brings them back
    ray.get(engine.wake.remote(["kv_cache"]))
    assert ray.get(engine.generate.remote(PROMPTS, SAMPLING)) == before


def test_level1_sleep_keeps_weights_without_a_sync(runtime):
    engine = runtime.engines[0]
    before = ray.get(engine.generate.remote(PROMPTS, SAMPLING))
    ray.get(engine.sleep.remote(1))
    ray.get(engine.wake.remote(["weights", "kv_cache"]))
    assert ray.get(engine.generate.remote(PROMPTS, SAMPLING)) == before


def test_sync_uses_the_reshard_plan_and_the_full_tensor_path_stays_correct(runtime):
    from colocate.sync.weight_sync import WeightSync

    assert runtime.sync.plan.mode == "sliced"
    specs = ray.get(runtime.trainers[0].param_specs.remote(runtime.cfg.engine.dtype))
    full = WeightSync(runtime.trainers, runtime.engines, specs, cfg=runtime.cfg.sync, hf_config=hf_config(runtime),
                      sliced=False)
    assert full.open().mode == "full"
    full.run()
    assert full.verify_full(runtime.cfg.engine.dtype) == []
    runtime.sync.open()  # back to the sliced plan for the tests after this one


def test_the_gather_protocol_is_bit_exact_after_every_sync(runtime):
    """The CUDA path's protocol on gloo and shared memory: each rank all-gathers every layer and feeds only the TP
    worker on its own slot (pairs read back from the actors), through that worker's own ring."""
    from colocate.sync.weight_sync import WeightSync

    assert runtime.pairs == [(0, 0), (0, 1)]
    specs = ray.get(runtime.trainers[0].param_specs.remote(runtime.cfg.engine.dtype))
    gather = WeightSync(runtime.trainers, runtime.engines, specs, cfg=runtime.cfg.sync, hf_config=hf_config(runtime),
                        method="gather", pairs=runtime.pairs)
    assert gather.open().mode == "sliced" and gather.plan.ring_bytes > 0
    controller = Controller(runtime.cfg, runtime)
    for step in range(2):
        controller.step(step)  # trains, then syncs in place (the runtime's own sync)
        ray.get(runtime.engines[0].sleep.remote(2))  # zeros: the gather sync alone must restore every byte
        ray.get(runtime.engines[0].wake.remote(["weights"]))
        stats = gather.run()
        ray.get(runtime.engines[0].wake.remote(["kv_cache"]))
        assert stats["sync_method"] == "gather" and stats["sync_buckets"] == len(gather.plan.buckets)
        assert_engine_equals_trainer(runtime)


def test_restarted_engine_gets_a_fresh_plan(runtime):
    old_plan = runtime.sync.plan
    runtime.restart_engines()
    assert runtime.sync.plan is not old_plan
    Controller(runtime.cfg, runtime).step(0)
    assert_engine_equals_trainer(runtime)


def test_an_in_place_sync_whose_arena_was_replaced_fails_loudly(runtime):
    """A second in-place sync shares the weights again (a new arena); the first one's plan now addresses the old
    segment, and it must say so instead of writing where the engine no longer reads."""
    from colocate.sync.weight_sync import WeightSync

    assert runtime.sync.plan.in_place
    specs = ray.get(runtime.trainers[0].param_specs.remote(runtime.cfg.engine.dtype))
    second = WeightSync(runtime.trainers, runtime.engines, specs, cfg=runtime.cfg.sync, hf_config=hf_config(runtime),
                        method="in_place")
    second.open()
    second.run()
    with pytest.raises(ray.exceptions.RayTaskError, match="a later sync replaced"):
        runtime.sync.run()
    runtime.sync.open()  # the runtime's own sync again, for the tests after this one
    runtime.sync.run()
    assert_engine_equals_trainer(runtime)


def test_a_corrupted_ring_slot_fails_the_sync_naming_the_tensor_and_loads_nothing_of_it(runtime):
    """Through the ring, a byte of one slot flipped after the trainer checksummed it (a test hook in the trainer
    ranks, through Ray's __ray_call__) fails the sync with the tensor's name; the engine worker keeps that
    tensor as it was."""
    from colocate.sync.weight_sync import WeightSync

    specs = ray.get(runtime.trainers[0].param_specs.remote(runtime.cfg.engine.dtype))
    ring = WeightSync(runtime.trainers, runtime.engines, specs, cfg=runtime.cfg.sync, hf_config=hf_config(runtime),
                      method="ring")
    plan = ring.open()
    assert not plan.in_place and plan.mode == "sliced"
    name = "model.layers.0.self_attn.qkv_proj.weight"
    index = next(b.index for b in plan.buckets if any(r.engine_name == name for r in b.regions[1]))
    (region,) = [r for r in plan.buckets[index].regions[1] if r.engine_name == name]
    offset = region.offset + 3  # row 0: q_proj's first row, written by the rank that holds it

    def corrupt_once(trainer):  # runs in each trainer rank; flips the byte if this rank wrote it
        import colocate.sync.trainer_end as module

        real = module.run_copies

        def corrupting(copies, **kwargs):
            written = real(copies, **kwargs)
            hit = [c for c in copies if c.worker == 1 and c.start <= offset < c.start + c.num_bytes]
            if hit:
                hit[0].ring[offset] ^= 0x10  # after the checksum: as if the slot changed in transit
                module.run_copies = real
            return written

        module.run_copies = corrupting

    def restore(trainer):  # the rank that did not write the byte still has the hook
        import colocate.sync.shards
        import colocate.sync.trainer_end

        colocate.sync.trainer_end.run_copies = colocate.sync.shards.run_copies

    before = ray.get(runtime.engines[0].state_dicts.remote())
    ray.get([t.__ray_call__.remote(corrupt_once) for t in runtime.trainers])
    try:
        with pytest.raises(ray.exceptions.RayTaskError) as info:
            ring.run()
    finally:
        ray.get([t.__ray_call__.remote(restore) for t in runtime.trainers])
    message = str(info.value)
    assert (f"weight sync: bucket {index} ({plan.buckets[index].group}) of engine 0 (TP rank 1) arrived corrupted "
            f"in {name} rows [0, ") in message, message
    assert "(the trainer's model.layers.0.self_attn.q_proj.weight)" in message
    after = ray.get(runtime.engines[0].state_dicts.remote())
    assert torch.equal(after[1][name], before[1][name])  # the corrupted bytes never reached the parameter
    runtime.sync.run()  # the runtime's own sync, for the tests after this one
    assert_engine_equals_trainer(runtime)


def test_the_simulators_calibration_measures_this_runtime_and_leaves_it_as_it_found_it(runtime):
    """`colocate simulate --calibrate`'s measurement (simulate/calibrate.py) on the module's job, two batch sizes:
    what a step of each phase costs here, and running a decode pass beside a train step (the overlap gain)."""
    from colocate.simulate.calibrate import measure

    cal = measure(runtime, runtime.cfg, batch_sizes=(1, 4))
    assert sorted({b for b, _, _ in cal.decode_step_s}) == [1, 4]
    assert all(s > 0 for _, _, s in cal.decode_step_s) and cal.prefill_s_per_token >= 0
    tokens = [t for t, _ in cal.train_step_s]
    assert tokens == sorted(tokens) and len(set(tokens)) == 3 and all(s > 0 for _, s in cal.train_step_s)
    assert 0 < cal.overlap_gain <= 2 and cal.sync_s > 0  # two sides at once, each at most its alone speed
    assert set(cal.switch_s) == {"to_train", "to_sync", "to_rollout", "seconds"}
    assert cal.prompt_tokens > 0 and cal.num_engines == 1
    # left as a job starts: a step runs its whole switching order from here, and the engines end synced
    assert Controller(runtime.cfg, runtime).step(0)["sync_bytes"] > 0
    assert_engine_equals_trainer(runtime)


def test_the_driver_set_the_job_up_once(runtime, set_up_calls):
    """Runtime(cfg) alone builds its set-up at start (job/setup.py bare_setup), and every controller of the tests
    above took the task and the tokenizer from it: in this process each was made once (the actors load their own).
    Last in the module, after the controllers and the engine restart."""
    assert {name: len(calls) for name, calls in set_up_calls.items()} == dict.fromkeys(set_up_calls, 1)
    assert runtime.setup.tokenizer is runtime.tokenizer
