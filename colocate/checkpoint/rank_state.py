"""One trainer rank's side of a checkpoint: FSDP2-sharded model and optimizer state through
`torch.distributed.checkpoint` (DCP), plus the rank's random number generators.

    save_rank_state(directory, model, optimizer, rank=r)    # a collective: every rank calls it
    load_rank_state(directory, model, optimizer, rank=r)    # a collective too; loads in place

Each rank writes only its own shards (DCP's `__<rank>_0.distcp` files) and rank 0 the metadata; nothing is
gathered. The state is loaded *in place*: DCP reads into the tensors `get_state_dict` hands out, which for
FSDP2 are the live parameter shards and the live AdamW moments. That matters beyond speed: the sync's shard
views (`sync.shards.local_shards`) and the offloader's tensors (on CUDA, allocated inside torch_memory_saver's
region) keep pointing at the same storage, where `optimizer.load_state_dict` would have replaced the moments
with new tensors outside the region.

The RNG states are written as JSON (base64 bytes), one file per rank, so a resume reads no pickle.
"""

from __future__ import annotations

import base64
import json
import random
from pathlib import Path

import numpy as np
import torch

MODEL_KEY = "model"
OPTIMIZER_KEY = "optimizer"


def _state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """{model: FQN -> DTensor shard, optimizer: {state: FQN -> {step, exp_avg, exp_avg_sq}, param_groups}},
    sharing storage with the live model and optimizer (no copy)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=False))
    return {MODEL_KEY: model_state, OPTIMIZER_KEY: optim_state}


def save_rank_state(directory: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                    rank: int, name: str = "trainer") -> None:
    """`name`: the DCP directory; the policy's ("trainer") also writes the rank's RNG states, a second model
    (the critic's, "critic") its shards alone."""
    import torch.distributed.checkpoint as dcp

    directory = Path(directory)
    assert optimizer.state, "checkpoint before the first optimizer step: AdamW has no state yet"
    dcp.save(_state_dicts(model, optimizer), checkpoint_id=str(directory / name))
    if name == "trainer":
        (directory / f"rng_rank{rank}.json").write_text(json.dumps(rng_state()))


def load_rank_state(directory: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                    rank: int, name: str = "trainer") -> None:
    """Read the checkpoint into the live model and optimizer. The optimizer's state must exist (the caller
    creates it first, inside its memory region); DCP then overwrites it in place."""
    import torch.distributed.checkpoint as dcp

    directory = Path(directory)
    assert optimizer.state, "create the optimizer state before loading into it"
    state = _state_dicts(model, optimizer)
    before = {name: t.to_local().data_ptr() for name, t in state[MODEL_KEY].items()}
    if not (directory / name).is_dir():
        raise FileNotFoundError(f"{directory} holds no {name} state (a checkpoint of a job without a critic?)")
    dcp.load(state, checkpoint_id=str(directory / name))
    # The in-place promise above, checked: a DCP that returned new tensors would leave the model untouched.
    assert all(t.to_local().data_ptr() == before[name] for name, t in state[MODEL_KEY].items())
    for group, loaded in zip(optimizer.param_groups, state[OPTIMIZER_KEY]["param_groups"]):
        # hyperparameters come from this run's config (a resume may lower the learning rate on purpose)
        assert len(group["params"]) == len(loaded["params"])
    if name == "trainer":
        load_rng_state(json.loads((directory / f"rng_rank{rank}.json").read_text()))


def rng_state() -> dict:
    """Every generator a rank draws from: torch (CPU and this process's CUDA device), Python, NumPy."""
    state = {"torch": _b64(torch.get_rng_state()), "python": _json_python_state(random.getstate()),
             "numpy": _json_numpy_state(np.random.get_state())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = _b64(torch.cuda.get_rng_state())
    return state


def load_rng_state(state: dict) -> None:
    torch.set_rng_state(_tensor(state["torch"]))
    random.setstate((state["python"][0], tuple(state["python"][1]), state["python"][2]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(_tensor(state["cuda"]))


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def _json_python_state(state: tuple) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _json_numpy_state(state: tuple) -> list:
    kind, keys, pos, has_gauss, cached = state
    return [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]
