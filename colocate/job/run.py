"""Run one RL job: set it up once (job/setup.py), build the runtime, run the controller's steps, always clean up;
after a fault, start again from the newest checkpoint with the same set-up.

    from colocate.config import load_config
    from colocate.job.run import run_job
    run_job(load_config("configs/default.yaml", ["algo.num_steps=5"]))    # returns the process exit code
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from pathlib import Path

from colocate.checkpoint.layout import checkpoint_root, complete_checkpoints, resume_point
from colocate.config import JobConfig, to_dict
from colocate.errors import EXIT_FAILED, EnvError, JobFault, RewardError, UserError
from colocate.host.signals import Terminated, catch_stop_signals, stop_outcome, stop_received
from colocate.job.checks import read_inputs
from colocate.job.controller import Controller
from colocate.job.injections import parse_injections
from colocate.job.placement import plan_line
from colocate.job.runtime import Runtime
from colocate.job.setup import CheckedJob, JobSetup, check_job, set_up_job
from colocate.rl.data import make_prompt_source
from colocate.telemetry.metrics import MetricsWriter

log = logging.getLogger("colocate")


def run_job(cfg: JobConfig, checked: CheckedJob | None = None) -> int:
    """Run the job to its end; returns the process exit code. `checked`: check_job's result when the caller
    already ran it (`colocate launch`); else it runs here, raising ConfigError before anything is written."""
    from omegaconf import OmegaConf

    if checked is None:
        checked = check_job(cfg)
    cfg = checked.config  # placement.engine_slots=auto decided: the runtime, controller and checkpoints read an int
    logging.basicConfig(level=cfg.logging.level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    out = Path(cfg.logging.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(OmegaConf.to_yaml(to_dict(cfg)))
    # before any actor: a sink's missing package (logging.wandb=true without wandb) is a ConfigError, exit 2
    metrics = MetricsWriter(cfg.logging, num_steps=cfg.algo.num_steps, run_config=to_dict(cfg))
    started: list[Controller] = []  # each start's controller; the last one's history is the finished steps
    restore_signals = catch_stop_signals()
    try:
        setup = set_up_job(cfg, checked)  # the model on this machine, its tokenizer: once for every start
        # a bad row, a checkpoint of another model: exit 2, one line, no actor started
        inputs = read_inputs(cfg, setup.model_path, setup.tokenizer)
        prompts, resume_from = inputs.prompts, inputs.resume_from
        attempt_cfg, attempt_setup = cfg, setup
        fired: set[str] = set()  # fault.inject's injections that fired: a restart does not repeat them
        for restart in range(cfg.fault.max_restarts + 1):
            try:
                _attempt(attempt_cfg, attempt_setup, metrics, prompts, resume_from, started)
                break
            except JobFault as fault:
                if started and started[-1].watchdog is not None:
                    fired |= {i.spec for i in started[-1].watchdog.fired}
                if restart == cfg.fault.max_restarts:
                    raise
                # the same job again, from its newest checkpoint (or from the start when it has none)
                attempt_cfg, attempt_setup = _restarted(cfg, fired), _restarted_setup(setup, fired)
                resume_from = resume_point(attempt_cfg, setup.model_path)
                metrics.write({"event": "restart", "fault": str(fault), "restart": restart + 1,
                               "from": str(resume_from) if resume_from else None})
                print(f"colocate: {fault}\ncolocate: restart {restart + 1}/{cfg.fault.max_restarts} from "
                      f"{resume_from or 'the first step (no checkpoint yet)'}", file=sys.stderr, flush=True)
                if prompts is not None:  # a fresh place: the checkpoint's load sets it
                    prompts = make_prompt_source(cfg, setup.tokenizer, setup.task)
        _summary(started[-1] if started else None, metrics.path)
        return 0
    except UserError as e:  # a bad row, a checkpoint of another model, the cluster's resources: before any actor
        print(f"colocate: error: {e}", file=sys.stderr)
        return e.exit_code
    except (KeyboardInterrupt, Terminated) as e:
        return _stopped(e, _num_steps(started[-1] if started else None), metrics.path)
    except Exception as e:
        # a stop signal was received (or is in the chain) while this error came about: the user stopped the job
        signal_exc = stop_received() or (None if isinstance(e, JobFault) else _signal_in_chain(e))
        if signal_exc is not None:
            return _stopped(signal_exc, _num_steps(started[-1] if started else None), metrics.path)
        num_done = _num_steps(started[-1] if started else None)
        metrics.write({"event": "error", "step": num_done, "error": one_line(e)})
        print(f"colocate: error: {one_line(e)}\ncolocate: {num_done} finished step(s) kept in {metrics.path}"
              # user code that failed mid-run (a reward, an environment) is fixed and the job resumed, as after a fault
              + (_resume_hint(cfg) if isinstance(e, JobFault | RewardError | EnvError) else ""), file=sys.stderr)
        log.debug("job failed", exc_info=True)
        return EXIT_FAILED
    finally:
        metrics.close()
        restore_signals()


def _attempt(cfg: JobConfig, setup: JobSetup, metrics: MetricsWriter, prompts, resume_from,
             started: list) -> list[dict]:
    """One start of the job: the runtime up, the controller's steps, the runtime down (whatever happens)."""
    with Runtime(cfg, setup) as runtime:
        metrics.write({"event": "startup", "trainers": runtime.trainer_info, "engines": runtime.engine_info,
                       "sync_mode": runtime.sync.plan.mode, "sync_method": runtime.sync.method,
                       "sync_bytes": runtime.sync.plan.num_bytes, "placement": runtime.placement_report,
                       **({"sync_hosts": runtime.sync.hosts} if runtime.sync.hosts else {}),
                       "switch": {"engine_sleep_level": runtime.switch.engine_sleep_level,
                                  "trainer_offload": runtime.switch.trainer_offload,
                                  "reason": runtime.switch.reason},
                       **({"reward_model": runtime.reward_model_info} if runtime.reward_model_info else {})})
        if cfg.logging.progress:
            print(f"switch plan: {plan_line(cfg, runtime.switch.reason, device=runtime.device)}", file=sys.stderr,
                  flush=True)
        started.append(Controller(cfg, runtime, metrics, prompts=prompts, resume_from=resume_from))
        return started[-1].run()


def _restarted(cfg: JobConfig, fired: set[str]) -> JobConfig:
    """The job as a restart runs it: from its newest checkpoint, and an injected fault that fired is not injected
    again (`fired`: their specs)."""
    left = ",".join(i.spec for i in parse_injections(cfg.fault.inject) if i.spec not in fired)
    return dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, resume="auto"),
                               fault=dataclasses.replace(cfg.fault, inject=left))


def _restarted_setup(setup: JobSetup, fired: set[str]) -> JobSetup:
    """The same set-up, its decided config restarted as the user's is (_restarted: sections no decision reads)."""
    setup = dataclasses.replace(setup, config=_restarted(setup.config, fired))
    if setup.resolved is None:  # a Ray cluster's: the runtime decides once connected, from the restarted config
        return setup
    resolved = dataclasses.replace(setup.resolved, config=_restarted(setup.resolved.config, fired))
    return dataclasses.replace(setup, resolved=resolved)


def _resume_hint(cfg: JobConfig) -> str:
    found = complete_checkpoints(checkpoint_root(cfg))
    if not found:
        return "\ncolocate: no checkpoint was saved yet (checkpoint.every_steps=0 saves only at the end)"
    return f"\ncolocate: continue from its newest checkpoint ({found[-1][1]}) with resume=auto"


def _stopped(e: BaseException, num_steps: int, path: Path) -> int:
    what, code = stop_outcome(e)
    print(f"colocate: {what}; {num_steps} finished step(s) kept in {path}", file=sys.stderr)
    return code


def _signal_in_chain(e: BaseException) -> BaseException | None:
    """A signal's exception raised while C code ran comes back wrapped: CPython reports "SystemError: ...
    returned a result with an exception set" with the signal's exception as its cause (seen with SIGTERM
    during a Ray call). Follows causes, and contexts not suppressed (`raise ... from None`: a JobFault the watchdog
    delivered by an interrupt is not a Ctrl-C); chains can loop."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, (KeyboardInterrupt, Terminated)):
            return e
        e = e.__cause__ if e.__cause__ is not None else (None if e.__suppress_context__ else e.__context__)
    return None


def one_line(e: BaseException) -> str:
    """The user-facing line of an error, unwrapping Ray's task errors to the exception the actor raised."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException):
        e = cause
    lines = [line for line in str(e).strip().splitlines() if line.strip()]
    if isinstance(e, JobFault):  # already a sentence naming who failed where
        return lines[0]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"


def _num_steps(controller: Controller | None) -> int:
    return controller.num_done if controller else 0


def _summary(controller: Controller | None, path: Path) -> None:
    if controller is None or not controller.num_done:
        return
    history = list(controller.history)
    first, last = controller.first_record, history[-1]
    window = history[-min(5, len(history)):]
    mean_last = sum(r["reward_mean"] for r in window) / len(window)
    print(f"colocate: done, {controller.num_done} steps | reward {first['reward_mean']:.3f} -> "
          f"{last['reward_mean']:.3f} (last {len(window)} mean {mean_last:.3f}) | metrics: {path}", file=sys.stderr)
