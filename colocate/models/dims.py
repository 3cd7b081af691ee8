"""A model's dimensions, read before any actor starts: from a preset, or the model's config.json (a local
directory, or a hub id already in the Hugging Face cache). The one reader of them: the checks (job/checks.py:
experts, LoRA targets, the sync bucket), the memory preflight (job/preflight.py) and the train step's memory model
(job/train_peaks.py, trainer/step_moments.py) compute on what it returns, read once per job (job/setup.py).

    dims = model_dims(cfg)            # None: a hub id not on this machine
    dims.num_params, dims.layer_params, dims.root_params, dims.largest_tensor_params
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from colocate.config import JobConfig
from colocate.config.critic import POLICY
from colocate.config.fields import bad
from colocate.models.sources import PRESETS, is_hub_id


@dataclass
class ModelDims:
    num_params: int
    num_layers: int
    hidden_size: int
    vocab_size: int
    layer_params: int  # one decoder layer
    tie_word_embeddings: bool
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int = 0  # routed experts per layer; 0: dense
    shared_expert_size: int = 0  # a MoE layer's shared expert's intermediate size; 0: none
    expert_intermediate_size: int = 0  # one routed expert's intermediate size; 0: dense
    model_type: str = ""  # the config's model_type (qwen3_moe, ...)

    @classmethod
    def from_config_dict(cls, d: dict) -> ModelDims:
        d = d.get("text_config", d)
        hidden, layers = d["hidden_size"], d["num_hidden_layers"]
        inter = d.get("intermediate_size", 4 * hidden)
        heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or hidden // heads
        kv = d.get("num_key_value_heads", heads)
        # q/k/v biases: Qwen2's always (its config has no key for them), others' where attention_bias says so;
        # Qwen3's per-head q and k norms instead
        model_type = d.get("model_type", "")
        qkv_bias = d.get("attention_bias", model_type.startswith("qwen2"))
        attention = hidden * head_dim * (2 * heads + 2 * kv) + (head_dim * (heads + 2 * kv) if qkv_bias else 0) \
            + (2 * head_dim if model_type.startswith("qwen3") else 0)
        num_experts = num_routed_experts(d)
        expert_inter = 0
        if num_experts:  # every layer sparse (Qwen3-MoE, Mixtral): experts, router, an optional shared expert
            expert_inter = d.get("moe_intermediate_size") or inter
            shared = d.get("shared_expert_intermediate_size") or 0
            mlp = num_experts * (3 * hidden * expert_inter + hidden) + 3 * hidden * shared + (hidden if shared else 0)
            inter = d.get("num_experts_per_tok", 1) * expert_inter + shared  # what one token computes through
        else:
            mlp = 3 * hidden * inter
        per_layer = attention + mlp + 2 * hidden
        tied = bool(d.get("tie_word_embeddings"))
        embeddings = d["vocab_size"] * hidden * (1 if tied else 2)
        return cls(layers * per_layer + embeddings + hidden, layers, hidden, d["vocab_size"], per_layer, tied,
                   inter, heads, kv, head_dim, num_experts, shared if num_experts else 0, expert_inter, model_type)

    def projections(self) -> dict[str, tuple[int, int]]:
        """The linear projections of a decoder layer, name -> (in, out) features: attention's, and the MLP's
        where it is made of linear layers (a dense model's; a MoE layer's shared expert: routed experts are
        fused tensors)."""
        q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        out = {"q_proj": (self.hidden_size, q_out), "k_proj": (self.hidden_size, kv_out),
               "v_proj": (self.hidden_size, kv_out), "o_proj": (q_out, self.hidden_size)}
        mlp = self.shared_expert_size if self.num_experts else self.intermediate_size
        if mlp:
            out.update(gate_proj=(self.hidden_size, mlp), up_proj=(self.hidden_size, mlp),
                       down_proj=(mlp, self.hidden_size))
        return out

    @property
    def root_params(self) -> int:
        """FSDP2's root group: what is not in a decoder layer (embeddings, final norm, lm_head)."""
        return self.num_params - self.num_layers * self.layer_params

    @property
    def largest_tensor_params(self) -> int:
        """The largest weight, in params: the embeddings (or lm_head), a dense MLP's projection, or a MoE layer's
        experts fused as transformers 5 holds them (gate_up_proj: experts x 2 x intermediate rows of hidden)."""
        mlp = self.num_experts * 2 * self.expert_intermediate_size if self.num_experts else self.intermediate_size
        return max(self.vocab_size, self.hidden_size, mlp) * self.hidden_size

    @property
    def largest_sync_group(self) -> int:
        """The sync streams pre (embeddings), each layer, post (final norm + lm_head): the largest, in params."""
        embedding = self.vocab_size * self.hidden_size
        return max(embedding, self.layer_params, self.hidden_size + (0 if self.tie_word_embeddings else embedding))


def num_adapter_params(cfg: JobConfig, dims: ModelDims) -> int:
    """A LoRA job's adapter parameters (trainer.lora): rank x (in + out) per adapted projection and layer."""
    lora = cfg.trainer.lora
    if not lora.rank:
        return 0
    shapes = dims.projections()
    targets = set(shapes) if "all-linear" in lora.targets else set(lora.targets) & set(shapes)
    return dims.num_layers * lora.rank * sum(sum(shapes[t]) for t in targets)


def trainer_state_bytes(cfg: JobConfig, dims: ModelDims) -> tuple[int, int]:
    """(params + optimizer, params + grads + optimizer) of the whole model in bytes, fp32: each trained
    parameter has a gradient and two AdamW moments the size of itself. A LoRA job trains its adapters alone: the
    frozen base has no gradient and no optimizer state."""
    trained = num_adapter_params(cfg, dims) if cfg.trainer.lora.rank else dims.num_params
    params = 4 * (dims.num_params + (trained if cfg.trainer.lora.rank else 0))
    return params + 8 * trained, params + 12 * trained


def critic_params(cfg: JobConfig, dims: ModelDims) -> int:
    """The value model's parameters (algo.advantage=gae; 0 without a critic): its backbone (the policy's, or the
    critic.model_path model's) with a [hidden -> 1] head instead of the LM head. An untied head's vocab x hidden
    goes; a tied one stays as the input embeddings. A path whose config.json cannot be read counts as the policy."""
    if not cfg.critic.enabled:
        return 0
    critic = dims
    if cfg.critic.model_path != POLICY:
        config_file = model_config_file(cfg.critic.model_path)
        if config_file is not None:
            try:
                critic = ModelDims.from_config_dict(json.loads(config_file.read_text()))
            except (OSError, ValueError, KeyError):
                critic = dims
    head = 0 if critic.tie_word_embeddings else critic.vocab_size * critic.hidden_size
    return critic.num_params - head + critic.hidden_size + 1


def num_routed_experts(config: dict) -> int:
    """A model config's routed experts per layer, under the names the MoE families use (Qwen2/3-MoE, transformers
    5's saved configs, Mixtral, DeepSeek); 0 for a dense model."""
    return int(config.get("num_experts") or config.get("num_local_experts") or config.get("n_routed_experts") or 0)


def model_dims(cfg: JobConfig) -> ModelDims | None:
    """From the preset, or the model's config.json on this machine (None for a hub id not on this machine).
    Raises ConfigError naming model.path when the config.json lacks a decoder's dimensions."""
    if not cfg.model.path:
        p = PRESETS[cfg.model.preset]
        return ModelDims.from_config_dict({**asdict(p), "num_hidden_layers": p.num_layers,
                                           "model_type": "qwen3_moe" if p.num_experts else "qwen2"})
    config_file = model_config_file(cfg.model.path)
    if config_file is None:
        return None
    try:
        return ModelDims.from_config_dict(json.loads(config_file.read_text()))
    except KeyError as e:  # not a decoder LM's config (GPT-2 names its widths n_embd, n_layer, ...)
        raise bad("model.path", cfg.model.path, f"its config.json has no {e.args[0]} (colocate reads a decoder's "
                  "hidden_size, num_hidden_layers, num_attention_heads and vocab_size)") from None


def model_config_file(path: str) -> Path | None:
    """`path`'s config.json: in the directory `path`, or for a hub id ("org/name") in the Hugging Face cache,
    where a download put it (a run's, or `hf download ORG/NAME config.json`). Never asks the network; None when
    neither has it."""
    local = Path(path).expanduser()
    if (local / "config.json").is_file():
        return local / "config.json"
    if local.exists() or not is_hub_id(path):
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(path, "config.json")
    except (ImportError, ValueError, OSError):  # no huggingface_hub, not a valid repo id: as if not downloaded
        return None
    return Path(found) if isinstance(found, str) else None
