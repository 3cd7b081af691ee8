"""`colocate plot RUN_DIR`: one PNG of a run's metrics.jsonl, a panel per question a user asks of a run.

    colocate plot outputs/default                  # writes outputs/default/metrics.png
    colocate plot outputs/default --out run.png

Panels, per step: reward (the mean, its min-max band, and each named reward's mean when `rollout.rewards`
combines several); evaluation (pass@1 and pass@k at the steps that evaluated, when any did); the
training/inference mismatch (mean |log w| per token and the share of tokens outside the monitor's band); the KL
to the reference policy (when `algo.kl_coef` > 0 logs one); phase times (rollout, score, sleep/wake, train, sync,
stacked); memory (engine and trainer host RSS, and on CUDA each GPU's lowest free memory). The JSONL is the source
of truth; this only draws it.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from colocate.errors import ConfigError
from colocate.telemetry.metrics import read_records

PHASES = ("rollout", "score", "switch", "train", "sync")
GIB = 1 << 30


def read_steps(run_dir: str) -> list[dict]:
    path = Path(run_dir).expanduser() / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"RUN_DIR={run_dir!r} is invalid: it has no metrics.jsonl (a run's "
                          "logging.output_dir, e.g. outputs/default)")
    try:
        records = read_records(path)  # a run killed mid-write leaves half a last line: skipped
    except ValueError as e:
        raise ConfigError(str(e)) from None
    steps = {}
    for record in records:
        if "event" not in record:
            steps[record["step"]] = record  # a step run again after a resume counts by its last record
    if not steps:
        raise ConfigError(f"{path} holds no finished step yet")
    return [steps[step] for step in sorted(steps)]


def plot_run(run_dir: str, out: str | None = None) -> Path:
    steps = read_steps(run_dir)
    fig = draw_steps(steps, title=f"{Path(run_dir).expanduser().resolve().name}: {len(steps)} steps")
    path = Path(out) if out else Path(run_dir).expanduser() / "metrics.png"
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def draw_steps(steps: list[dict], title: str):
    """The figure, two panels a row; the evaluation and KL panels only when some step carries them."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("colocate plot needs matplotlib: pip install 'colocate[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["step"] for r in steps]
    panels = [_rewards]
    if any("eval" in r for r in steps):
        panels.append(_evals)
    panels.append(_mismatch)
    if any("kl" in r for r in steps):
        panels.append(_kl)
    panels += [_phases, _memory]
    rows = math.ceil(len(panels) / 2)
    fig, axes = plt.subplots(rows, 2, figsize=(12, 3.75 * rows), sharex=True, squeeze=False)
    cells = [ax for row in axes for ax in row]
    for draw, ax in zip(panels, cells):
        draw(ax, x, steps)
    for index in range(len(panels), len(cells)):  # an odd number of panels leaves the last cell empty
        cells[index].remove()
        cells[index - 2].xaxis.set_tick_params(labelbottom=True)  # sharex hid the tick labels of the one above
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def _rewards(ax, x, steps) -> None:
    ax.fill_between(x, [r["reward_min"] for r in steps], [r["reward_max"] for r in steps], alpha=0.15,
                    label="min-max")
    ax.plot(x, [r["reward_mean"] for r in steps], label="mean")
    named = sorted({k for r in steps for k in r if k.startswith("reward_") and k.endswith("_mean")} - {"reward_mean"})
    for key in named:
        ax.plot(x, [r.get(key) for r in steps], linewidth=1, label=key.removeprefix("reward_").removesuffix("_mean"))
    ax.set_title("reward")
    ax.legend(fontsize=7)


def _evals(ax, x, steps) -> None:
    """pass@1 and pass@k (k = eval.num_samples) only at the steps that evaluated: markers, not a curve per step."""
    evaluated = [(step, r["eval"]) for step, r in zip(x, steps) if "eval" in r]
    keys = sorted({k for _, e in evaluated for k in e if re.fullmatch(r"pass_at_\d+", k)},
                  key=lambda k: int(k.removeprefix("pass_at_")))
    for key in keys:
        points = [(step, e[key]) for step, e in evaluated if key in e]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=key.replace("pass_at_", "pass@"))
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("evaluation")
    ax.legend(fontsize=7)


def _kl(ax, x, steps) -> None:
    ax.plot(x, [r.get("kl") for r in steps], label="KL(policy || reference) per token")
    ax.set_title("KL to the reference policy")
    ax.legend(fontsize=7)


def _mismatch(ax, x, steps) -> None:
    ax.plot(x, [r["mismatch"] for r in steps], label="mean |log w| per token")
    ax.set_yscale("log")
    ax.set_title("training/inference mismatch")
    outside = ax.twinx()
    outside.plot(x, [r["mismatch_monitor"]["token"]["fraction_outside_band"] for r in steps], color="C3", linewidth=1,
                 label="tokens outside the band")
    outside.set_ylabel("share outside the band", color="C3")
    ax.legend(fontsize=7, loc="upper left")
    outside.legend(fontsize=7, loc="upper right")


def _phases(ax, x, steps) -> None:
    bottom = [0.0] * len(steps)
    for i, phase in enumerate(PHASES):
        heights = [r["times"].get(phase, 0.0) for r in steps]
        ax.bar(x, heights, bottom=bottom, width=1.0, color=f"C{i}", label="sleep/wake" if phase == "switch" else phase)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_title("seconds per step, by phase")
    ax.set_xlabel("step")
    ax.legend(fontsize=7)


def _memory(ax, x, steps) -> None:
    ax.plot(x, [r["memory"]["engine_rss_bytes"] / GIB for r in steps], label="engines, host RSS")
    ax.plot(x, [r["memory"]["trainer_rss_bytes"] / GIB for r in steps], label="trainers, host RSS")
    if "trainers" in steps[0]["memory"]:
        ax.plot(x, [min(t["device_free_bytes"] for t in r["memory"]["trainers"]) / GIB for r in steps],
                label="lowest GPU free")
    ax.set_title("memory (GiB)")
    ax.set_xlabel("step")
    ax.legend(fontsize=7)
