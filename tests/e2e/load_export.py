"""Load an exported model with plain vLLM (CPU build) and plain transformers, as a user would, and print each
one's greedy answer tokens to the given prompts as one JSON line (run by the e2e tests in a fresh process, since
vLLM configures the process it runs in).

    python tests/e2e/load_export.py MODEL_DIR '["12+3=", ...]' MAX_TOKENS [--adapter DIR] [--only transformers]

--adapter: a LoRA export (PEFT's format) on the base MODEL_DIR, through vLLM's LoRARequest and PEFT's PeftModel.
"""

from __future__ import annotations

import argparse
import json
import os


def main(model_dir: str, prompts: list[str], max_tokens: int, adapter: str | None, only: str | None) -> dict:
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND="nobind",
                      VLLM_LOGGING_LEVEL="WARNING")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = [tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
    eos = tokenizer.eos_token_id
    out = {}
    if only in (None, "vllm"):
        out["vllm"] = _vllm(model_dir, ids, max_tokens, eos, adapter)

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    hf_tokens = []
    for prompt_ids in ids:
        generated = model.generate(input_ids=torch.tensor([prompt_ids]), max_new_tokens=max_tokens,
                                   do_sample=False, eos_token_id=eos, pad_token_id=eos)
        hf_tokens.append(generated[0, len(prompt_ids):].tolist())
    out["transformers"] = hf_tokens
    return out


def _vllm(model_dir: str, ids: list[list[int]], max_tokens: int, eos: int, adapter: str | None) -> list:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    lora = {}
    if adapter:
        from colocate.config.schema import engine_lora_rank

        # vLLM takes a few max_lora_ranks (1, 8, 16, ...): the smallest that holds the adapter's, as a job's engine
        rank = json.loads(open(os.path.join(adapter, "adapter_config.json")).read())["r"]
        lora = dict(enable_lora=True, max_lora_rank=engine_lora_rank(rank), max_loras=1)
    llm = LLM(model=model_dir, dtype="float32", max_model_len=128, enforce_eager=True,
              kv_cache_memory_bytes=64 << 20, seed=0, **lora)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=[eos], detokenize=False)
    request = LoRARequest("exported", 1, adapter) if adapter else None
    outputs = llm.generate([TokensPrompt(prompt_token_ids=i) for i in ids], params, use_tqdm=False,
                           lora_request=request)
    return [list(o.outputs[0].token_ids) for o in outputs]


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("prompts", type=json.loads)
    parser.add_argument("max_tokens", type=int)
    parser.add_argument("--adapter")
    parser.add_argument("--only", choices=["vllm", "transformers"])
    args = parser.parse_args()
    print(json.dumps(main(args.model_dir, args.prompts, args.max_tokens, args.adapter, args.only)))
