"""Every check a job needs before any actor starts, beyond its config's own fields (JobConfig.check): the user's
code, the files it reads, the paths it writes, the model, the devices and the node. `colocate validate`,
`colocate launch` and `run_job` call these same functions (through job/setup.py, which keeps what they build),
so what validate accepts, launch accepts.

    task, dims = check_sources(cfg)          # user code, data and model files, paths written, metric sinks; no
                                             #   device. Returns the task it imported and the model's dimensions
    slots, prediction = check_devices(cfg, dims, node=...)  # the slots and each phase's memory on this machine
                                                            #   (or on a described node)
    inputs = read_inputs(cfg, model_path, tokenizer)        # the data's rows, the resume point, the reward model

Each raises ConfigError (exit 2) naming the key, the bad value and what would be valid. `colocate submit` runs
check_sources only: a cluster's devices are checked when the job connects to it (Runtime.start), still before
any actor starts.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path

from colocate.checkpoint.layout import checkpoint_root, resume_point
from colocate.config import JobConfig
from colocate.config.fields import bad
from colocate.config.reward_model import RewardModelSpec, reward_models_in
from colocate.errors import ConfigError
from colocate.job.injections import parse_injections
from colocate.job.placement import SlotPlan, local_device_count, plan_slots, resolve_device
from colocate.job.preflight import DTYPE_BYTES, GIB, Prediction, host_available_bytes, preflight
from colocate.models import sources as models
from colocate.models.dims import ModelDims, model_config_file, model_dims
from colocate.rl.data import data_files, load_val_samples, make_prompt_source
from colocate.rollout.evaluation import enabled as evaluation_enabled
from colocate.rl.rewards import check_covered, parse_rewards, parse_source_rewards
from colocate.rl.tasks import Task, load_reward_fn, make_task
from colocate.telemetry.sinks import check_sinks


@dataclass(frozen=True)
class GpuNode:
    """A GPU node described by the user (`colocate validate --gpus N --gpu-memory-gib G`), not this machine."""
    num_gpus: int
    gpu_memory_gib: float


def check_sources(cfg: JobConfig, *, writes_here: bool = True) -> tuple[Task, ModelDims | None]:
    """What needs this machine's files and the user's code, but no device. `writes_here=False`: the job writes on
    another machine (`colocate submit`: the cluster's), whose directories its own launch checks there. Returns
    what the checks built: the task (rollout.task, imported) and the model's dimensions (None: a hub id not on
    this machine yet)."""
    if not cfg.model.path and cfg.model.preset not in models.PRESETS:
        import difflib

        near = (difflib.get_close_matches(cfg.model.preset, list(models.PRESETS), n=1) or ["tiny"])[0]
        raise bad("model.preset", cfg.model.preset, "valid: " + ", ".join(sorted(models.PRESETS)) +
                  f"; e.g. model.preset={near}", fix={"model.preset": near})
    _check_model_path(cfg.model.path)
    _check_chunked_head(cfg)
    _check_activation_checkpointing(cfg)
    dims = model_dims(cfg)
    check_experts(cfg, dims)
    check_lora(cfg, dims)
    check_critic(cfg, dims)
    task = make_task(cfg.rollout.task, length=cfg.rollout.task_length)
    if cfg.rollout.env and not cfg.data.train_files:  # on data rows, read_inputs checks it with the first one
        _check_env(cfg, task.sample(random.Random(0)))
    if cfg.rollout.reward_fn:
        load_reward_fn(cfg.rollout.reward_fn)
    if cfg.rollout.source_rewards:
        parse_source_rewards(cfg.rollout.source_rewards)
    if cfg.rollout.rewards:
        parse_rewards(cfg.rollout.rewards)
        for spec in reward_models_in(cfg.rollout.rewards):
            _check_reward_model(spec)
    data_files(cfg.data.train_files, "data.train_files")
    data_files(cfg.data.val_files, "data.val_files")
    if cfg.data.chat_template not in ("auto", "none") and not Path(cfg.data.chat_template).expanduser().is_file():
        raise bad("data.chat_template", cfg.data.chat_template, "is neither auto, none nor a chat template file "
                  "that exists", fix={"data.chat_template": "auto"})
    if cfg.fault.inject:
        parse_injections(cfg.fault.inject)
    _check_bucket_size(cfg, dims)
    check_sinks(cfg.logging)
    if writes_here:
        for key, path in written_paths(cfg).items():
            check_writable(key, path)
    return task, dims


def check_devices(cfg: JobConfig, dims: ModelDims | None, *,
                  node: GpuNode | None = None) -> tuple[SlotPlan | None, Prediction | None]:
    """The slots must fit this machine (or `node`), and every phase's memory the device. Returns (slot plan,
    preflight prediction), or (None, None) when the job's devices are a Ray cluster's (checked once connected)."""
    from colocate.host.node_checks import check_node, compute_modes, mps_pipe_directory, shm_free_bytes

    if node is not None:
        if cfg.placement.device == "cpu":
            raise ConfigError("placement.device='cpu' is invalid with --gpus: --gpus describes a CUDA node; "
                              "valid: auto, cuda")
        plan = plan_slots(cfg, device="cuda", num_devices=node.num_gpus, where=f"the node of --gpus {node.num_gpus}")
        return plan, preflight(cfg, dims, device="cuda", available_bytes=int(node.gpu_memory_gib * GIB))
    device = resolve_device(cfg.placement.device)
    if cfg.placement.ray_address:
        return None, None
    plan = plan_slots(cfg, device=device, num_devices=local_device_count(device))
    prediction = preflight(cfg, dims, device=device)
    if prediction.host_needs:  # a CUDA job, and this machine is its node: what the node must provide
        check_node(cfg, prediction.host_needs, available_host_bytes=host_available_bytes(),
                   shm_bytes=shm_free_bytes(), modes=compute_modes(), mps=mps_pipe_directory())
    return plan, prediction


@dataclass
class JobInputs:
    """What the job reads before any actor starts: a bad row or a checkpoint of another model is a ConfigError
    here, not an error after minutes of model loading."""
    prompts: object | None  # a DatasetPrompts when data.train_files is set; None: the task's own stream
    resume_from: Path | None
    reward_model_path: str | None = None  # model:PATH or judge:PATH of rollout.rewards, fetched or built


def _check_env(cfg: JobConfig, sample) -> None:
    """One episode's reset and one step of rollout.env, on a sample of the job's own prompts."""
    from colocate.rollout.environments import check_env

    check_env(cfg.rollout.env, sample, length=cfg.rollout.task_length, timeout_s=cfg.rollout.env_timeout_s)


def read_inputs(cfg: JobConfig, model_path: str, tokenizer) -> JobInputs:
    """The job's model on this machine (`model_path`, with its `tokenizer`): job/setup.py's set_up_job."""
    prompts = make_prompt_source(cfg, tokenizer) if cfg.data.train_files else None
    if cfg.rollout.env and prompts is not None:  # an environment may expect the data's own fields
        _check_env(cfg, prompts.samples[0])
    if cfg.rollout.turn_stop:
        check_turn_stop(cfg.rollout.turn_stop, tokenizer)
    rewards = parse_source_rewards(cfg.rollout.source_rewards) if cfg.rollout.source_rewards else None
    if rewards is not None and prompts is not None:  # every source of the rows has its rewards
        check_covered([s.source for s in prompts.samples], rewards, key="data.train_files")
    if cfg.data.val_files and evaluation_enabled(cfg.eval):
        val = load_val_samples(cfg, tokenizer)
        if rewards is not None:
            check_covered([s.source for s in val], rewards, key="data.val_files")
    return JobInputs(prompts, resume_point(cfg, model_path), reward_model_path(cfg))


def check_experts(cfg: JobConfig, dims: ModelDims | None) -> None:
    """engine.expert_parallel splits a MoE model's experts over each engine's TP workers: the model must have
    experts, at least one per worker. A hub id not on this machine yet passes (set_up_job checks it once it is).
    algo.router_replay replays the routing of a Qwen3-MoE model (trainer/router_replay.py)."""
    if dims is None:
        return
    model = cfg.model.path or f"model.preset={cfg.model.preset}"
    if cfg.algo.router_replay and (not dims.num_experts or dims.model_type != "qwen3_moe"):
        what = "a dense model (no routed experts in its config)" if not dims.num_experts else \
            f"a {dims.model_type} model, whose router colocate does not replay"
        raise bad("algo.router_replay", True, f"{model} is {what}; routing replay replays a Qwen3-MoE model's "
                  "expert choices (e.g. model.preset=tiny-moe); valid: false", fix={"algo.router_replay": False})
    if not cfg.engine.expert_parallel:
        return
    if not dims.num_experts:
        raise bad("engine.expert_parallel", True, f"{model} is a dense model (no routed experts in its config); "
                  "expert parallelism splits a MoE model's experts (e.g. model.preset=tiny-moe); valid: false",
                  fix={"engine.expert_parallel": False})
    if dims.num_experts < cfg.engine.tp:
        raise bad("engine.expert_parallel", True, f"{model} has {dims.num_experts} experts per layer, fewer than "
                  f"engine.tp={cfg.engine.tp} workers to split them over; valid: false, or engine.tp <= "
                  f"{dims.num_experts}", fix={"engine.expert_parallel": False})


def check_lora(cfg: JobConfig, dims: ModelDims | None) -> None:
    """Every trainer.lora.target_modules entry must name a projection the model has as a linear layer (a MoE
    model's routed experts are fused tensors: its MLP has none, bar a shared expert). A hub id not on this
    machine yet passes (set_up_job checks it once it is)."""
    if dims is None or not cfg.trainer.lora.rank:
        return
    have = dims.projections()
    missing = [t for t in cfg.trainer.lora.targets if t != "all-linear" and t not in have]
    if missing:
        model = cfg.model.path or f"model.preset={cfg.model.preset}"
        raise bad("trainer.lora.target_modules", cfg.trainer.lora.target_modules,
                  f"{', '.join(missing)} {'matches' if len(missing) == 1 else 'match'} no linear layer of {model}; "
                  "valid: all-linear, "
                  + ", ".join(have), fix={"trainer.lora.target_modules": "all-linear"})


def check_critic(cfg: JobConfig, dims: ModelDims | None) -> None:
    """critic.model_path, when it is a model of its own: a local causal LM whose tokens are the policy's, and whose
    value head, when it carries one, fits its hidden size (trainer/critic.py loads it)."""
    from colocate.config.critic import POLICY
    from colocate.trainer.critic import saved_value_head

    path = cfg.critic.model_path
    if not path or path == POLICY:
        return
    local, key = Path(path).expanduser(), "critic.model_path"
    if not (local / "config.json").is_file():
        raise bad(key, path, "not a local Hugging Face model directory (no config.json there); valid: policy (a copy "
                  "of the policy with a value head), or such a directory", fix={key: POLICY})
    config = json.loads((local / "config.json").read_text())
    name = (config.get("architectures") or ["(none)"])[0]
    if not name.endswith("ForCausalLM"):
        raise bad(key, path, f"{name} is not a causal LM (*ForCausalLM), whose backbone the value head sits on")
    vocab = config.get("vocab_size")
    if dims is not None and vocab is not None and vocab != dims.vocab_size:
        raise bad(key, path, f"its vocabulary has {vocab} tokens and the policy's {dims.vocab_size}: the critic "
                  "reads the policy's token ids, so the two must share a tokenizer")
    head, hidden = saved_value_head(local), config.get("hidden_size")
    if head is not None and head[1] != (1, hidden):
        raise bad(key, path, f"its value head {head[0]}.weight has shape {list(head[1])}, and its hidden size "
                  f"{hidden} needs [1, {hidden}]")


def check_turn_stop(turn_stop: str, tokenizer) -> None:
    """rollout.turn_stop must be text the model can write: its tokens read back as itself (a character the
    vocabulary lacks becomes the unknown token, and the stop would never match)."""
    ids = tokenizer(turn_stop, add_special_tokens=False).input_ids
    back = tokenizer.decode(ids)
    if back != turn_stop or (tokenizer.unk_token_id is not None and tokenizer.unk_token_id in ids):
        raise bad("rollout.turn_stop", turn_stop, f"the model's tokenizer cannot write it (its {len(ids)} tokens "
                  f"read back as {back!r}); valid: text of the model's vocabulary, e.g. its tool call's end tag")


def reward_model_path(cfg: JobConfig) -> str | None:
    """The directory of the job's reward model (fetched from the hub or built from a preset once), checked
    for its kind; None when rollout.rewards names none."""
    specs = reward_models_in(cfg.rollout.rewards)
    if not specs:
        return None
    path = models.ensure_reward_model(specs[0].kind, specs[0].path, cache_dir=cfg.model.cache_dir,
                                      seed=cfg.model.seed)
    _check_reward_model(RewardModelSpec(specs[0].kind, path))
    return path


# ------------------------------------------------------------------------------------------------ paths

def written_paths(cfg: JobConfig) -> dict[str, Path]:
    """Every directory the job writes, by the key that names it."""
    paths = {"logging.output_dir": Path(cfg.logging.output_dir).expanduser()}
    if cfg.checkpoint.dir and (cfg.checkpoint.every_steps or cfg.checkpoint.at_end):  # else under output_dir
        paths["checkpoint.dir"] = checkpoint_root(cfg)
    if cfg.trainer.offload_dir:
        paths["trainer.offload_dir"] = Path(cfg.trainer.offload_dir).expanduser()
    if not cfg.model.path:  # the embedded preset is built there once
        paths["model.cache_dir"] = Path(cfg.model.cache_dir).expanduser()
    if cfg.sync.carrier == "directory" and cfg.placement.split:  # the feeders write the sync's files there
        paths["sync.carrier_dir"] = Path(cfg.sync.carrier_dir).expanduser()
    return paths


def check_writable(key: str, path: Path) -> None:
    """`path` can be created (if missing) and written by this user: tried, then undone (a probe file, and the
    folders the try created). access() would not do: it answers yes to root for /proc, where mkdir fails."""
    missing = []
    probe = path
    while not probe.exists():
        missing.append(probe)
        if probe.parent == probe:
            break
        probe = probe.parent
    try:
        if probe.exists() and not probe.is_dir():
            raise NotADirectoryError(f"{probe} is not a directory")
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".colocate-write-check-"):
            pass
    except OSError as e:
        raise bad(key, str(path), f"cannot write there ({e.strerror or e}); valid: a directory this user can "
                   "create and write") from None
    finally:
        for folder in missing:  # deepest first
            try:
                os.rmdir(folder)
            except OSError:
                pass


# ------------------------------------------------------------------------------------------------ model

# What some causal LMs do to the logits after lm_head, in their own forward: the chunked head returns log-probs
# there instead of logits, and these would be applied to them (Gemma 2/3 soft-cap, Cohere scales).
_AFTER_LM_HEAD = ("final_logit_softcapping", "logit_scale")


def _model_config(cfg: JobConfig) -> dict | None:
    """model.path's config.json as a dict; None for the presets (plain Qwen2) or a hub id not on this machine."""
    config_file = model_config_file(cfg.model.path) if cfg.model.path else None
    return json.loads(config_file.read_text()) if config_file else None


def _check_chunked_head(cfg: JobConfig) -> None:
    config = _model_config(cfg) if cfg.trainer.logprob_chunk_tokens else None
    for section in (config, config.get("text_config") or {}) if config else ():
        for key in _AFTER_LM_HEAD:
            if section.get(key) not in (None, 0, 1, 1.0):
                raise bad("trainer.logprob_chunk_tokens", cfg.trainer.logprob_chunk_tokens,
                           f"the model transforms its logits after lm_head ({key}={section[key]}), which the "
                           "chunked log-prob pass does not; set trainer.logprob_chunk_tokens=null"
                           + (" and trainer.fp32_lm_head=false (the chunked head computes it)"
                              if cfg.trainer.fp32_lm_head else ""),
                           fix={"trainer.logprob_chunk_tokens": None,
                                **({"trainer.fp32_lm_head": False} if cfg.trainer.fp32_lm_head else {})})


def _check_activation_checkpointing(cfg: JobConfig) -> None:
    """The model's class must checkpoint its layers (the presets are Qwen2, which does)."""
    config = _model_config(cfg) if cfg.trainer.activation_checkpointing else None
    if not config:
        return
    import transformers

    for name in config.get("architectures") or []:
        cls = getattr(transformers, name, None)
        if cls is not None and not getattr(cls, "supports_gradient_checkpointing", False):
            raise bad("trainer.activation_checkpointing", True, f"{name} cannot checkpoint its layers "
                       "(transformers' supports_gradient_checkpointing is False); set "
                       "trainer.activation_checkpointing=false", fix={"trainer.activation_checkpointing": False})


def _check_model_path(path: str) -> None:
    if not path:
        return
    local = Path(path).expanduser()
    if local.is_dir() and not (local / "config.json").is_file():
        raise bad("model.path", path, "the directory has no config.json (not a Hugging Face model directory)")
    if "/" in path and not local.exists() and not models.is_hub_id(path):
        # "org/name" may be a hub id; anything path-like must exist.
        raise bad("model.path", path, "no such directory (give a Hugging Face model directory or hub id, or "
                   "leave empty for the embedded preset)")


def _check_reward_model(spec: RewardModelSpec) -> None:
    """A local reward model must be the kind its component says: `model:` a sequence classifier with one label
    (its logit is the score), `judge:` a causal LM. An embedded preset or a hub id not fetched yet passes here
    (reward_model_path checks it once it is on this machine); a path-like PATH that does not exist does not."""
    key, value = "rollout.rewards", f"{spec.kind}:{spec.path}"
    local = Path(spec.path).expanduser()
    presets = models.REWARD_PRESETS if spec.kind == "model" else models.PRESETS
    if not local.is_dir():
        if spec.path not in presets and not models.is_hub_id(spec.path):
            raise bad(key, value, f"no such directory; give a model directory, a hub id (ORG/NAME) or an embedded "
                      f"preset ({', '.join(presets)})")
        return
    if not (local / "config.json").is_file():
        raise bad(key, value, "the directory has no config.json (not a Hugging Face model directory)")
    try:
        config = json.loads((local / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise bad(key, value, f"its config.json cannot be read ({type(e).__name__}: {e})") from None
    architectures = config.get("architectures") or ["(none)"]
    if spec.kind == "model":
        if not architectures[0].endswith("ForSequenceClassification"):
            raise bad(key, value, f"{architectures[0]} is not a sequence classifier (*ForSequenceClassification); "
                      "a causal LM can judge instead: judge:PATH")
        num_labels = len(config.get("id2label") or {}) or config.get("num_labels", 2)
        if num_labels != 1:
            raise bad(key, value, f"the classifier has {num_labels} labels; a reward model has one (num_labels=1), "
                      "whose logit is the reward")
    elif not architectures[0].endswith(("ForCausalLM", "ForConditionalGeneration")):
        raise bad(key, value, f"{architectures[0]} does not generate; a judge is a causal LM (*ForCausalLM), a "
                  "sequence classifier scores as model:PATH")


def _check_bucket_size(cfg: JobConfig, dims: ModelDims | None) -> None:
    """A bucket of sync.bucket_mb must hold the model's largest weight in the engine's dtype (a hub id not on this
    machine yet passes)."""
    if cfg.sync.bucket_mb > 0 and dims is not None:
        largest = dims.largest_tensor_params * DTYPE_BYTES[cfg.engine.dtype]
        if cfg.sync.bucket_mb * (1 << 20) < largest:
            raise bad("sync.bucket_mb", cfg.sync.bucket_mb,
                       f"must hold the largest tensor ({largest / (1 << 20):.2f} MiB in {cfg.engine.dtype}), "
                       "or 0 to size it automatically")
