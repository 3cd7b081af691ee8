"""sync.carrier=directory (sync/directory_carrier.py): the broadcast's stand-in over shared storage. The feeder's
files round-trip through sync.delta's ends (all written first, then read, as engines at another site would);
a torn or corrupted file is refused with nothing applied; a file that never comes raises within the timeout; files
two syncs old are removed; and the config's refusals are one line before any actor starts."""

from __future__ import annotations

import pytest
import torch

from colocate.config import load_config
from colocate.errors import ConfigError
from colocate.sync.broadcast import BroadcastError
from colocate.sync.delta_channel import DeltaReceiver, DeltaSender
from colocate.sync.directory_carrier import HEAD, DirectoryChannel, TornFile


def _weights(seed: int, n: int = 2048) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16).view(torch.uint8)


def test_deltas_round_trip_through_the_files(tmp_path):
    feeder = DirectoryChannel(tmp_path, name="k-tp0", rank=0, timeout_s=5)
    sender = DeltaSender(feeder, element_size=2)
    engines = [DeltaReceiver(DirectoryChannel(tmp_path, name="k-tp0", rank=r, timeout_s=5), element_size=2)
               for r in (1, 2)]
    versions = [_weights(0)]
    for v in range(1, 4):  # each sync changes a few weights
        w = versions[-1].view(torch.bfloat16).clone()
        w[v::97] += 1.0
        versions.append(w.view(torch.uint8))
    for v, weights in enumerate(versions):
        feeder.begin_version(v)
        sender.send(0, weights, version=v)
        for engine in engines:
            ring = torch.zeros_like(weights)
            engine.receive(0, ring)
            assert torch.equal(ring, weights) and engine.store.version == v
    # two headers and a payload a sync; those of syncs 0 and 1 removed once sync 3 began
    assert sorted(int(p.stem) for p in (tmp_path / "k-tp0").glob("*.bin")) == [4, 5, 6, 7]
    assert sender.take_stats().record()["sent_fraction"] < 0.5


@pytest.mark.parametrize("damage", ["truncated", "flipped", "short_header"])
def test_a_torn_file_is_refused_and_nothing_applied(tmp_path, damage):
    feeder = DirectoryChannel(tmp_path, name="c", rank=0, timeout_s=5)
    engine = DirectoryChannel(tmp_path, name="c", rank=1, timeout_s=5)
    data = _weights(1)
    feeder.broadcast(data)
    path = feeder.path(0)
    blob = bytearray(path.read_bytes())
    if damage == "truncated":
        blob = blob[:-100]
    elif damage == "flipped":
        blob[HEAD.size + 10] ^= 0xFF
    else:
        blob = blob[:HEAD.size - 2]
    path.write_bytes(bytes(blob))
    ring = torch.zeros_like(data)
    with pytest.raises(TornFile, match="nothing applied"):
        engine.broadcast(ring)
    assert not ring.any()


def test_a_file_that_never_comes_raises_within_the_timeout(tmp_path):
    DirectoryChannel(tmp_path, name="c", rank=0, timeout_s=5)
    engine = DirectoryChannel(tmp_path, name="c", rank=1, timeout_s=0.05)
    with pytest.raises(BroadcastError, match="did not appear within 0.05 s"):
        engine.broadcast(torch.zeros(8, dtype=torch.uint8))


SPLIT = ["placement.num_slots=2", "placement.engine_slots=1", "engine.tp=1"]


@pytest.mark.parametrize("overrides, line", [
    (["sync.carrier=directory", *SPLIT], "sync.carrier_dir='' is invalid: sync.carrier=directory sends the sync"),
    (["sync.carrier=directory", "sync.carrier_dir=/tmp/x"], "sync.carrier='directory' is invalid: carries the split"),
    (["sync.carrier=disk"], "sync.carrier='disk' is invalid: valid: group, directory"),
])
def test_bad_carrier_settings_are_one_line(overrides, line):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides).check()
    assert str(e.value).startswith(line) and "\n" not in str(e.value)


def test_a_carrier_directory_that_cannot_be_written_is_refused(tmp_path):
    from colocate.job.checks import check_sources

    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    cfg = load_config(None, [*SPLIT, "sync.carrier=directory", f"sync.carrier_dir={blocked / 'sub'}",
                             f"logging.output_dir={tmp_path / 'out'}"])
    with pytest.raises(ConfigError) as e:
        check_sources(cfg)
    assert str(e.value).startswith("sync.carrier_dir=") and "\n" not in str(e.value)
