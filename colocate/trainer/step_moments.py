"""What a train step holds on a trainer rank beyond its resident state (the fp32 shard of the parameters and
AdamW's two moments), moment by moment, and the peak: the preflight's train phase and the benches' predictions.

    setting = StepSetting(compute_bytes=2, temperature=1.0, top_p=1.0, chunk_tokens=1024, checkpointed=True,
                          world_size=8, device="cuda")
    moments = step_moments(dims, setting, rows=1, length=4096, masked=False)   # name -> parts (bytes)
    name, parts = peak_moment(moments)
    optimizer_step_parts(dims, setting)                                        # AdamW's step, beside

Why moments and not one sum: the parts never coexist. The forward keeps activations and no gradient; the backward
frees activations layer by layer while the gradients build up group by group, so the largest activations (at the
head, before any decoder gradient exists) and the whole gradients (at the end, when the activations are gone) meet
only in the middle. A sum of every part's maximum was 27-92% above the peaks measured on an H200 (they were 0.52-0.79
of it, docs/preflight.md) and 30-67% above the CPU's (`colocate bench train-memory`: 0.60-0.77).

FSDP2's groups are trainer/fsdp.py's: each decoder layer; untied, the input embeddings and lm_head each a group
(lm_head kept unsharded from its forward into its backward); the root (final norm, tied embeddings = lm_head). In
the backward each group (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py, FSDPParamGroup):
- pre_backward unshards it (`wait_for_unshard`: world size 1 copies the shard into a full buffer, more ranks copy
  the all-gather's output out), then prefetches the group before it in the forward's order. With more than one
  rank the prefetch's all-gather output, full size, waits beside the current group; with one it allocates
  nothing until that group's own wait (`unshard`'s world-size-1 branch);
- post_backward takes the unsharded gradients, reshards the parameters, drops the previous group's reduce-scatter
  input (`reduce_scatter_max_input_buffers`, 1), and `foreach_reduce` (_fsdp_collectives.py) copies the gradients
  into a flat fp32 input of the whole group, frees them, and reduce-scatters into a new 1/world output: the
  rank's sharded gradient, or added to it when micro-batches accumulate. The flat input stays alive until the next
  group's post_backward.
So after lm_head's reduce-scatter its full fp32 input (4 x vocab x hidden: 2.0 GiB for Qwen2.5-7B) stays through
the first decoder layer's backward, and at the very end the embeddings' (same size) is the step's peak at short
lengths: all the gradients plus that buffer.

AdamW (torch/optim/adam.py): on CUDA the foreach path (`_multi_tensor_adam`, the default for CUDA tensors, DTensor
included) takes `torch._foreach_sqrt` of every second moment at once: one fp32 copy of the trained shard beside
the gradients (measured 7.54 GiB for a 2.02B model on one H200). The CPU has no foreach kernels
(`_get_foreach_kernels_supported_devices`), so `_single_tensor_adam` runs parameter by parameter: the sqrt and its
quotient, two copies of the largest one.

Measured against torch's MemTracker on real train steps (tests/distributed/test_step_moments.py) and pinned to the
H200's table (tests/unit/test_preflight.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from colocate.trainer.step_memory import (
    CHUNKED_OUTPUT_BYTES,
    FP32,
    Dims,
    attention_mask_bytes,
    head_input_bytes_per_token,
    layer_bytes_per_token,
    logprob_pass_peaks,
    rotary_bytes,
    uses_math_attention,
)

MLP_BACKWARD_TEMPORARIES = 2  # beyond a layer's saved MLP tensors: the product's, SiLU's and up's gradients (3 x i)
# while the product itself is freed


@dataclass(frozen=True)
class StepSetting:
    """How the trainer computes (trainer config, rollout sampling, placement), as the moments need it."""

    compute_bytes: int  # 2 under bf16 mixed precision, else 4
    temperature: float
    top_p: float
    chunk_tokens: int | None  # trainer.logprob_chunk_tokens
    checkpointed: bool  # trainer.activation_checkpointing
    world_size: int  # FSDP2 ranks
    device: str  # "cuda" or "cpu"
    entropy_grad: bool = False  # algo.entropy_coef > 0
    adapter_params: int = 0  # LoRA: the adapters' parameters, the only ones trained; 0: every parameter
    fp32_head: bool = False  # trainer.fp32_lm_head under bf16 compute: fp32 logits from an fp32 copy of lm_head


@dataclass(frozen=True)
class _Groups:
    """FSDP2's groups in parameters, and what each trains (LoRA: the adapters, which live in the layers)."""

    layer: int
    head: int  # untied lm_head's own group; 0 tied (the root holds it)
    embeddings: int  # untied input embeddings' own group; 0 tied
    root: int  # final norm, and tied embeddings = lm_head
    layer_trained: int
    head_trained: int
    embeddings_trained: int
    root_trained: int


def _groups(dims: Dims, setting: StepSetting) -> _Groups:
    table = dims.vocab_size * dims.hidden_size
    tied = dims.tie_word_embeddings
    head, embeddings = (0, 0) if tied else (table, table)
    root = dims.root_params - head - embeddings
    if setting.adapter_params:
        return _Groups(dims.layer_params, head, embeddings, root, setting.adapter_params // dims.num_layers, 0, 0, 0)
    return _Groups(dims.layer_params, head, embeddings, root, dims.layer_params, head, embeddings, root)


def trained_params(dims: Dims, setting: StepSetting) -> int:
    return setting.adapter_params or dims.num_params


class _Step:
    """What the moments share: one micro-batch of `rows` x `length` tokens under `setting`."""

    def __init__(self, dims: Dims, setting: StepSetting, rows: int, length: int, masked: bool):
        self.dims, self.s, self.rows, self.length, self.masked = dims, setting, rows, length, masked
        self.c, self.world, self.tokens = setting.compute_bytes, setting.world_size, rows * length
        self.g = _groups(dims, setting)
        c, tokens = self.c, self.tokens
        math = uses_math_attention(dims, compute_bytes=c, masked=masked, device=setting.device)
        self.math_length = length if math else 0
        self.layer_saved = tokens * layer_bytes_per_token(dims, compute_bytes=c, masked=masked,
                                                          math_length=self.math_length)
        self.kept_layer = tokens * c * dims.hidden_size if setting.checkpointed else self.layer_saved
        self.head_input = tokens * head_input_bytes_per_token(dims, compute_bytes=c)
        self.rotary = rotary_bytes(dims, num_tokens=length, compute_bytes=c)
        self.chunked = setting.chunk_tokens is not None
        self.positions = min(tokens, setting.chunk_tokens) if self.chunked else tokens  # logits alive at once
        self.several_chunks = self.chunked and tokens > setting.chunk_tokens
        self.prefetch = self.world > 1  # the next group's all-gather output waits beside the current group

    def grads(self, params: int) -> int:
        """fp32 gradients of `params`, the rank's shard"""
        return FP32 * params // self.world

    def gloo_copy(self, params: int) -> int:
        """gloo's reduce-scatter (ProcessGroupGloo, through an all-reduce) holds a copy of its whole input and one
        of its output (measured by MemTracker at world size 2); NCCL's writes the output in place"""
        return FP32 * params + self.grads(params) if self.s.device == "cpu" and self.world > 1 else 0

    def masks(self, copies: int) -> int:
        """The padding mask and `copies` layers' additive copies of it."""
        if not self.masked:
            return 0
        return attention_mask_bytes(self.dims, rows=self.rows, length=self.length, compute_bytes=self.c,
                                    num_layers=copies)

    def activations(self, layers: int, *, head: bool) -> dict[str, int]:
        """What `layers` decoder layers keep (and the head's input, before its backward)."""
        mask_copies = (1 if layers else 0) if self.s.checkpointed else layers
        return {"activations kept for backward": layers * self.kept_layer + self.rotary
                + (self.head_input if head else 8 * self.tokens),
                "attention masks": self.masks(mask_copies)}

    @property
    def every_grad(self) -> int:
        return self.grads(trained_params(self.dims, self.s))


def step_moments(dims: Dims, setting: StepSetting, *, rows: int, length: int, masked: bool,
                 accumulating: bool = False) -> dict[str, dict[str, int]]:
    """Each moment of one micro-batch's forward and backward: its parts in bytes, beyond the resident state.
    `accumulating`: a micro-batch after the step's first, when every gradient exists from the start and each
    reduce-scatter's output is added into it."""
    step = _Step(dims, setting, rows, length, masked)
    moments = _head_moments(step, accumulating)
    moments.update(_layer_moments(step, accumulating))
    moments["backward: embeddings reduce-scatter"] = _end_moment(step, accumulating)
    return moments


def _head_moments(step: _Step, accumulating: bool) -> dict[str, dict[str, int]]:
    """The log-prob pass, forward and backward, and lm_head's weight gradient: every layer's activations kept."""
    dims, g, c = step.dims, step.g, step.c
    s = step.s
    # trainer.fp32_lm_head: the logits are made in fp32 (no bf16 copy), from an fp32 copy of the head's weight
    # per chunk (trainer/logprobs.py ChunkedLogprobHead.logits), whose fp32 gradient the head's backward adds
    fp32_head = s.fp32_head and c != FP32
    logits_bytes = FP32 if fp32_head else c
    head_copy = FP32 * dims.vocab_size * dims.hidden_size if fp32_head else 0
    forward_pass, backward_pass = logprob_pass_peaks(
        dims, num_tokens=step.tokens, compute_bytes=logits_bytes, temperature=s.temperature, top_p=s.top_p,
        chunk_tokens=s.chunk_tokens, entropy_grad=s.entropy_grad)
    kept = {**step.activations(dims.num_layers, head=True),
            "gradients (fp32 shard)": step.every_grad if accumulating else 0}
    # the forward's copy is freed once its GEMM is done, before the logits' larger temporaries (measured); the
    # recompute's is saved for the chunk's backward
    saved_copy = {"fp32 copy of lm_head": head_copy} if fp32_head else {}
    head_param = c * (g.head or g.root)  # tied: the root, embeddings = lm_head
    head_grad = c * (g.head_trained or g.root_trained)
    outputs = step.tokens * CHUNKED_OUTPUT_BYTES if step.chunked else 0
    return {
        # after (unchunked) or inside (chunked) the model's forward; with more ranks lm_head's all-gather output
        # waits there until the root's post-forward frees it
        "forward: log-prob pass": {
            **kept, "fsdp unsharded groups": head_param + (c * g.head if step.prefetch and step.chunked else 0),
            "logits and log-softmax": forward_pass},
        # chunked: each chunk's recompute and backward, inside lm_head's, after its pre-backward prefetched the
        # last layer, beside the head's gradient accumulated over the chunks before
        "backward: log-prob pass": {
            **kept, "fsdp unsharded groups": head_param + (c * g.layer if step.prefetch and step.chunked else 0)
            + (head_grad if step.several_chunks else 0),
            "logits and log-softmax": backward_pass, **saved_copy},
        # the logits' gradient (fp32, and cast to the compute dtype) beside a new gradient of the whole head and
        # the one it adds to
        "backward: lm_head": {
            **kept, "fsdp unsharded groups": head_param + (c * g.layer if step.prefetch else 0)
            + head_grad * (2 if step.several_chunks else 1),
            "logits and log-softmax": (FP32 + (0 if fp32_head else c)) * step.positions * dims.vocab_size
            + outputs, **({"fp32 copy of lm_head and its gradient": 2 * head_copy} if fp32_head else {})},
    }


def _layer_moments(step: _Step, accumulating: bool) -> dict[str, dict[str, int]]:
    """Each decoder layer's backward and its reduce-scatter, the last layer first; the first to run holds
    lm_head's reduce-scatter input."""
    dims, g, c = step.dims, step.g, step.c
    tied = dims.tie_word_embeddings
    # tied: the root (embeddings = lm_head) stays unsharded from the forward to the end of the backward, its full
    # gradient from lm_head's backward on (the embeddings' backward adds into it)
    root_held = c * (g.root + (g.root_trained if tied else 0))
    # the math kernel's backward: the scores' gradient and the softmax's, beside the kept softmax
    scores = step.rows * dims.num_heads * step.math_length ** 2 * c
    temporaries = step.tokens * c * (MLP_BACKWARD_TEMPORARIES * dims.intermediate_size + dims.hidden_size) \
        + 2 * scores
    moments, previous_input = {}, FP32 * g.head_trained
    for k in reversed(range(dims.num_layers)):
        done = step.every_grad if accumulating else step.grads(
            g.head_trained + (0 if tied else g.root_trained) + (dims.num_layers - 1 - k) * g.layer_trained)
        prefetched = c * (g.layer if k else g.embeddings) if step.prefetch else 0  # tied: the root is unsharded
        moments[f"backward: layer {k}"] = {
            **step.activations(k + 1, head=False),
            **({"one layer recomputed": step.layer_saved} if step.s.checkpointed else {}),
            "layer backward temporaries": temporaries,
            "gradients (fp32 shard)": done,
            "reduce-scatter buffers": previous_input,
            "fsdp unsharded groups": c * (g.layer + g.layer_trained) + prefetched + root_held}
        # its post-backward: resharded, the previous input dropped, its gradients copied into a flat fp32 input
        # and reduce-scattered into the rank's shard
        moments[f"backward: layer {k} reduce-scatter"] = {
            **step.activations(k, head=False),
            "gradients (fp32 shard)": done,
            "reduce-scatter buffers": FP32 * g.layer_trained + max(
                c * g.layer_trained, step.grads(g.layer_trained) + step.gloo_copy(g.layer_trained)),
            "fsdp unsharded groups": prefetched + root_held}
        previous_input = FP32 * g.layer_trained
    return moments


def _end_moment(step: _Step, accumulating: bool) -> dict[str, int]:
    """The embeddings' backward and reduce-scatter (tied: the root's), every other gradient done: the parameters
    and the gradient (tied: and the gradient it adds to) beside layer 0's reduce-scatter input; then, resharded,
    the gradient copied into the group's flat fp32 input; then that input and its output."""
    g, c = step.g, step.c
    last = g.embeddings_trained or g.root_trained
    tied = step.dims.tie_word_embeddings
    unsharded = max(c * (g.embeddings or g.root) + c * last * (2 if tied else 1) + FP32 * g.layer_trained,
                    c * last + FP32 * last)
    return {"gradients (fp32 shard)": step.every_grad if accumulating else step.every_grad - step.grads(last),
            "reduce-scatter buffers": max(unsharded, FP32 * last + step.grads(last) + step.gloo_copy(last))}


def peak_moment(moments: dict[str, dict[str, int]]) -> tuple[str, dict[str, int]]:
    """The moment that holds the most, with its parts (the parts that are zero left out)."""
    name = max(moments, key=lambda m: sum(moments[m].values()))
    return name, {part: size for part, size in moments[name].items() if size}


def optimizer_step_parts(dims: Dims, setting: StepSetting) -> dict[str, int]:
    """AdamW's step beyond the resident state: the gradients, and its temporaries (the module docstring)."""
    trained = trained_params(dims, setting)
    if setting.device == "cuda":
        temporaries = FP32 * trained // setting.world_size  # foreach: one copy of the whole shard
        name = "adamw foreach temporaries (one fp32 copy of the shard)"
    else:
        g = _groups(dims, setting)
        largest = max(g.layer_trained and dims.hidden_size * max(dims.intermediate_size, dims.num_heads
                                                                 * dims.head_dim),
                      g.head_trained, g.embeddings_trained, g.root_trained)
        temporaries = 2 * FP32 * largest // setting.world_size
        name = "adamw temporaries (two fp32 copies of the largest parameter)"
    return {"gradients (fp32 shard)": FP32 * trained // setting.world_size, name: temporaries}
