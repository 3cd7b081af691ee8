"""Does a LoRA job learn the default task, and what does its sync move against a full fine-tune's? Two jobs of
the default config, side by side on the same prompts and seeds: full training (trainer.lr=1e-3) and LoRA rank 8
on every projection (trainer.lr=5e-3, alpha 16), each 32 steps with an evaluation of fixed prompts (64 prompts x
8 samples at temperature 1) before the first step and after every 8th. Writes one JSON with both reward curves
and each job's sync bytes and seconds per step.

    .venv/bin/python benchmarks/lora_learning.py [--out benchmarks/results] [--runs DIR]

--runs DIR keeps the jobs' output directories there (default: a temporary directory); a job whose directory
already holds its 32 steps is not run again, so the summary can be rebuilt from finished runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from colocate.bench.common import write_result

NUM_STEPS = 32
COMMON = ["configs/default.yaml", f"algo.num_steps={NUM_STEPS}", "logging.progress=false", "checkpoint.at_end=false",
          "eval.at_start=true", "eval.every_steps=8", "eval.num_samples=8", "eval.temperature=1.0"]
JOBS = {"full": ["trainer.lr=1e-3"], "lora_rank8": ["trainer.lora.rank=8", "trainer.lr=5e-3"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--runs", default=None)
    args = parser.parse_args()
    runs = Path(args.runs or tempfile.mkdtemp(prefix="lora-learning-"))
    colocate = Path(sys.executable).parent / "colocate"
    result = {"command": " ".join(["python", "benchmarks/lora_learning.py", *sys.argv[1:]]),
              "config": {"common": COMMON, "jobs": JOBS}}
    for name, overrides in JOBS.items():
        out = runs / name
        command = [str(colocate), "launch", *COMMON, *overrides, f"logging.output_dir={out}"]
        if len(_steps(out)) != NUM_STEPS:
            subprocess.run(command, check=True)
        result[name] = _summary(out)
    full, lora = result["full"], result["lora_rank8"]
    result["ratios"] = {
        "lora_sync_bytes_over_full": lora["sync_bytes_per_step"] / full["sync_bytes_per_step"],
        "lora_sync_s_over_full": lora["sync_s_median"] / full["sync_s_median"],
        **{f"{name}_eval_reward_gain": result[name]["eval_reward_mean"][-1]["reward_mean"]
           / result[name]["eval_reward_mean"][0]["reward_mean"] for name in JOBS},
    }
    path = write_result(result, args.out, "lora_learning")
    for name in JOBS:
        r = result[name]
        curve = " -> ".join(f"{e['reward_mean']:.3f}" for e in r["eval_reward_mean"])
        print(f"{name:>10}: eval reward {curve} | sync {r['sync_bytes_per_step'] / 1e3:.1f} KB, "
              f"{r['sync_s_median'] * 1e3:.1f} ms a step | trained params {r['num_trained_params']}")
    print(f"results: {path}")


def _records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _steps(out: Path) -> list[dict]:
    return [r for r in _records(out) if "event" not in r]


def _summary(out: Path) -> dict:
    records = _records(out)
    steps = _steps(out)
    startup = next(r for r in records if r.get("event") == "startup")
    evals = [{"after_steps": 0, "reward_mean": r["eval"]["reward_mean"]} for r in records if r.get("event") == "eval"]
    evals += [{"after_steps": r["step"] + 1, "reward_mean": r["eval"]["reward_mean"]} for r in steps if "eval" in r]
    return {
        "num_params": startup["trainers"][0]["num_params"],
        "num_trained_params": startup["trainers"][0]["num_trained_params"],
        "eval_reward_mean": evals,
        "train_reward_mean": [r["reward_mean"] for r in steps],
        "sync_bytes_per_step": steps[-1]["sync_bytes"],
        "sync_s_median": statistics.median(r["sync_s"] for r in steps),
        "sync_s": [r["sync_s"] for r in steps],
    }


if __name__ == "__main__":
    main()
