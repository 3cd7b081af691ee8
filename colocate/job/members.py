"""The job's processes as the watchdog knows and names them (job/faults.py): trainer ranks, engine actors and their
vLLM TP workers, the reward model's, each with its slots and node; and the fault that names one of them."""

from __future__ import annotations

from dataclasses import dataclass

import ray

from colocate.errors import EngineFault, JobFault


@dataclass(frozen=True)
class Member:
    name: str  # "trainer rank 1", "engine 0", "engine 0 TP worker 1", "reward model"
    pid: int
    slots: tuple[int, ...]
    node: str  # Ray node id
    actor_id: str | None = None  # the Ray actor (None for vLLM's worker processes)
    engine: int | None = None  # the engine a worker belongs to

    def describe(self, local_node: str) -> str:
        slots = f"slot {self.slots[0]}" if len(self.slots) == 1 else f"slots {self.slots[0]}-{self.slots[-1]}"
        node = "this node" if self.node == local_node else f"node {self.node[:8]}"
        return f"{self.name} ({slots}, {node}, pid {self.pid})"


def member_fault(member: Member, text: str) -> JobFault:
    """The fault naming `member`: an EngineFault for a policy engine's process (its actor or a TP worker), which
    fault.engine_restarts may recover, a JobFault for any other."""
    if member.engine is not None:
        return EngineFault(text, engine=member.engine, member=member.name)
    return JobFault(text)


def job_members(runtime) -> list[Member]:
    """Every process of the job that does its work: trainer ranks, engine actors and their vLLM workers."""
    report = runtime.placement_report
    trainer_pids = ray.get([t.pid.remote() for t in runtime.trainers])
    engine_pids = ray.get([e.pid.remote() for e in runtime.engines])
    worker_pids = ray.get([e.worker_pids.remote() for e in runtime.engines])
    members = [Member(f"trainer rank {r}", pid, (r,), report["trainer_nodes"][r], t._actor_id.hex())
               for r, (t, pid) in enumerate(zip(runtime.trainers, trainer_pids))]
    for e, (engine, pid, workers) in enumerate(zip(runtime.engines, engine_pids, worker_pids)):
        slots = tuple(runtime.plan.engine_slots(e))  # after the trainers' slots on a split placement
        node = report["engine_nodes"][e]
        members.append(Member(f"engine {e}", pid, slots, node, engine._actor_id.hex(), engine=e))
        members += [Member(f"engine {e} TP worker {rank}", wpid, (slots[rank],), node, engine=e)
                    for rank, wpid in workers]
    if runtime.reward_model is not None:  # on the first slots of the policy's engines (placement)
        actor = runtime.reward_model.actor
        pid, workers, node = ray.get([actor.pid.remote(), actor.worker_pids.remote(), actor.node_id.remote()])
        slots = tuple(runtime.plan.reward_model_slots())
        members.append(Member("reward model", pid, slots, node, actor._actor_id.hex()))
        members += [Member(f"reward model TP worker {rank}", wpid, (slots[rank],), node) for rank, wpid in workers]
    return members
