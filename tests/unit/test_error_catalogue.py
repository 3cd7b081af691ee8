"""docs/errors.md, the catalogue of every error a user can meet: the errors no other test covered (each one line,
naming its key, with its exit code), every range-checked key of the config refused by name, and checks that keep
the catalogue in step with the code (every key the config's checks name is in it; every test it cites exists)."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from colocate.cli import main
from colocate.config import JobConfig, load_config
from colocate.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
CATALOGUE = ROOT / "docs" / "errors.md"
# where config errors are raised: each section's own checks, and the checks that need the machine
CONFIG_SOURCE = "\n".join((ROOT / "colocate" / f).read_text()
                          for f in ("config/schema.py", "config/algo.py", "job/checks.py"))
MODEL_DIR = ROOT / "tests" / "data" / "model_configs" / "Qwen2.5-0.5B-Instruct"  # a config.json, no weights


def one_error_line(capsys, code: int, expected_code: int = 2) -> str:
    err = capsys.readouterr().err
    assert code == expected_code, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("colocate: error: "), err  # one line, no traceback
    return lines[0]


def one_line(exc_info) -> str:
    message = str(exc_info.value)
    assert "\n" not in message, message
    return message


# ----------------------------------------------------------------------------- config errors no test covered


@pytest.mark.parametrize("argv, needles", [
    pytest.param(["algo.normalize_advantages=false"], ["'algo.normalize_advantages' is no longer a key",
                                                       "algo.advantage=dr_grpo"], id="replaced_key"),
    pytest.param(["sync.transport=ring"], ["sync.transport='ring' is no longer a key", "use sync.method=ring"],
                 id="renamed_key"),
    pytest.param(["trainer.mixed_precision=maybe"], ["trainer.mixed_precision='maybe'", "expected true or false"],
                 id="bool_not_true_or_false"),
    pytest.param(["rollout.task=[1, 2]"], ["rollout.task=[1, 2]", "expected a string"], id="str_given_a_list"),
    pytest.param(["logging.wandb=true", "logging.wandb_project="], ["logging.wandb_project=''", "name a project"],
                 id="wandb_without_project"),
    pytest.param(["rollout.oversample=0.5"], ["rollout.oversample=0.5", "must be >= 1"], id="oversample_below_1"),
    pytest.param(["rollout.partial_tokens=2", "rollout.leftover=drop"],
                 ["rollout.leftover='drop'", "valid with it: carry"], id="partial_rollout_dropping_leftovers"),
    pytest.param(["rollout.partial_tokens=1", "rollout.max_tokens=3"],
                 ["rollout.partial_tokens=1", "restarted forever", "partial_tokens >= 2"], id="partial_never_finishes"),
    pytest.param(["rollout.top_p=1.5"], ["rollout.top_p=1.5", "(0, 1]"], id="top_p_above_1"),
    pytest.param(["engine.gpu_memory_utilization=1.5"], ["engine.gpu_memory_utilization=1.5", "(0, 1]"],
                 id="gpu_memory_utilization_above_1"),
    pytest.param(["engine.gpu_memory_utilization=0"], ["engine.gpu_memory_utilization=0", "(0, 1]"],
                 id="gpu_memory_utilization_zero"),
    pytest.param(["engine.extra_args='{\"block_size\": }'"], ["engine.extra_args=", "not a JSON object"],
                 id="extra_args_quoted_but_not_json"),
    pytest.param(["data.train_files=data/math/train.jsonl", "data.prompt_key="],
                 ["data.prompt_key=''", "name the column"], id="empty_prompt_key"),
    pytest.param([f"model.path={ROOT / 'tests' / 'data'}"], ["model.path=", "has no config.json"],
                 id="model_dir_without_config_json"),
    pytest.param(["fault.inject=SIGKILL:trainer0"], ["fault.inject='SIGKILL:trainer0'", "four fields"],
                 id="inject_fields"),
    pytest.param(["fault.inject=SIGFOO:trainer0:train:1"], ["fault.inject=", "unknown signal 'SIGFOO'"],
                 id="inject_signal"),
    pytest.param(["fault.inject=SIGKILL:bob:train:1"], ["fault.inject=", "unknown member 'bob'"], id="inject_member"),
    pytest.param(["fault.inject=SIGKILL:trainer0:eat:1"], ["fault.inject=", "unknown phase 'eat'"], id="inject_phase"),
    pytest.param(["fault.inject=SIGKILL:trainer0:train:x"], ["fault.inject=", "step 'x' is not a step number"],
                 id="inject_step"),
    pytest.param(["--gpus", "0", "--gpu-memory-gib", "80"], ["--gpus 0 --gpu-memory-gib 80.0 is invalid"],
                 id="zero_gpus"),
])
def test_validate_refuses_in_one_line(argv, needles, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    line = one_error_line(capsys, main(["validate", *argv]))
    for needle in needles:
        assert needle in line, line


@pytest.mark.parametrize("text, needles", [
    pytest.param("engine: [1\n", ["is not valid YAML"], id="not_yaml"),
    pytest.param("engine: 3\n", ["engine=3 is invalid: expected a mapping"], id="section_not_a_mapping"),
])
def test_a_bad_config_file_is_one_line(text, needles, tmp_path, capsys):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    line = one_error_line(capsys, main(["validate", str(path)]))
    assert all(needle in line for needle in needles), line


def test_unknown_command_line_arguments_exit_2_after_argparses_usage_line(capsys):
    with pytest.raises(SystemExit) as exit_info:  # argparse's own error: it exits
        main(["validate", "--bogus"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("usage: colocate") and err[-1] == "colocate: error: unrecognized arguments: --bogus"


# ------------------------------------------------------------------- every range-checked key, refused by name


def _checked_keys(helper: str) -> list[str]:
    """The keys the sections pass to a check helper (`positive(self, "trainer", "lr", ...)`), read from the
    source."""
    keys = []
    for node in ast.walk(ast.parse(CONFIG_SOURCE)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == helper:
            section, *names = [a.value for a in node.args[1:] if isinstance(a, ast.Constant)]
            keys += [f"{section}.{name}" for name in names]
    return keys


def _bad_value(helper: str, key: str) -> str:
    if helper == "one_of":
        return "no_such_choice"
    section, name = key.split(".")
    default = getattr(getattr(JobConfig(), section), name)
    return "0" if helper == "positive" and isinstance(default, (int, float)) else "-1"


RANGE_CHECKS = [(helper, key) for helper in ("positive", "non_negative", "one_of") for key in _checked_keys(helper)]


def test_the_range_checks_were_found():
    keys = {key for _, key in RANGE_CHECKS}
    assert {"trainer.lr", "engine.tp", "checkpoint.keep_last", "engine.dtype", "placement.device"} <= keys
    assert len(RANGE_CHECKS) > 40


@pytest.mark.parametrize("helper, key", RANGE_CHECKS, ids=[f"{h}-{k}" for h, k in RANGE_CHECKS])
def test_every_range_checked_key_is_refused_naming_it(helper, key):
    value = _bad_value(helper, key)
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"{key}={value}"])
    message = one_line(info)
    assert message.startswith(f"{key}="), message
    expected = {"positive": "must be > 0", "non_negative": "must be >= 0", "one_of": "valid: "}[helper]
    assert expected in message, message


# ------------------------------------------------------------------------------ the memory preflight's advice


@pytest.mark.parametrize("phase, largest, overrides, plan, advice", [
    pytest.param("train", "trainer params + grads + optimizer", ["engine.sleep_level=0"], (0, False),
                 "use engine.sleep_level=auto or 2 (now 0", id="engine_kept_awake"),
    pytest.param("rollout", "trainer params + optimizer", ["trainer.offload=false"], (2, False),
                 "use trainer.offload=auto or true (now false", id="trainer_kept_resident"),
    pytest.param("rollout", "kv cache", [], (2, True), "lower engine.kv_cache_gib (now 0.125)", id="kv_cache"),
    pytest.param("startup", "engine (gpu_memory_utilization)", [], (2, True),
                 "lower engine.gpu_memory_utilization (now 0.5)", id="engine_share"),
    pytest.param("engine gpu", "engine (gpu_memory_utilization)", ["placement.engine_slots=1", "engine.tp=1"],
                 (0, False), "lower engine.gpu_memory_utilization (now 0.5): the worker's context",
                 id="split_engine_gpu"),
    pytest.param("train", "engine host copy (sleep level 1)", ["engine.sleep_level=1"], (1, True),
                 "use engine.sleep_level=2 (the sync restores the weights)", id="host_copy"),
    pytest.param("sync", "sync ring", [], (2, True), "lower sync.bucket_mb (now 0.0)", id="ring"),
    pytest.param("train", "activations kept for backward", [], (2, True), "use trainer.activation_checkpointing="
                 "true (each layer keeps only its input), or lower trainer.micro_batch_size (now 16) or "
                 "rollout.max_tokens (now 3)", id="activations"),
    pytest.param("train", "activations kept for backward", ["trainer.activation_checkpointing=true"], (2, True),
                 "lower trainer.micro_batch_size (now 16), rollout.max_tokens (now 3) or engine.max_model_len "
                 "(now 128)", id="checkpointed_activations"),
    pytest.param("train", "one layer recomputed", ["trainer.activation_checkpointing=true"], (2, True),
                 "lower trainer.micro_batch_size (now 16), rollout.max_tokens (now 3) or engine.max_model_len "
                 "(now 128)", id="recomputed_layer"),
    pytest.param("train", "logits and log-softmax", [], (2, True), "lower trainer.micro_batch_size (now 16), "
                 "rollout.max_tokens (now 3) or engine.max_model_len (now 128)", id="logits"),
    pytest.param("train", "logits and log-softmax", ["trainer.logprob_chunk_tokens=null"], (2, True),
                 "use trainer.logprob_chunk_tokens=1024 (one chunk of logits at a time)", id="full_logits"),
    pytest.param("train", "attention masks", [], (2, True), "use trainer.micro_batch_size=1 (now 16): one row needs "
                 "no padding mask", id="attention_masks"),
    pytest.param("train", "fsdp unsharded groups", [], (2, True), "use trainer.mixed_precision=true",
                 id="unsharded_groups"),
    pytest.param("train", "trainer params + grads + optimizer", [], (2, True),
                 "use more device slots (placement.num_slots) or a smaller model", id="trainer_state"),
])
def test_each_preflight_advice_names_the_key_to_change(phase, largest, overrides, plan, advice):
    from colocate.job.preflight import GIB, Phase, SwitchPlan, check_fits

    cfg = load_config(None, overrides)
    parts = {largest: 10 * GIB, "cuda contexts (2 processes, est.)": GIB}
    with pytest.raises(ConfigError) as info:
        check_fits([Phase(phase, parts)], available_bytes=8 * GIB, cfg=cfg, device="cuda",
                   plan=SwitchPlan(*plan, ""))
    message = one_line(info)
    assert message.startswith(f"memory preflight: phase '{phase}' needs 11.0 GiB but one GPU (8.0 GiB) allows 7.8 GiB "
                              f"(short by 3.2 GiB; largest part: {largest} 10.0 GiB); "), message
    assert advice in message, message


# --------------------------------------------------------------------------------------- checkpoint.resume


def _checkpoint(tmp_path: Path, cfg, **signature_changes) -> Path:
    from colocate.checkpoint.layout import COMMIT_FILE, job_signature

    path = tmp_path / "checkpoints" / "step_00000004"
    path.mkdir(parents=True)
    signature = job_signature(cfg, MODEL_DIR)
    for key, value in signature_changes.items():
        if key == "model":
            signature["model"] = {**signature["model"], **value}
        else:
            signature[key] = value
    (path / COMMIT_FILE).write_text(json.dumps({"step": 4, "signature": signature}))
    return path


def _resume(cfg, path) -> str:
    from colocate.checkpoint.layout import resume_point

    cfg.checkpoint.resume = str(path)
    with pytest.raises(ConfigError) as info:
        resume_point(cfg, MODEL_DIR)
    return one_line(info)


def test_resume_from_a_folder_that_does_not_exist(tmp_path):
    message = _resume(load_config(None, []), tmp_path / "nope")
    assert message.startswith("checkpoint.resume=") and "no such directory" in message


def test_resume_from_an_unfinished_save(tmp_path):
    (tmp_path / "step_00000002.partial").mkdir()
    message = _resume(load_config(None, []), tmp_path / "step_00000002.partial")
    assert "not a complete checkpoint (no meta.json" in message


@pytest.mark.parametrize("changes, needle", [
    pytest.param({"model": {"hidden_size": 1024}}, "saved from another model (hidden_size=1024 there, 896 here)",
                 id="another_model"),
    pytest.param({"num_trainer_ranks": 8},
                 "saved with 8 trainer ranks (placement.num_slots - placement.engine_slots), this job has 2",
                 id="other_rank_count"),
    pytest.param({"num_samples": 4}, "saved with 4 samples per prompt (rollout.num_samples), this job has 8",
                 id="other_group_size"),
    pytest.param({"multi_turn": True}, "saved with multi-turn episodes (rollout.env set), this job has single-turn "
                 "answers (rollout.env empty)",
                 id="multi_turn_into_single_turn"),
    pytest.param({"lora": "LoRA (trainer.lora.rank=8, alpha=16, target_modules=all-linear)"},
                 "saved with LoRA (trainer.lora.rank=8, alpha=16, target_modules=all-linear), this job has no LoRA "
                 "(trainer.lora.rank=0)", id="lora_into_full"),
    pytest.param({"critic": "a critic (critic.model_path=policy)"}, "saved with a critic (critic.model_path=policy), "
                 "this job has no critic (critic.model_path empty)", id="ppo_into_grpo"),
])
def test_resume_from_a_checkpoint_of_another_job(changes, needle, tmp_path):
    cfg = load_config(None, [])
    message = _resume(cfg, _checkpoint(tmp_path, cfg, **changes))
    assert message.startswith("checkpoint.resume=") and needle in message, message
    from colocate.checkpoint.layout import resume_point

    cfg.checkpoint.resume = str(_checkpoint(tmp_path / "same", cfg))
    assert resume_point(cfg, MODEL_DIR).name == "step_00000004"  # the same job's checkpoint is accepted


# -------------------------------------------------------------------------------- export, clean, plot, sinks


def test_export_of_something_that_is_not_a_checkpoint(tmp_path, capsys):
    line = one_error_line(capsys, main(["export", str(tmp_path), str(tmp_path / "out")]))
    assert "is not a checkpoint: expected a step_<N> folder holding meta.json" in line
    (tmp_path / "step_00000001" / "trainer").mkdir(parents=True)
    line = one_error_line(capsys, main(["export", str(tmp_path / "step_00000001"), str(tmp_path / "out")]))
    assert "is not a complete checkpoint (no meta.json" in line


def test_export_with_a_bad_dtype(tmp_path, capsys):
    cfg = load_config(None, [])
    checkpoint = _checkpoint(tmp_path, cfg)
    line = one_error_line(capsys, main(["export", str(checkpoint), str(tmp_path / "out"), "--dtype", "int8"]))
    assert "dtype 'int8' is invalid; valid: bfloat16, float16, float32" in line


def test_clean_of_an_unreadable_job_record(tmp_path, capsys):
    (tmp_path / "job.json").write_text("{not json")
    line = one_error_line(capsys, main(["clean", str(tmp_path)]))
    assert f"cannot read {tmp_path / 'job.json'}" in line


def test_plot_without_matplotlib(tmp_path, capsys, monkeypatch):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "reward_mean": 0.5}) + "\n")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what `import matplotlib` sees when it is not installed
    line = one_error_line(capsys, main(["plot", str(tmp_path)]))
    assert "colocate plot needs matplotlib" in line


def test_tensorboard_on_without_the_package(tmp_path, monkeypatch):
    from colocate.config import LoggingConfig
    from colocate.telemetry.sinks import check_sinks

    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ConfigError) as info:
        check_sinks(LoggingConfig(output_dir=str(tmp_path)))
    assert one_line(info).startswith("logging.tensorboard=true needs the tensorboard package")
    check_sinks(LoggingConfig(output_dir=str(tmp_path), tensorboard=False))


# ------------------------------------------------------------------------------------- evaluation, data rows


def test_evaluation_without_prompts_or_with_a_prompt_that_fills_the_context():
    from colocate.models.sources import build_tokenizer
    from colocate.rollout.evaluation import Evaluator
    from colocate.rl.tasks import Sample

    tokenizer = build_tokenizer()
    cfg = load_config(None, ["eval.at_end=true"])
    with pytest.raises(ConfigError) as info:
        Evaluator(cfg, [object()], tokenizer, [], None)
    assert one_line(info).startswith("eval: no validation prompts to evaluate")
    cfg = load_config(None, ["eval.at_end=true", "engine.max_model_len=8", "rollout.max_tokens=2"])
    with pytest.raises(ConfigError) as info:
        Evaluator(cfg, [object()], tokenizer, [Sample("1" * 10, "1")], None)
    assert "is 10 tokens, leaving no room to answer within engine.max_model_len=8" in one_line(info)


@pytest.mark.parametrize("row, needle", [
    pytest.param({"prompt": 5, "answer": "1"}, "data.prompt_key='prompt': row 0 of", id="prompt_not_text"),
    pytest.param({"prompt": "1+1=", "answer": None}, "data.answer_key='answer': row 0 of", id="no_answer"),
])
def test_a_bad_row_names_its_key_file_and_row(row, needle, tmp_path, monkeypatch):
    import datasets

    from colocate.models.sources import build_tokenizer
    from colocate.rl.data import make_prompt_source

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    path = tmp_path / "train.jsonl"
    path.write_text((json.dumps(row) + "\n") * 4)
    cfg = load_config(None, [f"data.train_files={path}", "rollout.num_prompts=4"])
    with pytest.raises(ConfigError) as info:
        make_prompt_source(cfg, build_tokenizer())
    message = one_line(info)
    assert needle in message and "train.jsonl" in message, message
    assert ("holds int; valid: text or a list of {role, content} messages" if row["answer"] else "has no answer") \
        in message


def test_resuming_a_prompt_stream_of_another_task_is_refused():
    from colocate.rl.tasks import PromptStream, make_task

    state = PromptStream(make_task("copy", length=3), seed=0).state()
    with pytest.raises(ValueError) as info:
        PromptStream(make_task("add", length=3), seed=0).load_state(state)
    assert one_line(info) == "prompt stream state is of task 'copy', this job's is 'add'"


# ------------------------------------------------------------------------------------------- the job server


def test_token_mode_without_a_readable_token_is_one_line():
    # in a child: Ray's token loader caches per process
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_API_SERVER", "RAY_AUTH"))}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH="/nonexistent/colocate-token")
    result = subprocess.run([sys.executable, "-m", "colocate.cli", "jobs", "--address", "http://127.0.0.1:9"],
                            env=env, capture_output=True, text=True, timeout=120, cwd=ROOT, check=False)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("colocate: error: no token for the job server: "), result.stderr


@pytest.mark.parametrize("lengths", ["512,256", "64,128", "abc", "256,256"])
def test_bench_lengths_are_checked(lengths, capsys):
    code = main(["bench", "train-memory", "--lengths", lengths])
    line = one_error_line(capsys, code)
    assert f"--lengths {lengths!r} is invalid: expected ascending token counts above 64" in line


@pytest.mark.parametrize("variants", ["all", "today,bogus", ","])
def test_bench_train_variants_are_checked(variants, capsys):
    code = main(["bench", "train", "--variants", variants])
    line = one_error_line(capsys, code)
    assert f"--variants {variants!r} is invalid: expected a comma-separated subset of today, chunked" in line


@pytest.mark.parametrize("variants", ["async", "sync,async_split_later"])
def test_bench_async_variants_are_checked(variants, capsys):
    code = main(["bench", "async", "--variants", variants])
    line = one_error_line(capsys, code)
    assert f"--variants {variants!r} is invalid: expected a comma-separated subset of sync, one_step_off, async, " \
           "sync_split, async_split, async_split_in_pass, async_split_stream that includes sync" in line


# --------------------------------------------------------------------------------- the catalogue's own checks


def test_catalogue_names_every_key_the_configs_checks_name():
    """Every `_bad("<key>"` of config.py, every key of its range checks, and every key a ConfigError message of
    any module starts with (`f"data.prompt_key=...`) appears in docs/errors.md."""
    catalogue = CATALOGUE.read_text()
    keys = set(re.findall(r'\bbad\("([a-z_.]+)"', CONFIG_SOURCE))
    assert {"engine.tp", "model.path", "rollout.top_p"} <= keys  # the pattern still matches the code
    keys |= {key for _, key in RANGE_CHECKS}
    for path in (ROOT / "colocate").rglob("*.py"):
        keys |= set(re.findall(r'ConfigError\(\s*f?"([a-z_]+\.[a-z_]+)[=!\'"{ ]', path.read_text()))
    missing = sorted(key for key in keys if f"`{key}" not in catalogue)
    assert missing == [], f"docs/errors.md does not name {missing}"


def test_every_test_the_catalogue_cites_exists():
    catalogue = CATALOGUE.read_text()
    cited = set(re.findall(r"(tests/[\w/]+\.py)::(\w+)", catalogue))
    assert len(cited) > 40
    for file, name in sorted(cited):
        source = (ROOT / file).read_text()
        assert re.search(rf"^def {name}\(", source, re.MULTILINE), f"docs/errors.md cites {file}::{name}, not found"

