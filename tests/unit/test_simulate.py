"""`colocate simulate`: the rollout chapter's numbers reproduced exactly, the train phase against the H200's
measured table, each candidate checked by the job's own checks, and bad input refused in one line."""

from __future__ import annotations

import json
import statistics

import pytest

from colocate.cli import main
from colocate.config import load_config
from colocate.models.dims import ModelDims, model_dims
from colocate.simulate.decode import chapter_numbers, decode, lognormal_lengths
from colocate.simulate.hardware import H200_TRAIN_TOKENS_PER_S, hardware
from colocate.simulate.lengths import LengthDistribution
from colocate.simulate.phases import Work, overlapped_s, train_s
from colocate.simulate.rollout import RolloutSim
from colocate.simulate.step import candidates

QWEN_7B = "tests/data/model_configs/Qwen2.5-7B-Instruct"


def test_the_chapters_numbers():
    n = chapter_numbers()
    assert (n["median"], n["longest"]) == (1549, 16384)
    assert round(n["rollout_s"]) == 203 and round(n["full_batch_s"]) == 102
    assert round(100 * n["fraction_under_128"]) == 54
    assert round(n["capped_s"]) == 96 and n["carried"] == 145


def test_decode_counts_every_token_once_and_stops_early_on_groups():
    lengths = lognormal_lengths(64, median=50, sigma=0.9, low=4, high=400, seed=1)
    run = decode(lengths, max_running=16, prompt_tokens=8, step_s=lambda b, c: 1.0)
    assert run.num_tokens == sum(lengths) and run.num_finished == 64 and not run.left
    stopped = decode(lengths, max_running=16, prompt_tokens=8, step_s=lambda b, c: 1.0,
                     groups=[i // 4 for i in range(64)], stop_after_groups=3)
    assert stopped.num_tokens + sum(stopped.left.values()) == sum(lengths)  # what was cut is carried, to the token
    assert stopped.num_steps < run.num_steps and stopped.num_carried == len(stopped.left)


def test_a_kv_cache_that_holds_less_admits_fewer():
    lengths = [100] * 32
    wide = decode(lengths, max_running=32, prompt_tokens=10, step_s=lambda b, c: 1.0)
    narrow = decode(lengths, max_running=32, prompt_tokens=10, step_s=lambda b, c: 1.0, kv_capacity=100)
    assert wide.num_steps == 100 and narrow.num_steps > 100


@pytest.mark.parametrize("tokens, measured", H200_TRAIN_TOKENS_PER_S)
def test_the_train_phase_against_the_h200_table(tokens, measured):
    """The measured model (Qwen2.5-7B cut to 4 layers, one rank, one micro-batch of `tokens`) within 15%."""
    config = json.loads(open(f"{QWEN_7B}/config.json").read())
    dims = ModelDims.from_config_dict({**config, "num_hidden_layers": 4})
    work = Work.of(load_config(None, [f"model.path={QWEN_7B}"]), dims, prompt_tokens=512)
    predicted = tokens / train_s(work, hardware("h200"), ranks=1, tokens=tokens, micro_batch_tokens=tokens,
                                 sequence_tokens=tokens)["seconds"]
    assert predicted == pytest.approx(measured, rel=0.15)


def _engine(resume_s_per_token: float = 0.0, pass_s: float = 0.0):
    """An engine of 10 ms decode steps and free prompts, continuations and passes unless given a cost."""
    return type("E", (), {"step_s": staticmethod(lambda b, c: 0.01), "prefill_s": staticmethod(lambda n: 0.0),
                          "resume_s": staticmethod(lambda n: n * resume_s_per_token), "pass_s": pass_s,
                          "kv_capacity_tokens": 10**9})()


def test_a_continued_answer_computes_its_context_again_and_each_pass_costs_its_fixed_part():
    """A continuation is a new request (engine/requests.py): its prompt and tokens so far are prefilled again."""
    cfg = load_config(None, [f"model.path={QWEN_7B}", "rollout.num_prompts=8", "rollout.num_samples=4"])
    work = Work.of(cfg, model_dims(cfg), prompt_tokens=64)

    def run(engine):
        draw = LengthDistribution.parse("lognormal:200,0.9,8,2000").sampler(seed=0)
        return RolloutSim(work, engine, num_engines=1, draw=draw, partial_tokens=100, max_lag=20).run(4).steps

    free, resumed, fixed = run(_engine()), run(_engine(resume_s_per_token=1e-3)), run(_engine(pass_s=0.5))
    assert resumed[0]["seconds"] == free[0]["seconds"]  # nothing to continue in the first pass
    for before, f, r in zip(free, free[1:], resumed[1:]):
        # each answer carried into the pass had at least a pass's 100 tokens: its prompt and those, again
        assert before["carried_answers"] and r["seconds"] - f["seconds"] >= 0.164 * before["carried_answers"] - 1e-9
    assert all(x["seconds"] == pytest.approx(f["seconds"] + 0.5) for x, f in zip(fixed, free))


def test_partial_rollout_carries_and_over_sampling_stops_early():
    cfg = load_config(None, [f"model.path={QWEN_7B}", "rollout.num_prompts=8", "rollout.num_samples=4"])
    work = Work.of(cfg, model_dims(cfg), prompt_tokens=64)
    step = _engine()
    draw = LengthDistribution.parse("lognormal:200,0.9,8,2000").sampler(seed=0)
    whole = RolloutSim(work, step, num_engines=2, draw=draw).run(4)
    assert all(s["groups"] == 8 and s["carried_answers"] == 0 for s in whole.steps)
    draw = LengthDistribution.parse("lognormal:200,0.9,8,2000").sampler(seed=0)
    partial = RolloutSim(work, step, num_engines=2, draw=draw, partial_tokens=100, max_lag=20).run(4)
    assert any(s["carried_answers"] for s in partial.steps) and partial.mean("seconds") < whole.mean("seconds")
    # async's step: the passes that complete 8 groups; a pass completes fewer, so the step is longer than one
    completed = sum(s["groups"] for s in partial.steps[2:])
    assert completed < 8 * len(partial.steps[2:])
    per_step = partial.per_step_of(8, "seconds")
    assert per_step == pytest.approx(sum(s["seconds"] for s in partial.steps[2:]) * 8 / completed)
    assert per_step > partial.mean("seconds")


def test_async_holds_complete_groups_until_a_step_takes_num_prompts_of_them():
    """rollout/passes.py: a complete group keeps its place until the step's take of rollout.num_prompts, so the
    pool is not topped up meanwhile; a step takes exactly num_prompts groups, and a version is a step."""
    cfg = load_config(None, [f"model.path={QWEN_7B}", "rollout.num_prompts=8", "rollout.num_samples=4"])
    work = Work.of(cfg, model_dims(cfg), prompt_tokens=64)
    draw = LengthDistribution.parse("lognormal:200,0.9,8,2000").sampler(seed=0)
    rounds = RolloutSim(work, _engine(), num_engines=2, draw=draw, partial_tokens=100, max_lag=20,
                        take_whole=True).run(4)
    takes = [s["groups"] for s in rounds.steps]
    assert sorted(set(takes)) == [0, 8] and takes.count(8) == 4 and takes[-1] == 8  # run(4): until four takes
    assert rounds.warmup_steps == takes.index(8, takes.index(8) + 1) + 1  # the passes of the first two steps
    assert rounds.per_step_of(8, "trained_tokens") == pytest.approx(
        statistics.fmean(s["trained_tokens"] for s in rounds.steps[rounds.warmup_steps:] if s["groups"]))


@pytest.mark.parametrize("gain, step", [(2.0, 3.0), (1.0, 5.0), (0.5, 10.0), (0.99, 5.0 / 0.99)])
def test_overlapped_sides_by_their_gain(gain, step):
    """Sides of their own (2): the longer; time-sliced (1, an H200's 0.99): the sum; fighting (0.5): worse."""
    assert overlapped_s(2.0, 3.0, gain) == pytest.approx(step)


def test_each_partial_candidate_sets_a_lag_cap_its_check_accepts():
    cfg = load_config(None, [f"model.path={QWEN_7B}", "rollout.max_tokens=16384", "engine.max_model_len=17000",
                             "placement.num_slots=8"])
    for label, keys in candidates(cfg, 8):
        if "rollout.partial_tokens" in keys:  # the config's own checks: a cap the lag cap forbids raises
            load_config(None, [f"model.path={QWEN_7B}", "rollout.max_tokens=16384", "engine.max_model_len=17000",
                               "placement.num_slots=8", *(f"{k}={v}" for k, v in keys.items())])


@pytest.mark.parametrize("argv, says", [
    (["--gpu", "h900"], "--gpu 'h900' is not a GPU colocate simulate knows; valid: h100, h200, a100, b200, l20"),
    (["--lengths", "lognormal:x"], "--lengths 'lognormal:x' does not parse"),
    (["placement.engine_slots=8"], "placement.engine_slots=8 is invalid: a split placement leaves at least one"),
    (["--speculative", "2,4,0.1"], "--speculative '2,4,0.1' does not parse"),
])
def test_bad_input_is_one_line(argv, says, capsys, tmp_path):
    code = main(["simulate", f"model.path={QWEN_7B}", "--gpus", "8", "--out", str(tmp_path), *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and says in err, err


def test_simulate_prints_each_mode_and_the_best_and_writes_json_and_png(capsys, tmp_path):
    code = main(["simulate", f"model.path={QWEN_7B}", "rollout.num_prompts=16", "rollout.num_samples=4",
                 "trainer.micro_batch_size=1", "trainer.mixed_precision=true", "--gpus", "8", "--gpu", "h100",
                 "--lengths", "lognormal:500,0.9,32,4096", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0 and "best: " in out and "one_step_off, split 4+4" in out
    result = json.loads((tmp_path / "simulate.json").read_text())
    assert (tmp_path / "simulate.png").stat().st_size > 10_000
    fitting = [p for p in result["predictions"] if p["fits"]]
    assert fitting and all(p["step_s"] > 0 and p["trained_tokens_per_s"] > 0 for p in fitting)
    assert result["best"] == max(fitting, key=lambda p: p["trained_tokens_per_s"])["label"]


def test_validate_prints_the_predicted_step_beside_the_memory(capsys):
    job = [f"model.path={QWEN_7B}", "placement.num_slots=8", "engine.tp=2", "engine.max_model_len=4096",
           "rollout.max_tokens=1024", "trainer.micro_batch_size=1"]
    assert main(["validate", *job, "--gpus", "8", "--gpu-memory-gib", "79.6", "--gpu", "h200"]) == 0
    out = capsys.readouterr().out
    assert "# predicted memory per phase, per GPU" in out and "# predicted step on 8 x H200" in out
    assert main(["validate", *job, "--gpus", "8", "--gpu-memory-gib", "79.6", "--gpu", "v100"]) == 2
    assert "--gpu 'v100' is not a GPU colocate simulate knows" in capsys.readouterr().err



def test_mini_batches_epochs_and_the_recompute_add_their_share_of_a_train_phase():
    config = json.loads(open(f"{QWEN_7B}/config.json").read())
    work = Work.of(load_config(None, [f"model.path={QWEN_7B}"]), ModelDims.from_config_dict(config), prompt_tokens=512)
    kwargs = dict(ranks=8, tokens=64 * 8 * 1024, micro_batch_tokens=8192, sequence_tokens=1024)
    one = train_s(work, hardware("h100"), **kwargs)
    many = train_s(work, hardware("h100"), **kwargs, num_updates=16, num_epochs=2, recompute=True)
    assert many["optimizer_s"] == pytest.approx(16 * one["optimizer_s"])  # AdamW once an optimizer step
    assert many["compute_s"] == pytest.approx(2 * one["compute_s"])  # the tokens once an epoch
    assert many["recompute_s"] > 0 == one["recompute_s"]
    assert many["seconds"] == pytest.approx(2 * (one["seconds"] - one["optimizer_s"]) + many["optimizer_s"]
                                            + many["recompute_s"])


def test_the_critic_adds_its_own_forward_backward_optimizer_and_values_pass():
    config = json.loads(open(f"{QWEN_7B}/config.json").read())
    work = Work.of(load_config(None, [f"model.path={QWEN_7B}"]), ModelDims.from_config_dict(config), prompt_tokens=512)
    kwargs = dict(ranks=8, tokens=64 * 8 * 1024, micro_batch_tokens=8192, sequence_tokens=1024, num_updates=4,
                  num_epochs=2, recompute=True)
    policy = train_s(work, hardware("h100"), **kwargs)
    ppo = train_s(work, hardware("h100"), **kwargs, critic=True)
    assert policy["critic_s"] == 0 and ppo["critic_s"] == pytest.approx(policy["seconds"])  # with its values pass
    assert ppo["seconds"] == pytest.approx(2 * policy["seconds"])
