"""Reward functions for the failure tests (loaded by dotted path, as users' would be)."""

_calls = 0


def explode_in_second_step(prompt: str, response: str, answer: str) -> float:
    """Scores the first step (4 prompts x 4 samples), then raises: a user bug that shows up mid-run."""
    global _calls
    _calls += 1
    if _calls > 16:
        raise ZeroDivisionError("user reward bug")
    return 0.5


def share_of_a(prompt: str, response: str, answer: str) -> float:
    """The share of the response that is the letter a: differs between an untrained model's samples, so every
    group has advantages to train on, whatever the answers' length."""
    return response.count("a") / max(len(response), 1)
