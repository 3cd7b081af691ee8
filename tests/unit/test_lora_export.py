"""`colocate export` of a LoRA checkpoint: the adapter alone in PEFT's format, which PEFT loads onto the base
model and computes with as the trainer's LoRA layers do; and merged, a plain model computing the same. The
checkpoint is a real DCP save of the tiny model with rank-8 adapters on every projection (no process group: the
export never needs one)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from colocate.checkpoint.export import export_hf
from colocate.checkpoint.layout import COMMIT_FILE, MODEL_FILES
from colocate.config import ModelConfig
from colocate.errors import ExportError
from colocate.models.sources import ensure_model
from colocate.trainer.lora import add_lora, lora_targets

ROOT = Path(__file__).resolve().parents[2]
RANK, ALPHA = 8, 16.0


@pytest.fixture(scope="module")
def base_dir() -> str:
    return ensure_model(ModelConfig(cache_dir=str(ROOT / ".cache" / "models")))


def _checkpoint(tmp_path: Path, base_dir: str, *, lora: bool) -> tuple[Path, torch.nn.Module]:
    """A committed step folder as the checkpointer writes it, and the trained model it holds."""
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if lora:
        names = lora_targets(model, ["all-linear"])["all-linear"]
        add_lora(model, names, rank=RANK, alpha=ALPHA, seed=0)
        with torch.no_grad():  # a trained adapter: B away from its zero start
            generator = torch.Generator().manual_seed(1)
            for name, param in model.named_parameters():
                if ".lora_B." in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    step = tmp_path / "step_00000003"
    dcp.save({"model": {k: v.detach().clone() for k, v in model.state_dict().items()}},
             checkpoint_id=str(step / "trainer"), no_dist=True)
    (step / "model").mkdir()
    for name in MODEL_FILES:
        if (Path(base_dir) / name).is_file():
            shutil.copy2(Path(base_dir) / name, step / "model" / name)
    lora_config = {"rank": RANK if lora else 0, "alpha": ALPHA, "target_modules": "all-linear"}
    (step / COMMIT_FILE).write_text(json.dumps({"step": 3, "config": {"trainer": {"lora": lora_config}}}))
    return step, model.eval()


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.arange(3, 19).reshape(2, 8)
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_the_adapter_export_is_peft_format_and_peft_computes_the_trainers_policy(tmp_path, base_dir):
    from peft import PeftModel

    step, trained = _checkpoint(tmp_path, base_dir, lora=True)
    out = export_hf(step, tmp_path / "adapter", dtype="float32")
    assert not (out / "model.safetensors").exists() and (out / "tokenizer.json").is_file()
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == RANK and config["lora_alpha"] == 16
    assert config["target_modules"] == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj"])
    saved = load_file(out / "adapter_model.safetensors")
    assert len(saved) == 2 * 7 * 2 and all(k.startswith("base_model.model.model.layers.") for k in saved)
    for key, value in saved.items():
        assert torch.equal(value, trained.state_dict()[key.removeprefix("base_model.model.")]), key

    expected = _logits(trained)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    assert not torch.allclose(_logits(base), expected, atol=1e-3), "the adapter moves nothing"
    peft_model = PeftModel.from_pretrained(base, str(out)).eval()
    torch.testing.assert_close(_logits(peft_model), expected, rtol=1e-5, atol=1e-5)


def test_the_merged_export_is_a_plain_model_computing_the_same(tmp_path, base_dir):
    step, trained = _checkpoint(tmp_path, base_dir, lora=True)
    out = export_hf(step, tmp_path / "merged", dtype="float32", merged=True)
    saved = load_file(out / "model.safetensors")
    assert not any("lora_" in k for k in saved) and saved.keys() == load_file(
        Path(base_dir) / "model.safetensors").keys()
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    torch.testing.assert_close(_logits(merged), _logits(trained), rtol=1e-5, atol=1e-5)


def test_merged_on_a_full_checkpoint_is_one_line(tmp_path, base_dir):
    step, _ = _checkpoint(tmp_path, base_dir, lora=False)
    with pytest.raises(ExportError, match=r"^--merged: .* holds no LoRA adapter .*; drop --merged$"):
        export_hf(step, tmp_path / "out", merged=True)
