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

from colocate.host.memory import tree_pss_bytes

# The controller's last recorded event -> the phase whose memory is resident now. Each switch first releases
# (engine sleep, gradients, trainer offload: memory falls, still the old phase's) and then acquires (trainer
# onload, engine wake: memory rises, the new phase's), and records each step after it is done; so a phase starts
# at the event of its switch's releasing step. A reading racing an event can only land a falling value in the
# old phase, never a rising one there.
_PHASE_AFTER = {
    "rollout": "rollout", "score": "rollout",
    "engine.sleep": "train", "trainer.onload": "train", "train": "train",
    "trainer.release_grads": "sync", "engine.wake.weights": "sync", "sync": "sync",
    "trainer.offload": "rollout", "engine.wake.kv_cache": "rollout",
}


class PhaseSampler:
    def __init__(self, interval_s: float = 0.02):
        self.interval_s = interval_s
        self.peaks: dict[str, int] = {}
        self.peak_by_process: dict[str, dict[str, int]] = {}  # phase -> process name -> bytes, at the peak
        self._controller = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="phase-sampler", daemon=True)

    def follow(self, controller) -> None:
        self._controller = controller

    def phase(self) -> str:
        if self._controller is None:
            return "startup"
        # the last event that names a phase: a checkpoint, an eval or a restore runs within the one before it
        for event in reversed(self._controller.events):
            if event in _PHASE_AFTER:
                return _PHASE_AFTER[event]
        return "startup"  # until the trainers first offload

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
            by_process = tree_pss_bytes(root)
            used = sum(by_process.values())
            if used > self.peaks.get(phase, 0):
                self.peaks[phase] = used
                self.peak_by_process[phase] = by_process


def compare(predicted: list, sampler: PhaseSampler) -> dict:
    """Per phase: predicted and measured bytes, their ratio, what each kind of process held at the measured
    peak (the calibration data of preflight.py); and the same for the job's overall peak. A phase shorter than
    the sampling interval may have no reading (None)."""
    peaks = sampler.peaks
    rows = {p.name: {"predicted_bytes": p.total, "predicted_parts": p.parts, "measured_bytes": peaks.get(p.name),
                     "predicted_over_measured": p.total / peaks[p.name] if peaks.get(p.name) else None,
                     "measured_by_process": sampler.peak_by_process.get(p.name)}
            for p in predicted}
    peak_predicted = max(p.total for p in predicted)
    peak_measured = max(peaks.values())
    return {"phases": rows, "peak_predicted_bytes": peak_predicted, "peak_measured_bytes": peak_measured,
            "peak_predicted_over_measured": peak_predicted / peak_measured}
