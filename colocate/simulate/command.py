"""`colocate simulate CONFIG [key=value ...] --gpus 8 --gpu h100 [--lengths SPEC]`: each way to run the job
predicted on a node of that GPU, side by side, the best one with the keys to set, a JSON and a PNG of the running
answers over one rollout per mode (the rollout chapter's picture). Everything is a model: docs/simulate.md says
what it counts, its constants and how far it landed from measurements.

Bad input is one line before anything runs: an unknown GPU (the known ones listed), a length distribution that
does not parse, a split that leaves no trainer GPU, a model whose dimensions are not on this machine.
"""

from __future__ import annotations

import json
from pathlib import Path

from colocate.config import JobConfig, load_config
from colocate.config.schema import AUTO
from colocate.errors import ConfigError
from colocate.job.resolve import place_engines
from colocate.models.dims import model_dims
from colocate.simulate.hardware import hardware
from colocate.simulate.lengths import LengthDistribution
from colocate.simulate.rollout import Speculative
from colocate.simulate.split import gpu_split_predictor, job_lengths
from colocate.simulate.step import Prediction, best_choice, predict, predict_modes


def check_request(cfg: JobConfig, gpus: int) -> None:
    """What `simulate` refuses before modelling anything, each one line naming the bad value (a split that leaves
    no trainer GPU, a TP that does not divide the GPUs: the config's own checks, placement.num_slots being --gpus)."""
    if gpus < 1:
        raise ConfigError(f"--gpus {gpus} is invalid: valid: a number of GPUs >= 1")
    if model_dims(cfg) is None:
        raise ConfigError(f"model.path={cfg.model.path!r}: its config.json is not on this machine (a local directory "
                          "or the Hugging Face cache); the simulation needs the model's dimensions")


def run_simulate(paths: list[str], overrides: list[str], *, gpus: int, gpu_name: str, lengths_spec: str,
                 prompt_tokens: int, out: Path, speculative: str = "", name: str = "simulate") -> dict:
    gpu = hardware(gpu_name)
    lengths = LengthDistribution.parse(lengths_spec)
    spec = _speculative(speculative) if speculative else None
    fixed = [f"placement.num_slots={gpus}", "placement.device=cuda", f"rollout.max_tokens={lengths.longest}",
             f"engine.max_model_len={prompt_tokens + lengths.longest}", f"data.max_prompt_tokens={prompt_tokens}"]

    decided: list[str] = []  # placement.engine_slots=auto, decided as launch decides it: the job as configured

    def load(keys: dict[str, str]) -> JobConfig:
        return load_config(paths, fixed + overrides + decided + [f"{k}={v}" for k, v in keys.items()])

    check_request(load({}), gpus)
    if load({}).placement.engine_slots == AUTO:
        predictor = gpu_split_predictor(gpu, num_gpus=gpus, lengths=lengths, prompt_tokens=prompt_tokens,
                                        note=f"a model: answers {lengths_spec}")
        placed, (decision,) = place_engines(load({}), device="cuda", predictor=predictor)
        print(f"{decision.key}: {decision.value} ({decision.why})")
        decided.append(f"placement.engine_slots={placed.placement.engine_slots}")
    predictions = predict_modes(load, gpu, gpus=gpus, lengths=lengths, prompt_tokens=prompt_tokens,
                                speculative=spec)
    best = best_choice(predictions)
    result = {"model": "colocate simulate (a model, not a measurement: docs/simulate.md)",
              "gpu": gpu.name, "measured": list(gpu.measured), "gpus": gpus, "lengths": lengths_spec,
              "prompt_tokens": prompt_tokens, "config": paths, "overrides": overrides,
              "predictions": [_as_json(p) for p in predictions], "best": best.label if best else None}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    _plot(predictions, out / f"{name}.png", title=f"{gpus} x {gpu.name}, lengths {lengths_spec} (model)")
    _print(predictions, best, out / f"{name}.json")
    return result


def _speculative(spec: str) -> Speculative:
    try:
        acceptance, num_draft, draft_cost = (float(v) for v in spec.split(","))
        if not 0 <= acceptance < 1 or num_draft < 1 or draft_cost < 0:
            raise ValueError
    except ValueError:
        raise ConfigError(f"--speculative {spec!r} does not parse; valid: ACCEPTANCE,DRAFT_TOKENS,DRAFT_COST with "
                          "0 <= ACCEPTANCE < 1, DRAFT_TOKENS >= 1, DRAFT_COST >= 0 (e.g. 0.7,4,0.05)") from None
    return Speculative(acceptance, int(num_draft), draft_cost)


def _as_json(p: Prediction) -> dict:
    return {"label": p.label, "keys": p.keys, "fits": p.fits, "refused": p.refused, "step_s": p.step_s,
            "phases": p.phases, "engine_utilization": p.engine_utilization,
            "trained_tokens_per_s": p.trained_tokens_per_s, "trained_tokens": p.trained_tokens,
            "carried_answers": p.carried_answers, "restarts": p.restarts, "timeline": p.timeline[::max(
                1, len(p.timeline) // 400)]}


def _print(predictions: list[Prediction], best: Prediction | None, path: Path) -> None:
    print(f"{'mode':<40} {'step s':>8} {'rollout':>8} {'switch':>7} {'train':>7} {'sync':>6} {'engine use':>10} "
          f"{'trained tok/s':>13}")
    for p in predictions:
        if not p.fits:
            print(f"{p.label:<40} does not fit: {p.refused}")
            continue
        ph = p.phases
        print(f"{p.label:<40} {p.step_s:8.1f} {ph['rollout']:8.1f} {ph.get('switch', 0.0):7.1f} "
              f"{ph['train']:7.1f} {ph['sync']:6.2f} {p.engine_utilization:10.0%} {p.trained_tokens_per_s:13.0f}")
    if best is not None:
        keys = " ".join(f"{k}={v}" for k, v in best.keys.items()) or "(the job as configured)"
        print(f"best: {best.label}: {keys}")
    print(f"results: {path} (+ .png); a model, not a measurement")


def _plot(predictions: list[Prediction], path: Path, *, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5))
    colors = plt.get_cmap("tab20").colors  # a colour a mode: more than the default cycle's ten
    for i, p in enumerate(predictions):
        if p.fits and p.timeline:
            ax.step([t for t, _ in p.timeline], [n for _, n in p.timeline], where="post", label=p.label,
                    color=colors[(2 * i) % 20 + (2 * i) // 20 % 2], linestyle="--" if i % 2 else "-")
    ax.set_xlabel("seconds into one rollout (engine 0, a steady-state step)")
    ax.set_ylabel("running answers")
    ax.set_title(title, fontsize=9)
    if ax.get_legend_handles_labels()[0]:  # nothing fits: an empty picture, the JSON says why
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def predicted_step_line(cfg: JobConfig, *, gpus: int, gpu_name: str) -> str:
    """`colocate validate --gpus N`: the job as configured, its step predicted on N GPUs of `gpu_name` with answers
    log-normal around a quarter of rollout.max_tokens (`colocate simulate --lengths` for others)."""
    gpu = hardware(gpu_name)
    longest = cfg.rollout.max_tokens
    lengths, prompt = job_lengths(cfg)
    p = predict(lambda keys: cfg, {}, "as configured", gpu, gpus=gpus, lengths=lengths, prompt_tokens=prompt)
    if not p.fits:
        return f"predicted step: none ({p.refused})"
    phases = ", ".join(f"{k} {v:.1f}" for k, v in p.phases.items())
    return (f"predicted step on {gpus} x {gpu.name}: {p.step_s:.1f} s ({phases}; {p.trained_tokens_per_s:.0f} "
            f"trained tokens/s; a model: answers log-normal around {longest // 4} tokens, colocate simulate for more)")
