"""Metric sinks and progress: step records flattened to tags, TensorBoard event files and an offline W&B run that
read back the same numbers per step, the missing-package and bad-mode errors, and the progress line on a terminal
and elsewhere (the terminal chosen by a flag, the clock by a fake)."""

from __future__ import annotations

import io
import json
import struct
import sys

import pytest

from colocate.config import LoggingConfig, load_config
from colocate.errors import ConfigError
from colocate.telemetry.metrics import MetricsWriter, Progress, format_duration
from colocate.telemetry.sinks import check_sinks, scalar_tags


def step_record(step: int, reward: float = 0.5, **extra) -> dict:
    """The shape of Controller._record's output (the keys the progress line reads, nested dicts, a list, text)."""
    return {"step": step, "reward_mean": reward, "reward_std": 0.1, "response_len_mean": 3.0, "mismatch": 0.002,
            "sync_mode": "sliced", "rollout_tokens_per_s": 1000.0, "rollout": {"num_passes": 2},
            "times": {"rollout": 1.0 + step, "score": 0.1, "switch": 0.2, "train": 0.5, "sync": 0.05},
            "memory": {"engine_rss_bytes": 1 << 30, "trainers": [{"device_free_bytes": 5}]},
            "mismatch_monitor": {"band": 1.1, "token": {"count": 10, "fraction_outside_band": 0.1}},
            "correction": {"mode": "tis", "fraction_affected": 0.05, "truncated": True},
            "sample": {"response": "42"}, **extra}


def logging_cfg(tmp_path, **kwargs) -> LoggingConfig:
    return LoggingConfig(output_dir=str(tmp_path / "out"), **{"progress": False, "tensorboard": False, **kwargs})


# ------------------------------------------------------------------------------------------------ flattening


def test_scalar_tags_join_nested_dicts_and_skip_text_lists_and_flags():
    tags = scalar_tags(step_record(3, kl=0.01, eval={"pass_at_1": 0.25, "pass_at_4": 0.5, "num_samples": 4}))
    assert tags["times/rollout"] == 4.0 and tags["rollout/num_passes"] == 2.0
    assert tags["mismatch_monitor/token/fraction_outside_band"] == 0.1
    assert tags["eval/pass_at_1"] == 0.25 and tags["eval/pass_at_4"] == 0.5 and tags["kl"] == 0.01
    assert tags["reward_mean"] == 0.5
    assert not {"step", "sync_mode", "correction/mode", "correction/truncated", "sample/response"} & tags.keys()
    assert not any(tag.startswith("memory/trainers") for tag in tags)  # a list: left to the JSONL
    assert all(type(v) is float for v in tags.values())


# ------------------------------------------------------------------------------------------------ TensorBoard


def test_tensorboard_event_files_hold_each_steps_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = MetricsWriter(logging_cfg(tmp_path, tensorboard=True), num_steps=3)
    writer.write({"event": "startup", "engines": 1})
    records = [step_record(0, 0.25), step_record(1, 0.5, eval={"pass_at_1": 0.75}), step_record(2, 1.0)]
    for r in records:
        writer.step(r)
    writer.close()

    events = EventAccumulator(str(tmp_path / "out" / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward_mean")] == [(1, 0.25), (2, 0.5), (3, 1.0)]
    assert [(e.step, e.value) for e in events.Scalars("times/rollout")] == [(1, 1.0), (2, 2.0), (3, 3.0)]
    assert [(e.step, e.value) for e in events.Scalars("eval/pass_at_1")] == [(2, 0.75)]
    assert not any("engines" in tag or "sample" in tag for tag in events.Tags()["scalars"])  # events: JSONL only
    lines = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line).get("step") for line in lines] == [None, 0, 1, 2]  # the JSONL keeps everything


def test_a_failing_sink_is_dropped_and_the_jsonl_goes_on(tmp_path):
    class BrokenSink:
        closed = False

        def log(self, tags, step):
            raise OSError("No space left on device")

        def close(self, failed):
            BrokenSink.closed = True

    writer = MetricsWriter(logging_cfg(tmp_path), num_steps=2)
    writer.sinks.append(BrokenSink())
    writer.step(step_record(0))
    writer.step(step_record(1))
    writer.close()
    assert writer.sinks == [] and not BrokenSink.closed
    assert len((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()) == 2


# ------------------------------------------------------------------------------------------------ W&B


def wandb_history(out_dir) -> list[dict]:
    """The history rows of the offline run under out_dir/wandb: the .wandb file is a LevelDB-style log (a 7-byte
    file header, 32 KiB blocks of records with a 7-byte header: crc32, length, type 1 full / 2 first / 3 middle /
    4 last) of wandb's protobuf Records; wandb 0.31 ships no reader for it."""
    from wandb.proto import wandb_internal_pb2

    (path,) = out_dir.glob("wandb/offline-run-*/run-*.wandb")
    data, pos, chunk, rows = path.read_bytes(), 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # the tail of a block too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            chunk = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


def test_an_offline_wandb_run_gets_the_same_scalars(tmp_path, monkeypatch):
    import wandb

    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):  # keep wandb out of the home directory
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = logging_cfg(tmp_path, wandb=True, wandb_run_name="unit")
    writer = MetricsWriter(cfg, num_steps=2, run_config={"algo": {"num_steps": 2}})
    records = [step_record(0, 0.25), step_record(1, 0.5, kl=0.02, eval={"pass_at_1": 0.75})]
    for r in records:
        writer.step(r)
    writer.close()
    wandb.teardown()  # finish() can return before wandb's service has written the last rows; this waits for it

    rows = wandb_history(tmp_path / "out")
    assert [row["_step"] for row in rows] == [1, 2]
    for row, r in zip(rows, records):
        assert {k: v for k, v in row.items() if not k.startswith("_")} == pytest.approx(scalar_tags(r))
    assert rows[1]["eval/pass_at_1"] == 0.75 and rows[1]["kl"] == 0.02


def test_wandb_without_the_package_is_a_config_error_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` sees when it is not installed
    with pytest.raises(ConfigError) as e:
        MetricsWriter(logging_cfg(tmp_path, wandb=True), num_steps=1)
    assert str(e.value) == "logging.wandb=true needs the wandb package: pip install 'colocate[wandb]'"
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
    check_sinks(logging_cfg(tmp_path, wandb=False))  # off: the package is not needed


def test_online_wandb_without_a_key_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc from `wandb login`
    with pytest.raises(ConfigError, match="logging.wandb_mode=online needs WANDB_API_KEY"):
        check_sinks(logging_cfg(tmp_path, wandb=True, wandb_mode="online"))
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    check_sinks(logging_cfg(tmp_path, wandb=True, wandb_mode="online"))


def test_a_bad_wandb_mode_names_the_key():
    with pytest.raises(ConfigError, match=r"logging.wandb_mode='cloud' is invalid: valid: offline, online"):
        load_config(None, ["logging.wandb_mode=cloud"])
    assert load_config(None, ["logging.wandb_mode=online"]).logging.wandb_mode == "online"


# ------------------------------------------------------------------------------------------------ progress


@pytest.mark.parametrize("seconds, text", [(0, "0s"), (5.4, "5s"), (59.6, "1m00s"), (65, "1m05s"),
                                           (3599, "59m59s"), (3700, "1h01m"), (90000, "25h00m"), (-3, "0s")])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


class FakeClock:
    def __init__(self, *times: float):
        self.times = list(times)

    def __call__(self) -> float:
        return self.times.pop(0)


def test_plain_lines_one_per_step_with_elapsed_eta_and_eval():
    stream = io.StringIO()
    # created at 0; the startup event at 10 starts the step clock; steps end at 30 and 50: 20 s a step
    progress = Progress(4, stream, terminal=False, clock=FakeClock(0, 10, 30, 50))
    progress.event()
    progress.show(step_record(0, 0.25))
    progress.show(step_record(1, 0.5, eval={"pass_at_1": 0.75}))
    first, second = stream.getvalue().splitlines()
    assert first.startswith("step   1/4 | reward 0.250 (start 0.250) | len 3.0 | rollout 1.00s")
    assert first.endswith("| 30s elapsed, ETA 1m00s") and "eval" not in first  # 3 steps left x 20 s
    assert "mismatch 0.0020 (10.0% outside x1.1) | tis 5.0%" in first
    assert second.startswith("step   2/4 | reward 0.500 (start 0.250)")
    assert second.endswith("| eval pass@1 0.750 | 50s elapsed, ETA 40s")
    assert "\r" not in stream.getvalue()


def test_the_terminal_line_updates_in_place_and_keeps_the_last_eval():
    stream = io.StringIO()
    progress = Progress(3, stream, terminal=True, width=200, clock=FakeClock(0, 5, 65, 125, 185))
    progress.event()
    progress.show(step_record(0, 0.25, eval={"pass_at_1": 0.5}))
    first = stream.getvalue()
    assert first == ("\r[######--------------] 1/3 | 1m05s elapsed, ETA 2m00s | reward 0.250 (start 0.250) | "
                     "eval pass@1 0.500 (step 1) | rollout 1.0s score 0.1s switch 0.2s train 0.5s sync 0.1s\x1b[K")
    progress.show(step_record(1, 0.5))  # the line stays open (no newline) until the next update redraws it
    second = stream.getvalue()[len(first):]
    assert second.startswith("\r[#############-------] 2/3 | 2m05s elapsed, ETA 1m00s | reward 0.500 (start 0.250)")
    assert "eval pass@1 0.500 (step 1)" in second
    progress.show(step_record(2, 0.75))  # the last step ends the line: what follows starts on a line of its own
    last = stream.getvalue()[len(first) + len(second):]
    assert last.startswith("\r[####################] 3/3 | 3m05s elapsed, ETA 0s | reward 0.750")
    assert last.endswith("rollout 3.0s score 0.1s switch 0.2s train 0.5s sync 0.1s\x1b[K\n")


def test_the_terminal_line_is_cut_to_the_terminal_width():
    narrow, wide = io.StringIO(), io.StringIO()
    Progress(5, narrow, terminal=True, width=60, clock=FakeClock(0, 1)).show(step_record(0))
    Progress(5, wide, terminal=True, width=500, clock=FakeClock(0, 1)).show(step_record(0))
    line = wide.getvalue().removeprefix("\r").removesuffix("\x1b[K")
    assert len(line) > 100 and line.endswith("sync 0.1s")
    assert narrow.getvalue() == "\r" + line[:59] + "\x1b[K"  # one column spare: a full line wraps on some terminals
    assert line[:59].startswith("[####----------------] 1/5 | 1s elapsed, ETA 4s | reward")


def test_an_event_after_a_terminal_line_starts_on_a_new_line():
    stream = io.StringIO()
    progress = Progress(5, stream, terminal=True, clock=FakeClock(0, 1, 2))
    progress.show(step_record(0))
    assert not stream.getvalue().endswith("\n")
    progress.event()  # e.g. the error record, printed right after it
    assert stream.getvalue().endswith("\x1b[K\n")
    progress.end_line()
    assert stream.getvalue().count("\n") == 1


def test_progress_false_prints_nothing_and_still_writes_the_jsonl(tmp_path):
    stream = io.StringIO()
    writer = MetricsWriter(logging_cfg(tmp_path, progress=False), num_steps=2, stream=stream, terminal=False)
    writer.step(step_record(0))
    writer.close()
    assert stream.getvalue() == ""
    assert json.loads((tmp_path / "out" / "metrics.jsonl").read_text())["step"] == 0
    writer = MetricsWriter(logging_cfg(tmp_path, progress=True), num_steps=2, stream=stream, terminal=False)
    writer.step(step_record(1))
    writer.close()
    assert stream.getvalue().startswith("step   2/2 | reward 0.500")


# ------------------------------------------------------------------------------------------------ a killed run


def test_a_resumed_run_cuts_the_record_a_killed_one_left_half_written(tmp_path):
    from colocate.telemetry.metrics import read_records

    first = MetricsWriter(logging_cfg(tmp_path), num_steps=3)
    first.step(step_record(0, 0.25))
    first.close()
    path = tmp_path / "out" / "metrics.jsonl"
    whole = path.read_bytes()
    torn = json.dumps(step_record(1, 0.5))[:37]
    path.write_bytes(whole + torn.encode())  # SIGKILL mid-write: no newline after the fragment
    assert [r["step"] for r in read_records(path)] == [0]  # readers skip it

    resumed = MetricsWriter(logging_cfg(tmp_path), num_steps=3)
    resumed.step(step_record(1, 0.5))
    resumed.close()
    records = read_records(path)  # every line parses: the fragment is gone, not glued to the next record
    assert [r.get("step") for r in records] == [0, None, 1]
    assert records[1] == {"time": records[1]["time"], "event": "torn_record_dropped", "bytes": len(torn)}
    assert path.read_bytes().startswith(whole)


def test_a_broken_line_inside_the_file_is_named(tmp_path):
    from colocate.telemetry.metrics import read_records

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\nnot json\n{"step": 1}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl: line 2 is not JSON"):
        read_records(path)
