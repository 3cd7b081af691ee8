"""Several optimizer steps a step on the real ranks (job/updates.py): algo.num_mini_batches x algo.num_epochs
updates, each in the step's record, the learning rate counting them, and the proximal policy recomputed before
the first update: the trainer's log-probs bit for bit as a separate forward pass gives them. And the rollout dump
(logging.rollouts, job/rollout_dump.py) read back: the answers and both sides' log-probs the step trained on."""

from __future__ import annotations

import pytest

from colocate.job.controller import Controller
from colocate.job.rollout_dump import read_rollouts
from colocate.job.runtime import Runtime
from tests.e2e.conftest import small_job

pytestmark = pytest.mark.e2e


def test_mini_batches_and_epochs_with_the_recomputed_proximal_policy(tmp_path):
    cfg = small_job(tmp_path, "placement.num_slots=1", "engine.tp=1", "algo.num_mini_batches=2",
                    "algo.num_epochs=2", "algo.old_logprobs=recompute", "trainer.lr_schedule=linear",
                    "algo.num_steps=2", "logging.rollouts=2")
    with Runtime(cfg) as rt:
        controller = Controller(cfg, rt)
        given = []  # what each optimizer step was given
        train_step = rt.trainers.train_step

        def recording(sequences, trainer_cfg, *, step, update):
            given.append(sequences)
            return train_step(sequences, trainer_cfg, step=step, update=update)

        rt.trainers.train_step = recording
        lrs = []
        for step in range(2):
            groups, _ = controller.rollout.take(step)
            scored = controller.advantages(controller.score(groups))
            controller.switch_to_train()
            separate = rt.trainers.score(scored.sequences, cfg.trainer, temperature=cfg.rollout.temperature,
                                         top_p=cfg.rollout.top_p)  # a forward pass of its own, before the update
            given.clear()
            record = controller.train(scored, step)
            assert len(given) == 4 and all(len(seqs) == 8 for seqs in given)  # 16 sequences: 2 x 8, twice
            recomputed = {id(s.response_ids): s.old_logprobs for seqs in given for s in seqs}
            assert [recomputed[id(s.response_ids)] for s in scored.sequences] == separate  # bit for bit
            updates = record["updates"]
            assert len(updates) == 4 and all(u["tokens"] > 0 for u in updates)
            assert updates[0]["kl_old"] < 1e-6 < updates[-1]["kl_old"]  # the policy moves away from the proximal
            lrs += [u["lr"] for u in updates]
            dumped = [line for line in read_rollouts(tmp_path / "out" / "rollouts.jsonl") if line["step"] == step]
            assert len(dumped) == 2 * cfg.rollout.num_samples  # the first two groups, every answer
            for line in dumped:
                i = scored.origins.index((line["group"], line["answer"]))
                s = scored.sequences[i]
                assert line["response_ids"] == s.response_ids and line["prompt_ids"] == s.prompt_ids
                assert line["engine_logprobs"] == s.logprobs and line["advantage"] == s.advantage
                # the policy before the update (a forward of the dumped answers alone: other micro-batches)
                assert line["trainer_logprobs"] == pytest.approx(separate[i], abs=1e-6)
                assert line["reward"] == scored.groups[line["group"]].rewards[line["answer"]]
            controller.switch_to_sync()
            controller.sync()
            controller.switch_to_rollout()
        # the linear schedule over 2 steps x 4 updates: 8 optimizer steps, decaying at each
        assert lrs == sorted(lrs, reverse=True) and len(set(lrs)) == 8
