"""A checkpoint as a Hugging Face model: safetensors + config + tokenizer, which vLLM and `transformers` load as is.

    colocate export outputs/run/checkpoints/step_00000009 exported/ [--dtype bfloat16]
    export_hf(checkpoint_path, out_dir, dtype="bfloat16")

No process group, no device and no merger tool: the trainer's shards are read from the DCP files on the host a
few tensors at a time (DCP assembles each full tensor from the ranks' shards itself), cast, and written in
safetensors files of at most `shard_bytes` each, so memory holds one output file's worth of weights, never the
whole model (the issue of a merger that gathers everything on one rank's device first). The model's files
(config.json with its dtype set, generation config, tokenizer) come from the checkpoint's model/ folder.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from colocate.checkpoint.layout import COMMIT_FILE, MODEL_FILES, complete_checkpoints
from colocate.errors import ExportError

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_MODEL_PREFIX = "model."  # the trainer saves {"model": ..., "optimizer": ...}; DCP flattens keys with dots


def find_checkpoint(path: str | Path) -> Path:
    """A step_<N> folder, or a checkpoint directory (its newest complete checkpoint)."""
    path = Path(path).expanduser()
    if (path / COMMIT_FILE).is_file():
        return path
    found = complete_checkpoints(path)
    if found:
        return found[-1][1]
    if path.is_dir() and (path / "trainer").is_dir():
        raise ExportError(f"{path} is not a complete checkpoint (no {COMMIT_FILE}: its save did not finish)")
    raise ExportError(f"{path} is not a checkpoint: expected a step_<N> folder holding {COMMIT_FILE}, or a checkpoint "
                      "directory with one")


def export_hf(checkpoint: str | Path, out: str | Path, *, dtype: str = "bfloat16",
              shard_bytes: int = 2 << 30) -> Path:
    from safetensors.torch import save_file
    from torch.distributed.checkpoint import FileSystemReader

    if dtype not in DTYPES:
        raise ExportError(f"dtype {dtype!r} is invalid; valid: {', '.join(DTYPES)}")
    checkpoint, out = Path(checkpoint), Path(out)
    model_dir = checkpoint / "model"
    config = json.loads((model_dir / "config.json").read_text())
    tied = bool(config.get("tie_word_embeddings", config.get("text_config", {}).get("tie_word_embeddings", False)))
    metadata = FileSystemReader(str(checkpoint / "trainer")).read_metadata()
    tensors = {key[len(_MODEL_PREFIX):]: meta for key, meta in metadata.state_dict_metadata.items()
               if key.startswith(_MODEL_PREFIX) and hasattr(meta, "size")}
    if tied:  # transformers and vLLM tie lm_head to the embedding themselves; a second copy would be loaded twice
        tensors.pop("lm_head.weight", None)
    assert tensors, f"no model tensors in {checkpoint / 'trainer'}"

    out.mkdir(parents=True, exist_ok=True)
    itemsize = DTYPES[dtype].itemsize
    files: list[list[str]] = [[]]
    size = 0
    for name, meta in tensors.items():  # DCP's order is the model's, so a file holds neighbouring layers
        num_bytes = meta.size.numel() * itemsize
        if files[-1] and size + num_bytes > shard_bytes:
            files.append([])
            size = 0
        files[-1].append(name)
        size += num_bytes
    weight_map = {}
    for i, names in enumerate(files):
        file_name = "model.safetensors" if len(files) == 1 else f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        loaded = _load(checkpoint, {name: tensors[name] for name in names})
        save_file({name: t.to(DTYPES[dtype]).contiguous() for name, t in loaded.items()}, str(out / file_name),
                  metadata={"format": "pt"})
        weight_map.update({name: file_name for name in names})
        del loaded
    if len(files) > 1:
        total = sum(tensors[n].size.numel() * itemsize for n in tensors)
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    for name in MODEL_FILES:
        if (model_dir / name).is_file() and name != "config.json":
            shutil.copy2(model_dir / name, out / name)
    config["torch_dtype"] = dtype
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def _load(checkpoint: Path, wanted: dict) -> dict[str, torch.Tensor]:
    """Full tensors `wanted` (name -> DCP metadata), assembled by DCP from every rank's shards, on the host."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner

    state = {name: torch.empty(tuple(meta.size), dtype=meta.properties.dtype) for name, meta in wanted.items()}
    dcp.load({"model": state}, checkpoint_id=str(checkpoint / "trainer"),
             planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
    return state
