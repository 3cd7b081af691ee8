"""Config loading and validation through the CLI: each bad input exits 2 with one line naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from colocate.cli import config_docs, main
from colocate.config import load_config
from colocate.errors import ConfigError
from colocate.host.devices import cpu_bf16_features

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = str(ROOT / "configs" / "default.yaml")


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_validate_default_prints_config_and_placement(capsys):
    code, out, err = run_cli(capsys, "validate", DEFAULT)
    assert code == 0, err
    assert "tp: 2" in out
    assert "# 2 cpu slot(s), 1 engine(s) x TP=2, FSDP2 over 2 rank(s)" in out
    assert "slot 1: trainer rank 1 | engine 0 tp worker 1" in out


def test_overrides_apply_and_convert_types():
    cfg = load_config(DEFAULT, ["engine.tp=1", "trainer.lr=5e-4", "logging.progress=false"])
    assert cfg.engine.tp == 1 and cfg.trainer.lr == 5e-4 and cfg.logging.progress is False


def test_defaults_without_a_file():
    assert load_config(None, []).engine.tp == 2


@pytest.mark.parametrize(
    "overrides, key",
    [
        pytest.param(["engine.tpp=2"], "engine.tpp", id="unknown_key"),
        pytest.param(["bogus.x=1"], "bogus", id="unknown_section"),
        pytest.param(["engine.tp=two"], "engine.tp", id="wrong_type_int"),
        pytest.param(["trainer.offload=maybe"], "trainer.offload", id="wrong_type_bool"),
        pytest.param(["trainer.lr=fast"], "trainer.lr", id="wrong_type_float"),
        pytest.param(["engine.tp=3"], "engine.tp", id="tp_not_dividing_slots"),
        pytest.param(["placement.num_slots=64", "engine.tp=1"], "placement.num_slots", id="more_slots_than_devices"),
        pytest.param(["sync.bucket_mb=-1"], "sync.bucket_mb", id="negative_bucket"),
        pytest.param(["sync.bucket_mb=0.01"], "sync.bucket_mb", id="bucket_smaller_than_largest_tensor"),
        pytest.param(["rollout.num_prompts=0"], "rollout.num_prompts", id="zero_prompts"),
        pytest.param(["engine.kv_cache_gib=0"], "engine.kv_cache_gib", id="zero_kv_cache"),
        pytest.param(["sync.num_bucket_slots=1"], "sync.num_bucket_slots", id="one_slot_ring"),
        pytest.param(["model.path=/no/such/model"], "model.path", id="missing_model_path"),
        pytest.param(["model.preset=huge"], "model.preset", id="unknown_preset"),
        pytest.param(["engine.sleep_backend=vllm"], "engine.sleep_backend", id="cuda_only_sleep_on_cpu"),
        pytest.param(["trainer.mixed_precision=true"], "trainer.mixed_precision", id="mp_on_a_cpu_without_bf16",
                     marks=pytest.mark.skipif(bool(cpu_bf16_features()), reason="this CPU computes bf16")),
        pytest.param(["placement.device=cuda"], "placement.device", id="cuda_without_cuda"),
        pytest.param(["engine.dtype=int8"], "engine.dtype", id="bad_dtype"),
        pytest.param(["rollout.max_tokens=500"], "rollout.max_tokens", id="response_longer_than_context"),
        pytest.param(["rollout.task=copx"], "rollout.task", id="unknown_task"),
        pytest.param(["rollout.reward_fn=nowhere.mod:fn"], "rollout.reward_fn", id="unimportable_reward"),
        pytest.param(["enginetp"], "enginetp", id="override_without_equals"),
        pytest.param(["engine.enforce_eager=sometimes"], "engine.enforce_eager", id="bad_eager"),
        pytest.param(["engine.max_num_seqs=-1"], "engine.max_num_seqs", id="negative_max_num_seqs"),
        pytest.param(["engine.extra_args={block_size: 32"], "engine.extra_args", id="extra_args_not_json"),
        pytest.param(['engine.extra_args=[1, 2]'], "engine.extra_args", id="extra_args_not_an_object"),
        pytest.param(['engine.extra_args={"block_sise": 32}'], "did you mean block_size", id="extra_args_typo"),
        pytest.param(['engine.extra_args={"tensor_parallel_size": 4}'], "use engine.tp", id="extra_args_ours"),
        pytest.param(["algo.correction=ppo"], "algo.correction", id="unknown_correction"),
        pytest.param(["algo.mis_low=1.5"], "algo.mis_low", id="mis_band_without_one"),
        pytest.param(["algo.tis_cap=0.5"], "algo.tis_cap", id="tis_cap_below_one"),
        pytest.param(["algo.mismatch_band=1"], "algo.mismatch_band", id="empty_monitor_band"),
        pytest.param(["engine.batch_invariant=true"], "engine.batch_invariant", id="batch_invariance_on_a_cpu"),
        pytest.param(["trainer.fp32_lm_head=true"], "trainer.fp32_lm_head", id="fp32_head_without_bf16"),
        pytest.param(["trainer.fp32_lm_head=true", "trainer.mixed_precision=true", "trainer.logprob_chunk_tokens=null"],
                     "trainer.fp32_lm_head", id="fp32_head_without_the_chunked_head"),
        pytest.param(["engine.fp32_lm_head=true", "engine.dtype=float32"], "engine.fp32_lm_head",
                     id="fp32_head_of_an_fp32_engine"),
        pytest.param(["engine.fp32_lm_head=true", 'engine.extra_args={"hf_overrides": {"head_dtype": "float16"}}'],
                     "engine.extra_args", id="fp32_head_twice"),
        pytest.param(["engine.batch_invariant=true", "placement.num_slots=2", "placement.engine_slots=1",
                      "engine.tp=1"], "placement.engine_slots", id="batch_invariance_split"),
        pytest.param(["data.chat_template_kwargs=[1]"], "data.chat_template_kwargs", id="template_kwargs_not_a_map"),
        pytest.param(["algo.num_epochs=2"], "algo.old_logprobs='engine' is invalid", id="engine_old_logprobs_twice"),
        pytest.param(["algo.old_logprobs=recompute", "algo.correction=tis"], "algo.old_logprobs",
                     id="recompute_with_a_correction"),
        pytest.param(["algo.old_logprobs=decoupled"], "algo.correction=tis", id="decoupled_without_a_correction"),
        pytest.param(["algo.num_mini_batches=5", "algo.old_logprobs=recompute"], "algo.num_mini_batches=5",
                     id="mini_batches_not_dividing"),
        pytest.param(["algo.router_replay=true"], "algo.router_replay=True is invalid: model.preset=tiny is a dense "
                     "model", id="router_replay_on_a_dense_model"),
        pytest.param(["model.preset=tiny-moe", "algo.router_replay=true", "rollout.speculative=ngram"],
                     "rollout.speculative", id="router_replay_with_speculation"),
        pytest.param(["model.preset=tiny-moe", "algo.router_replay=true", "algo.mode=async",
                      "rollout.update_in_pass=keep", "rollout.stream=true"], "rollout.stream",
                     id="router_replay_streamed"),
    ],
)
def test_bad_config_exits_2_naming_the_key(capsys, overrides, key):
    code, out, err = run_cli(capsys, "validate", DEFAULT, *overrides)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err  # one line, no traceback
    assert lines[0].startswith("colocate: error: ")
    assert key in lines[0]


def test_launch_rejects_bad_config_before_starting_anything(capsys, monkeypatch):
    import colocate.job.run

    monkeypatch.setattr(colocate.job.run, "run_job", lambda cfg: pytest.fail("a job started"))
    code, _, err = run_cli(capsys, "launch", DEFAULT, "engine.tp=3")
    assert code == 2 and "engine.tp" in err


def test_the_renamed_sync_key_names_its_new_name_before_any_actor(capsys, tmp_path, monkeypatch):
    """sync.transport (the sync method, which shared its name with the buffers' module) is sync.method now: a
    config that still sets it, on the command line or in YAML, stops in one line that names the key to use."""
    import colocate.job.run

    monkeypatch.setattr(colocate.job.run, "run_job", lambda cfg: pytest.fail("a job started"))
    code, _, err = run_cli(capsys, "launch", DEFAULT, "sync.transport=gather")
    assert code == 2 and err.strip() == ("colocate: error: sync.transport='gather' is no longer a key: it is "
                                         "sync.method now; use sync.method=gather")
    path = tmp_path / "old.yaml"
    path.write_text("sync:\n  transport: in_place\n")
    with pytest.raises(ConfigError, match="use sync.method=in_place") as info:
        load_config(str(path))
    assert info.value.fix == {"sync.method": "in_place"}
    assert load_config(None, ["sync.method=gather"]).sync.method == "gather"


def test_missing_config_file(capsys):
    code, _, err = run_cli(capsys, "validate", "configs/nope.yaml")
    assert code == 2 and "nope.yaml" in err


def test_yaml_that_is_not_a_mapping(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("- just\n- a list\n")
    code, _, err = run_cli(capsys, "validate", str(path))
    assert code == 2 and "mapping" in err


def test_config_docs_are_generated_and_committed():
    committed = (ROOT / "docs" / "config.md").read_text()
    assert committed == config_docs(), "docs/config.md is stale: run `colocate config-docs > docs/config.md`"
    assert "| `engine.tp` | int | `2` |" in committed


def test_config_docs_list_every_preset_of_the_registry():
    from colocate.models.sources import PRESETS, REWARD_PRESETS

    rows = {line.split(" | ")[0].strip("| `"): line for line in config_docs().splitlines() if line.startswith("| `")}
    assert [name for name in PRESETS if f" {name} (" not in rows["model.preset"]] == []
    assert [name for name in REWARD_PRESETS if f" {name} (" not in rows["rollout.rewards"]] == []
    assert {"tiny-moe", "bench-moe"} <= PRESETS.keys() and "tiny-rm" in REWARD_PRESETS  # those the docstring missed


def test_every_key_is_documented():
    from colocate.config import field_docs

    undocumented = [key for key, _, _, doc in field_docs() if not doc]
    assert undocumented == []


def config_sections(cls=None) -> list[type]:
    """JobConfig's section dataclasses and the sections nested in them (trainer.lora)."""
    import dataclasses
    import typing

    from colocate.config import JobConfig

    cls = cls or JobConfig
    hints = typing.get_type_hints(cls)
    nested = [hints[f.name] for f in dataclasses.fields(cls) if dataclasses.is_dataclass(hints[f.name])]
    return nested + [section for child in nested for section in config_sections(child)]


def test_field_docstrings_are_short_lines_joined_into_one_paragraph():
    """A field's docstring is written as lines within 120 columns; `config-docs` joins them, so docs/config.md has
    each key's doc as one line of single spaces."""
    import ast
    import inspect

    from colocate.config import field_docs

    wide, wrapped = [], 0
    for cls in config_sections():
        lines, first = inspect.getsourcelines(cls)
        body = ast.parse("".join(lines)).body[0].body  # the sections are module-level classes
        for prev, node in zip(body, body[1:]):
            if isinstance(prev, ast.AnnAssign) and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
                source = lines[node.lineno - 1:node.end_lineno]
                wrapped += len(source) > 1
                wide += [f"{cls.__name__}.{prev.target.id} (line {first + node.lineno - 1})" for line in source
                         if len(line.rstrip("\n")) > 120]
    assert wide == [], f"field docstring lines over 120 columns: {wide}"
    assert wrapped > 10, "the long docstrings are written as several lines"
    assert [key for key, _, _, doc in field_docs() if doc != " ".join(doc.split())] == []


def test_config_error_is_a_value_error():
    with pytest.raises(ValueError):
        load_config(None, ["engine.tp=0"])
    assert issubclass(ConfigError, ValueError)


def test_default_yaml_is_the_dataclass_default():
    """`colocate launch` with no arguments and with configs/default.yaml run the same job."""
    from colocate.config import JobConfig

    assert load_config(DEFAULT, []) == JobConfig()


def test_engine_extra_args_from_a_yaml_mapping_or_json(tmp_path):
    from colocate.config import engine_extra_args

    path = tmp_path / "job.yaml"
    path.write_text("engine:\n  extra_args: {max_logprobs: 5, block_size: 16}\n")
    assert engine_extra_args(load_config(str(path)).engine) == {"max_logprobs": 5, "block_size": 16}
    cfg = load_config(None, ['engine.extra_args={"max_logprobs": 5}'])
    assert engine_extra_args(cfg.engine) == {"max_logprobs": 5}
    assert engine_extra_args(load_config(None, []).engine) == {}
