"""Every refusal that suggests a value, with the suggestion applied: the `key=value` overrides of its hint
(ConfigError.fix; the memory preflight's `use key=value`, read from its line) make the checks `colocate validate`
runs accept the job, or at least not refuse the same key again. One test walks every such refusal, and checks that
every raise in colocate/ that carries a fix is among those it met."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import torch

from colocate.config import load_config
from colocate.config.fields import override_value
from colocate.config.loading import RENAMED
from colocate.errors import ConfigError
from colocate.job import placement
from colocate.job.checks import GpuNode
from colocate.job.placement import plan_nodes, plan_slots, sync_method
from colocate.job.setup import check_job

ROOT = Path(__file__).resolve().parents[2]
QWEN = ROOT / "tests" / "data" / "model_configs" / "Qwen2.5-0.5B-Instruct"  # a config.json, no weights
SPLIT_HERE = ["placement.num_slots=2", "placement.engine_slots=1", "engine.tp=1"]
MOE_LORA = ["model.preset=tiny-moe", "trainer.lora.rank=8", "trainer.lora.target_modules=q_proj,up_proj"]
NO_CUDA_HERE = not torch.cuda.is_available()  # placement.device=cuda is refused only where CUDA is missing


def validate(node: GpuNode | None = None):
    """`colocate validate` after the config: check_job (with --gpus N --gpu-memory-gib G when `node` is given)."""
    return lambda cfg: check_job(cfg, node=node)


def on_cluster(nodes: dict[str, int]):
    """What Runtime.start checks on a Ray cluster of these nodes' CPU slots before any actor."""
    return lambda cfg: plan_nodes(plan_slots(cfg, device="cpu", num_devices=sum(nodes.values())), nodes)


def across_nodes(cfg) -> None:
    sync_method(cfg, "cpu", multi_node=True)


GPU = validate(GpuNode(2, 80.0))
# (overrides refused, the checks after the config, the key that may refuse next: None when the hint must pass)
HINTED = [
    (["trainer.activation_offload=true"], validate(), None),
    (["rollout.turn_stop=</x>"], validate(), None),
    (["rollout.env_workers=2"], validate(), None),
    (["rollout.partial_tokens=2", "rollout.leftover=drop"], validate(), None),
    (["rollout.partial_tokens=1"], validate(), None),
    (["rollout.env=copy_turns", "rollout.reward_fn=nowhere:fn"], validate(), None),
    (["rollout.env=copy_turns", "rollout.rewards=math"], validate(), None),
    (["rollout.env=copy_turns", "rollout.ignore_eos=true"], validate(), None),
    (["rollout.env=copy_turns", "rollout.max_turns=4", "rollout.max_tokens=12", "rollout.partial_tokens=6"],
     validate(), None),
    (["algo.mode=one_step_off", "rollout.partial_tokens=4", "rollout.max_tokens=6"], validate(), None),
    (["algo.mode=async"], validate(), None),  # the default job: a quarter of 3 tokens needs more passes
    (["algo.mode=sync", "rollout.update_in_pass=keep"], validate(), None),
    (["rollout.stream=true"], validate(), None),
    (["algo.mode=async", "rollout.update_in_pass=keep", "rollout.stream=true", "rollout.leftover=drop"], validate(),
     None),
    (["rollout.speculative=eagle"], validate(), None),
    (["rollout.speculative=ngram"], validate(), None),  # on the CPU
    # then refused on the CPU, by another check of the same key
    (["rollout.speculative=ngram", "rollout.temperature=0.7"], validate(), "rollout.speculative"),
    (["rollout.speculative=ngram", "rollout.top_p=0.9"], validate(), "rollout.speculative"),
    (["algo.mode=async", "rollout.update_in_pass=keep", "rollout.partial_tokens=4", "rollout.max_tokens=8",
      "rollout.max_lag=1"], validate(), None),
    (["algo.mode=async", "rollout.env=copy_turns", "rollout.max_turns=4", "rollout.max_tokens=12"], validate(), None),
    (["algo.mode=one_step_off", "engine.sleep_level=2"], validate(), None),
    (["algo.mode=async", "rollout.partial_tokens=2", "trainer.offload=true"], validate(), None),
    (["algo.mode=one_step_off", "rollout.max_lag=0"], validate(), None),
    (["data.train_files=data/math/train.jsonl", "data.prompt_key="], validate(), None),
    (["eval.num_samples=4"], validate(), None),
    (["placement.engine_slots=2"], validate(), None),
    (["placement.engine_slots=1"], validate(), None),
    (["placement.engine_slots=1", "engine.tp=1", "sync.method=in_place"], validate(), None),
    (["placement.engine_slots=1", "engine.tp=1", "engine.sleep_level=2"], validate(), None),
    (["placement.engine_slots=1", "engine.tp=1", "trainer.offload=true"], validate(), None),
    (["algo.mode=one_step_off", "placement.engine_slots=auto"], validate(), None),  # engine.tp=2 takes both slots
    (["algo.mode=one_step_off", "placement.engine_slots=auto", "placement.num_slots=1"], validate(), None),
    (["engine.tp=3"], validate(), None),
    (["sync.method=broadcast"], validate(), None),
    (["trainer.max_tokens_per_micro_batch=64"], validate(), None),
    (["rollout.rewards='math:1.0,model:'"], validate(), None),
    (["rollout.rewards=model:tiny-rm", "reward_model.tp=4"], validate(), None),
    (["rollout.num_samples=1"], validate(), None),
    (["rollout.temperature=0"], validate(), None),
    (["algo.advantage=reinforce_pp", "algo.dynamic_sampling=true"], validate(), None),
    (["algo.mask_truncated=true", "rollout.ignore_eos=true"], validate(), None),
    (["algo.overlong_buffer=3"], validate(), None),
    (["algo.kl_in_reward=true", "algo.kl_coef=0.01"], validate(), None),
    (["algo.clip_eps_low=-0.1"], validate(), None),
    (["algo.policy_loss=gspo", "algo.clip_ratio_c=3"], validate(), None),
    (["algo.clip_ratio_c=0.5"], validate(), None),
    (["model.preset=tinny"], validate(), None),
    (["engine.expert_parallel=true"], validate(), None),
    # 16 slots are more than this machine has: the hint passes the expert check, the slot count refuses next
    (["model.preset=tiny-moe", "engine.expert_parallel=true", "engine.tp=16", "placement.num_slots=16"], validate(),
     "placement.num_slots"),
    (MOE_LORA, validate(), None),
    (["trainer.lora.rank=12", "engine.max_lora_rank=8"], validate(), None),
    (["engine.max_lora_rank=8"], validate(), None),
    # a 0.5B model, checked on a GPU node (this machine's memory is not the point): logits soft-capped after
    # lm_head (no chunked log-probs), and a class that cannot checkpoint its layers (the test says so)
    (["model.path={softcapped}"], GPU, None),
    (["model.path={qwen}", "trainer.activation_checkpointing=true"], GPU, None),
    *([(["placement.device=cuda"], validate(), None)] if NO_CUDA_HERE else []),
    (["placement.num_slots=64"], validate(), None),
    (["placement.num_slots=64", "placement.engine_slots=40"], validate(), None),
    (["placement.device=cpu", "engine.sleep_backend=vllm"], validate(), None),
    (["placement.device=cpu", "engine.batch_invariant=true"], validate(), None),
    (["trainer.fp32_lm_head=true"], validate(), None),
    # the bf16 trainer is refused next on a CPU without bf16, as this test's is
    (["trainer.fp32_lm_head=true", "trainer.mixed_precision=true", "trainer.logprob_chunk_tokens=null"], validate(),
     "trainer.mixed_precision"),
    (["engine.fp32_lm_head=true", "engine.dtype=float32"], validate(), None),
    (["engine.batch_invariant=true", "placement.num_slots=2", "placement.engine_slots=1", "engine.tp=1"],
     validate(), None),
    (["trainer.mixed_precision=true"], validate(), None),  # on a CPU without bf16 (the test says so)
    (["algo.router_replay=true"], validate(), None),
    (["algo.num_mini_batches=2"], validate(), None),
    (["logging.rollouts=-2"], validate(), None),
    (["data.chat_template=/no/such/template.jinja"], validate(), None),
    (['rollout.source_rewards={{"a": "math"}}'], validate(), None),
    (['rollout.source_rewards={{"*": "math"}}', "rollout.rewards=exact", "data.train_files=data/math/train.jsonl"],
     validate(), None),
    (["algo.old_logprobs=recompute", "algo.correction=tis"], validate(), None),
    (["algo.old_logprobs=decoupled"], validate(), None),
    (["algo.advantage=gae"], validate(), None),
    (["sync.delta=true"], validate(), None),
    (["sync.carrier=directory", "sync.carrier_dir=/tmp/colocate-carrier"], validate(), None),
    (["sync.delta=true", "placement.num_slots=2", "placement.engine_slots=1", "engine.tp=1", "trainer.lora.rank=8"],
     validate(), None),
    (["critic.model_path=policy"], validate(), None),
    (["fault.engine_restarts=2"], validate(), None),
    (["fault.engine_restarts=2", *SPLIT_HERE, "algo.mode=one_step_off"], validate(), None),
    (["fault.engine_restarts=2", *SPLIT_HERE, "sync.carrier=directory", "sync.carrier_dir=/tmp/colocate-carrier"],
     validate(), None),
    (["fault.engine_restarts=2", *SPLIT_HERE, "sync.delta=false"], validate(), None),
    (["algo.lam=0.9"], validate(), None),
    (["algo.advantage=gae", "critic.model_path=policy", "trainer.lora.rank=8"], validate(), None),
    (["algo.advantage=gae", "critic.model_path=/nowhere/at/all"], validate(), None),
    (["algo.num_mini_batches=5", "algo.old_logprobs=recompute"], validate(), None),
    (["model.preset=tiny-moe", "algo.router_replay=true", "rollout.speculative=ngram"], validate(), None),
    (["sync.method=in_place"], GPU, None),
    (["sync.method=ring"], GPU, None),
    (["placement.num_slots=4"], validate(GpuNode(1, 80.0)), None),
    (["placement.num_slots=4"], on_cluster({"a": 1, "b": 1, "c": 1, "d": 1}), None),
    (["placement.num_slots=5", "placement.engine_slots=4"], on_cluster({"a": 3, "b": 1, "c": 1}), None),
    (["placement.num_slots=4", "engine.tp=2"], on_cluster({"a": 3, "b": 1}), None),
    (["sync.method=in_place"], across_nodes, None),
    (["sync.transport=gather"], validate(), None),  # a key renamed since: the fix is its new name
]

# The memory preflight's advice (`use key=value ...`): refused on a GPU node of some size, the hint applied on the
# same node. The sizes are scanned, so that the predictions may change without the case going vacuous.
BENCH_ON_ONE_GPU = ["model.preset=bench", "placement.num_slots=1", "engine.tp=1"]
PREFLIGHT = [
    [*BENCH_ON_ONE_GPU, "algo.mode=one_step_off"],
    [*BENCH_ON_ONE_GPU, "engine.sleep_level=0"],
    [*BENCH_ON_ONE_GPU, "trainer.offload=false"],
    ["rollout.max_tokens=4000", "engine.max_model_len=4096"],
    ["model.preset=bench", "rollout.max_tokens=4000", "engine.max_model_len=4096"],
]
GPU_SIZES_GIB = [2.0 * n for n in range(1, 33)]


def refusal(overrides: list[str], after) -> ConfigError | None:
    try:
        after(load_config(None, overrides))
    except ConfigError as e:
        return e
    return None


def applied(overrides: list[str], fix: dict) -> list[str]:
    """`overrides` with the fix's keys set as it says, and a renamed key's old name gone (its fix is the new)."""
    kept = [o for o in overrides if o.split("=", 1)[0] not in fix and o.split("=", 1)[0] not in RENAMED]
    return kept + [f"{key}={override_value(value)}" for key, value in fix.items()]


def refused_key(error: ConfigError) -> str:
    return str(error).split("=", 1)[0]


def raise_site(error: BaseException) -> tuple[str, int]:
    tb = error.__traceback__
    while tb.tb_next:
        tb = tb.tb_next
    return str(Path(tb.tb_frame.f_code.co_filename).relative_to(ROOT)), tb.tb_lineno


def raises_with_a_fix() -> set[tuple[str, int]]:
    """Every `raise ...(..., fix=...)` in colocate/."""
    sites = set()
    for path in (ROOT / "colocate").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and \
                    any(k.arg == "fix" for k in node.exc.keywords):
                sites.add((str(path.relative_to(ROOT)), node.lineno))
    return sites


def preflight_hint(error: ConfigError | None) -> dict[str, str]:
    found = re.search(r"\buse ([a-z_.]+)=([^\s,;)]+)", str(error)) if error else None
    return {found[1]: found[2]} if found and str(error).startswith("memory preflight") else {}


def test_every_hint_applied_passes_the_check_that_gave_it(tmp_path, monkeypatch):
    from transformers import Qwen2ForCausalLM

    monkeypatch.setattr(placement, "cpu_bf16_features", lambda: False)  # a CPU without native bf16
    monkeypatch.setattr(Qwen2ForCausalLM, "supports_gradient_checkpointing", False)
    monkeypatch.chdir(ROOT)  # data/math/train.jsonl
    softcapped = tmp_path / "softcapped"
    softcapped.mkdir()
    (softcapped / "config.json").write_text(json.dumps({**json.loads((QWEN / "config.json").read_text()),
                                                        "final_logit_softcapping": 30.0}))
    base = [f"logging.output_dir={tmp_path / 'out'}", "logging.tensorboard=false"]
    problems, met = [], set()
    for overrides, after, next_key in HINTED:
        overrides = [o.format(softcapped=softcapped, qwen=QWEN) for o in overrides]
        error = refusal([*base, *overrides], after)
        if error is None or not error.fix:
            problems.append(f"{overrides}: refused without a fix: {error}")
            continue
        met.add(raise_site(error))
        message = str(error)
        for key, value in error.fix.items():  # the line names what the fix holds
            if key.rsplit(".", 1)[-1] not in message or override_value(value) not in message:
                problems.append(f"{overrides}: fix {key}={value!r} is not what the line says: {message}")
        again = refusal(applied([*base, *overrides], error.fix), after)
        if again is not None and (next_key is None or refused_key(again) == refused_key(error)
                                  or refused_key(again) != next_key):
            problems.append(f"{overrides} + {error.fix}: refused again: {again}")
    for overrides in PREFLIGHT:
        refused_at = []
        for gib in GPU_SIZES_GIB:
            after = validate(GpuNode(1 if "placement.num_slots=1" in overrides else 2, gib))
            fix = preflight_hint(refusal([*base, *overrides], after))
            if not fix:
                continue
            refused_at.append(gib)
            again = preflight_hint(refusal(applied([*base, *overrides], fix), after))
            if again.keys() & fix.keys():
                problems.append(f"{overrides} on {gib} GiB + {fix}: refused again, advising {again}")
        if not refused_at:
            problems.append(f"{overrides}: no GPU size of {GPU_SIZES_GIB[0]}-{GPU_SIZES_GIB[-1]} GiB refused it with "
                            "a `use key=value` advice")
    missing = raises_with_a_fix() - met
    if not NO_CUDA_HERE:
        missing = {site for site in missing if "placement.py" not in site[0] or
                   "no CUDA device" not in (ROOT / site[0]).read_text().splitlines()[site[1] - 1]}
    assert not problems, "\n".join(problems)
    assert not missing, f"raises with a fix that no case of this test meets: {sorted(missing)}"
