"""The trainer's forward passes that are not a train step's, and the pieces every forward shares: the loss's
log-probs without training (score: bench mismatch, the proximal policy of job/updates.py, the rollout dump), the
same with each position's routing (score_routing: router replay's bench and tests), the critic's values (values:
algo.advantage=gae, before a step's first update), the policy's forward with its
routers replaying the batch's routing (_logprobs), and a rank's micro-batches (_micro_batches, _collate).

A mixin of TrainerActor (trainer/actor.py), whose state it reads: `model`, `cfg`, `pad_id`, `device`, `replay`,
`critic` and `_offloaded`.
"""

from __future__ import annotations

import torch

from colocate.rl.samples import Sequence
from colocate.trainer.batching import MicroBatch, collate, trainer_micro_batches
from colocate.trainer.logprobs import sequence_logprobs


class ScoringPasses:
    @torch.no_grad()
    def score(self, seqs: list[Sequence], *, num_micro_batches: int, temperature: float,
              top_p: float) -> list[list[float]]:
        """The trainer's logprob of every response token of `seqs` under the sampling they came from (as the
        loss sees them), without training. A collective, like train_step: every rank runs `num_micro_batches`."""
        out: dict[int, list[float]] = {}
        index = {id(s): i for i, s in enumerate(seqs)}
        for chunk in self._micro_batches(seqs, num_micro_batches):
            batch = self._collate(chunk or [dummy_sequence(self.pad_id)])
            logprobs = self._logprobs(batch, temperature=temperature, top_p=top_p)[0].cpu()
            for s, (row, first, num) in zip(chunk, batch.spans):
                out[index[id(s)]] = logprobs[row, first:first + num].tolist()
        return [out[i] for i in range(len(seqs))]

    @torch.no_grad()
    def score_routing(self, seqs: list[Sequence], *, num_micro_batches: int, temperature: float,
                      top_p: float) -> list[tuple[list[float], object, object]]:
        """score()'s logprobs, each with the experts of every position of the sequence, uint16 [length, layers,
        top_k]: those the trainer's routers chose, and those the forward used (the replayed ones, where the
        sequence carries a routing). For bench mismatch and the tests."""
        assert self.replay is not None, "score_routing needs algo.router_replay (the routers that record)"
        out, index = {}, {id(s): i for i, s in enumerate(seqs)}
        self.replay.record(True)
        try:
            for chunk in self._micro_batches(seqs, num_micro_batches):
                batch = self._collate(chunk or [dummy_sequence(self.pad_id)])
                logprobs = self._logprobs(batch, temperature=temperature, top_p=top_p)[0].cpu()
                own, used = (t.cpu().numpy().astype("uint16") for t in self.replay.recorded(*batch.input_ids.shape))
                for s, (row, first, num) in zip(chunk, batch.spans):
                    start, end = first - len(s.prompt_ids) + 1, first + 1 + num
                    out[index[id(s)]] = (logprobs[row, first:first + num].tolist(), own[row, start:end],
                                         used[row, start:end])
        finally:
            self.replay.record(False)
        return [out[i] for i in range(len(seqs))]

    @torch.no_grad()
    def values(self, seqs: list[Sequence], *, num_micro_batches: int) -> list[list[float]]:
        """The critic's value of every response token of `seqs` (algo.advantage=gae: trainer/critic.py), in order,
        without training. A collective, like score: every rank runs `num_micro_batches`."""
        assert self.critic is not None and not self._offloaded, "values need the critic, onloaded"
        self.critic.model.eval()
        out, index = {}, {id(s): i for i, s in enumerate(seqs)}
        for chunk in self._micro_batches(seqs, num_micro_batches):
            batch = self._collate(chunk or [dummy_sequence(self.pad_id)])
            values = self.critic.values(batch).cpu()
            for s, (row, first, num) in zip(chunk, batch.spans):
                out[index[id(s)]] = values[row, first:first + num].tolist()
        return [out[i] for i in range(len(seqs))]

    def _logprobs(self, batch: MicroBatch, **kwargs):
        """sequence_logprobs of the policy, its routers replaying the batch's routing (algo.router_replay)."""
        # an offloaded model's storages are released: a forward would crash the actor, not raise
        assert not self._offloaded, "a forward of the offloaded trainer: onload it first"
        if self.replay is not None:
            self.replay.set(batch.routing)  # kept through the backward: a checkpointed layer recomputes
        return sequence_logprobs(self.model, batch, **kwargs)

    def _micro_batches(self, seqs: list[Sequence], num_micro_batches: int) -> list[list[Sequence]]:
        """This rank's micro-batches (trainer/batching.py), then empty ones up to the count every rank runs."""
        groups = trainer_micro_batches(seqs, self.cfg)
        assert len(groups) <= num_micro_batches, (len(groups), num_micro_batches)
        return groups + [[] for _ in range(num_micro_batches - len(groups))]

    def _collate(self, seqs: list[Sequence]) -> MicroBatch:
        return collate(seqs, pad_id=self.pad_id, device=self.device, packed=self.cfg.pack_sequences)



def dummy_sequence(pad_id: int) -> Sequence:
    """A one-token sequence: the micro-batch of a rank with none left runs on it, zero-weighted."""
    return Sequence(prompt_ids=[pad_id], response_ids=[pad_id], logprobs=[0.0], advantage=0.0)
