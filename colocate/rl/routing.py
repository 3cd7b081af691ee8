"""An answer's routing for router replay (algo.router_replay, R3): the experts each position of its prompt and
answer was routed to in the engine, uint16 [positions, layers, top_k], from 0 up to the last token the engine ran
(the last sampled token never is).

An answer generated in several segments (partial rollout, multi-turn, a weight update inside a pass) gets each
segment's rows for the positions it does not have yet: a continuation prefills the earlier tokens again (or reads
them from the prefix cache), and the routing kept for them is the one of the forward that sampled from them.

    answer.routing = extend(answer.routing, result.routing)
    state = encode(answer.routing); answer.routing = decode(state)        # a checkpoint's JSON
"""

from __future__ import annotations

import base64

import numpy as np

DTYPE = np.uint16


def extend(have: np.ndarray | None, rows: np.ndarray | None) -> np.ndarray | None:
    """`have` followed by the rows of `rows` past its length (both from position 0)."""
    if rows is None:
        return have
    rows = np.asarray(rows, dtype=DTYPE)
    if have is None or len(have) == 0:
        return rows
    assert have.shape[1:] == rows.shape[1:], (have.shape, rows.shape)
    return have if len(rows) <= len(have) else np.concatenate([have, rows[len(have):]])


def encode(rows: np.ndarray | None) -> dict | None:
    if rows is None:
        return None
    return {"shape": list(rows.shape), "data": base64.b64encode(np.ascontiguousarray(rows, DTYPE).tobytes()).decode()}


def decode(state: dict | None) -> np.ndarray | None:
    if state is None:
        return None
    return np.frombuffer(base64.b64decode(state["data"]), dtype=DTYPE).reshape(state["shape"]).copy()


def sequence_routing(rows: np.ndarray | None, length: int, num_layers: int, top_k: int) -> np.ndarray:
    """int64 [length, layers, top_k] for a sequence of `length` tokens: the engine's rows where it has them, -1
    (route freely) past them. The positions without a row are the last token (never a prediction that is
    trained) and what the engine did not run."""
    out = np.full((length, num_layers, top_k), -1, dtype=np.int64)
    if rows is not None:
        n = min(length, len(rows))
        assert rows.shape[1:] == (num_layers, top_k), f"routing of {rows.shape[1:]}, the model routes " \
                                                      f"{(num_layers, top_k)}"
        out[:n] = rows[:n]
    return out
