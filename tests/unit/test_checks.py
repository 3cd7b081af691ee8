"""The one home of the checks before any actor (colocate/job/checks.py): validate and launch call the same functions
and refuse a bad job with the same line; every path the job writes is tried first."""

from __future__ import annotations

import pytest

import colocate.job.run
from colocate.cli import main
from colocate.config import load_config
from colocate.errors import ConfigError
from colocate.job.checks import check_writable, written_paths

BAD_JOBS = [
    pytest.param(["logging.output_dir=/proc/forbidden"], "logging.output_dir='/proc/forbidden' is invalid: cannot "
                 "write there", id="output_dir_in_proc"),
    pytest.param(["checkpoint.dir=/proc/forbidden/ckpt"], "checkpoint.dir='/proc/forbidden/ckpt' is invalid",
                 id="checkpoint_dir"),
    pytest.param(["trainer.offload_dir=/proc/forbidden"], "trainer.offload_dir='/proc/forbidden' is invalid",
                 id="offload_dir"),
    pytest.param(["rollout.task=no_such_module:make"], "rollout.task='no_such_module:make' is invalid",
                 id="task_module"),
    pytest.param(["data.train_files=missing.jsonl"], "data.train_files='missing.jsonl' is invalid", id="data_file"),
    pytest.param(["fault.inject=SIGKILL:bob:train:1"], "fault.inject='SIGKILL:bob:train:1' is invalid",
                 id="fault_injection"),
    pytest.param(["placement.num_slots=64"], "placement.num_slots=64 is invalid", id="more_slots_than_the_machine"),
]


@pytest.mark.parametrize("overrides, start", BAD_JOBS)
def test_validate_and_launch_refuse_a_bad_job_with_the_same_line(overrides, start, capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(colocate.job.run, "run_job", lambda cfg, checked=None: pytest.fail("a job started"))
    if not any(o.startswith("logging.output_dir=") for o in overrides):
        overrides = [f"logging.output_dir={tmp_path / 'out'}", *overrides]
    lines = []
    for command in ("validate", "launch"):
        assert main([command, *overrides]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"colocate: error: {start}"), err
        lines.append(err[0])
    assert lines[0] == lines[1]
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_a_writable_path_is_tried_and_left_as_it_was(tmp_path):
    target = tmp_path / "a" / "b" / "c"
    check_writable("logging.output_dir", target)
    assert list(tmp_path.iterdir()) == []  # the folders the try created are gone again
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"logging.output_dir='.*/file/out' is invalid: cannot write there .*; valid: "
                       "a directory this user can create and write"):
        check_writable("logging.output_dir", tmp_path / "file" / "out")


def test_the_paths_a_job_writes():
    cfg = load_config(None, ["logging.output_dir=/x/out", "checkpoint.at_end=false"])
    assert sorted(written_paths(cfg)) == ["logging.output_dir", "model.cache_dir"]
    cfg = load_config(None, ["logging.output_dir=/x/out", "checkpoint.dir=/y/ckpt", "trainer.offload_dir=/z",
                             "model.path=/m"])
    assert {k: str(v) for k, v in written_paths(cfg).items()} == {
        "logging.output_dir": "/x/out", "checkpoint.dir": "/y/ckpt", "trainer.offload_dir": "/z"}


def test_a_submitted_job_writes_on_the_cluster_so_its_directories_are_not_tried_here():
    from colocate.job.checks import check_sources

    cfg = load_config(None, ["logging.output_dir=/proc/forbidden"])  # a path of the cluster's, say
    check_sources(cfg, writes_here=False)
    with pytest.raises(ConfigError, match="logging.output_dir='/proc/forbidden' is invalid"):
        check_sources(cfg)


def test_a_model_whose_config_has_no_decoder_dimensions_is_refused_in_one_line(tmp_path, capsys):
    """The checks read the model's dimensions once (models/dims.py); a config.json without them (GPT-2 names its
    widths n_embd, n_layer) is one line before anything starts, not a KeyError in the memory preflight."""
    model = tmp_path / "gpt2"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "vocab_size": 50257}')
    for command in ("validate", "submit"):
        assert main([command, f"model.path={model}", f"logging.output_dir={tmp_path / 'out'}"]) == 2
        assert capsys.readouterr().err.strip().splitlines() == [
            f"colocate: error: model.path={str(model)!r} is invalid: its config.json has no hidden_size (colocate "
            "reads a decoder's hidden_size, num_hidden_layers, num_attention_heads and vocab_size)"]
