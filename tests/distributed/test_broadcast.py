"""The split placement's sync on gloo: trainer ranks (an FSDP2 group of their own) all-gather each layer group,
and the feeder of each TP rank broadcasts that TP rank's slice of every bucket to the worker of that TP rank in
every engine, each a process of its own with no trainer beside it. Every worker then holds exactly its TP slice
of the trainer's weights, bit for bit, after every sync: one engine of TP=2 fed by two ranks, two engines of
TP=1 fed by one broadcast (rank 1 gathers only), one rank feeding both TP ranks, and the full-tensor plan. A member
lost mid-sync (dead, or alive and silent) makes the survivors raise a named BroadcastError, never hang."""

from __future__ import annotations

import datetime

import pytest
import torch

from colocate.sync.broadcast import fed_by, feeder_of, slot_extent
from tests.distributed.conftest import run_distributed
from tests.distributed.test_gather import HD, NKV, NQ, VOCAB, _expected, _plan
from tests.unit.test_reshard import hf_state

TIMEOUT_S = 60


# sync.delta: the share of the trainer's elements each sync changes, after the first (which sends everything): none,
# a few, many, all. A seeded mask each (the same on every rank: each changes its own shard's part of it)
DENSITIES = [0.0, 0.01, 0.3, 1.0]


def _change(params: dict, sync: int, delta: bool) -> None:
    """Training changed the weights: the next sync must carry the new values."""
    with torch.no_grad():
        for i, p in enumerate(params.values()):
            local = p.to_local()
            if not delta or sync == 0:
                local.add_(0.25 * (sync + 1))
                continue
            mask = torch.rand(local.shape, generator=torch.Generator().manual_seed(100 * sync + i))
            local.add_(torch.where(mask < DENSITIES[sync - 1], 0.125 * sync, 0.0))


def _model(tp: int, sliced: bool, ep: bool):
    """(full HF state, plan, specs, each worker's layout dict, expected(current state, worker) -> its tensors): the
    dense model of test_gather, or with `ep` the MoE of test_experts_sync whose 7 experts are split 4/3 over two
    workers by expert parallelism (EP=2: whole experts per worker, vLLM's block)."""
    if not ep:
        full = hf_state(VOCAB, tied=False, num_layers=2)
        plan, specs, layouts = _plan(full, tp, False, 0, sliced)
        return full, plan, specs, layouts, lambda current, t: _expected(current, layouts[t], False)
    from colocate.sync.tp_layout import engine_tensor
    from tests.distributed.test_experts_sync import _layouts, _state
    from tests.distributed.test_experts_sync import _plan as experts_plan

    full = _state()
    layouts = _layouts(full, True)
    plan, specs = experts_plan(full, layouts)

    def expected(current, t):
        hf = {n: v.to(torch.bfloat16) for n, v in current.items()}
        return {n: engine_tensor(n, hf, layouts[t]["layout"]) for n, _, _ in layouts[t]["params"]}
    return full, plan, specs, layouts, expected


def _member(rank: int, world_size: int, port: int, num_trainers: int, tp: int, num_engines: int, sliced: bool,
            delta: bool = False, ep: bool = False):
    """Processes 0 .. num_trainers - 1: trainer ranks; the rest: engine e's worker t, in engine-major order."""
    import torch.distributed as dist
    from torch.distributed import PrefixStore, TCPStore

    from colocate.sync.broadcast import BroadcastChannel, BroadcastFeeder, open_store, receive
    from colocate.sync.load import verify_then_load

    # the test's own rendezvous, where each feeder publishes its group's store (Ray carries it in a job)
    board = TCPStore("127.0.0.1", port, world_size, is_master=rank == 0,
                     timeout=datetime.timedelta(seconds=TIMEOUT_S))
    full, plan, specs, layouts, expected_of = _model(tp, sliced, ep)
    size = 1 + num_engines
    num_syncs = 1 + len(DENSITIES) if delta else 2
    if rank < num_trainers:
        from colocate.sync.gather import plan_gather
        from colocate.sync.shards import local_shards
        from tests.distributed.test_shards import _sharded

        dist.init_process_group("gloo", store=PrefixStore("fsdp", board), rank=rank, world_size=num_trainers)
        params, specs = _sharded(full, num_trainers)
        stores = {t: open_store("127.0.0.1", f"t{t}", size=size, timeout_s=TIMEOUT_S)
                  for t in fed_by(rank, tp=tp, num_trainer_ranks=num_trainers)}
        for t, (_, address) in stores.items():
            board.set(f"port{t}", str(address.port))
        channels = {t: BroadcastChannel.join(address, rank=0, size=size, device=torch.device("cpu"),
                                             timeout_s=TIMEOUT_S, store=store)
                    for t, (store, address) in stores.items()}
        feeder = BroadcastFeeder.create(plan, plan_gather(plan, specs, world_size=num_trainers), rank=rank,
                                        world_size=num_trainers, device=torch.device("cpu"), channels=channels,
                                        checksum=True, delta=delta, element_size=2)
        for sync in range(num_syncs):
            _change(params, sync, delta)
            shards = local_shards(params)
            for index in range(len(plan.buckets)):
                written = feeder.write(index, shards)
                for t in channels:
                    board.set(f"sums{sync}/{index}/{t}", repr(written))
            if delta and channels:
                stats = feeder.take_delta_stats()
                assert stats["store_version"] == sync
                if sync == 0:  # nothing stored: every slice whole
                    assert stats["sent_bytes"] >= stats["full_bytes"] and stats["density"] == 1.0
                elif DENSITIES[sync - 1] == 0.0:  # nothing changed: headers and empty payloads alone
                    assert stats["changed"] == 0 and stats["sent_bytes"] < 0.01 * stats["full_bytes"] + 1000
                board.set(f"stats{sync}/{rank}", repr(stats))
            current = {n: p.full_tensor() for n, p in params.items()}  # a collective of the trainers
            if rank == 0:
                for t in range(tp):
                    board.set(f"expected{sync}/{t}", repr({n: v.float().tolist() for n, v in
                                                          expected_of(current, t).items()}))
        dist.destroy_process_group()
        board.wait(["done"])  # the workers have read everything
        return
    member = rank - num_trainers
    engine, worker = divmod(member, tp)
    from colocate.sync.broadcast import StoreAddress

    board.wait([f"port{worker}"])
    address = StoreAddress("127.0.0.1", int(board.get(f"port{worker}")), f"t{worker}")
    channel = BroadcastChannel.join(address, rank=1 + engine, size=size, device=torch.device("cpu"),
                                    timeout_s=TIMEOUT_S)
    receiver = None
    if delta:
        from colocate.sync.delta_channel import DeltaReceiver

        receiver = DeltaReceiver(channel, element_size=2)
    ring = torch.zeros(plan.ring_bytes, dtype=torch.uint8)
    weights = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s, _ in layouts[worker]["params"]}
    for sync in range(num_syncs):
        for v in weights.values():
            v.zero_()
        received = {}  # full mode: the full tensors as each bucket delivered them
        for index in range(len(plan.buckets)):
            receive(plan, index, ring, channel, worker, receiver)
            board.wait([f"sums{sync}/{index}/{worker}"])
            sums = eval(board.get(f"sums{sync}/{index}/{worker}").decode())  # noqa: S307 (the test's own repr)
            assert sums, "the feeder checksums what it sends"
            _, _, error = verify_then_load(plan, index, ring, sums, worker=worker, params=weights, engine=engine,
                                           load_weights=lambda weights, into=received: into.update(
                                               (name, view.clone()) for name, view in weights))
            assert error is None, error
        if not sliced:  # sliced here by the layout oracle, as vLLM's load_weights slices full tensors
            from colocate.sync.tp_layout import TPLayout, engine_tensor

            for name in weights:
                value = engine_tensor(name, received, TPLayout(worker, tp, NQ, NKV, HD, VOCAB))
                weights[name][:value.shape[0]] = value
        board.wait([f"expected{sync}/{worker}"])
        expected = eval(board.get(f"expected{sync}/{worker}").decode())  # noqa: S307
        for name, values in expected.items():
            want = torch.tensor(values).to(torch.bfloat16)
            assert torch.equal(weights[name][:want.shape[0]], want), (sync, engine, worker, name)
        if receiver is not None:
            assert receiver.store.version == sync  # the store's version is the engine's after every sync
    if board.add("finished", 1) == world_size - num_trainers:
        board.set("done", "1")


@pytest.mark.parametrize("num_trainers, tp, num_engines, sliced", [
    pytest.param(2, 2, 1, True, id="tp2_engine_two_feeders"),
    pytest.param(2, 1, 2, True, id="tp1_two_engines_one_broadcast"),
    pytest.param(1, 2, 1, True, id="one_rank_feeds_both_tp_ranks"),
    pytest.param(2, 2, 1, False, id="tp2_full_tensors"),
])
def test_broadcast_sync_is_bit_exact_after_every_sync(num_trainers, tp, num_engines, sliced):
    run_distributed(_member, num_trainers, tp, num_engines, sliced, world_size=num_trainers + tp * num_engines,
                    init=False)


@pytest.mark.parametrize("num_trainers, tp, num_engines, ep", [
    pytest.param(1, 1, 1, False, id="tp1"),
    pytest.param(2, 2, 1, False, id="tp2_engine_two_feeders"),
    pytest.param(2, 1, 2, False, id="tp1_two_engines_one_broadcast"),
    pytest.param(2, 2, 1, True, id="moe_ep2_uneven_experts"),
])
def test_a_delta_sync_reproduces_the_full_sync_bit_for_bit(num_trainers, tp, num_engines, ep):
    """sync.delta over the broadcast: after a first sync of everything, syncs that change none, 1%, 30% and all of
    the elements (seeded random masks) leave every worker bit-equal to the trainer's weights, the checksums of the
    staged bytes holding against the ring's, and both stores at the sync's version; on dense TP layouts and on a
    MoE's expert-parallel one (each worker its own whole experts, cut across the FSDP2 shards)."""
    run_distributed(_member, num_trainers, tp, num_engines, True, True, ep, world_size=num_trainers + tp * num_engines,
                    init=False)


LOST_TIMEOUT_S = 5  # the group's bound in the lost-member tests: a hung member costs the survivors this long


def _losing_a_member(rank: int, world_size: int, port: int, how: str):
    """A feeder (0) and two members; after one good broadcast member 2 is lost (it exits, or stays alive and never
    joins the next broadcast). The survivors' next broadcast returns or raises BroadcastError (whichever of them
    waited on the lost member), never hangs past the group's timeout, and each survivor lives on to report."""
    import os
    import time

    from torch.distributed import TCPStore

    from colocate.sync.broadcast import BroadcastChannel, BroadcastError, StoreAddress, open_store

    board = TCPStore("127.0.0.1", port, world_size, is_master=rank == 0,
                     timeout=datetime.timedelta(seconds=TIMEOUT_S))
    cpu = torch.device("cpu")
    if rank == 0:
        store, address = open_store("127.0.0.1", "lost", size=3, timeout_s=TIMEOUT_S)
        board.set("port", str(address.port))
        channel = BroadcastChannel.join(address, rank=0, size=3, device=cpu, timeout_s=LOST_TIMEOUT_S, store=store)
    else:
        board.wait(["port"])
        address = StoreAddress("127.0.0.1", int(board.get("port")), "lost")
        channel = BroadcastChannel.join(address, rank=rank, size=3, device=cpu, timeout_s=LOST_TIMEOUT_S)
    sent = torch.arange(1 << 16, dtype=torch.int64).to(torch.uint8)
    data = sent.clone() if rank == 0 else torch.zeros_like(sent)
    channel.broadcast(data)
    assert torch.equal(data, sent)
    if rank == 2:
        board.set("lost", str(os.getpid()))
        if how == "hangs":
            board.wait(["done"], datetime.timedelta(seconds=TIMEOUT_S))
        os._exit(0)  # its sockets close as a killed process's do (exit code 0: the harness counts no failure)
    board.wait(["lost"])
    while how == "dies" and os.path.exists(f"/proc/{board.get('lost').decode()}/stat"):
        time.sleep(0.05)
    if rank:
        data.zero_()
    try:
        channel.broadcast(data)
        board.set(f"outcome{rank}", "received" if torch.equal(data, sent) else "wrong bytes")
    except BroadcastError as e:
        with pytest.raises(BroadcastError, match="failed earlier"):
            channel.broadcast(data)  # the group is broken: no second collective on it
        board.set(f"outcome{rank}", str(e))
    if rank != 0:
        return
    board.wait(["outcome0", "outcome1"])
    outcomes = [board.get(f"outcome{r}").decode() for r in (0, 1)]
    board.set("done", "1")
    failed = [o for o in outcomes if o != "received"]
    assert failed, outcomes  # a survivor met the loss
    assert all(o.startswith("the broadcast group lost (member ") and "lost a member or passed its timeout: " in o
               for o in failed), outcomes
    time.sleep(0.5 if how == "hangs" else 0)  # member 2 reads "done" before this store goes


@pytest.mark.parametrize("how", ["dies", "hangs"])
def test_a_lost_member_makes_the_survivors_raise_instead_of_hanging(how):
    """The fault path of the split sync on gloo, which NCCL's blocking wait gives the same shape on GPUs
    (sync/broadcast.py; tests/gpu/test_cuda_broadcast.py): a named BroadcastError in the survivors."""
    run_distributed(_losing_a_member, how, world_size=3, init=False)


def test_feeders_spread_over_the_ranks_and_cover_every_tp_rank():
    assert [feeder_of(t, 2) for t in range(4)] == [0, 1, 0, 1]
    assert fed_by(0, tp=4, num_trainer_ranks=2) == [0, 2] and fed_by(1, tp=1, num_trainer_ranks=2) == []
    assert fed_by(0, tp=2, num_trainer_ranks=1) == [0, 1]
    full = hf_state(VOCAB, tied=False, num_layers=2)
    plan, _, _ = _plan(full, 2, False, 0, True)
    for index, bucket in enumerate(plan.buckets):  # what is broadcast lies in the bucket's slot
        start, end = slot_extent(plan, index, 1)
        assert bucket.slot * plan.slot_bytes <= start < end <= (bucket.slot + 1) * plan.slot_bytes


def _replacing_an_engine(rank: int, world_size: int, port: int):
    """fault.engine_restarts' reload (WeightSync.rejoin): rank 0 feeds two TP=1 engines (ranks 1 and 2) a full sync
    and a delta sync; then engine 1's worker is gone and a new process (rank 3) takes its place. The feeder joins
    new groups with the survivor and the newcomer, keeping its weight store (BroadcastFeeder.adopt), and replays
    the store whole without a gather: the newcomer loads exactly the version the survivor holds, the survivor
    loads nothing, and the next sync is a delta (against that version) that leaves both bit-equal to the
    trainer's weights, every store at the sync's version."""
    import torch.distributed as dist
    from torch.distributed import PrefixStore, TCPStore

    from colocate.sync.broadcast import BroadcastChannel, BroadcastFeeder, StoreAddress, open_store, receive
    from colocate.sync.delta_channel import DeltaReceiver
    from colocate.sync.load import verify_then_load

    board = TCPStore("127.0.0.1", port, world_size, is_master=rank == 0,
                     timeout=datetime.timedelta(seconds=TIMEOUT_S))
    full = hf_state(VOCAB, tied=False, num_layers=2)
    plan, specs, layouts = _plan(full, 1, False, 0, True)
    cpu = torch.device("cpu")

    def feeder_for(name: str, old: BroadcastFeeder | None = None) -> BroadcastFeeder:
        store, address = open_store("127.0.0.1", name, size=3, timeout_s=TIMEOUT_S)
        board.set(f"port/{name}", str(address.port))
        channel = BroadcastChannel.join(address, rank=0, size=3, device=cpu, timeout_s=TIMEOUT_S, store=store)
        feeder = BroadcastFeeder.create(plan, plan_gather(plan, specs, world_size=1), rank=0, world_size=1,
                                        device=cpu, channels={0: channel}, checksum=True, delta=True)
        if old is not None:
            feeder.adopt(old)
        return feeder

    if rank == 0:
        from colocate.sync.gather import plan_gather
        from colocate.sync.shards import local_shards
        from tests.distributed.test_shards import _sharded

        dist.init_process_group("gloo", store=PrefixStore("fsdp", board), rank=0, world_size=1)
        params, specs = _sharded(full, 1)
        feeder = feeder_for("first")
        for sync in range(3):
            if sync == 2:  # engine 1 replaced: new groups, the same stores, the store's version replayed
                board.wait(["replaced"])
                feeder = feeder_for("second", old=feeder)
                for index in range(len(plan.buckets)):
                    board.set(f"replay/{index}", repr(feeder.replay(index)))
                assert feeder.senders[0].store.version == 1
            _change(params, sync, True)
            for index in range(len(plan.buckets)):
                board.set(f"sums{sync}/{index}", repr(feeder.write(index, local_shards(params))))
            stats = feeder.take_delta_stats()
            assert stats["store_version"] == sync
            if sync == 2:  # a delta against the replayed version, not the whole model again
                assert stats["full_slices"] == 0 and stats["changed"] < stats["elements"], stats
            current = {n: p.full_tensor() for n, p in params.items()}
            board.set(f"expected{sync}", repr({n: v.float().tolist() for n, v in
                                               _expected(current, layouts[0], False).items()}))
        dist.destroy_process_group()
        board.wait(["done"])
        return

    engine = 0 if rank == 1 else 1
    ring = torch.zeros(plan.ring_bytes, dtype=torch.uint8)
    weights = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s, _ in layouts[0]["params"]}

    def join(name: str) -> DeltaReceiver:
        board.wait([f"port/{name}"])
        address = StoreAddress("127.0.0.1", int(board.get(f"port/{name}")), name)
        return DeltaReceiver(BroadcastChannel.join(address, rank=1 + engine, size=3, device=cpu,
                                                   timeout_s=TIMEOUT_S), element_size=2)

    def receive_sync(receiver: DeltaReceiver, sums_key: str, *, load: bool = True) -> None:
        for index in range(len(plan.buckets)):
            receive(plan, index, ring, receiver.channel, 0, receiver)
            if load:
                board.wait([f"{sums_key}/{index}"])
                sums = eval(board.get(f"{sums_key}/{index}").decode())  # noqa: S307 (the test's own repr)
                _, _, error = verify_then_load(plan, index, ring, sums, worker=0, params=weights, engine=engine,
                                               load_weights=None)
                assert error is None, error

    def assert_holds(sync: int) -> None:
        board.wait([f"expected{sync}"])
        for name, values in eval(board.get(f"expected{sync}").decode()).items():  # noqa: S307
            want = torch.tensor(values).to(torch.bfloat16)
            assert torch.equal(weights[name][:want.shape[0]], want), (sync, rank, name)

    if rank in (1, 2):
        receiver = join("first")
        for sync in range(2):
            receive_sync(receiver, f"sums{sync}")
            assert_holds(sync)
            assert receiver.store.version == sync
        if rank == 2:  # gone: its sockets close as a killed worker's do
            board.set("gone", "1")
            return
        board.wait(["gone"])
        held = {n: v.clone() for n, v in weights.items()}
        receiver = join("second")
        receive_sync(receiver, "replay", load=False)  # a collective of every member; nothing loaded here
        assert all(torch.equal(held[n], weights[n]) for n in held) and receiver.store.version == 1
    else:  # rank 3: the new engine 1, from model.path's weights (zeros here), nothing stored
        board.wait(["gone"])
        board.set("replaced", "1")
        receiver = join("second")
        receive_sync(receiver, "replay")
        assert_holds(1)  # the version the survivor holds, from the store alone
        assert receiver.store.version == 1
    receive_sync(receiver, "sums2")
    assert_holds(2)
    assert receiver.store.version == 2
    if board.add("finished", 1) == 2:
        board.set("done", "1")


def test_a_replaced_engine_reloads_the_store_and_the_next_sync_is_a_delta_for_all():
    run_distributed(_replacing_an_engine, world_size=4, init=False)
