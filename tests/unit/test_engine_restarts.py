"""fault.engine_restarts (job/engine_restarts.py): where an engine can come back, refused in one line elsewhere; the
phase run again after a replaced engine, bounded, with every other fault raised as it was. The runtime and the
watchdog are stand-ins here, at the actor boundary the unit isolates; the real recovery (a TP worker SIGKILLed
and another SIGSTOPped in a split job's rollouts) is tests/e2e/test_split.py's, the store's reload on gloo
tests/distributed/test_broadcast.py's."""

from __future__ import annotations

import contextlib

import pytest

from colocate.bench.restart import fault_costs
from colocate.config.loading import load_config
from colocate.errors import ConfigError, EngineFault, JobFault
from colocate.job.engine_restarts import EngineRestarts, check_engine_restarts
from colocate.job.members import Member, member_fault
from colocate.telemetry.trace import Trace

SPLIT = ["placement.num_slots=2", "placement.engine_slots=1", "engine.tp=1"]


@pytest.mark.parametrize("overrides, says", [
    ([], "co-located (placement.engine_slots=0) an engine's devices are the trainers' between phases"),
    ([*SPLIT, "algo.mode=one_step_off"], "needs algo.mode=sync: with algo.mode=one_step_off the engines generate"),
    ([*SPLIT, "sync.carrier=directory", "sync.carrier_dir=/tmp/x"], "sync.carrier=directory has none"),
    ([*SPLIT, "sync.delta=false"], "which this job does not keep (sync.delta=false)"),
    ([*SPLIT, "trainer.lora.rank=8"], "(a LoRA job (trainer.lora.rank=8) syncs its adapters alone)"),
])
def test_restarts_where_an_engine_cannot_come_back_are_one_line(overrides, says):
    with pytest.raises(ConfigError) as e:
        check_engine_restarts(load_config(None, [*overrides, "fault.engine_restarts=2"]))
    line = str(e.value)
    assert line.startswith("fault.engine_restarts=2 is invalid: ") and says in line and "\n" not in line
    assert e.value.fix == {"fault.engine_restarts": 0}


def test_a_split_in_sync_mode_with_the_store_may_restart_and_none_asked_is_never_refused():
    check_engine_restarts(load_config(None, [*SPLIT, "fault.engine_restarts=2"]))
    check_engine_restarts(load_config(None, ["algo.mode=one_step_off"]))  # 0: nothing asked, nothing checked


def test_the_refusal_comes_before_any_actor(tmp_path):
    from colocate.job.setup import check_job

    with pytest.raises(ConfigError, match="fault.engine_restarts=1 is invalid"):
        check_job(load_config(None, ["fault.engine_restarts=1", f"logging.output_dir={tmp_path}"]))


def test_an_engine_process_fault_is_an_engine_fault_and_others_are_not():
    worker = Member("engine 1 TP worker 0", 42, (3,), "n", engine=1)
    fault = member_fault(worker, "engine 1 TP worker 0 (...) died during rollout of step 2: killed by SIGKILL")
    assert isinstance(fault, EngineFault) and fault.engine == 1 and fault.member == "engine 1 TP worker 0"
    trainer = member_fault(Member("trainer rank 0", 7, (0,), "n", "a1"), "trainer rank 0 (...) died")
    assert isinstance(trainer, JobFault) and not isinstance(trainer, EngineFault)


# ----------------------------------------------------------------------------------- the phase, run again


class Watchdog:
    """The controller's watchdog, as EngineRestarts uses it."""

    local_node = "here"

    def __init__(self):
        self.fault, self.forgotten, self.watched_again = None, [], 0

    @contextlib.contextmanager
    def phase(self, name, step):
        yield

    @contextlib.contextmanager
    def deferring(self):
        self.deferred = True
        yield

    def waiting(self):
        return contextlib.nullcontext()

    def forget_engine(self, engine):
        self.forgotten.append(engine)
        self.fault = None
        return [Member(f"engine {engine} TP worker 0", 101, (1,), "here", engine=engine),
                Member(f"engine {engine} TP worker 1", 102, (2,), "elsewhere", engine=engine)]

    def watch_again(self):
        self.watched_again += 1


class Sync:
    def __init__(self, mismatched=()):
        self.mismatched, self.rejoined = list(mismatched), []

    def rejoin(self, replaced):
        self.rejoined.append(replaced)
        return {"reload_s": 0.5, "reload_bytes": 1000, "store_version": 3}

    def verify_full(self, dtype, engines=None):
        return self.mismatched


class Runtime:
    def __init__(self, sync, fails: Exception | None = None):
        self.sync, self.fails, self.replaced = sync, fails, []

    def replace_engine(self, e, pids):
        if self.fails:
            raise self.fails
        self.replaced.append((e, pids))
        return {"start_s": 2.0}

    def record_job(self):
        self.recorded = True


def _restarts(n: int, runtime: Runtime, metrics=None) -> tuple[EngineRestarts, Watchdog]:
    trace = Trace()
    trace.watchdog = watchdog = Watchdog()
    restarts = EngineRestarts(load_config(None, [*SPLIT, f"fault.engine_restarts={n}"]), runtime, trace,
                              metrics=metrics, in_flight=lambda engine: 16)
    return restarts, watchdog


def _failing(*faults):
    """A phase's work that raises each of `faults` in turn, then returns "done"."""
    left = list(faults)

    def work():
        if left:
            raise left.pop(0)
        return "done"
    return work


def _fault(engine: int = 0, step: int = 2) -> EngineFault:
    return EngineFault(f"engine {engine} TP worker 1 (...) died during rollout of step {step}: killed by SIGKILL",
                       engine=engine, member=f"engine {engine} TP worker 1")


class Metrics:
    def __init__(self):
        self.written = []

    def write(self, record):
        self.written.append(record)


def test_a_replaced_engine_runs_the_phase_again_and_names_the_event(capsys):
    runtime, metrics = Runtime(Sync()), Metrics()
    restarts, watchdog = _restarts(2, runtime, metrics)
    assert restarts.run("rollout", 2, _failing(_fault(engine=1))) == "done"
    assert watchdog.forgotten == [1] and watchdog.watched_again == 1
    assert runtime.replaced == [(1, [101])]  # this node's processes: another node's go with their actor
    assert runtime.sync.rejoined == [[1]]
    [event] = restarts.take_events()
    assert event["member"] == "engine 1 TP worker 1" and event["step"] == 2 and event["phase"] == "rollout"
    assert event["verified"] == "full" and event["store_version"] == 3 and event["answers_regenerated"] == 16
    assert event["restarts_left"] == 1 and event["recovery_s"] >= 0 and metrics.written == [event]
    assert restarts.take_events() == []  # taken once, by the step's record
    err = capsys.readouterr().err
    assert "died during rollout of step 2" in err and "engine 1 replaced on its slots" in err
    assert watchdog.deferred and runtime.recorded  # the rollout's faults were kept outside its waits


def test_a_fault_kept_until_the_rollout_ended_replaces_the_engine_without_running_it_again():
    runtime = Runtime(Sync())
    restarts, watchdog = _restarts(2, runtime)
    runs = []

    def work():  # the rollout took its groups; the engine's fault was found meanwhile, kept (Watchdog.deferring)
        runs.append(1)
        watchdog.fault = _fault(engine=0)
        return "groups"
    assert restarts.run("rollout", 2, work) == "groups" and runs == [1]
    [event] = restarts.take_events()
    assert event["answers_regenerated"] == 0 and runtime.replaced == [(0, [101])]
    trainer = JobFault("trainer rank 0 (...) died during rollout of step 2: killed by SIGKILL")

    def trainer_lost():
        watchdog.fault = trainer
        return "groups"
    with pytest.raises(JobFault) as e:
        restarts.run("rollout", 3, trainer_lost)
    assert e.value is trainer


def test_an_engine_fault_pickles_with_its_engine():
    import pickle

    fault = pickle.loads(pickle.dumps(_fault(engine=3)))
    assert isinstance(fault, EngineFault) and fault.engine == 3 and fault.member == "engine 3 TP worker 1"


def test_restarts_are_bounded_then_the_fault_ends_the_job():
    restarts, _ = _restarts(1, Runtime(Sync()))
    with pytest.raises(JobFault, match=r"killed by SIGKILL \(fault.engine_restarts=1 spent\)"):
        restarts.run("rollout", 2, _failing(_fault(), _fault()))


def test_faults_it_does_not_recover_are_raised_as_they_were():
    restarts, _ = _restarts(2, Runtime(Sync()))
    in_sync = _fault()  # a sync's fault leaves the stores at different versions: the whole-job path
    with pytest.raises(EngineFault) as e:
        restarts.run("sync", 2, _failing(in_sync))
    assert e.value is in_sync
    trainer = JobFault("trainer rank 0 (...) died during rollout of step 2: killed by SIGKILL")
    with pytest.raises(JobFault) as e:
        restarts.run("rollout", 2, _failing(trainer))
    assert e.value is trainer and restarts.left == 2
    off, _ = _restarts(0, Runtime(Sync()))  # none asked: exactly as before
    fault = _fault()
    with pytest.raises(EngineFault) as e:
        off.run("rollout", 2, _failing(fault))
    assert e.value is fault


def test_an_engine_that_cannot_come_back_or_reloads_wrong_ends_the_job_in_one_line():
    restarts, _ = _restarts(2, Runtime(Sync(), fails=RuntimeError("Traceback ...\nEngineStartError: out of memory")))
    with pytest.raises(JobFault, match=r"killed by SIGKILL; engine 0 could not be replaced: EngineStartError: out "
                                       r"of memory$"):
        restarts.run("rollout", 2, _failing(_fault()))
    restarts, _ = _restarts(2, Runtime(Sync(mismatched=["engine0/tp0/qkv_proj.weight"])))
    with pytest.raises(JobFault, match=r"1 of its tensors differ .* e.g. engine0/tp0/qkv_proj.weight"):
        restarts.run("rollout", 2, _failing(_fault()))


# ----------------------------------------------------------------------------------- bench restart's figures


def test_the_bench_reads_a_faulted_steps_cost_against_the_steps_without_one():
    def step(n, t):
        return {"step": n, "time": t}

    ours = [{"event": "startup", "time": 0.0}, step(0, 5.0), step(1, 6.0),
            {"event": "engine_restart", "time": 14.0, "step": 2, "member": "engine 0", "recovery_s": 7.5,
             "reload_s": 0.1, "verify_s": 0.2, "store_version": 1, "answers_regenerated": 16},
            step(2, 15.0), step(3, 16.0), step(4, 17.2)]
    costs = fault_costs(ours, [2])
    assert costs["faulted_step_s"] == 9.0 and costs["floor_step_s"] == 1.0 and costs["recovery_s"] == 7.5
    assert costs["whole_job_restarts"] == 0 and costs["engine_restarts"][0]["member"] == "engine 0"
    whole = [{"event": "startup", "time": 0.0}, step(0, 5.0), step(1, 6.0), {"event": "restart", "time": 9.0},
             {"event": "startup", "time": 15.0}, {"event": "resume", "time": 20.0}, step(2, 21.0), step(3, 22.0)]
    costs = fault_costs(whole, [2])
    assert costs["faulted_step_s"] == 15.0 and costs["recovery_s"] == 11.0 and costs["whole_job_restarts"] == 1
    with pytest.raises(AssertionError, match="every step ran once"):
        fault_costs([*whole, step(2, 30.0)], [2])


# ---------------------------------------------------------------------- the pass cut short, and run again


class _Dead(Exception):
    """Ray's error for a call to an engine whose actor is gone."""


def test_a_rollout_run_again_keeps_the_other_engines_answers_and_generates_only_the_failed_engines(monkeypatch):
    """The real Passes and rollout pool over two engines faked at their actor boundary (ray.get, run_pass): engine
    1 dies in the pass. Run again after engine 1 was replaced, the rollout applies engine 0's answers of the pass
    that was cut short (engine 0 is not asked again) and asks only engine 1's groups of the new engine; the step
    takes every group once, complete."""
    import ray

    from colocate.rl.tasks import PromptStream, make_task
    from colocate.rollout.passes import Passes
    from tests.unit.test_one_step_off_resume import FakeGeneratingEngine, _Tokenizer
    from tests.unit.test_switching_order import Ref  # noqa: F401 -- what .remote() returns, unwrapped below

    asked = []  # (engine, the groups of its requests) per run_pass

    class Engine(FakeGeneratingEngine):
        def do_run_pass(self, requests, *args, **kwargs):
            asked.append((self.name, sorted({r.group for r in requests})))
            if self.name == "engine 1":
                return _Dead("engine 1's actor died")
            return super().do_run_pass(requests, *args, **kwargs)

    def get(refs, **kwargs):
        values = [r.value for r in refs] if isinstance(refs, list) else [refs.value]
        failed = next((v for v in values if isinstance(v, Exception)), None)
        if failed is not None:
            raise failed
        return values if isinstance(refs, list) else values[0]

    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray, "wait", lambda refs, num_returns: (refs, []))
    cfg = load_config(None, ["rollout.num_prompts=4", "rollout.num_samples=2"])
    engines = [Engine("engine 0", [], {}), Engine("engine 1", [], {})]
    passes = Passes(cfg, engines, _Tokenizer(), PromptStream(make_task(cfg.rollout.task,
                                                                       length=cfg.rollout.task_length), seed=0))
    with pytest.raises(_Dead):
        passes.collect(version=0)
    assert passes.pool.num_complete() == 0  # nothing of the pass applied while it failed
    assert asked == [("engine 0", [0, 2]), ("engine 1", [1, 3])]
    assert passes.regenerated(1) == 4  # engine 1's 2 groups x 2 answers: engine 0's are kept
    engines[1] = Engine("engine 1 (new)", [], {})  # Runtime.replace_engine, in place
    groups, stats = passes.collect(version=0)
    assert asked[2:] == [("engine 1 (new)", [1, 3])]  # engine 0 is not asked again
    assert sorted(stats["group_ids"]) == [0, 1, 2, 3] and stats["num_groups_drawn"] == 4
    assert all(a.done for g in groups for a in g.completions)
