"""`colocate bench restart`: an engine's fault recovered by replacing that engine alone (fault.engine_restarts)
against the whole job restarted from its newest checkpoint (fault.max_restarts), side by side: the same job, the
same faults.

    colocate bench restart                                    # the default job on a split of this machine's 2 slots
    colocate bench restart configs/default.yaml placement.ray_address=... placement.num_slots=3 \
        placement.engine_slots=2 engine.tp=2 --fault SIGKILL:engine0.worker1:rollout:2

Each variant is the job as `colocate launch` runs it, in a process of its own, with the faults injected
(fault.inject, several separated by commas) and a checkpoint after every step in both: the whole-job restart's
kindest case, in which it trains no step again (with checkpoints every N steps it would also train up to N - 1
steps again). From each run's metrics:
- each faulted step's cost: its record's time minus the previous step record's, against the median of the
  steps without a fault (the floor, measured in the same run);
- what the recovery itself took: the engine restart's event (replace, reload from the store, verify), and for
  the whole job, from its restart event to its resume event (every actor started again, the checkpoint loaded
  and synced);
- each run's wall time, and that both ran every step.
Each run's metrics.jsonl and stderr.log stay in <out>/<name>_<variant>/ (its checkpoints are removed).
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from colocate.bench.common import write_result
from colocate.job.injections import parse_injections
from colocate.telemetry.metrics import read_records

# Without a CONFIG: the default job on a split of this machine's two slots (one trainer rank, one TP=1 engine,
# whose model runs in the engine actor's own process), checked in full after every sync.
RESTART_DEFAULTS = ["placement.num_slots=2", "placement.engine_slots=1", "engine.tp=1", "algo.num_steps=6",
                    "sync.verify=full", "logging.progress=false", "checkpoint.at_end=false"]
DEFAULT_FAULT = "SIGKILL:engine0:rollout:2"
VARIANTS = {  # what each run adds to the job: the bound is the number of faults, so every fault is recovered
    "engine_restarts": lambda n: [f"fault.engine_restarts={n}"],
    "whole_job": lambda n: [f"fault.max_restarts={n}"],
}


def restart_overrides(fault: str) -> list[str]:
    """What both runs add to the job: the faults, a checkpoint after every step (kept: the whole-job restart
    resumes from the newest)."""
    return [f"fault.inject={fault}", "checkpoint.every_steps=1", "checkpoint.keep_last=0"]


def run_restart_bench(paths: list[str], overrides: list[str], *, fault: str, out_dir: str, name: str) -> dict:
    steps = sorted({i.step for i in parse_injections(fault)})
    result = {"fault": fault, "faulted_steps": steps, "variants": {}}
    for variant, adds in VARIANTS.items():
        run_dir = Path(out_dir) / f"{name}_{variant}"
        args = [*paths, *([] if paths else RESTART_DEFAULTS), *overrides, *restart_overrides(fault),
                *adds(len(parse_injections(fault))), f"logging.output_dir={run_dir}"]
        shutil.rmtree(run_dir, ignore_errors=True)  # the bench's own: an earlier run's checkpoints would be resumed
        run_dir.mkdir(parents=True)
        started = time.perf_counter()
        done = subprocess.run([str(Path(sys.executable).parent / "colocate"), "launch", *args], capture_output=True,
                              text=True)
        wall = time.perf_counter() - started
        (run_dir / "stderr.log").write_text(done.stderr)  # the faults and recoveries as the job named them
        if done.returncode != 0:
            raise RuntimeError(f"bench restart: the {variant} run failed (exit {done.returncode}): "
                               f"{done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ''}")
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # the bench's scratch: a model's state a step
        result["variants"][variant] = {"wall_s": wall, "run_dir": str(run_dir), "command": " ".join(args),
                                       **fault_costs(read_records(run_dir / "metrics.jsonl"), steps)}
    ours, whole = result["variants"]["engine_restarts"], result["variants"]["whole_job"]
    result["faulted_step_ratio"] = whole["faulted_step_s"] / max(ours["faulted_step_s"], 1e-9)
    result["wall_ratio"] = whole["wall_s"] / max(ours["wall_s"], 1e-9)
    path = write_result(result, out_dir, name)
    print(f"faults {fault}: a faulted step costs {ours['faulted_step_s']:.1f} s with engine restarts "
          f"(recovery {ours['recovery_s']:.1f} s) and {whole['faulted_step_s']:.1f} s with a whole-job restart "
          f"(recovery {whole['recovery_s']:.1f} s): {result['faulted_step_ratio']:.2f}x; a step without a fault "
          f"{ours['floor_step_s']:.1f} s; the runs {ours['wall_s']:.0f} s against {whole['wall_s']:.0f} s "
          f"({result['wall_ratio']:.2f}x) -> {path}")
    return result


def fault_costs(records: list[dict], faulted: list[int]) -> dict:
    """One run's figures (the module's list) from its metrics: every step ran once, each faulted step's wall time
    and the others' median, and the recovery's own seconds (engine_restart events, or restart to resume)."""
    steps = [r for r in records if "event" not in r]
    startup = next(r for r in records if r.get("event") == "startup")
    assert [r["step"] for r in steps] == list(range(len(steps))), "every step ran once"
    spans = {r["step"]: r["time"] - (steps[i - 1]["time"] if i else startup["time"]) for i, r in enumerate(steps)}
    floor = [s for step, s in spans.items() if step not in faulted and step > 0]  # step 0: the first compiles
    events = [r for r in records if r.get("event") == "engine_restart"]
    restarts = [r for r in records if r.get("event") == "restart"]
    resumes = [r for r in records if r.get("event") == "resume"]
    recovery = sum(e["recovery_s"] for e in events) + \
        sum(resume["time"] - restart["time"] for restart, resume in zip(restarts, resumes))
    return {"num_steps": len(steps), "step_s": spans, "floor_step_s": statistics.median(floor) if floor else 0.0,
            "faulted_step_s": sum(spans[s] for s in faulted if s in spans), "recovery_s": recovery,
            "engine_restarts": [{k: e[k] for k in ("step", "member", "recovery_s", "reload_s", "verify_s",
                                                    "store_version", "answers_regenerated")} for e in events],
            "whole_job_restarts": len(restarts)}
