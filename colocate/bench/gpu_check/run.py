"""The check's command line: which sections run, with what sizes, and the one JSON they write.

Sections run in order, each timed and recorded as pass / fail / skipped / not_applicable; one failing does not
stop the others, and the JSON is rewritten after each (a run cut short still leaves what it measured). The sizes
are the GPU's by default and the CPU twin's with `--device cpu` (CI runs that in under a minute on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

import torch

from colocate.bench.gpu_check import constants, fresh_pages, node, offload, ring, sync_steady, train_step, trainer
from colocate.bench.gpu_check.common import failure

# Sections whose path the CPU has: they must pass in `--device cpu` (the rest are CUDA-only and say why not)
CPU_TWINS = ("env", "node_checks", "ring_ipc", "fsdp2", "offload", "memory_release", "constants", "fresh_pages",
             "steady_sync", "train_step")
CUDA_ONLY = {"late_load_race": "not_applicable", "memory_saver": "skipped"}


def sections(args, device: torch.device, tms: dict) -> dict:
    cuda = device.type == "cuda"
    return {
        "env": lambda: node.env_section(device, tms),
        "node_checks": lambda: node.node_checks_section(device),
        "ring_ipc": lambda: ring.ring_section(device, size_mib=args.size_mib, num_buckets=args.num_buckets),
        "late_load_race": lambda: ring.race_section(device, size_mib=args.size_mib, trials=args.race_trials),
        "fsdp2": lambda: trainer.fsdp2_section(device, tms),
        "offload": lambda: offload.offload_section(device, tms, state_bytes=int(args.offload_gib * (1 << 30))),
        "memory_release": lambda: offload.memory_section(device, size=(2 << 30) if cuda else (64 << 20)),
        "constants": lambda: constants.constants_section(device),
        "memory_saver": lambda: offload.memory_saver_section(device, tms),
        "fresh_pages": lambda: fresh_pages.fresh_pages_section(device, tms,
                                                               num_bytes=(256 << 20) if cuda else (16 << 20)),
        "steady_sync": lambda: sync_steady.steady_sync_section(device, syncs=args.syncs),
        "train_step": lambda: train_step.train_step_section(device, lengths=args.train_lengths,
                                                            measured=args.train_measured),
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="One-GPU check of colocate's CUDA path; writes one JSON.")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--size-mib", type=int, help="ring slot size (and the race's slot); default 256, CPU 8")
    parser.add_argument("--num-buckets", type=int, default=8, help="buckets sent through the 2-slot ring")
    parser.add_argument("--race-trials", type=int, default=5)
    parser.add_argument("--offload-gib", type=float, help="trainer state in the offload section; default 4, CPU 1/16")
    parser.add_argument("--syncs", type=int, default=3, help="timed syncs per slot size in steady_sync")
    parser.add_argument("--train-lengths", type=lambda s: [int(x) for x in s.split(",")],
                        help="train_step's lengths in tokens; default 4096,8192,16384,32768 (CPU 192,384)")
    parser.add_argument("--train-measured", type=int, help="measured steps per length after the warm one; "
                        "default 2, CPU 1")
    parser.add_argument("--sections", help="comma-separated subset to run (default: all)")
    parser.add_argument("--tms-wheel", help="torch_memory_saver wheel to use when the package is not importable")
    parser.add_argument("--out", help="JSON path (default: $OUT/gpu_check.json, else benchmarks/results/gpu/)")
    args = parser.parse_args(argv)
    cpu = args.device == "cpu"
    args.size_mib = args.size_mib or (8 if cpu else 256)
    args.offload_gib = args.offload_gib or (1 / 16 if cpu else 4.0)
    args.train_measured = args.train_measured or (1 if cpu else 2)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    default_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else node.ROOT / "benchmarks/results/gpu"
    out_path = Path(args.out) if args.out else default_dir / f"gpu_check{'' if args.device == 'cuda' else '_cpu'}.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        # as a CPU trainer rank runs (trainer.num_threads): with the cores busy, torch's second intra-op thread
        # stalls every parallel copy (measured here under load: 14 ms per 0.5 MB copy, 30-60x one thread's)
        torch.set_num_threads(1)
    report = {"command": shlex.join([Path(sys.executable).name, *(sys.argv if argv is None else argv)]),
              "config": vars(args), "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "sections": {}}
    started = time.perf_counter()
    # first: the forkserver every child comes from keeps the sys.path of its start (common.py)
    tms = node.ensure_tms(args.tms_wheel) if device.type == "cuda" else {"available": False, "reason": "CPU mode"}
    chosen = sections(args, device, tms)
    wanted = args.sections.split(",") if args.sections else list(chosen)
    unknown = sorted(set(wanted) - set(chosen))
    if unknown:
        raise SystemExit(f"--sections: unknown {', '.join(unknown)}; valid: {', '.join(chosen)}")
    for key in wanted:
        t0 = time.perf_counter()
        try:
            result = chosen[key]()
        except Exception:
            result = failure()
        result["seconds"] = time.perf_counter() - t0
        report["sections"][key] = result
        report["total_seconds"] = time.perf_counter() - started
        report["passed"] = all(s["status"] != "fail" for s in report["sections"].values())
        out_path.write_text(json.dumps(report, indent=2, default=str))
        print(f"[{key}] {result['status']} in {result['seconds']:.1f} s"
              + (f": {result.get('error') or result.get('reason')}" if result["status"] != "pass" else ""), flush=True)
    print(f"total {report['total_seconds']:.1f} s, {'passed' if report['passed'] else 'FAILED'}; wrote {out_path}")
    return 0 if report["passed"] else 1
