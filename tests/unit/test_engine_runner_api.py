"""Engine code reaches into vLLM's model runner only for what its V2 runner has too.

vLLM 0.32 runs its V1 model runner on the CPU and its V2 runner on CUDA by default (`vllm/config/vllm.py`,
`VllmConfig.use_v2_model_runner`). CI runs only the V1 runner, so a reach into an attribute the V2 runner lacks
(as `model_runner.requests` was, for random streams) passes every CPU test and raises `AttributeError` on the
first GPU job. This test reads the V2 runner's class from the installed vLLM's source (never imported: it needs
Triton) and every `model_runner.<name>` in colocate, and fails on a name the V2 runner does not define.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The V2 runner and the mixin it derives from (`class GPUModelRunner(LoRAModelRunnerMixin)`).
V2_SOURCES = {"v1/worker/gpu/model_runner.py": "GPUModelRunner",
              "v1/worker/lora_model_runner_mixin.py": "LoRAModelRunnerMixin"}


def class_attributes(source: str, class_name: str) -> set[str]:
    """Every name an instance of `class_name` has: its methods and properties, class attributes, and each
    `self.<name>` its methods assign."""
    tree = ast.parse(source)
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == class_name)
    names = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        for t in targets:
            for sub in ast.walk(t):
                if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                    names.add(sub.attr)
    return names


def runner_reaches(source: str) -> set[str]:
    """Names read through a model runner: `<x>.model_runner.<name>`, `getattr(<x>.model_runner, "<name>")`, and
    `runner.<name>` where a function takes the runner as `runner` or `model_runner`."""
    def is_runner(node) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "model_runner") or \
            (isinstance(node, ast.Name) and node.id in ("runner", "model_runner"))

    reached = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and is_runner(node.value):
            reached.add(node.attr)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") \
                and len(node.args) >= 2 and is_runner(node.args[0]) and isinstance(node.args[1], ast.Constant):
            reached.add(node.args[1].value)
    return reached


@pytest.fixture(scope="module")
def v2_attributes() -> set[str]:
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        pytest.skip("vLLM is not installed")
    package = Path(spec.origin).parent
    return set().union(*(class_attributes((package / path).read_text(), name) for path, name in V2_SOURCES.items()))


def test_the_v2_runner_is_read_as_it_is(v2_attributes):
    # what colocate uses, and what it used to use and the V2 runner lacks
    assert {"model", "kv_caches", "device", "load_model"} <= v2_attributes
    assert "requests" not in v2_attributes and "input_batch" not in v2_attributes


def test_a_reach_into_runner_internals_is_found(v2_attributes):
    snippet = ("def read(self):\n    state = self.model_runner.requests.get('a')\n"
               "    return getattr(self.model_runner, 'input_batch'), self.model_runner.model\n")
    assert runner_reaches(snippet) - v2_attributes == {"requests", "input_batch"}


def test_colocate_reaches_only_what_the_v2_runner_has(v2_attributes):
    lacking = {}
    for path in sorted((ROOT / "colocate").rglob("*.py")):
        missing = runner_reaches(path.read_text()) - v2_attributes
        if missing:
            lacking[str(path.relative_to(ROOT))] = sorted(missing)
    assert not lacking, f"model-runner attributes vLLM's V2 runner (CUDA's default) does not have: {lacking}"


DEVICE_CALLS = {"synchronize", "mem_get_info", "current_device", "memory_allocated", "memory_reserved"}


def calls_without_a_device(source: str) -> list[str]:
    """`torch.cuda.<call>()` with no device argument: in a vLLM worker these read the calling thread's current
    device, which a collective_rpc does not promise to be the worker's (use `self.device`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        f = node.func if isinstance(node, ast.Call) else None
        if isinstance(f, ast.Attribute) and f.attr in DEVICE_CALLS and isinstance(f.value, ast.Attribute) \
                and f.value.attr == "cuda" and not node.args and not node.keywords:
            found.append(f"line {node.lineno}: torch.cuda.{f.attr}()")
    return found


def test_engine_worker_code_names_its_device():
    assert calls_without_a_device("torch.cuda.synchronize()\ntorch.cuda.mem_get_info(self.device)\n") == \
        ["line 1: torch.cuda.synchronize()"]
    found = {str(p.relative_to(ROOT)): calls_without_a_device(p.read_text())
             for p in sorted((ROOT / "colocate" / "engine").rglob("*.py"))}
    assert not {k: v for k, v in found.items() if v}, found
