"""RewardEngineActor: the job's reward model in a vLLM engine of its own, beside the policy's engines.

It is an EngineActor (the same start, sleep, wake, memory and worker watch, on the same device slots), with
other engine arguments and one call, `score`:
- a sequence classifier (`model:PATH`) runs under vLLM's pooling runner (`runner="pooling"`), and its score is
  the classification head's one logit, raw: `PoolingParams(use_activation=False)` turns off the sigmoid that
  vLLM's classify applies to a one-label head by default (vllm/pooling_params.py, `use_activation`);
- a generative judge (`judge:PATH`) generates its verdict greedily, and the verdict's number is the score.

What the model reads is built here (the functions below, pure, tested without an engine); how the controller
uses the scores is rollout/reward_model.py's. The actor takes part in no weight sync: it opens no ring, and its
weights are the ones it loaded.

    actor = RewardEngineActor.options(...).remote(engine_cfg, path, kind="model", rm_cfg=cfg.reward_model,
                                                  device="cpu", sleep_backend="portable")
    ray.get(actor.start.remote())
    ray.get(actor.score.remote(prompts, responses, answers))   # {"scores", "num_truncated", "num_unparsed", ...}
"""

from __future__ import annotations

import dataclasses
import re

from colocate.config import EngineConfig, RewardModelConfig
from colocate.engine.actor import EngineActor


def reward_engine_config(engine: EngineConfig, rm: RewardModelConfig) -> EngineConfig:
    """The reward model's engine settings: the policy engine's (dtype, eager mode, seed), with the reward model's
    size, context and memory. No prefix caching (a classifier pools over its whole input) and none of what the
    policy's engine was given for the policy: its extra vLLM arguments, its LoRA buffers (the reward model carries
    no adapter: max_lora_rank=0 starts it without enable_lora), its expert parallelism (a layout of the policy's
    experts over the policy's TP; the reward model has its own model and reward_model.tp), nor what keeps the
    policy's log-probs consistent with the trainer's (fp32_lm_head: a classifier's head is vLLM's pooling head,
    and a quantized judge's lm_head would refuse it; batch_invariant)."""
    return dataclasses.replace(engine, tp=rm.tp, max_model_len=rm.max_model_len or engine.max_model_len,
                               kv_cache_gib=rm.kv_cache_gib, gpu_memory_utilization=rm.gpu_memory_utilization,
                               enable_prefix_caching=False, max_num_seqs=0, extra_args="", max_lora_rank=0,
                               expert_parallel=False, fp32_lm_head=False, batch_invariant=False)


def chat_or_plain(tokenizer, user: str, assistant: str | None) -> list[int]:
    """`user` (and `assistant`'s reply) as the tokenizer's chat template lays them out, or as plain text when it
    has none. Without an assistant turn the template's generation prompt follows (a judge answers there)."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": user}]
        if assistant is not None:
            messages.append({"role": "assistant", "content": assistant})
        ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=assistant is None)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # transformers 5: a BatchEncoding
    return tokenizer.encode(user + (assistant or ""), add_special_tokens=False)


def classifier_inputs(tokenizer, prompts: list[str], responses: list[str]) -> list[list[int]]:
    return [chat_or_plain(tokenizer, p, r) for p, r in zip(prompts, responses)]


def judge_inputs(tokenizer, template: str, prompts: list[str], responses: list[str],
                 answers: list[str]) -> list[list[int]]:
    return [chat_or_plain(tokenizer, template.format(prompt=p, response=r, answer=a), None)
            for p, r, a in zip(prompts, responses, answers)]


def keep_last(inputs: list[list[int]], max_tokens: int) -> tuple[list[list[int]], int]:
    """Each input cut to its last `max_tokens` tokens; and how many were cut."""
    return [ids[-max_tokens:] for ids in inputs], sum(len(ids) > max_tokens for ids in inputs)


def parse_verdict(text: str, pattern: str) -> float | None:
    """The score a judge's verdict gives: the first match of `pattern` (its first group when it has one) as a
    number; None when there is none or it is not a finite number."""
    match = re.search(pattern, text)
    if match is None:
        return None
    try:
        value = float(match.group(1) if match.groups() else match.group(0))
    except (TypeError, ValueError):
        return None
    return value if value == value and abs(value) != float("inf") else None


class RewardEngineActor(EngineActor):
    def __init__(self, cfg: EngineConfig, model_path: str, *, kind: str, rm_cfg: RewardModelConfig, device: str,
                 sleep_backend: str, placement_env: dict[str, str] | None = None):
        super().__init__(cfg, model_path, device=device, sleep_backend=sleep_backend, eos_token_id=None,
                         placement_env=placement_env)
        assert kind in ("model", "judge"), kind
        self.kind, self.rm_cfg = kind, rm_cfg
        self.tokenizer = None

    def _llm_kwargs(self) -> dict:
        kwargs = super()._llm_kwargs()
        del kwargs["logprobs_mode"]  # nothing sampled is trained
        if self.kind == "model":
            # vLLM's pooling I/O processors read the tokenizer at start (vllm/entrypoints/pooling/factories.py),
            # even for token-id inputs: it must be initialised
            kwargs.update(runner="pooling", skip_tokenizer_init=False)
        return kwargs

    def start(self) -> dict:
        info = super().start()
        from colocate.models.sources import load_tokenizer

        self.tokenizer = load_tokenizer(self.model_path)
        self.eos_token_id = self.tokenizer.eos_token_id
        return info

    def score(self, prompts: list[str], responses: list[str], answers: list[str]) -> dict:
        """Every sample's reward, in one batch: {"scores", "num_scored", "num_truncated", "num_unparsed",
        "verdicts" (a judge's first few, for a look)}."""
        from vllm.inputs import TokensPrompt

        assert not self._asleep, f"score() while the reward model's {sorted(self._asleep)} sleep: wake them first"
        cfg = self.rm_cfg
        if self.kind == "model":
            from vllm import PoolingParams

            inputs, num_truncated = keep_last(classifier_inputs(self.tokenizer, prompts, responses),
                                              self.cfg.max_model_len)
            outputs = self.llm.classify([TokensPrompt(prompt_token_ids=ids) for ids in inputs],
                                        pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
            return {"scores": [float(o.outputs.probs[0]) for o in outputs], "num_scored": len(outputs),
                    "num_truncated": num_truncated, "num_unparsed": 0, "verdicts": []}
        from vllm import SamplingParams

        inputs, num_truncated = keep_last(judge_inputs(self.tokenizer, cfg.judge_prompt, prompts, responses, answers),
                                          self.cfg.max_model_len - cfg.judge_max_tokens)
        params = SamplingParams(temperature=0.0, max_tokens=cfg.judge_max_tokens, detokenize=False,
                                stop_token_ids=[self.eos_token_id] if self.eos_token_id is not None else None)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in inputs], params, use_tqdm=False)
        verdicts = [self.tokenizer.decode(o.outputs[0].token_ids, skip_special_tokens=True) for o in outputs]
        values = [parse_verdict(v, cfg.verdict_pattern) for v in verdicts]
        return {"scores": [cfg.unparsed_reward if v is None else v for v in values], "num_scored": len(values),
                "num_truncated": num_truncated, "num_unparsed": sum(v is None for v in values),
                "verdicts": verdicts[:4]}
