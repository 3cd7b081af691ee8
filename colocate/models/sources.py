"""The embedded default models: small random-initialised Qwen2 (and Qwen3-MoE) causal LMs with a character
tokenizer.

No machine of ours can download weights, so the default job builds its own model once into a cache
directory (safetensors + Hugging Face tokenizer files) and reuses it. The result is an ordinary Hugging
Face model directory: `transformers`, vLLM and colocate's trainer all load it by path.

    >>> path = ensure_model(ModelConfig(preset="tiny"))   # builds on the first call, reuses after
    >>> tokenizer = load_tokenizer(path)

The presets are the registry PRESETS below, each with its use in PRESET_USES; reward presets
(`rollout.rewards=model:tiny-rm`) are REWARD_PRESETS: a preset's body under a one-logit sequence classification
head (Qwen2ForSequenceClassification), random, so CI serves a reward model without downloads. A generative judge
can be any causal preset (`judge:tiny`). `colocate config-docs` lists them all from here (preset_docs).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from colocate.config import ModelConfig
from colocate.errors import ConfigError

# The character vocabulary of the toy tasks. Ids 0..3 are special; the rest are single characters.
SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARACTERS = list("0123456789") + list("+-=*,:; ") + list("abcdefghijklmnopqrstuvwxyz")
VOCAB = SPECIAL_TOKENS + CHARACTERS


@dataclass(frozen=True)
class Preset:
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int  # may exceed the tokenizer's vocabulary (rows beyond it are never sampled in tasks)
    tie_word_embeddings: bool
    max_position_embeddings: int = 512
    characters: str = ""  # the tokenizer's characters after the special tokens; empty: the toy tasks' CHARACTERS
    # routed experts (Qwen3-MoE, every layer sparse); 0: a dense Qwen2. Named as Hugging Face's config names them.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


# head_dim must be one the vLLM CPU attention backend supports (32, 64, 80, ...).
# tiny-tied (below) is tiny with lm_head tied to the embeddings, the layout small Qwen/Llama models ship.
PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        num_layers=2,
        hidden_size=128,
        intermediate_size=384,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(VOCAB),
        tie_word_embeddings=False,
        max_position_embeddings=4096,  # room for reasoning-length answers (the long-answer e2e job: 2,048)
    ),
    "bench": Preset(
        num_layers=24,
        hidden_size=1024,
        intermediate_size=2304,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=32768,
        tie_word_embeddings=False,
    ),
}


PRESETS["tiny-tied"] = replace(PRESETS["tiny"], tie_word_embeddings=True)
# tiny's attention under 8 routed experts, top-2, in both layers: a Qwen3-MoE that CI can train, serve at TP=2 or
# with expert parallelism, and sync (each expert's intermediate 64 splits in two blocks of 32 under TP=2)
PRESETS["tiny-moe"] = replace(PRESETS["tiny"], num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64)
# the bench preset's attention and vocabulary over 4 layers of 32 experts (top-4): 0.56 GB of bf16 weights, 90% of
# them experts, for `colocate bench sync model.preset=bench-moe` (the sync of a MoE against its floors)
PRESETS["bench-moe"] = replace(PRESETS["bench"], num_layers=4, num_experts=32, num_experts_per_tok=4,
                               moe_intermediate_size=512)
# tiny's width in 2 heads of 64: the head size at which vLLM's CPU attention and torch's SDPA agree bit for bit
# (tiny's 32 do not), for the equal-bits path of docs/mismatch.md (engine.native_rotary, fp32, TP=1)
PRESETS["tiny-hd64"] = replace(PRESETS["tiny"], num_attention_heads=2, num_key_value_heads=1)
# tiny over every printable ASCII character and the newline: the characters of chat and tool-call formats
# (`<tool_call>{"name": ...}`), which the toy vocabulary lacks (the calculator environment's e2e test)
CHAT_CHARACTERS = "".join(c for c in map(chr, range(32, 127))) + "\n"
PRESETS["tiny-chat"] = replace(PRESETS["tiny"], vocab_size=len(SPECIAL_TOKENS) + len(CHAT_CHARACTERS),
                               characters=CHAT_CHARACTERS)
# reward presets: a preset's body with a one-logit classification head (vLLM's pooling runner serves it)
REWARD_PRESETS: dict[str, Preset] = {"tiny-rm": PRESETS["tiny"]}
# what each preset is for, in docs/config.md (preset_docs); a preset missing here is listed by its shape alone
PRESET_USES = {
    "tiny": "tests and the default job: seconds to build, learns in minutes",
    "tiny-tied": "tiny with lm_head tied to the embeddings, as small Qwen and Llama models ship them",
    "tiny-moe": "tiny's attention over routed experts, a Qwen3-MoE (docs/moe.md)",
    "bench": ">= 0.4 GB of bf16 weights, for the sync and switch benchmarks",
    "bench-moe": "bench's attention and vocabulary over experts, for `colocate bench sync` of a MoE",
    "tiny-hd64": "tiny in 2 heads of 64: the engine's forward bit for bit the trainer's (docs/mismatch.md)",
    "tiny-chat": "every printable ASCII character and the newline: chat and tool-call formats",
    "tiny-rm": "tiny's body under a one-logit classification head",
}


def preset_docs() -> dict[str, str]:
    """What docs/config.md says of the presets, generated from the registry (PRESETS, REWARD_PRESETS): a sentence
    for each key that names them, which `colocate config-docs` adds to that key's docstring."""
    def listed(presets: dict[str, Preset]) -> str:
        return ", ".join(f"{name} ({_shape(p)}" + (f"; {PRESET_USES[name]}" if name in PRESET_USES else "") + ")"
                         for name, p in presets.items())
    return {"model.preset": f"The presets: {listed(PRESETS)}.",
            "rollout.rewards": f"Embedded reward models (model:NAME): {listed(REWARD_PRESETS)}."}


def _shape(p: Preset) -> str:
    experts = f", {p.num_experts} experts, top-{p.num_experts_per_tok}" if p.num_experts else ""
    return (f"{p.num_layers} layers, hidden {p.hidden_size}{experts}, vocabulary {p.vocab_size}"
            + (", tied lm_head" if p.tie_word_embeddings else ""))


def preset_dir(config: ModelConfig) -> Path:
    """Where a preset is cached: one directory per preset, its dimensions and seed, so presets never overwrite
    each other and a preset whose dimensions change (a newer colocate) is built anew, not read stale."""
    return _cache_dir(config.cache_dir, config.preset, PRESETS[config.preset], config.seed)


# fields that join a preset's fingerprint only when set, so the presets without them keep their cache directories
_FINGERPRINT_IF_SET = ("characters", "num_experts", "num_experts_per_tok", "moe_intermediate_size")


def _cache_dir(cache_dir: str, name: str, preset: Preset, seed: int) -> Path:
    dims = {k: v for k, v in asdict(preset).items() if k not in _FINGERPRINT_IF_SET or v}
    fingerprint = hashlib.sha1(json.dumps(dims, sort_keys=True).encode()).hexdigest()[:8]
    family = "qwen3moe" if preset.num_experts else "qwen2"
    return Path(cache_dir).expanduser() / f"{family}-{name}-{fingerprint}-seed{seed}"


def is_hub_id(path: str) -> bool:
    """Whether `path` reads as a Hugging Face hub id (ORG/NAME) rather than a local path."""
    return path.count("/") == 1 and not path.startswith((".", "/", "~"))


def ensure_model(config: ModelConfig) -> str:
    """Return a loadable model directory: `config.path` if it is one, a hub id's snapshot (downloaded once, in
    the driver, before any actor: every later reader sees files, not an id), or the preset built into the cache."""
    if config.path:
        local = Path(config.path).expanduser()
        if local.is_dir():
            return str(local)
        return hub_snapshot(config.path)
    return _built(preset_dir(config), PRESETS[config.preset], seed=config.seed)


def ensure_reward_model(kind: str, path: str, *, cache_dir: str, seed: int, key: str = "rollout.rewards") -> str:
    """The directory of a reward model named by `model:PATH` or `judge:PATH`: a directory, an embedded preset
    (a reward preset for `model`, a causal one for `judge`), built once into `cache_dir`, or a hub id's
    snapshot. Raises ConfigError naming `key`."""
    local = Path(path).expanduser()
    if local.is_dir():
        return str(local)
    presets = REWARD_PRESETS if kind == "model" else PRESETS
    if path in presets:
        head = "classifier" if kind == "model" else "causal_lm"
        return _built(_cache_dir(cache_dir, path, presets[path], seed), presets[path], seed=seed, head=head)
    if not is_hub_id(path):
        raise ConfigError(f"{key}={kind}:{path} is invalid: {path!r} is not a directory; give a model directory, "
                          f"a hub id (ORG/NAME) or an embedded preset ({', '.join(presets)})")
    return hub_snapshot(path, key=f"{key} ({kind}:)")


def _built(target: Path, preset: Preset, *, seed: int, head: str = "causal_lm") -> str:
    if (target / "config.json").exists():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    # A file lock keeps two processes (two test workers, two jobs) from building the same preset at once;
    # the build goes to a temporary directory and is renamed into place, so a crash leaves no half model.
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "config.json").exists():
            tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
            try:
                build_model(preset, tmp, seed=seed, head=head)
                os.rename(tmp, target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def hub_snapshot(repo_id: str, *, key: str = "model.path") -> str:
    """The local directory of a Hugging Face hub model: the cached snapshot, downloaded first when missing
    (weights, config, tokenizer; not other formats' files). Raises ConfigError naming model.path if it cannot."""
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
    try:
        return snapshot_download(repo_id, allow_patterns=patterns)
    except Exception as e:  # offline, no such repository, no access: one line, before any actor
        raise ConfigError(f"{key}={repo_id!r} is invalid: not a local directory, and the Hugging Face hub "
                         f"did not give it ({type(e).__name__}: {str(e).strip().splitlines()[0][:160]}); give a "
                         "model directory, e.g. after `hf download ORG/NAME --local-dir DIR`") from None


def build_model(preset: Preset, out_dir: Path, *, seed: int, head: str = "causal_lm") -> None:
    """Write a random-initialised Qwen2ForCausalLM (head "causal_lm"), Qwen3MoeForCausalLM (a preset with
    experts) or Qwen2ForSequenceClassification with one label (head "classifier": a reward model), safetensors in
    float32, and the character tokenizer."""
    import torch
    from transformers import (Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM)

    vocab = preset_vocab(preset)
    moe = dict(num_experts=preset.num_experts, num_experts_per_tok=preset.num_experts_per_tok,
               moe_intermediate_size=preset.moe_intermediate_size, head_dim=preset.head_dim, norm_topk_prob=True,
               decoder_sparse_step=1) if preset.num_experts else {}
    assert not (moe and head == "classifier"), "reward presets are dense"
    hf_config = (Qwen3MoeConfig if moe else Qwen2Config)(
        vocab_size=preset.vocab_size,
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_layers,
        num_attention_heads=preset.num_attention_heads,
        num_key_value_heads=preset.num_key_value_heads,
        max_position_embeddings=preset.max_position_embeddings,
        tie_word_embeddings=preset.tie_word_embeddings,
        bos_token_id=vocab.index("<bos>"),
        eos_token_id=vocab.index("<eos>"),
        pad_token_id=vocab.index("<pad>"),
        torch_dtype="float32",
        **({"num_labels": 1} if head == "classifier" else {}),
        **moe,
    )
    torch.manual_seed(seed)
    model_class = Qwen3MoeForCausalLM if moe else Qwen2ForCausalLM
    model = (Qwen2ForSequenceClassification if head == "classifier" else model_class)(hf_config)
    model.save_pretrained(out_dir, safe_serialization=True)
    build_tokenizer(vocab).save_pretrained(out_dir)
    (out_dir / "colocate_preset.json").write_text(json.dumps(asdict(preset), indent=2))


def preset_vocab(preset: Preset) -> list[str]:
    return SPECIAL_TOKENS + list(preset.characters) if preset.characters else VOCAB


def build_tokenizer(tokens: list[str] = VOCAB):
    """A character-level fast tokenizer in Hugging Face format (one token per character)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
    )


def load_tokenizer(path: str):
    """The model's tokenizer. For embedded presets, read tokenizer.json as written: AutoTokenizer would pick the
    architecture's own tokenizer class (Qwen2's byte-level pre-tokenizer) and drop the character splitting."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if (Path(path) / "colocate_preset.json").exists():
        return PreTrainedTokenizerFast.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path)
