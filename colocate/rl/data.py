"""Prompt data from files: JSONL or Parquet rows of (prompt, answer), served in batches like the toy tasks' stream.

    prompts = make_prompt_source(cfg, tokenizer)   # data.train_files set: DatasetPrompts; empty: PromptStream(task)
    batch = prompts.next_batch(16)                 # list[Sample(prompt, answer)]
    state = prompts.state()                        # {"epoch", "position", "seed", "num_rows"}: the data order
    DatasetPrompts(samples, seed=0).load_state(state)   # ...resumes exactly where `state` was taken

Rows are read with Hugging Face `datasets`, one file at a time so that every error can name its file and row.
A prompt is plain text or a list of chat messages ({"role", "content"}); messages are rendered with the
tokenizer's chat template when it has one (with the generation prompt, as the engine must continue after it),
else their contents are joined by newlines. Prompts longer than the token limit are dropped (data.too_long=filter,
the count logged once) or stop the job (error). Every check raises a one-line ConfigError naming the key, the
file and the row, and runs before any actor starts (`train.run_job`).

The order: rows are shuffled with `random.Random(seed + epoch)` at the start of each epoch; a batch that runs past
the end finishes with the next epoch's first rows, so every batch has the size asked for.
"""

from __future__ import annotations

import glob
import logging
import random
from pathlib import Path
from typing import Protocol

from colocate.config import DataConfig, JobConfig, chat_template_kwargs
from colocate.errors import ConfigError
from colocate.rl.tasks import PromptStream, Sample, Task, make_task

log = logging.getLogger("colocate")

FORMATS = {".jsonl": "json", ".parquet": "parquet"}  # extension -> datasets' builder


class PromptSource(Protocol):
    """What Passes draws prompts from: PromptStream (toy tasks) or DatasetPrompts (files)."""

    def next_batch(self, n: int) -> list[Sample]: ...

    def state(self) -> dict: ...

    def load_state(self, state: dict) -> None: ...


def data_files(spec: str, key: str) -> list[str]:
    """The comma-separated files (or globs) of `key`, each existing with a supported extension."""
    files: list[str] = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        matches = sorted(glob.glob(str(Path(item).expanduser()))) if glob.has_magic(item) else [item]
        if not matches:
            raise ConfigError(f"{key}={spec!r} is invalid: no file matches {item!r}")
        for path in matches:
            if Path(path).suffix not in FORMATS:
                raise ConfigError(f"{key}={spec!r} is invalid: {path!r} has an unsupported extension; valid: "
                                  f"{', '.join(FORMATS)}")
            if not Path(path).expanduser().is_file():
                raise ConfigError(f"{key}={spec!r} is invalid: data file {path!r} does not exist")
            files.append(str(Path(path).expanduser()))
    return files


def _read_rows(path: str, key: str) -> dict[str, list]:
    """The file's columns as Python lists (`datasets` converts it once into its cache and reuses it)."""
    import datasets

    datasets.disable_progress_bars()  # one bar per file per job is noise in a job's log
    try:
        table = datasets.load_dataset(FORMATS[Path(path).suffix], data_files=path, split="train")
    except Exception as e:  # malformed JSON, a broken Parquet footer, rows of mixed types: datasets' many errors
        cause = e.__cause__ or e
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        raise ConfigError(f"{key}: cannot read data file {path!r}: {type(cause).__name__}: {first}") from None
    return table.to_dict()  # one Arrow-to-Python conversion, not row by row


def chat_template(data: DataConfig, tokenizer) -> str | None:
    """The Jinja template prompts are rendered with (data.chat_template): a file's, the model's under auto when
    its tokenizer has one, else None (no template)."""
    if data.chat_template == "none":
        return None
    if data.chat_template == "auto":
        return getattr(tokenizer, "chat_template", None) or None
    return Path(data.chat_template).expanduser().read_text()


def render_prompt(value, tokenizer, data: DataConfig | None = None) -> str | None:
    """The text the engine continues (data.chat_template): with a template, plain text as one user message and
    chat messages as they are, through the tokenizer's `apply_chat_template` with the generation prompt and
    data.chat_template_kwargs; without one, plain text as is and messages' contents joined by newlines. None when
    `value` is neither text nor a list of {role, content} messages."""
    data = data or DataConfig()
    if isinstance(value, str):
        messages = [{"role": "user", "content": value}]
    elif isinstance(value, list) and all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in value):
        if not value:
            return ""
        messages = [{"role": m.get("role") or "user", "content": m["content"]} for m in value]
    else:
        return None
    template = chat_template(data, tokenizer)
    if template is None:
        return value if isinstance(value, str) else "\n".join(m["content"] for m in messages)
    return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                         add_generation_prompt=True, **chat_template_kwargs(data))


def _file_samples(path: str, data: DataConfig, tokenizer, key: str) -> list[Sample]:
    """Every row of one file as a Sample, its prompt rendered; a missing key or an empty prompt is refused."""
    columns = _read_rows(path, key)
    for column, name in ((data.prompt_key, "data.prompt_key"), (data.answer_key, "data.answer_key")):
        if column and column not in columns:
            raise ConfigError(f"{name}={column!r} is invalid: {path!r} has no such key; its keys: "
                              f"{', '.join(columns)}")
    answers = columns[data.answer_key] if data.answer_key else [""] * len(columns[data.prompt_key])
    # the rows' sources (data.source_key), where the file has the column: one source otherwise
    sources = columns.get(data.source_key) if data.source_key else None
    sources = [str(s or "") for s in sources] if sources is not None else [""] * len(answers)
    samples = []
    for row, (value, answer, source) in enumerate(zip(columns[data.prompt_key], answers, sources)):
        prompt = render_prompt(value, tokenizer, data)
        if prompt is None:
            raise ConfigError(f"data.prompt_key={data.prompt_key!r}: row {row} of {path!r} holds "
                              f"{type(value).__name__}; valid: text or a list of {{role, content}} messages")
        if not prompt.strip():
            raise ConfigError(f"data.prompt_key={data.prompt_key!r}: row {row} of {path!r} has an empty prompt")
        if answer is None:
            raise ConfigError(f"data.answer_key={data.answer_key!r}: row {row} of {path!r} has no answer")
        samples.append(Sample(prompt=prompt, answer=answer if isinstance(answer, str) else str(answer), source=source))
    return samples


def load_samples(files: list[str], data: DataConfig, tokenizer, *, key: str,
                 max_tokens: int) -> tuple[list[Sample], int]:
    """Every row of `files` as a Sample, and how many were dropped for having more than `max_tokens` tokens
    (data.too_long=filter; with error the first such row stops the job)."""
    kept: list[Sample] = []
    num_dropped, first_dropped = 0, ""
    for path in files:
        samples = _file_samples(path, data, tokenizer, key)
        # One tokenizer call per file (fast tokenizers batch in Rust); the count is the one Passes will send.
        ids = tokenizer([s.prompt for s in samples], add_special_tokens=False).input_ids if samples else []
        for row, (sample, length) in enumerate(zip(samples, map(len, ids))):
            if length <= max_tokens:
                kept.append(sample)
            elif data.too_long == "error":
                raise ConfigError(f"data.max_prompt_tokens={data.max_prompt_tokens}: row {row} of {path!r} has a "
                                  f"{length}-token prompt (limit {max_tokens}); valid: a larger limit, or "
                                  "data.too_long=filter")
            else:
                num_dropped += 1
                first_dropped = first_dropped or f"row {row} of {path!r}, {length} tokens"
    if num_dropped:
        log.warning("data: dropped %d of %d prompts of %s longer than %d tokens (data.max_prompt_tokens); the first: "
                    "%s", num_dropped, num_dropped + len(kept), key, max_tokens, first_dropped)
    return kept, num_dropped


class DatasetPrompts:
    """Batches of a fixed list of samples in a seeded order, epoch after epoch; `state()` pins the place in it."""

    def __init__(self, samples: list[Sample], *, shuffle: bool = True, seed: int = 0, num_dropped: int = 0):
        if not samples:
            raise ValueError("DatasetPrompts needs at least one sample")
        self.samples, self.shuffle, self.seed = samples, shuffle, seed
        self.num_dropped = num_dropped  # rows filtered out as too long, for whoever reports it
        self.epoch, self.position = 0, 0
        self._order = self._order_of(0)

    def _order_of(self, epoch: int) -> list[int]:
        order = list(range(len(self.samples)))
        if self.shuffle:
            # a private generator per epoch: the order depends on (seed, epoch) only, so a resumed run can rebuild it
            random.Random(self.seed + epoch).shuffle(order)
        return order

    def next_batch(self, n: int) -> list[Sample]:
        batch = []
        while len(batch) < n:
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._order_of(self.epoch)
            take = min(n - len(batch), len(self._order) - self.position)
            batch.extend(self.samples[i] for i in self._order[self.position:self.position + take])
            self.position += take
        return batch

    def state(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "shuffle": self.shuffle,
                "num_rows": len(self.samples)}

    def load_state(self, state: dict) -> None:
        """Continue from `state()` of a source over the same rows; a different data set or seed is refused,
        since its epoch and position would point into another order."""
        mine = {"seed": self.seed, "shuffle": self.shuffle, "num_rows": len(self.samples)}
        theirs = {k: state.get(k) for k in mine}
        if theirs != mine:
            raise ValueError(f"data state {theirs} does not match this data {mine}: the checkpoint was taken with "
                             "other data.train_files, data.seed or data.shuffle")
        if not 0 <= state["position"] <= len(self.samples) or state["epoch"] < 0:
            raise ValueError(f"data state has position {state['position']} and epoch {state['epoch']}, outside "
                             f"0..{len(self.samples)} rows")
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._order_of(self.epoch)


def prompt_token_limit(cfg: JobConfig) -> int:
    """data.max_prompt_tokens, or (0) the most that leaves one response token within engine.max_model_len."""
    return cfg.data.max_prompt_tokens or cfg.engine.max_model_len - 1


def load_dataset_prompts(cfg: JobConfig, tokenizer) -> DatasetPrompts:
    files = data_files(cfg.data.train_files, "data.train_files")
    samples, dropped = load_samples(files, cfg.data, tokenizer, key="data.train_files",
                                    max_tokens=prompt_token_limit(cfg))
    need = cfg.rollout.num_prompts
    if len(samples) < need:
        raise ConfigError(f"data.train_files={cfg.data.train_files!r} is invalid: {len(samples)} prompts"
                          f"{' after filtering' if dropped else ''}, fewer than one batch (rollout.num_prompts="
                          f"{need})")
    return DatasetPrompts(samples, shuffle=cfg.data.shuffle, seed=cfg.data.seed, num_dropped=dropped)


def load_val_samples(cfg: JobConfig, tokenizer) -> list[Sample]:
    """data.val_files as samples, with the same checks and limit as the training prompts (empty when unset)."""
    files = data_files(cfg.data.val_files, "data.val_files")
    return load_samples(files, cfg.data, tokenizer, key="data.val_files", max_tokens=prompt_token_limit(cfg))[0]


def make_prompt_source(cfg: JobConfig, tokenizer, task: Task | None = None) -> PromptSource:
    """DatasetPrompts over data.train_files, or, when it is empty, the toy task's PromptStream as before."""
    if cfg.data.train_files:
        return load_dataset_prompts(cfg, tokenizer)
    task = task or make_task(cfg.rollout.task, length=cfg.rollout.task_length)
    return PromptStream(task, seed=cfg.rollout.seed)
