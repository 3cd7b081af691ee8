"""Split placement as a user launches it: the trainers on slots of their own, the engines on the others, nothing
asleep, every sync broadcast from the trainers to the engines' workers over gloo groups (sync/broadcast.py).
A Ray cluster is told of 4 CPU slots (this machine has 2 cores: the layout, not the speed, is what is tested) and
`colocate launch` joins it, in a process of its own. `sync.verify=full` compares every engine tensor with the
trainers' after each sync and fails the job on any difference: steps done are exact syncs. One engine of TP=2 fed
by one trainer rank (it feeds both TP ranks), and two engines of TP=1 fed by one broadcast from two trainer ranks
(rank 1 gathers only)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from colocate.telemetry.metrics import read_records
from tests.e2e.conftest import ROOT, assert_nothing_left, colocate_processes, launch, shm_segments

pytestmark = pytest.mark.e2e


def records(out: Path) -> list[dict]:
    # as the product reads them: a run SIGKILLed mid-write leaves half a last line
    return read_records(out / "metrics.jsonl")


@pytest.fixture(scope="module")
def four_slots():
    from ray.cluster_utils import Cluster

    before = (colocate_processes(), shm_segments())
    saved = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"  # the head's, and the launched job's (it inherits it)
    cluster = None
    try:
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "include_dashboard": False})
        cluster.wait_for_nodes()
        yield cluster.address
    finally:
        if cluster is not None:
            cluster.shutdown()
        if saved is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = saved
    assert_nothing_left(*before)


@pytest.mark.parametrize("num_slots, tp, trainer_devices, worker_devices", [
    pytest.param(3, 2, ["cpu-slot0"], [["cpu-slot1", "cpu-slot2"]], id="one_rank_feeds_a_tp2_engine"),
    pytest.param(4, 1, ["cpu-slot0", "cpu-slot1"], [["cpu-slot2"], ["cpu-slot3"]], id="one_broadcast_two_engines"),
])
def test_split_sync_is_bit_exact_after_every_step(four_slots, tmp_path, num_slots, tp, trainer_devices,
                                                  worker_devices):
    result = launch(tmp_path, f"placement.ray_address={four_slots}", f"placement.num_slots={num_slots}",
                    "placement.engine_slots=2", f"engine.tp={tp}", "sync.verify=full", "algo.num_steps=2",
                    "logging.progress=false", "checkpoint.at_end=false")
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    startup = next(r for r in records if r.get("event") == "startup")
    assert startup["sync_method"] == "broadcast" and startup["sync_mode"] == "sliced"
    assert startup["switch"]["engine_sleep_level"] == 0 and not startup["switch"]["trainer_offload"]
    placement = startup["placement"]
    assert placement["trainer_devices"] == trainer_devices and placement["engine_worker_devices"] == worker_devices
    assert placement["pairs"] == [None] * len(trainer_devices)
    steps = [r for r in records if "event" not in r]
    assert [r["step"] for r in steps] == [0, 1] and all(r["sync_method"] == "broadcast" for r in steps)
    # sync.delta=auto is on over the broadcast: every record has the sync's density and bytes; the first sync sends
    # every slice whole (nothing stored), the next its changes (at the default job's lr of 1e-3 most weights change:
    # docs/delta.md), and the stores' version is the step's; verify=full held after each (the job would have failed)
    deltas = [r["sync_delta"] for r in steps]
    assert [d["store_version"] for d in deltas] == [0, 1]
    assert deltas[0]["sent_fraction"] >= 1.0 and deltas[0]["density"] == 1.0
    assert 0 < deltas[1]["density"] <= 1.0 and deltas[1]["sent_bytes"] > 0 and deltas[1]["encode_s"] > 0
    assert deltas[1]["apply_s"] > 0  # the engine's side of it: the overwrite and its copies


def test_the_default_task_learns_on_a_split_with_the_delta_verified_every_step(four_slots, tmp_path):
    """The default job (16 prompts x 8 answers) on a split placement with sync.delta (auto: on) and sync.verify=full
    after every step: it learns, and every record has the sync's density and bytes."""
    result = launch(tmp_path, f"placement.ray_address={four_slots}", "placement.num_slots=3",
                    "placement.engine_slots=2", "engine.tp=2", "sync.verify=full", "algo.num_steps=12",
                    "logging.progress=false", "checkpoint.at_end=false", small=False)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [r for r in records(tmp_path / "out") if "event" not in r]
    assert [r["step"] for r in steps] == list(range(12))
    assert all(0 < r["sync_delta"]["density"] <= 1 and r["sync_delta"]["sent_bytes"] > 0 for r in steps)
    first = sum(r["reward_mean"] for r in steps[:4]) / 4
    last = sum(r["reward_mean"] for r in steps[-4:]) / 4
    assert last > first + 0.01, (first, last, [round(r["reward_mean"], 3) for r in steps])


def test_the_directory_carrier_syncs_through_shared_files(four_slots, tmp_path):
    """sync.carrier=directory: the engines reach the trainers' weights only through files (each checksummed), the
    delta's changes among them; sync.verify=full after every step; the files of old syncs removed."""
    carrier = tmp_path / "shared"
    result = launch(tmp_path, f"placement.ray_address={four_slots}", "placement.num_slots=3",
                    "placement.engine_slots=2", "engine.tp=2", "sync.verify=full", "algo.num_steps=3",
                    "sync.carrier=directory", f"sync.carrier_dir={carrier}", "logging.progress=false",
                    "checkpoint.at_end=false")
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [r for r in records(tmp_path / "out") if "event" not in r]
    assert [r["step"] for r in steps] == [0, 1, 2]
    assert [r["sync_delta"]["store_version"] for r in steps] == [0, 1, 2]
    assert steps[0]["sync_delta"]["sent_fraction"] >= 1.0
    channels = sorted(p.name for p in carrier.iterdir())
    assert len(channels) == 2 and all(name.endswith(("-tp0", "-tp1")) for name in channels)  # one per TP rank
    for channel in channels:  # the last two syncs' files, no older
        files = sorted(int(p.stem) for p in (carrier / channel).glob("*.bin"))
        assert files and files[0] > 0


def test_bench_sync_times_the_broadcast_with_and_without_the_delta(four_slots, tmp_path):
    """`colocate bench sync` on a split placement (bench/sync_broadcast.py): after each real step, the broadcast sync
    with every byte and with sync.delta, the delta's result verified against the trainers' weights in full."""
    cli = Path(sys.executable).parent / "colocate"
    done = subprocess.run([str(cli), "bench", "sync", "configs/default.yaml", f"placement.ray_address={four_slots}",
                           "placement.num_slots=2", "placement.engine_slots=1", "engine.tp=1", "rollout.num_prompts=4",
                           "rollout.num_samples=4", "checkpoint.at_end=false", f"logging.output_dir={tmp_path / 'out'}",
                           f"model.cache_dir={ROOT / '.cache' / 'models'}", "--repeats", "2", "--out", str(tmp_path),
                           "--name", "broadcast"], cwd=ROOT, capture_output=True, text=True, timeout=420)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = json.loads((tmp_path / "broadcast.json").read_text())["steps"]
    assert [s["step"] for s in steps] == [0, 1, 2] and steps[0]["sent_fraction"] >= 1.0  # the stores start empty
    assert all(0 < s["density"] <= 1 and s["full_sync_s"] > 0 and s["delta_sync_s"] > 0 for s in steps[1:])
    assert [s["store_version"] for s in steps] == [0, 1, 2]
    assert "after the first sync the delta sends at most" in done.stdout


def test_an_engine_killed_or_stopped_mid_rollout_is_replaced_and_the_job_goes_on(four_slots, tmp_path):
    """fault.engine_restarts (job/engine_restarts.py) through `colocate bench restart`, which runs the job twice, as
    `colocate launch` does, with the same faults: a TP worker SIGKILLed as step 1's rollout begins and the other
    one SIGSTOPped as step 3's does. With engine restarts the job finishes every step without a restart: each
    fault found (the stopped worker within the heartbeat), named, the engine replaced on its slots, reloaded
    from the weight store and verified in full (sync.verify=full after every step too), no group lost or taken
    twice, and the sync after it a delta for the new engine. Without them (fault.max_restarts) the whole job
    restarts from its newest checkpoint, as it always did; the bench sets the two side by side."""
    cli = Path(sys.executable).parent / "colocate"
    faults = "SIGKILL:engine0.worker1:rollout:1,SIGSTOP:engine0.worker0:rollout:3"
    done = subprocess.run([str(cli), "bench", "restart", "configs/default.yaml", f"placement.ray_address={four_slots}",
                           "placement.num_slots=3", "placement.engine_slots=2", "engine.tp=2", "rollout.num_prompts=4",
                           "rollout.num_samples=4", "rollout.max_tokens=4", "engine.kv_cache_gib=0.125",
                           "algo.num_steps=5", "sync.verify=full", "logging.progress=false", "checkpoint.at_end=false",
                           f"model.cache_dir={ROOT / '.cache' / 'models'}", "--fault", faults, "--out", str(tmp_path),
                           "--name", "restart"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "restart.json").read_text())
    ours, whole = result["variants"]["engine_restarts"], result["variants"]["whole_job"]
    assert ours["num_steps"] == whole["num_steps"] == 5
    assert ours["whole_job_restarts"] == 0 and whole["whole_job_restarts"] == 2 and not whole["engine_restarts"]
    assert "a faulted step costs" in done.stdout
    run = records(tmp_path / "restart_engine_restarts")
    steps = [r for r in run if "event" not in r]
    # every group drawn was trained once, none lost to the failed passes
    assert [g for r in steps for g in r["rollout"]["group_ids"]] == list(range(20))
    events = [r for r in run if r.get("event") == "engine_restart"]
    assert [(e["step"], e["member"], e["phase"]) for e in events] == \
        [(1, "engine 0 TP worker 1", "rollout"), (3, "engine 0 TP worker 0", "rollout")]
    assert [[e["member"] for e in r.get("engine_restarts", [])] for r in steps] == \
        [[], ["engine 0 TP worker 1"], [], ["engine 0 TP worker 0"], []]
    for event in events:
        assert event["verified"] == "full" and event["reload_bytes"] > 0 and event["answers_regenerated"] == 16
        # the version the engines held: that of the sync before the fault
        assert event["store_version"] == steps[event["step"] - 1]["sync_delta"]["store_version"]
    assert events[1]["found_after_s"] < 5  # a stopped worker: its state read every fault.heartbeat_s (1 s)
    assert [e["restarts_left"] for e in events] == [1, 0]
    # the new engine's store was filled by the reload: the next sync is a delta, no slice sent whole
    assert all(steps[e["step"]]["sync_delta"]["full_slices"] == 0 for e in events)
    assert [r["sync_delta"]["store_version"] for r in steps] == list(range(5))
    said = (tmp_path / "restart_engine_restarts" / "stderr.log").read_text()
    assert re.search(r"colocate: engine 0 TP worker 1 \(slot 2, this node, pid \d+\) died during rollout of step 1: "
                     r"killed by SIGKILL\ncolocate: engine 0 replaced on its slots and reloaded from the weight store "
                     r"\(version 0\) in [\d.]+ s, verified in full; the rollout goes on \(1 engine restart\(s\) left\)",
                     said), said[-3000:]
    assert re.search(r"engine 0 TP worker 0 \(slot 1, this node, pid \d+\) is stopped \(SIGSTOP or a debugger\) "
                     r"during rollout of step 3", said), said[-3000:]
    assert "restart 2/2 from" in (tmp_path / "restart_whole_job" / "stderr.log").read_text()


@pytest.mark.parametrize("stream", [False, True], ids=["passes", "streamed"])
def test_split_async_with_updates_inside_passes_killed_and_resumed_counts_every_group(four_slots, tmp_path, stream):
    """Split async with weight updates inside the passes (rollout.update_in_pass=keep), its rollout in passes or
    streamed (rollout.stream: groups taken as they complete, requests fed into the passes), as a user runs it on a
    cluster: the controller SIGKILLed after step 1's record, `colocate clean`, then resume=auto to step 5.
    Counted from the steps' records (each step's last record: a step run again after the resume counts once)
    and the last checkpoint's pool: every group drawn from the prompt stream was trained exactly once or is in
    flight at the end; no group is lost or trained twice. Versions and lags after the resume are as before it:
    every token within the lag cap, none newer than the policy that trains it."""
    out = tmp_path / "out"
    job = ["rollout.num_prompts=4", "rollout.num_samples=4", "rollout.max_tokens=4", "engine.kv_cache_gib=0.125",
           f"logging.output_dir={out}", f"model.cache_dir={ROOT / '.cache' / 'models'}",
           f"placement.ray_address={four_slots}", "placement.num_slots=3", "placement.engine_slots=1",
           "engine.tp=1", "algo.mode=async", "rollout.update_in_pass=keep", "rollout.partial_tokens=2",
           "rollout.max_lag=2", "rollout.oversample=1.5", "checkpoint.every_steps=1", "checkpoint.keep_last=0",
           "logging.progress=false", f"rollout.stream={str(stream).lower()}"]
    cli = str(Path(sys.executable).parent / "colocate")
    first = subprocess.Popen([cli, "launch", "configs/default.yaml", *job, "algo.num_steps=30"], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not ((out / "metrics.jsonl").is_file() and 1 in {r.get("step") for r in records(out)}):
        assert first.poll() is None and time.monotonic() < deadline, "the job ended or never reached step 1"
        time.sleep(0.2)
    first.send_signal(signal.SIGKILL)
    first.wait()
    cleaned = subprocess.run([cli, "clean", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert cleaned.returncode == 0, cleaned.stdout + cleaned.stderr
    result = subprocess.run([cli, "launch", "configs/default.yaml", *job, "algo.num_steps=6", "resume=auto"],
                            cwd=ROOT, capture_output=True, text=True, timeout=420)
    assert result.returncode == 0, result.stderr[-3000:]
    resumed_at = [r for r in records(out) if r.get("event") == "resume"][-1]["step"]
    steps = {r["step"]: r for r in records(out) if "event" not in r}  # a step's last record
    assert sorted(steps) == list(range(6)) and resumed_at >= 1
    trained = [g for step in range(6) for g in steps[step]["rollout"]["group_ids"]]
    assert len(trained) == 4 * 6 and len(set(trained)) == len(trained)  # none twice
    pool = json.loads((out / "checkpoints" / "step_00000005" / "controller.json").read_text())["rollouts"]["pool"]
    in_flight = {g["group_id"] for g in pool["groups"]}
    assert set(trained) | in_flight == set(range(pool["next_group_id"])) and not set(trained) & in_flight
    for step, record in steps.items():
        lags = {int(lag) for lag in record["rollout"]["token_lags"]}
        assert lags and min(lags) >= 0 and max(lags) <= 2, (step, lags)  # the lag cap, no token from the future
