"""The memory preflight held against what a real job uses: each phase's measured peak beside its prediction.

A sampler thread in the driver reads the whole job's memory (the driver's process tree: Ray's daemons and
workers, the trainer ranks, the engine and its TP workers) every few tens of milliseconds, each page counted
once (PSS), and files every reading under the phase the controller is in:

    sampler = PhaseSampler().start()      # before the Runtime starts: its start-up is the "startup" phase
    with Runtime(cfg) as rt:
        controller = Controller(cfg, rt)
        sampler.follow(controller)        # phases from then on: the controller's recorded events
        controller.step(0)
        sampler.stop()
    sampler.peaks                         # phase -> most bytes seen

Host memory only: on CUDA the preflight budgets the GPU, which this does not read.
"""

from __future__ import annotations

import os
import threading

from colocate.memory import tree_pss_bytes

# The controller's last recorded event -> the phase running now (the switch after a phase counts with the phase
# it leads into, where its memory lands).
_PHASE_AFTER = {
    "rollout": "rollout", "score": "rollout", "engine.sleep": "train", "trainer.onload": "train",
    "train": "train", "trainer.release_grads": "sync", "engine.wake.weights": "sync", "sync": "sync",
    "trainer.offload": "rollout", "engine.wake.kv_cache": "rollout",
}


class PhaseSampler:
    def __init__(self, interval_s: float = 0.02):
        self.interval_s = interval_s
        self.peaks: dict[str, int] = {}
        self._controller = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="phase-sampler", daemon=True)

    def follow(self, controller) -> None:
        self._controller = controller

    def phase(self) -> str:
        if self._controller is None:
            return "startup"
        events = self._controller.events
        return _PHASE_AFTER[events[-1]] if events else "rollout"

    def start(self) -> PhaseSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            self._stop.set()
            self._thread.join()

    def _run(self) -> None:
        root = os.getpid()
        while not self._stop.wait(self.interval_s):
            phase = self.phase()  # before the reading: a reading that spans a switch goes to the earlier phase
            used = tree_pss_bytes(root)
            self.peaks[phase] = max(self.peaks.get(phase, 0), used)


def compare(predicted: list, peaks: dict[str, int]) -> dict:
    """Per phase: predicted and measured bytes and their ratio; and the same for the job's overall peak."""
    rows = {p.name: {"predicted_bytes": p.total, "measured_bytes": peaks.get(p.name, 0),
                     "predicted_over_measured": p.total / peaks[p.name] if peaks.get(p.name) else None}
            for p in predicted}
    peak_predicted = max(p.total for p in predicted)
    peak_measured = max(peaks.values())
    return {"phases": rows, "peak_predicted_bytes": peak_predicted, "peak_measured_bytes": peak_measured,
            "peak_predicted_over_measured": peak_predicted / peak_measured}
