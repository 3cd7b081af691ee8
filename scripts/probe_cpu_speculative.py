"""Probe of vLLM's speculative decoding on the CPU build, the measurement behind colocate's one-line refusal of
rollout.speculative on a CPU run (job/placement.py). Writes one JSON.

    .venv/bin/python scripts/probe_cpu_speculative.py --out benchmarks/results/speculative_cpu_probe.json

The model is the tiny preset rewritten to be deterministic: attention's output zeroed (the last hidden state is a
function of the last token alone) and lm_head solved so that each token's successor in a cycle of 4 gets a logit
100 above every other. Any token that breaks its cycle is one the model gives probability ~e^-100. Each row
generates 16 answers of 64 tokens from the same prompts in a fresh engine (vLLM in this process, TP=1, fp32):

- plain sampling (temperature 1), no speculation;
- ngram prompt lookup (4 drafts), greedy;
- ngram prompt lookup, temperature 1, with raw and with processed log-probs.

Measured on this project's 2-core CPU with vLLM 0.32: without speculation and greedy with it, no token leaves its
cycle; sampled with it, a large share does, each reported with a log-prob of 0.0. So the CPU build's rejection
sampling is not the policy's distribution, and colocate refuses it there. Run it again after a vLLM upgrade.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

VOCAB_CYCLE = 4
NUM_ANSWERS, NUM_TOKENS = 16, 64


def cycling_model(out: Path) -> tuple[Path, dict[int, int]]:
    """The tiny preset made deterministic (the module's docstring); returns its directory and each token's
    successor."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from colocate.config import load_config
    from colocate.models.sources import ensure_model

    source = Path(ensure_model(load_config(None, []).model))
    model = out / "cycling"
    shutil.copytree(source, model, ignore=shutil.ignore_patterns("colocate_preset.json"))
    weights = load_file(model / "model.safetensors")
    for name in weights:
        if name.endswith("self_attn.o_proj.weight"):
            weights[name] = torch.zeros_like(weights[name])
    save_file(weights, model / "model.safetensors")
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    vocab = lm.config.vocab_size
    with torch.no_grad():
        hidden = lm.model(input_ids=torch.arange(vocab).unsqueeze(1)).last_hidden_state[:, 0].double()
    # a token whose embedding is zero (the padding's) has no hidden state to map: the cycles skip it
    alive = [t for t in range(vocab) if hidden[t].abs().max() > 0]
    cycles = len(alive) - len(alive) % VOCAB_CYCLE
    successor = {t: alive[i - i % VOCAB_CYCLE + (i + 1) % VOCAB_CYCLE] for i, t in enumerate(alive[:cycles])}
    target = torch.zeros(vocab, vocab, dtype=torch.float64)  # [next token, last token]
    for t, nxt in successor.items():
        target[nxt, t] = 100.0
    weights["lm_head.weight"] = (target @ torch.linalg.pinv(hidden.T)).float()  # W H^T = target
    save_file(weights, model / "model.safetensors")
    return model, successor


def generate(model: str, speculative: bool, temperature: float, logprobs_mode: str) -> list[dict]:
    """One engine in this process: NUM_ANSWERS seeded answers; each answer's tokens and log-probs."""
    os.environ.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                       "OMP_NUM_THREADS": "1", "TORCH_COMPILE_DISABLE": "1", "VLLM_LOGGING_LEVEL": "ERROR"})
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    llm = LLM(model=model, dtype="float32", max_model_len=256, enforce_eager=True, skip_tokenizer_init=True,
              logprobs_mode=logprobs_mode, kv_cache_memory_bytes=1 << 27, enable_chunked_prefill=False,
              max_num_batched_tokens=4096, distributed_executor_backend="uni",
              speculative_config=spec if speculative else None)
    prompts = [TokensPrompt(prompt_token_ids=[5 + (i + j) % 8 for j in range(24)]) for i in range(NUM_ANSWERS)]
    params = [SamplingParams(temperature=temperature, max_tokens=NUM_TOKENS, seed=i, logprobs=0, detokenize=False,
                             ignore_eos=True) for i in range(NUM_ANSWERS)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [{"prompt": list(o.prompt_token_ids), "tokens": list(o.outputs[0].token_ids),
             "logprobs": [next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs]} for o in outs]


def row(answers: list[dict], successor: dict[int, int]) -> dict:
    """Tokens that leave their cycle (the model gives them ~e^-100), and the log-probs reported for them."""
    off, logprobs_off = 0, []
    total = 0
    for a in answers:
        previous = a["prompt"][-1]
        for token, logprob in zip(a["tokens"], a["logprobs"]):
            if previous in successor:
                total += 1
                if token != successor[previous]:
                    off += 1
                    logprobs_off.append(logprob)
            previous = token
    return {"tokens_checked": total, "tokens_off_the_policy": off, "off_fraction": off / max(total, 1),
            "logprobs_reported_for_them": sorted(set(round(x, 4) for x in logprobs_off))[:5]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/speculative_cpu_probe.json")
    parser.add_argument("--row", default="", help=argparse.SUPPRESS)  # one engine per process: internal
    parser.add_argument("--model", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.row:  # a child: one engine, its answers as JSON on stdout
        speculative, temperature, mode = args.row.split(",")
        print(json.dumps(generate(args.model, speculative == "1", float(temperature), mode)))
        return 0
    import vllm

    rows = {"no_speculation_sampled": "0,1.0,processed_logprobs", "ngram_greedy": "1,0.0,processed_logprobs",
            "ngram_sampled_raw_logprobs": "1,1.0,raw_logprobs",
            "ngram_sampled_processed_logprobs": "1,1.0,processed_logprobs"}
    with tempfile.TemporaryDirectory() as tmp:
        model, successor = cycling_model(Path(tmp))
        result = {"command": " ".join(["scripts/probe_cpu_speculative.py", *sys.argv[1:]]),
                  "vllm": vllm.__version__, "answers": NUM_ANSWERS, "tokens_each": NUM_TOKENS, "rows": {}}
        for name, spec in rows.items():
            child = subprocess.run([sys.executable, __file__, "--row", spec, "--model", str(model)],
                                   capture_output=True, text=True, check=True)
            result["rows"][name] = row(json.loads(child.stdout.strip().splitlines()[-1]), successor)
            print(name, result["rows"][name])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
