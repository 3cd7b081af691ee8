"""Where the engine's forward and the trainer's first differ, module by module, on one sequence in fp32.

    python scripts/probe_consistency_layers.py [--preset bench] [--tokens 96] [--out benchmarks/results]

`colocate bench consistency` shows that on the CPU the engine's decode equals its own prefill bit for bit, and that
neither side depends on its batch; what is left is the engine's prefill against the trainer's forward. This probe
takes that apart. The same checkpoint is loaded twice in this process: by vLLM (TP=1, eager, colocate's worker
extension and engine environment, so its CPU linear layers are the plain F.linear colocate runs) and by
transformers (the attention implementation the trainer picks on the CPU). One prefill of the same token ids runs
through each, with forward hooks on every decoder sub-module. Two comparisons per module, each the share of
elements bit-equal and the largest |difference|:
  chained   each side's own output, as the forward ran (where the first difference appears, and how it grows)
  isolated  the trainer's module run on the engine's input to that module (which kernel differs on equal input)
lm_head is also run on the rows as the engine split them (with prompt_logprobs it makes every position's logits
but the last in one call, then the last's): a difference there and none on the split is the GEMM's row count.
Writes probe_consistency_layers.json (_native_rotary.json with --native-rotary). The modules named are Qwen2's
(the presets' architecture).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CAPTURED: dict[str, tuple] = {}  # module name -> (inputs, output), the vLLM side's; in this process (uni executor)
SUBMODULES = ("input_layernorm", "self_attn", "self_attn.qkv_proj", "self_attn.attn", "self_attn.o_proj",
              "post_attention_layernorm", "mlp", "mlp.gate_up_proj", "mlp.act_fn", "mlp.down_proj")


def _first(x):
    return x[0] if isinstance(x, tuple) else x


def _hook(name: str, store: dict):
    def hook(module, args, kwargs, output):
        store[name] = (tuple(a.detach().clone() if torch.is_tensor(a) else a for a in args),
                       {k: v.detach().clone() for k, v in kwargs.items() if torch.is_tensor(v)},
                       tuple(o.detach().clone() if torch.is_tensor(o) else o for o in output)
                       if isinstance(output, tuple) else output.detach().clone())
    return hook


def _rotary_hooks(module) -> None:
    """vLLM's rotary embedding rotates q and k in place (its inputs are read before), and one module may serve
    every layer (get_rope caches them): each call is kept, in layer order"""
    def before(module, args):
        CAPTURED.setdefault("rotary_in", []).append(tuple(a.detach().clone() for a in args[1:3]))

    def after(module, args, output):
        CAPTURED.setdefault("rotary_out", []).append(tuple(o.detach().clone() for o in output[:2]))
    module.register_forward_pre_hook(before)
    module.register_forward_hook(after)


def install_engine_hooks(worker) -> int:
    model = worker.model_runner.model
    named = dict(model.named_modules())
    for i in range(len(model.model.layers)):
        for sub in SUBMODULES:
            named[f"model.layers.{i}.{sub}"].register_forward_hook(_hook(f"{i}.{sub}", CAPTURED), with_kwargs=True)
    for rotary in {id(layer.self_attn.rotary_emb): layer.self_attn.rotary_emb for layer in model.model.layers}.values():
        _rotary_hooks(rotary)
    model.model.norm.register_forward_hook(_hook("norm", CAPTURED), with_kwargs=True)
    # logits are made twice in a prefill with prompt_logprobs: every prompt position's but the last (the prompt
    # log-probs), then the last's (the sample): each call is kept
    model.logits_processor.register_forward_hook(
        lambda module, args, output: CAPTURED.setdefault("logits", []).append(output.detach().clone()))
    return len(model.model.layers)


def compare(a: torch.Tensor, b: torch.Tensor) -> dict:
    a, b = a.reshape(-1, a.shape[-1]).double(), b.reshape(-1, b.shape[-1]).double()
    assert a.shape == b.shape, (a.shape, b.shape)
    d = (a - b).abs()
    return {"bit_equal": float((d == 0).double().mean()), "max_abs": float(d.max()),
            "max_rel": float((d / b.abs().clamp(min=1e-30)).max())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="bench")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--native-rotary", action="store_true",
                        help="the engine's rotary embedding through vLLM's torch implementation (forward_native), "
                        "its CPU kernel off (compilation_config custom_ops -rotary_embedding)")
    args = parser.parse_args()

    from colocate.config import EngineConfig, ModelConfig, TrainerConfig
    from colocate.engine.actor import EXTENSION, engine_env
    from colocate.models.sources import ensure_model
    from colocate.trainer.batching import attention_implementation

    os.environ.update(engine_env(EngineConfig(enforce_eager="true", tp=1), "cpu"))
    torch.set_num_threads(1)
    path = ensure_model(ModelConfig(preset=args.preset, cache_dir=str(Path(".cache/models").resolve())))
    from transformers import AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                              attn_implementation=attention_implementation(TrainerConfig(), "cpu"))
    ids = torch.randint(3, hf.config.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    llm = LLM(model=path, dtype="float32", enforce_eager=True, skip_tokenizer_init=True, max_model_len=args.tokens + 8,
              kv_cache_memory_bytes=1 << 28, distributed_executor_backend="uni", enable_chunked_prefill=False,
              enable_prefix_caching=False, worker_extension_cls=EXTENSION, seed=0,
              **({"compilation_config": {"custom_ops": ["-rotary_embedding"]}} if args.native_rotary else {}))
    num_layers = llm.collective_rpc(install_engine_hooks)[0]
    CAPTURED.clear()  # the start-up's profile runs
    llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=1, prompt_logprobs=0),
                 use_tqdm=False)

    ours: dict[str, tuple] = {}
    named = dict(hf.named_modules())
    for i in range(num_layers):
        for sub in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp"):
            named[f"model.layers.{i}.{sub}"].register_forward_hook(_hook(f"{i}.{sub}", ours), with_kwargs=True)
    hf.model.norm.register_forward_hook(_hook("norm", ours), with_kwargs=True)
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0]

    chained, isolated = {}, {}
    with torch.no_grad():
        position_embeddings = hf.model.rotary_emb(torch.zeros(1, len(ids), 1), torch.arange(len(ids))[None])
        for i in range(num_layers):
            layer = hf.model.layers[i]
            for sub in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp"):
                chained[f"{i}.{sub}"] = compare(_first(CAPTURED[f"{i}.{sub}"][2]), _first(ours[f"{i}.{sub}"][2]))
            # the engine's norms fuse the residual add: norm(hidden + residual), returning both
            for norm in ("input_layernorm", "post_attention_layernorm"):
                args_, _, out = CAPTURED[f"{i}.{norm}"]
                x = args_[0] + args_[1] if len(args_) > 1 and torch.is_tensor(args_[1]) else args_[0]
                isolated[f"{i}.{norm}"] = compare(_first(out), getattr(layer, norm)(x))
            normed = _first(CAPTURED[f"{i}.input_layernorm"][2])
            qkv = _first(CAPTURED[f"{i}.self_attn.qkv_proj"][2])
            attn = layer.self_attn
            ours_qkv = torch.cat([attn.q_proj(normed), attn.k_proj(normed), attn.v_proj(normed)], dim=-1)
            isolated[f"{i}.self_attn.qkv_proj"] = compare(qkv, ours_qkv)
            isolated[f"{i}.self_attn"] = compare(_first(CAPTURED[f"{i}.self_attn"][2]), attn(
                hidden_states=normed[None], position_embeddings=position_embeddings, attention_mask=None)[0])
            # rotary alone: HF's apply_rotary_pos_emb on the engine's q and k before its rotation
            q_in, k_in = CAPTURED["rotary_in"][i]
            heads = (len(ids), -1, attn.head_dim)
            q_rot, k_rot = apply_rotary_pos_emb(q_in.view(heads).transpose(0, 1)[None],
                                                k_in.view(heads).transpose(0, 1)[None], *position_embeddings)
            engine_q, engine_k = CAPTURED["rotary_out"][i]
            isolated[f"{i}.self_attn.rotary_emb"] = compare(
                torch.cat([engine_q.view(heads), engine_k.view(heads)], dim=1),
                torch.cat([q_rot[0].transpose(0, 1), k_rot[0].transpose(0, 1)], dim=1))
            # the attention core alone: the trainer's SDPA path on the engine's rotated q, k and its v
            q, k, v = (t.view(heads).transpose(0, 1)[None] for t in CAPTURED[f"{i}.self_attn.attn"][0][:3])
            core = sdpa_attention_forward(attn, q, k, v, None, scaling=attn.scaling)[0]
            isolated[f"{i}.self_attn.attn"] = compare(_first(CAPTURED[f"{i}.self_attn.attn"][2]),
                                                      core.reshape(len(ids), -1))
            o_in = CAPTURED[f"{i}.self_attn.o_proj"][0][0]
            isolated[f"{i}.self_attn.o_proj"] = compare(_first(CAPTURED[f"{i}.self_attn.o_proj"][2]), attn.o_proj(o_in))
            mlp_in = _first(CAPTURED[f"{i}.post_attention_layernorm"][2])
            isolated[f"{i}.mlp"] = compare(_first(CAPTURED[f"{i}.mlp"][2]), layer.mlp(mlp_in))
            gate_up = _first(CAPTURED[f"{i}.mlp.gate_up_proj"][2])
            isolated[f"{i}.mlp.gate_up_proj"] = compare(
                gate_up, torch.cat([layer.mlp.gate_proj(mlp_in), layer.mlp.up_proj(mlp_in)], dim=-1))
            gate, up = gate_up.chunk(2, dim=-1)
            isolated[f"{i}.mlp.act_fn"] = compare(_first(CAPTURED[f"{i}.mlp.act_fn"][2]), layer.mlp.act_fn(gate) * up)
            down_in = CAPTURED[f"{i}.mlp.down_proj"][0][0]
            isolated[f"{i}.mlp.down_proj"] = compare(_first(CAPTURED[f"{i}.mlp.down_proj"][2]),
                                                     layer.mlp.down_proj(down_in))
        chained["norm"] = compare(_first(CAPTURED["norm"][2]), _first(ours["norm"][2]))
        final = _first(CAPTURED["norm"][2])
        calls = {c.shape[0]: c for c in CAPTURED["logits"]}
        assert set(calls) == {len(ids) - 1, 1}, sorted(calls)
        engine_logits = torch.cat([calls[len(ids) - 1], calls[1]])  # every position, in order
        chained["logits"] = compare(engine_logits, logits)
        isolated["lm_head"] = compare(engine_logits, hf.lm_head(final))
        # the same head on the same rows, as the engine split them: the GEMM's row count alone
        isolated["lm_head, the engine's row split"] = compare(
            engine_logits, torch.cat([hf.lm_head(final[:len(ids) - 1]), hf.lm_head(final[-1:])]))

    first = next((name for name, c in chained.items() if c["bit_equal"] < 1.0), None)
    differ = {name: c for name, c in isolated.items() if c["bit_equal"] < 1.0}
    result = {"preset": args.preset, "tokens": len(ids), "dtype": "float32", "engine_tp": 1,
              "engine_rotary": "vLLM forward_native (torch)" if args.native_rotary else "vLLM's CPU kernel",
              "trainer_attention": attention_implementation(TrainerConfig(), "cpu"),
              "first_chained_difference": first, "isolated_kernels_that_differ": sorted({n.split(".", 1)[-1]
                                                                                         for n in differ}),
              "chained": chained, "isolated": isolated,
              "command": "python scripts/probe_consistency_layers.py " + " ".join(sys.argv[1:])}
    out = Path(args.out) / f"probe_consistency_layers{'_native_rotary' * args.native_rotary}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"first chained difference: {first}")
    for name in ("0.input_layernorm", "0.self_attn", "0.mlp", f"{num_layers - 1}.mlp", "norm", "logits"):
        c = chained[name]
        print(f"  chained {name:<28} bit-equal {c['bit_equal']:.1%}  max |d| {c['max_abs']:.2e}")
    for name, c in isolated.items():
        if name.startswith(("0.", "lm_head")):
            print(f"  isolated {name:<27} bit-equal {c['bit_equal']:.1%}  max |d| {c['max_abs']:.2e}")
    print(f"isolated kernels that differ somewhere: {result['isolated_kernels_that_differ']}\nwrote {out}")


if __name__ == "__main__":
    main()
