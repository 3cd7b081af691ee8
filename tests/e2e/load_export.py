"""Load an exported model with plain vLLM (CPU build) and plain transformers, as a user would, and print each
one's greedy answer tokens to the given prompts as one JSON line (run by test_resume in a fresh process, since
vLLM configures the process it runs in).

    python tests/e2e/load_export.py MODEL_DIR '["12+3=", ...]' MAX_TOKENS
"""

from __future__ import annotations

import json
import os
import sys


def main(model_dir: str, prompts: list[str], max_tokens: int) -> dict:
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND="nobind",
                      VLLM_LOGGING_LEVEL="WARNING")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = [tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
    eos = tokenizer.eos_token_id

    llm = LLM(model=model_dir, dtype="float32", max_model_len=128, enforce_eager=True,
              kv_cache_memory_bytes=64 << 20, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=[eos], detokenize=False)
    vllm_tokens = [list(o.outputs[0].token_ids) for o in
                   llm.generate([TokensPrompt(prompt_token_ids=i) for i in ids], params, use_tqdm=False)]
    del llm

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf_tokens = []
    for prompt_ids in ids:
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=eos, pad_token_id=eos)
        hf_tokens.append(out[0, len(prompt_ids):].tolist())
    return {"vllm": vllm_tokens, "transformers": hf_tokens}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]))))
