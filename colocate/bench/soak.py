"""`colocate bench soak`: the default job run long, with every process's footprint read after each step.

    colocate bench soak                              # the default job, 200 steps, sleep/wake and sync every step
    colocate bench soak algo.num_steps=500 rollout.num_prompts=32

The job is the default one (load_config's defaults, or CONFIG) with the full switch forced (engine.sleep_level=2,
trainer.offload=true: the auto plan moves nothing on a machine where both sides fit), run by the controller's
own loop (Controller.run, metrics writer included, as `colocate launch` runs it). After each step, with
the engine awake and the trainers offloaded (the same point of every step), it reads:

- per process: RSS (VmRSS), open file descriptors and threads of the controller, each trainer rank, each engine
  actor (vLLM's engine core runs in it) and every process under it (its TP workers, named by TP rank from the
  engine's own `memory()` pids), and Ray's gcs_server and raylet when this job started them;
- device memory on CUDA: torch's reserved bytes per process and the driver's used bytes of its GPU;
- /dev/shm machine-wide (entries, their bytes, tmpfs used: unlinked but mapped segments too; other users' jobs
  included), and the job's own: every shm object (by inode, unlinked ones too) that one of its processes maps,
  the bytes mapped and the bytes held (allocated blocks, through /proc/PID/map_files where permitted).

Growth is judged on robust values, never on single readings: the median of the `WINDOW` steps from step index
`BASELINE_STEP` (0-based: 20..29, after 20 warm-up steps) against the median of the last `WINDOW` steps; a
resource passes when it grew at most `TOLERANCE` (5%). Counts (fds, threads, processes, shm entries) should be
flat: their absolute change is reported beside. For the diagnosis, step 20 against the last: what a moved count
consists of (fds by kind, threads by name), RSS by kind of page, the size of the controller's per-step lists; and
each resource's change per step. Each reading runs inside its actor (`__ray_call__`): nothing is added to the
actors, and the numbers are those of the actor's own node.
"""

from __future__ import annotations

import os
import re
import statistics
import sys
import time
from collections import Counter, deque
from pathlib import Path

import ray

from colocate.bench.common import write_result
from colocate.config import JobConfig, to_dict
from colocate.host.procfs import process_tree
from colocate.job.controller import Controller
from colocate.job.runtime import Runtime
from colocate.telemetry.metrics import MetricsWriter

# Prepended to the command line's overrides, with or without a CONFIG (the command line still wins). No
# checkpoint at the end: a one-off save is not what a soak measures, and it would land in the job's output dir.
SOAK_DEFAULTS = ["engine.sleep_level=2", "trainer.offload=true", "algo.num_steps=200", "checkpoint.at_end=false",
                 "logging.progress=false", "logging.output_dir=outputs/soak"]
BASELINE_STEP, WINDOW, TOLERANCE = 20, 10, 0.05
COUNTS = ("fds", "threads", "processes", "shm_entries")  # resource kinds that are counts: flat, not growing
SHM = Path("/dev/shm")
SAVE_EVERY = 25  # steps between partial writes of the JSON: a run that dies late still leaves its series


# ------------------------------------------------------------------------------------- readings (in actors)

def process_resources(pid: int) -> dict:
    """RSS, fds and threads of one process (this node's /proc), and the shm objects it maps, unlinked ones
    included: inode -> [bytes mapped, bytes the object holds (None where map_files is not ours to read)]."""
    status = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            status[key] = value.split()
    if "VmRSS" not in status:  # a zombie: dead, not yet reaped (e.g. a Ray daemon killed under the job)
        raise ProcessLookupError(f"process {pid} has exited ({' '.join(status.get('State', []))})")
    shm: dict[int, list] = {}
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith("/dev/shm/"):
                start, end = (int(x, 16) for x in parts[0].split("-"))
                entry = shm.setdefault(int(parts[4]), [0, None])
                entry[0] += end - start
                if entry[1] is None:
                    try:  # the object itself, even unlinked: its allocated blocks, not its (sparse) size
                        entry[1] = os.stat(f"/proc/{pid}/map_files/{parts[0]}").st_blocks * 512
                    except OSError:
                        pass
    fds = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:  # what it is, not which one: socket, pipe, anon_inode:[eventfd], or the file's path
            fds.append(re.sub(r"^(socket|pipe):\[\d+\]$", r"\1", os.readlink(f"/proc/{pid}/fd/{fd}")))
        except OSError:  # closed meanwhile
            continue
    threads = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            threads.append(Path(f"/proc/{pid}/task/{task}/comm").read_text().strip())
        except OSError:
            continue
    # RSS by kind of page: anonymous (heap), file-backed (libraries, file-backed tiers), shared memory
    parts = {k.lower(): int(status[f"Rss{k}"][0]) * 1024 for k in ("Anon", "File", "Shmem") if f"Rss{k}" in status}
    return {"pid": pid, "rss_bytes": int(status["VmRSS"][0]) * 1024, "threads": int(status["Threads"][0]),
            "fds": len(fds), "shm": shm, "names": {"fds": sorted(fds), "threads": sorted(threads), "rss": parts}}


def what_changed(before: dict[str, dict], after: dict[str, dict]) -> dict:
    """Per process, between two readings: the fds (by kind) and threads (by name) that appeared or went, what a
    count that moved consists of; and the change of its RSS by kind of page (rss: anon, file, shmem bytes)."""
    out = {}
    for name in sorted(set(before) | set(after)):
        b, a = before.get(name, {}), after.get(name, {})
        for kind in ("fds", "threads"):
            was, now = Counter(b.get(kind, [])), Counter(a.get(kind, []))
            if was != now:
                out.setdefault(name, {})[kind] = {"added": dict(now - was), "gone": dict(was - now)}
        rss = {k: v - b["rss"][k] for k, v in a.get("rss", {}).items() if k in b.get("rss", {})}
        if any(rss.values()):
            out.setdefault(name, {})["rss"] = rss
    return out


def _device(memory: dict) -> dict:
    """device_memory()'s reading as the soak's two resources; empty without a device."""
    if "device_free_bytes" not in memory:
        return {}
    return {"device_reserved_bytes": memory["device_reserved_bytes"],
            "device_used_bytes": memory["device_total_bytes"] - memory["device_free_bytes"]}


def trainer_resources(actor) -> dict:
    """Runs inside a TrainerActor (`__ray_call__`)."""
    from colocate.host.devices import device_memory

    return {**process_resources(os.getpid()), **_device(device_memory(actor.device))}


def engine_resources(actor) -> dict:
    """Runs inside an EngineActor (`__ray_call__`): the actor and every process under it, by name; the TP workers
    are found by the pids their own `colocate_memory` reports, anything else under the actor by its comm."""
    workers = {w["pid"]: (rank, w) for rank, w in enumerate(actor.memory())}
    out = {"actor": process_resources(os.getpid())}
    # on CUDA the workers are Ray's, not our children
    pids = {e["pid"] for e in process_tree(os.getpid())} | set(workers)
    for pid in sorted(pids - {os.getpid()}):
        try:
            if pid in workers:
                rank, memory = workers[pid]
                out[f"worker{rank}"] = {**process_resources(pid), **_device(memory)}
            else:
                out[f"{Path(f'/proc/{pid}/comm').read_text().strip()}:{pid}"] = process_resources(pid)
        except OSError:  # a helper process that exited meanwhile
            continue
    out["actor"]["processes"] = len(out)
    return out


def shm_usage() -> dict:
    """Machine-wide /dev/shm: entries, the bytes they hold (allocated blocks), tmpfs's used bytes."""
    entries = used = 0
    for path in SHM.iterdir():
        try:
            used += path.stat().st_blocks * 512
            entries += 1
        except OSError:  # removed meanwhile
            continue
    fs = os.statvfs(SHM)
    return {"shm_entries/machine": entries, "shm_entry_bytes/machine": used,
            "shm_used_bytes/machine": (fs.f_blocks - fs.f_bfree) * fs.f_frsize}


def sample(rt: Runtime) -> tuple[dict[str, float], dict[str, dict]]:
    """One reading of every resource, flat: "kind/process" -> value; and per process its fds and threads by name
    and its RSS by kind of page."""
    procs = {"controller": process_resources(os.getpid())}
    for pid in [e["pid"] for e in process_tree(os.getpid())]:  # Ray's daemons, when this job started its own Ray
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            if comm in ("gcs_server", "raylet"):
                procs[f"ray.{comm}"] = process_resources(pid)
        except OSError:
            continue
    readings = ray.get([t.__ray_call__.remote(trainer_resources) for t in rt.trainers]
                       + [e.__ray_call__.remote(engine_resources) for e in rt.engines])
    for rank, reading in enumerate(readings[:len(rt.trainers)]):
        procs[f"trainer{rank}"] = reading
    for e, tree in enumerate(readings[len(rt.trainers):]):
        for name, reading in tree.items():
            procs[f"engine{e}" if name == "actor" else f"engine{e}.{name}"] = reading
    values: dict[str, float] = {}
    mapped: dict[int, int] = {}
    held: dict[int, int | None] = {}
    for name, p in procs.items():
        for kind in ("rss_bytes", "fds", "threads", "processes", "device_reserved_bytes", "device_used_bytes"):
            if kind in p:
                values[f"{kind}/{name}"] = p[kind]
        for inode, (size, allocated) in p["shm"].items():  # one object mapped by several processes counts once
            mapped[inode] = max(mapped.get(inode, 0), size)
            held[inode] = allocated if held.get(inode) is None else held[inode]
    values.update({"shm_entries/job": len(mapped), "shm_mapped_bytes/job": sum(mapped.values())})
    if None not in held.values():
        values["shm_held_bytes/job"] = sum(held.values())
    return {**values, **shm_usage()}, {name: p["names"] for name, p in procs.items()}


def deep_size(obj, seen: set | None = None) -> int:
    """Bytes of a Python object with everything it holds (dicts, lists, tuples), each object counted once."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    size = sys.getsizeof(obj)
    if isinstance(obj, dict):
        size += sum(deep_size(k, seen) + deep_size(v, seen) for k, v in obj.items())
    elif isinstance(obj, (list, tuple, set, deque)):
        size += sum(deep_size(x, seen) for x in obj)
    return size


def controller_lists(controller: Controller) -> dict:
    """What the controller keeps per step for the whole run (a candidate for the controller's RSS growth)."""
    return {name: {"len": len(getattr(controller, name)), "bytes": deep_size(getattr(controller, name))}
            for name in ("history", "events")}


# --------------------------------------------------------------------------------------------- the run

class _SoakController(Controller):
    """The controller, its loop untouched; `after_step` is called once each step has returned."""
    after_step = None

    def step(self, step: int, *, num_steps: int | None = None) -> dict:
        record = super().step(step, num_steps=num_steps)
        self.after_step(step, record)
        return record


def run_soak_bench(cfg: JobConfig, *, out_dir: str, name: str) -> dict:
    num_steps = cfg.algo.num_steps
    series: dict[str, list] = {}
    step_s: list[float] = []
    started = time.perf_counter()
    config = {"model": cfg.model.preset or cfg.model.path, "num_steps": num_steps, "engine_tp": cfg.engine.tp,
              "num_prompts": cfg.rollout.num_prompts, "num_samples": cfg.rollout.num_samples,
              "max_tokens": cfg.rollout.max_tokens, "sync_method": cfg.sync.method}
    first = windows(num_steps, baseline_step=BASELINE_STEP, window=WINDOW)[0].start
    names: dict[str, dict] = {}  # fds and threads by name at the baseline's first step and at the last one
    kept: dict[str, dict] = {}  # the controller's per-step lists, likewise

    def result(complete: bool) -> dict:
        return {"config": config, "complete": complete, "wall_s": time.perf_counter() - started,
                "num_steps_done": len(step_s), "step_s": step_s, "series": series,
                "summary": summarize(series, baseline_step=BASELINE_STEP, window=WINDOW, tolerance=TOLERANCE),
                f"changed_since_step_{first}": what_changed(names.get("baseline", {}), names.get("last", {})),
                "controller_lists": kept}

    metrics = MetricsWriter(cfg.logging, num_steps=num_steps, run_config=to_dict(cfg))
    try:
        with Runtime(cfg) as rt:
            config.update(device=rt.device, switch={"engine_sleep_level": rt.switch.engine_sleep_level,
                                                    "trainer_offload": rt.switch.trainer_offload})
            controller = _SoakController(cfg, rt, metrics)

            def after_step(step: int, record: dict) -> None:
                step_s.append(sum(record["times"].values()))
                values_now, names["last"] = sample(rt)
                if step in (first, num_steps - 1):
                    kept[f"at_step_{step}"] = controller_lists(controller)
                    names.setdefault("baseline", names["last"])
                for key, value in values_now.items():
                    # a series that starts late (a process that appeared) is padded, so index = step
                    series.setdefault(key, [None] * step).append(value)
                for values in series.values():
                    values.extend([None] * (step + 1 - len(values)))
                if (step + 1) % SAVE_EVERY == 0 or step == 0:
                    write_result(result(False), out_dir, name)
                    rss = sum(v[-1] for k, v in series.items() if k.startswith("rss_bytes/") and v[-1])
                    print(f"step {step + 1}/{num_steps}: {step_s[-1]:.2f} s, rss of the job's processes "
                          f"{rss / 2**30:.2f} GiB, job shm entries {series['shm_entries/job'][-1]}", flush=True)

            controller.after_step = after_step
            controller.run()
    finally:
        metrics.close()
    out = result(True)
    path = write_result(out, out_dir, name)
    plot(out, Path(out_dir) / f"{name}.png")
    print_summary(out, path)
    return out


# -------------------------------------------------------------------------------------------- verdict

def windows(num_steps: int, *, baseline_step: int, window: int) -> tuple[slice, slice]:
    """The baseline window (steps baseline_step .. +window-1) and the end window (the last `window` steps). A
    run too short for both shrinks them: the baseline starts at half the run, each window at least one step."""
    start = baseline_step if num_steps >= baseline_step + 2 * window else num_steps // 2
    width = min(window, max(1, (num_steps - start) // 2))
    return slice(start, start + width), slice(max(start, num_steps - width), num_steps)


def summarize(series: dict[str, list], *, baseline_step: int = BASELINE_STEP, window: int = WINDOW,
              tolerance: float = TOLERANCE) -> dict:
    """Per resource: the medians of the baseline and end windows, growth (relative; counts also absolute), the
    largest reading after the baseline's start, and pass (growth <= tolerance)."""
    num_steps = max((len(v) for v in series.values()), default=0)
    base, end = windows(num_steps, baseline_step=baseline_step, window=window)
    rows = {}
    for key, values in series.items():
        b = [v for v in values[base] if v is not None]
        e = [v for v in values[end] if v is not None]
        if not b or not e:
            rows[key] = {"baseline": None, "end": None, "growth": None, "pass": False, "note": "not recorded"}
            continue
        b, e = statistics.median(b), statistics.median(e)
        growth = (e - b) / b if b else (0.0 if e == 0 else float("inf"))
        later = [v for v in values[base.start:] if v is not None]
        # the change per step between the windows' centres: a slow linear leak inside the band still shows
        span = (end.start + end.stop - base.start - base.stop) / 2
        rows[key] = {"baseline": b, "end": e, "growth": growth, "abs_change": e - b, "max": max(later),
                     "per_step": (e - b) / span if span else 0.0, "pass": growth <= tolerance}
        if key.split("/")[0] in COUNTS:  # a count that stepped once and stayed is no trend: where it last moved
            moved = [i for i in range(base.start + 1, len(values)) if values[i] != values[i - 1]]
            rows[key].update(flat=e == b, last_change_step=moved[-1] if moved else None)
    return {"method": f"median of steps {base.start}..{base.stop - 1} (0-based) against the median of steps "
                      f"{end.start}..{end.stop - 1}; pass: growth <= {tolerance:.0%}; counts report the absolute "
                      "change too (flat: none) and the step it last changed at",
            "baseline_steps": [base.start, base.stop - 1], "end_steps": [end.start, end.stop - 1],
            "short_run": num_steps < baseline_step + 2 * window, "tolerance": tolerance,
            "all_pass": all(r["pass"] for r in rows.values()),
            # machine-wide /dev/shm counts every user's jobs: on a shared machine it is context, not a verdict
            "job_pass": all(r["pass"] for k, r in rows.items() if not k.endswith("/machine")), "resources": rows}


# ----------------------------------------------------------------------------------------- reporting

# panel of each resource kind: bytes as a share of their baseline (one scale for a 30 MiB daemon and a 700 MiB
# worker, and the 5% band visible), counts as they are
PANELS = {"rss_bytes": "RSS", "device_reserved_bytes": "device: torch reserved", "device_used_bytes":
          "device: driver used (whole GPU)", "shm_mapped_bytes": "/dev/shm bytes", "shm_held_bytes": "/dev/shm bytes",
          "shm_entry_bytes": "/dev/shm bytes", "shm_used_bytes": "/dev/shm bytes", "shm_entries": "/dev/shm entries",
          "fds": "open fds", "threads": "threads", "processes": "processes under the engine actor"}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: dict[str, list[str]] = {}
    for key in result["series"]:
        panels.setdefault(PANELS.get(key.split("/")[0], key.split("/")[0]), []).append(key)
    cols = 2
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(14, 3.4 * rows), squeeze=False)
    summary = result["summary"]
    first, tolerance = summary["baseline_steps"][0], summary["tolerance"]
    for ax, (title, keys) in zip(axes.flat, panels.items()):
        relative = keys[0].split("/")[0].endswith("bytes")
        for key in keys:
            values, row = result["series"][key], summary["resources"][key]
            name = key.split("/", 1)[1] if len({k.split("/")[1] for k in keys}) == len(keys) else key
            if relative and row["baseline"]:
                ys = [None if v is None else 100 * v / row["baseline"] for v in values]
                label = f"{name} ({row['baseline'] / 2**20:.0f} MiB, {row['growth']:+.1%})"
            else:
                ys = values
                label = name + ("" if row["baseline"] is None else f" ({row['abs_change']:+g})")
            ax.plot(range(len(values)), ys, label=label, linewidth=1.1)
        if relative:
            ax.axhspan(100 * (1 - tolerance), 100 * (1 + tolerance), color="tab:green", alpha=0.08)
            ax.set_ylabel(f"% of steps {first}..{summary['baseline_steps'][1]}")
        ax.axvline(first, color="gray", linestyle="--", linewidth=0.8)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.legend(fontsize=6, ncol=2)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    verdict = f"all within {tolerance:.0%}" if summary["all_pass"] else f"GROWTH beyond {tolerance:.0%}"
    fig.suptitle(f"soak: {result['num_steps_done']} steps, sleep/wake and sync every step ({verdict}); dashed: "
                 f"step {first}; bytes as % of their median over steps {first}..{summary['baseline_steps'][1]} "
                 f"(green: +-{tolerance:.0%}), counts as they are (legend: change)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_summary(result: dict, path: Path) -> None:
    s = result["summary"]
    print(f"{s['method']}")
    print(f"{'resource':<40}{'baseline':>13}{'end':>13}{'growth':>8}{'change':>12}{'per step':>11}  verdict")
    for key, r in s["resources"].items():
        if r["baseline"] is None:
            print(f"{key:<40}{'-':>13}{'-':>13}{'-':>8}{'-':>12}{'-':>11}  FAIL (not recorded)")
            continue
        if key.split("/")[0].endswith("bytes"):
            b, e, c = (f"{v / 2**20:.1f} MiB" for v in (r["baseline"], r["end"], r["abs_change"]))
            rate = f"{r['per_step'] / 1024:+.1f} KiB"
        else:
            b, e, c, rate = f"{r['baseline']:g}", f"{r['end']:g}", f"{r['abs_change']:+g}", f"{r['per_step']:+.3f}"
        moved = f" (count last moved at step {r['last_change_step']})" if r.get("last_change_step") else ""
        print(f"{key:<40}{b:>13}{e:>13}{r['growth']:>+8.1%}{c:>12}{rate:>11}  {'ok' if r['pass'] else 'FAIL'}{moved}")
    steps = result["step_s"]
    verdict = "all within" if s["all_pass"] else "the job's own within" if s["job_pass"] else "NOT all within"
    print(f"{result['num_steps_done']} steps: {sum(steps):.0f} s of steps (median {statistics.median(steps):.2f} s), "
          f"{result['wall_s']:.0f} s with start-up | {verdict} {s['tolerance']:.0%} | results: {path} (+ .png)")
