"""Prompt data from files: formats, chat messages, the seeded epoch order and its resumable state, the length
filter, every bad input as a one-line ConfigError, and the shipped math set (regenerates byte for byte)."""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

import pytest

from colocate.config import DataConfig, load_config
from colocate.errors import ConfigError
from colocate.job.checks import check_sources
from colocate.models.sources import CHARACTERS, CHAT_CHARACTERS, SPECIAL_TOKENS, build_tokenizer
from colocate.rl.data import DatasetPrompts, load_val_samples, make_prompt_source, render_prompt
from colocate.rl.tasks import PromptStream, Sample, make_task

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()  # the embedded models' character tokenizer, as written into every preset


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    """Keep `datasets`' converted copies out of the user's cache."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def rows(n: int, start: int = 0) -> list[dict]:
    return [{"prompt": f"{i}+1=", "answer": i + 1} for i in range(start, start + n)]


def config(*overrides: str):
    return load_config(None, ["rollout.num_prompts=4", *overrides])


def one_line_error(fn, *needles: str) -> str:
    with pytest.raises(ConfigError) as info:
        fn()
    message = str(info.value)
    assert "\n" not in message, message
    for needle in needles:
        assert needle in message, message
    return message


# ---------------------------------------------------------------------------------------------------- formats


def test_jsonl_plain_text(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "train.jsonl", rows(6))
    prompts = make_prompt_source(config(f"data.train_files={path}", "data.shuffle=false"), tokenizer)
    assert isinstance(prompts, DatasetPrompts)
    assert prompts.next_batch(2) == [Sample("0+1=", "1"), Sample("1+1=", "2")]  # numeric answers become text


def test_parquet(tmp_path, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": r["prompt"], "solution": str(r["answer"])} for r in rows(5)]),
                   path)
    cfg = config(f"data.train_files={path}", "data.prompt_key=question", "data.answer_key=solution",
                 "data.shuffle=false")
    assert make_prompt_source(cfg, tokenizer).next_batch(5)[4] == Sample("4+1=", "5")


def test_several_files_as_a_yaml_list_and_as_commas(tmp_path, tokenizer):
    a, b = write_jsonl(tmp_path / "a.jsonl", rows(3)), write_jsonl(tmp_path / "b.jsonl", rows(3, start=3))
    as_list = config(f"data.train_files=[{a}, {b}]", "data.shuffle=false")
    as_commas = config(f"data.train_files={a},{b}", "data.shuffle=false")
    assert as_list.data.train_files == as_commas.data.train_files == f"{a},{b}"
    assert [s.prompt for s in make_prompt_source(as_list, tokenizer).next_batch(6)] == [f"{i}+1=" for i in range(6)]


def test_chat_messages_joined_without_a_template(tmp_path, tokenizer):
    messages = [{"role": "system", "content": "add"}, {"role": "user", "content": "2+2="}]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": messages, "answer": "4"}] * 4)
    sample = make_prompt_source(config(f"data.train_files={path}"), tokenizer).next_batch(1)[0]
    assert sample == Sample("add\n2+2=", "4")


def test_chat_messages_through_the_chat_template():
    tokenizer = build_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }};{% endfor %}"
                               "{% if add_generation_prompt %}a:{% endif %}")
    messages = [{"role": "system", "content": "add"}, {"role": "user", "content": "2+2="}]
    assert render_prompt(messages, tokenizer) == "s:add;u:2+2=;a:"
    # data.chat_template=auto (the default): plain text is the user's message, through the model's template
    assert render_prompt("2+2=", tokenizer) == "u:2+2=;a:"
    none = DataConfig(chat_template="none")
    assert render_prompt("2+2=", tokenizer, none) == "2+2=" and render_prompt(messages, tokenizer, none) == "add\n2+2="


QWEN3_LIKE = ("{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{%- endfor %}"
              "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- if enable_thinking is defined and "
              "enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}{%- endif %}")


@pytest.mark.parametrize("kwargs", ["", '{"enable_thinking": false}'])
def test_a_chat_template_file_renders_plain_prompts_byte_for_byte_as_the_tokenizer_does(tmp_path, kwargs):
    """data.chat_template=PATH over the model's own, its keyword arguments passed through (Qwen3's
    enable_thinking): each row's prompt is the tokenizer's apply_chat_template of it, byte for byte."""
    template = tmp_path / "chat.jinja"
    template.write_text(QWEN3_LIKE)
    tokenizer = build_tokenizer(SPECIAL_TOKENS + list(CHAT_CHARACTERS))
    path = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(4)])
    cfg = config(f"data.train_files={path}", f"data.chat_template={template}",
                 f"data.chat_template_kwargs={kwargs}" if kwargs else "data.chat_template_kwargs=")
    got = make_prompt_source(cfg, tokenizer).next_batch(4)
    for sample in got:
        text = sample.prompt.split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
        expected = tokenizer.apply_chat_template([{"role": "user", "content": text}], chat_template=QWEN3_LIKE,
                                                 tokenize=False, add_generation_prompt=True,
                                                 **({"enable_thinking": False} if kwargs else {}))
        assert sample.prompt == expected
        assert ("<think>" in sample.prompt) == bool(kwargs)  # the keyword reached the template


def test_toy_task_stays_the_source_without_files(tokenizer):
    prompts = make_prompt_source(load_config(None, []), tokenizer)
    assert isinstance(prompts, PromptStream) and prompts.task.name == "copy"


# ------------------------------------------------------------------------------------------ order and state


def test_shuffle_is_seeded_and_epochs_reshuffle(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "train.jsonl", rows(10))
    first = make_prompt_source(config(f"data.train_files={path}", "data.seed=3"), tokenizer)
    again = make_prompt_source(config(f"data.train_files={path}", "data.seed=3"), tokenizer)
    other = make_prompt_source(config(f"data.train_files={path}", "data.seed=4"), tokenizer)
    epoch0, epoch1 = first.next_batch(10), first.next_batch(10)
    assert again.next_batch(20) == epoch0 + epoch1
    assert other.next_batch(10) != epoch0
    assert sorted(s.prompt for s in epoch0) == sorted(s.prompt for s in epoch1) == sorted(f"{i}+1=" for i in range(10))
    assert epoch0 != epoch1 and epoch0 != [Sample(f"{i}+1=", str(i + 1)) for i in range(10)]
    assert first.state() == {"epoch": 1, "position": 10, "seed": 3, "shuffle": True, "num_rows": 10}


def test_a_batch_runs_on_into_the_next_epoch():
    samples = [Sample(str(i), "") for i in range(5)]
    prompts = DatasetPrompts(samples, shuffle=False)
    assert [s.prompt for s in prompts.next_batch(7)] == ["0", "1", "2", "3", "4", "0", "1"]
    assert prompts.state()["epoch"] == 1 and prompts.state()["position"] == 2


def test_state_resumes_the_same_order():
    samples = [Sample(str(i), "") for i in range(13)]
    run = DatasetPrompts(samples, seed=7)
    run.next_batch(4), run.next_batch(4), run.next_batch(9)  # into the second epoch
    state = run.state()
    expected = [run.next_batch(4) for _ in range(5)]
    resumed = DatasetPrompts(samples, seed=7)
    resumed.load_state(json.loads(json.dumps(state)))  # as a checkpoint would store it
    assert [resumed.next_batch(4) for _ in range(5)] == expected


def test_state_of_other_data_is_refused():
    state = DatasetPrompts([Sample("a", "")] * 3, seed=1).state()
    with pytest.raises(ValueError, match="data.seed"):
        DatasetPrompts([Sample("a", "")] * 3, seed=2).load_state(state)
    with pytest.raises(ValueError, match="num_rows"):
        DatasetPrompts([Sample("a", "")] * 4, seed=1).load_state(state)


# ---------------------------------------------------------------------------------------------- length limit


def test_too_long_prompts_are_filtered_and_counted_once(tmp_path, tokenizer, caplog):
    data = rows(6) + [{"prompt": "1" * 30, "answer": 1}, {"prompt": "2" * 31, "answer": 2}]
    path = write_jsonl(tmp_path / "train.jsonl", data)
    with caplog.at_level(logging.WARNING, logger="colocate"):
        prompts = make_prompt_source(config(f"data.train_files={path}", "data.max_prompt_tokens=10"), tokenizer)
    assert prompts.num_dropped == 2 and prompts.state()["num_rows"] == 6
    assert all(len(s.prompt) <= 10 for s in prompts.next_batch(12))
    warnings = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(warnings) == 1 and "dropped 2 of 8" in warnings[0] and "row 6" in warnings[0]


def test_engine_context_is_the_limit_when_none_is_set(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "train.jsonl", rows(4) + [{"prompt": "1" * 40, "answer": 1}])
    prompts = make_prompt_source(config(f"data.train_files={path}", "engine.max_model_len=32"), tokenizer)
    assert prompts.num_dropped == 1  # 40 tokens leave no room to answer within 32


def test_too_long_error_names_the_row(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "train.jsonl", rows(4) + [{"prompt": "1" * 30, "answer": 1}])
    cfg = config(f"data.train_files={path}", "data.max_prompt_tokens=10", "data.too_long=error")
    one_line_error(lambda: make_prompt_source(cfg, tokenizer), "data.max_prompt_tokens=10", "row 4", "30-token")


# -------------------------------------------------------------------------------------------- bad inputs


@pytest.mark.parametrize("overrides, needles", [
    pytest.param(["data.train_files=no/such.jsonl"], ["data.train_files", "'no/such.jsonl'", "does not exist"],
                 id="missing_file"),
    pytest.param(["data.train_files=train.csv"], ["data.train_files", "unsupported extension", ".jsonl, .parquet"],
                 id="unsupported_extension"),
    pytest.param(["data.val_files=nowhere/*.jsonl"], ["data.val_files", "no file matches"], id="empty_glob"),
    pytest.param(["data.too_long=truncate"], ["data.too_long", "filter, error"], id="bad_too_long"),
    pytest.param(["data.max_prompt_tokens=128"], ["data.max_prompt_tokens", "engine.max_model_len=128"],
                 id="no_room_to_answer"),
    pytest.param(["data.max_prompt_tokens=-1"], ["data.max_prompt_tokens", ">= 0"], id="negative_limit"),
    pytest.param(["data.train_files=[1, 2]"], ["data.train_files", "file paths"], id="list_of_numbers"),
])
def test_checks_before_any_actor(overrides, needles):
    one_line_error(lambda: check_sources(load_config(None, overrides)), *needles)


def test_bad_data_exits_2_from_the_cli(capsys):
    from colocate.cli import main

    assert main(["validate", "data.train_files=missing.jsonl"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "missing.jsonl" in err[0]


def test_missing_prompt_key_lists_the_file_keys(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "train.jsonl", [{"question": "1=", "answer": "1"}] * 4)
    one_line_error(lambda: make_prompt_source(config(f"data.train_files={path}"), tokenizer),
                   "data.prompt_key='prompt'", "train.jsonl", "its keys: question, answer")


def test_missing_answer_key(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "1=", "solution": "1"}] * 4)
    one_line_error(lambda: make_prompt_source(config(f"data.train_files={path}"), tokenizer),
                   "data.answer_key='answer'", "prompt, solution")
    cfg = config(f"data.train_files={path}", "data.answer_key=")  # no answers wanted: the reward gets ""
    assert make_prompt_source(cfg, tokenizer).next_batch(1) == [Sample("1=", "")]


@pytest.mark.parametrize("empty", ["", "   ", []])
def test_empty_prompt_names_its_row(tmp_path, tokenizer, empty):
    data = rows(3) + [{"prompt": empty, "answer": 1}] if empty != [] else \
        [{"prompt": [{"role": "user", "content": "1="}], "answer": 1}] * 3 + [{"prompt": empty, "answer": 1}]
    path = write_jsonl(tmp_path / "train.jsonl", data)
    one_line_error(lambda: make_prompt_source(config(f"data.train_files={path}"), tokenizer),
                   "data.prompt_key='prompt'", "row 3", "empty prompt")


def test_fewer_rows_than_a_batch(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "train.jsonl", rows(3))
    one_line_error(lambda: make_prompt_source(config(f"data.train_files={path}"), tokenizer),
                   "data.train_files", "3 prompts", "rollout.num_prompts=4")
    path = write_jsonl(tmp_path / "long.jsonl", rows(3) + [{"prompt": "1" * 20, "answer": 1}] * 2)
    cfg = config(f"data.train_files={path}", "data.max_prompt_tokens=10")
    one_line_error(lambda: make_prompt_source(cfg, tokenizer), "3 prompts after filtering")


def test_unreadable_file_is_one_line(tmp_path, tokenizer):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"prompt": "1=", "answer": "1"}\n{"prompt": \n')
    one_line_error(lambda: make_prompt_source(config(f"data.train_files={path}"), tokenizer),
                   "data.train_files", "cannot read data file", "broken.jsonl")


# ------------------------------------------------------------------------------------------ shipped math set


def _generator():
    spec = importlib.util.spec_from_file_location("make_math_data", ROOT / "scripts" / "make_math_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_math_data_regenerates_identically(tmp_path, capsys):
    _generator().main(["--out", str(tmp_path)])
    for name in ("train.jsonl", "val.jsonl"):
        assert (tmp_path / name).read_bytes() == (ROOT / "data" / "math" / name).read_bytes(), \
            f"data/math/{name} is stale: run python scripts/make_math_data.py"


def test_math_data_fits_the_embedded_vocabulary_and_answers_are_right():
    train = [json.loads(line) for line in (ROOT / "data" / "math" / "train.jsonl").read_text().splitlines()]
    val = [json.loads(line) for line in (ROOT / "data" / "math" / "val.jsonl").read_text().splitlines()]
    assert len(train) >= 2000 and len(val) >= 200
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in val}
    for row in train + val:
        assert set(row["prompt"] + row["expression"] + row["answer"]) <= set(CHARACTERS), row
        assert str(eval(row["expression"].rstrip("=").replace(":", "//"))) == row["answer"], row
    size = sum((ROOT / "data" / "math" / n).stat().st_size for n in ("train.jsonl", "val.jsonl"))
    assert size < 300_000


def test_math_demo_config_loads(tokenizer, monkeypatch):
    monkeypatch.chdir(ROOT)  # the config names its files relative to the repository root
    cfg = load_config(str(ROOT / "configs" / "math.yaml"))
    prompts = make_prompt_source(cfg, tokenizer)
    assert prompts.num_dropped == 0 and prompts.state()["num_rows"] == 2000
    assert len(load_val_samples(cfg, tokenizer)) == 200
    assert all(s.prompt.endswith("=") for s in prompts.next_batch(cfg.rollout.num_prompts))


# --------------------------------------------------------------------------------------------------- wiring


def test_controller_draws_from_the_files_and_scores_with_rollout_rewards(tmp_path, tokenizer):
    from types import SimpleNamespace

    from colocate.job.controller import Controller
    from colocate.job.preflight import SwitchPlan
    from colocate.rl.rewards import CombinedReward

    path = write_jsonl(tmp_path / "train.jsonl", rows(8))
    cfg = config(f"data.train_files={path}", "rollout.rewards=math:1.0,format:0.1")
    # Building the controller starts nothing: Passes keeps the engines' handles for later passes.
    setup = SimpleNamespace(task=make_task(cfg.rollout.task, length=cfg.rollout.task_length))
    controller = Controller(cfg, SimpleNamespace(engines=[], tokenizer=tokenizer, model_path="", reward_model=None,
                                                  env_workers=[], switch=SwitchPlan(0, False, "test"), setup=setup))
    assert isinstance(controller.passes.prompts, DatasetPrompts)
    assert isinstance(controller.reward_fn, CombinedReward)
    given = DatasetPrompts([Sample("1=", "1")] * 4)
    runtime = SimpleNamespace(engines=[], tokenizer=tokenizer, model_path="", reward_model=None, env_workers=[],
                              switch=SwitchPlan(0, False, "test"), setup=setup)
    assert Controller(cfg, runtime, prompts=given).passes.prompts is given


def test_run_job_refuses_bad_data_before_the_runtime_starts(tmp_path, monkeypatch, capsys):
    import colocate.job.run

    monkeypatch.setattr(colocate.job.run, "Runtime", lambda cfg: pytest.fail("the runtime started"))
    path = write_jsonl(tmp_path / "train.jsonl", [{"question": "1=", "answer": "1"}] * 4)
    cfg = config(f"data.train_files={path}", f"logging.output_dir={tmp_path / 'out'}",
                 f"model.cache_dir={tmp_path / 'models'}")
    assert colocate.job.run.run_job(cfg) == 2
    ours = [line for line in capsys.readouterr().err.splitlines() if line.startswith("colocate:")]
    assert len(ours) == 1 and "data.prompt_key='prompt'" in ours[0] and "question, answer" in ours[0]
