"""A checkpoint as a Hugging Face model: safetensors + config + tokenizer, which vLLM and `transformers` load as is.

    colocate export outputs/run/checkpoints/step_00000009 exported/ [--dtype bfloat16] [--merged]
    export_hf(checkpoint_path, out_dir, dtype="bfloat16")

A LoRA job's checkpoint (trainer.lora.rank > 0) holds the frozen base and the adapter. Its export is the adapter
alone, in PEFT's format (adapter_model.safetensors + adapter_config.json, and the tokenizer): vLLM loads it with
a LoRARequest and PEFT with PeftModel.from_pretrained, each on the base model the job started from. With
`merged=True` it is a plain model instead, each adapted weight W + alpha / rank x B A (computed in fp32).

No process group, no device and no merger tool: the trainer's shards are read from the DCP files on the host a
few tensors at a time (DCP assembles each full tensor from the ranks' shards itself), cast, and written in
safetensors files of at most `shard_bytes` each, so memory holds one output file's worth of weights, never the
whole model (the issue of a merger that gathers everything on one rank's device first). The model's files
(config.json with its dtype set, generation config, tokenizer) come from the checkpoint's model/ folder.
"""

from __future__ import annotations

import json
import re
import shutil
import warnings
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


def export_hf(checkpoint: str | Path, out: str | Path, *, dtype: str = "bfloat16", merged: bool = False,
              lora_alpha: float | None = None, shard_bytes: int = 2 << 30) -> Path:
    """`lora_alpha`: a LoRA checkpoint's scaling numerator when its meta.json is not written yet (the checkpointer
    exporting into a save in progress); otherwise read from the job config that meta.json keeps."""
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
    adapters = {name: meta for name, meta in tensors.items() if _ADAPTER.search(name)}
    if merged and not adapters:
        raise ExportError(f"--merged: {checkpoint} holds no LoRA adapter (its job trained every weight, "
                          "trainer.lora.rank=0), so its export is the whole model already; drop --merged")
    tensors = {name: meta for name, meta in tensors.items() if name not in adapters}
    if adapters:
        alpha = lora_alpha if lora_alpha is not None else _lora_alpha(checkpoint)
        if not merged:
            return _export_adapter(checkpoint, out, adapters, dtype=dtype, alpha=alpha, config=config)
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
        if adapters:
            _merge(loaded, _load(checkpoint, _adapters_of(names, adapters)), alpha)
        save_file({name: t.to(DTYPES[dtype]).contiguous() for name, t in loaded.items()}, str(out / file_name),
                  metadata={"format": "pt"})
        weight_map.update({name: file_name for name in names})
        del loaded
    if len(files) > 1:
        total = sum(tensors[n].size.numel() * itemsize for n in tensors)
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    _copy_model_files(model_dir, out)
    config["torch_dtype"] = dtype
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def _copy_model_files(model_dir: Path, out: Path) -> None:
    """The model's files but its config.json: generation config and tokenizer."""
    for name in MODEL_FILES:
        if (model_dir / name).is_file() and name != "config.json":
            shutil.copy2(model_dir / name, out / name)


# ------------------------------------------------------------------------------------------------------ LoRA

_ADAPTER = re.compile(r"\.lora_[AB]\.weight$")  # trainer/lora.py's names, PEFT's less its prefix and adapter name
_PEFT_PREFIX = "base_model.model."  # what PEFT's save_pretrained puts before a module's name


def _lora_alpha(checkpoint: Path) -> float:
    meta = json.loads((checkpoint / COMMIT_FILE).read_text())
    return float(meta["config"]["trainer"]["lora"]["alpha"])


def _adapters_of(names: list[str], adapters: dict) -> dict:
    """The adapter tensors of the base weights `names` (module.weight -> module.lora_A/B.weight)."""
    wanted = {}
    for name in names:
        module = name.removesuffix(".weight")
        for part in ("lora_A", "lora_B"):
            key = f"{module}.{part}.weight"
            if key in adapters:
                wanted[key] = adapters[key]
    return wanted


def _merge(base: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor], alpha: float) -> None:
    """W += alpha / rank x B A, in place and in fp32 (the checkpoint's master weights are fp32)."""
    for key, a in adapter.items():
        if ".lora_A." not in key:
            continue
        module = key.removesuffix(".lora_A.weight")
        b = adapter[f"{module}.lora_B.weight"]
        weight = base[f"{module}.weight"]
        weight.add_((b.float() @ a.float()).to(weight.dtype), alpha=alpha / a.shape[0])


def _export_adapter(checkpoint: Path, out: Path, adapters: dict, *, dtype: str, alpha: float,
                    config: dict) -> Path:
    """PEFT's adapter files: adapter_model.safetensors (its key names) and adapter_config.json, plus the tokenizer.
    The target modules are the adapted projections' names: trainer.lora.target_modules selects by suffix, so
    each named suffix covers exactly the modules PEFT's rule selects again on load."""
    from safetensors.torch import save_file

    loaded = _load(checkpoint, adapters)
    ranks = {t.shape[0] for k, t in loaded.items() if ".lora_A." in k}
    assert len(ranks) == 1, f"adapters of ranks {sorted(ranks)} in one checkpoint"
    out.mkdir(parents=True, exist_ok=True)
    save_file({_PEFT_PREFIX + k: t.to(DTYPES[dtype]).contiguous() for k, t in loaded.items()},
              str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    targets = sorted({k.removesuffix(".lora_A.weight").rsplit(".", 1)[-1] for k in loaded if ".lora_A." in k})
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": ranks.pop(),
        "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha, "target_modules": targets,
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "init_lora_weights": True, "modules_to_save": None, "inference_mode": True,
        "base_model_name_or_path": config.get("_name_or_path") or None,
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    _copy_model_files(checkpoint / "model", out)
    return out


def _load(checkpoint: Path, wanted: dict) -> dict[str, torch.Tensor]:
    """Full tensors `wanted` (name -> DCP metadata), assembled by DCP from every rank's shards, on the host."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner

    state = {name: torch.empty(tuple(meta.size), dtype=meta.properties.dtype) for name, meta in wanted.items()}
    with warnings.catch_warnings():  # no_dist=True is the intent: DCP warns about it on every load
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"model": state}, checkpoint_id=str(checkpoint / "trainer"),
                 planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
    return state
