"""The `colocate` command line.

    colocate launch [CONFIG] [key=value ...]     run an RL job (no arguments: the embedded CPU default)
    colocate validate [CONFIG] [key=value ...]   print the resolved config and its placement; starts nothing
    colocate submit [CONFIG] [key=value ...]     run the job on a Ray cluster through the Job Submission API
    colocate jobs | logs JOB [-f] | stop JOB     list, read or follow, and stop the jobs on a Ray cluster
    colocate bench {sync,switch,mismatch,consistency,routing,delta,rollout,async,soak,train,train-memory,restart}
    colocate plot RUN_DIR                        draw a run's metrics as a PNG
    colocate export CKPT OUT [--dtype D] [--merged]  a checkpoint as a Hugging Face model (LoRA: its PEFT adapter)
    colocate clean [RUN_DIR ...] [--dry-run]     remove what a killed job left (its segments, processes, actors)
    colocate simulate [CONFIG] [key=value ...] --gpus 8 --gpu h100   each mode's step predicted on a GPU node
    colocate config-docs                         print the table of every config key (docs/config.md)

User mistakes (bad keys, values, paths, resources) print one line `colocate: error: ...` and exit with code 2
before any actor starts; runtime failures print one line and exit 1; Ctrl-C exits 130 after cleaning up.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from colocate.config import JobConfig, config_docs_markdown, load_config, to_dict
from colocate.errors import EXIT_INTERRUPTED, ColocateError, ConfigError
from colocate.host.signals import Terminated, catch_stop_signals, stop_outcome, take_ctrl_c

if TYPE_CHECKING:  # imported where used: `colocate --help` loads neither
    from colocate.job.checks import GpuNode
    from colocate.job.split import SplitPredictor


def _split(items: list[str]) -> tuple[list[str], list[str]]:
    """`[CONFIG ...] [key=value ...]`: config files are the arguments without '=', merged in order (a job config,
    then presets such as configs/algos/dapo.yaml); the rest are overrides."""
    return [i for i in items if "=" not in i], [i for i in items if "=" in i]


def job_config(args) -> JobConfig:
    paths, overrides = _split(args.items)
    if getattr(args, "address", None):
        overrides.append(f"placement.ray_address={args.address}")
    elif os.environ.get("RAY_ADDRESS") and not any(o.startswith("placement.ray_address=") for o in overrides):
        overrides.append(f"placement.ray_address={os.environ['RAY_ADDRESS']}")
    return load_config(paths, overrides)


def cmd_validate(args) -> int:
    from omegaconf import OmegaConf

    from colocate.job.preflight import GIB

    if (args.gpus is None) != (args.gpu_memory_gib is None):
        raise ConfigError("--gpus and --gpu-memory-gib go together: they describe a GPU node that need not be "
                          "this machine")
    if args.gpus is not None and (args.gpus < 1 or args.gpu_memory_gib <= 0):
        raise ConfigError(f"--gpus {args.gpus} --gpu-memory-gib {args.gpu_memory_gib} is invalid: expected at "
                          "least one GPU and a positive size")
    from colocate.job.checks import GpuNode
    from colocate.job.placement import plan_line
    from colocate.job.setup import check_job

    cfg = job_config(args)
    node = None if args.gpus is None else GpuNode(args.gpus, args.gpu_memory_gib)
    # what launch checks and decides, in the same functions
    checked = check_job(cfg, node=node, predictor=_split_predictor(cfg, node=node, gpu_name=args.gpu))
    plan, prediction, resolved = checked.slots, checked.prediction, checked.resolved
    print(OmegaConf.to_yaml(to_dict(cfg)).rstrip())
    cfg = checked.config  # placement.engine_slots=auto decided; the user's config is printed as given
    print("# placement")
    if plan is None:
        print(f"# {cfg.placement.num_slots} slot(s) on the Ray cluster at {cfg.placement.ray_address}, "
              f"{cfg.num_engines} engine(s) x TP={cfg.engine.tp} (devices are checked, and every other auto "
              "decided, when the job connects)")
        for decision in checked.placed:
            print(f"# {decision.key}: {decision.value} ({decision.why})")
        return 0
    num_experts = checked.dims.num_experts if checked.dims and cfg.engine.expert_parallel else 0
    for line in plan.describe(num_experts=num_experts):
        print(f"# {line}")
    print("# decided (every auto of the config, as the job runs it)")
    for line in resolved.describe() or ["nothing: no key is auto"]:
        print(f"#   {line}")
    switch = prediction.plan
    print(f"# switch plan: engine sleep level {switch.engine_sleep_level}, trainer offload "
          f"{str(switch.trainer_offload).lower()}")
    print(f"#   {plan_line(cfg, switch.reason, device=resolved.device)}")
    if not prediction.phases:
        print("# predicted memory: none (the model's config.json is not on this machine)")
        return 0
    where = "per GPU" if prediction.device == "cuda" else "whole job, host memory"
    print(f"# predicted memory per phase, {where} (the preflight's estimate; budget "
          f"{prediction.budget_bytes / GIB:.1f} of {prediction.available_bytes / GIB:.1f} GiB)")
    peak = max(prediction.phases, key=lambda p: p.total)
    for phase in prediction.phases:
        parts = ", ".join(f"{k} {v / GIB:.2f}" for k, v in phase.parts.items() if v)
        print(f"#   {phase.name:<8} {phase.total / GIB:6.2f} GiB  ({parts}){'  <- peak' if phase is peak else ''}")
    if prediction.host_needs:
        print("# host memory on the node (the larger must fit; docs/gpu.md, node requirements): "
              + ", ".join(f"{k} {v / GIB:.1f} GiB" for k, v in prediction.host_needs.items()))
    if node is not None:  # the step's time beside its memory (colocate/simulate; docs/simulate.md)
        from colocate.simulate.command import predicted_step_line

        print(f"# {predicted_step_line(cfg, gpus=node.num_gpus, gpu_name=args.gpu)}")
    return 0


def cmd_launch(args) -> int:
    from colocate.job.setup import check_job

    cfg = job_config(args)
    # before anything is written or started; the same as validate's
    checked = check_job(cfg, predictor=_split_predictor(cfg))
    from colocate.job.run import run_job

    return run_job(cfg, checked)


def _split_predictor(cfg: JobConfig, *, node: GpuNode | None = None, gpu_name: str = "") -> SplitPredictor | None:
    """For placement.engine_slots=auto: each split's step, colocate simulate's (on `node`, the GPU node validate
    --gpus describes, else this machine's GPU), which job/ cannot import; None where nothing predicts it."""
    from colocate.simulate.split import split_predictor

    if node is None:
        return split_predictor(cfg)
    return split_predictor(cfg, gpu_name=gpu_name, memory_gib=node.gpu_memory_gib)


def cmd_submit(args) -> int:
    from colocate.cluster.submit import submit_job
    from colocate.job.checks import check_sources

    # Not resolve(): the job joins the cluster from inside it (`--address auto`), so neither the job server's URL
    # nor this shell's RAY_ADDRESS belongs in its config.
    paths, overrides = _split(args.items)
    cfg = load_config(paths, overrides)
    # its devices and directories are the cluster's: checked by its own launch there, before any actor
    check_sources(cfg, writes_here=False)
    return _job_command(lambda: submit_job(cfg, args.items, address=args.job_server, token_file=args.token_file,
                                           wait=not args.no_wait))


def cmd_jobs(args) -> int:
    from colocate.cluster.submit import show_jobs

    return _job_command(lambda: show_jobs(address=args.job_server, token_file=args.token_file))


def cmd_logs(args) -> int:
    from colocate.cluster.submit import show_logs

    return _job_command(lambda: show_logs(args.job, follow=args.follow, address=args.job_server,
                                          token_file=args.token_file))


def cmd_stop(args) -> int:
    from colocate.cluster.submit import stop_job

    if args.timeout <= 0:
        raise ConfigError(f"--timeout {args.timeout:g} is invalid: expected seconds > 0")
    return _job_command(lambda: stop_job(args.job, timeout_s=args.timeout, address=args.job_server,
                                         token_file=args.token_file))


def _job_command(run) -> int:
    """Ctrl-C is exit 130 (while following a job, follow_or_detach says first that the job keeps running); the job
    server's failures (JobServerError) and user mistakes are main's."""
    try:
        code = run()
        sys.stdout.flush()
        return code
    except KeyboardInterrupt:
        print("\ncolocate: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # `colocate logs JOB | head`: the reader left, which is no error; stdout goes nowhere so that Python's
        # last flush at exit does not complain either.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _job_server_args(parser: argparse.ArgumentParser, *aliases: str) -> None:
    """--address and --token-file, the same for every command that talks to a cluster's job server."""
    parser.add_argument("--address", *aliases, dest="job_server", metavar="URL",
                        help="the cluster's job server, http(s)://HOST:PORT (default: $RAY_API_SERVER_ADDRESS, else "
                        "$RAY_ADDRESS if it is an http(s) URL, else http://127.0.0.1:8265)")
    parser.add_argument("--token-file", metavar="PATH",
                        help="file holding the cluster's token (Ray's RAY_AUTH_MODE=token), for this command only "
                        "(default: RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH when RAY_AUTH_MODE=token)")


def cmd_bench(args) -> int:
    from colocate.bench.common import BENCH_DEFAULTS, CONSISTENCY_DEFAULTS
    from colocate.bench.overlap import ASYNC_DEFAULTS
    from colocate.bench.rollout import ROLLOUT_DEFAULTS
    from colocate.bench.delta import DELTA_DEFAULTS
    from colocate.bench.routing import ROUTING_DEFAULTS
    from colocate.job.setup import check_job

    paths, overrides = _split(args.items)
    if args.which == "soak":  # the default job (or CONFIG) with the full switch forced, with or without CONFIG
        from colocate.bench.soak import SOAK_DEFAULTS, run_soak_bench

        cfg = check_job(load_config(paths, SOAK_DEFAULTS + overrides)).config
        run_soak_bench(cfg, out_dir=args.out, name=args.name or "soak")
        return 0
    if args.which == "restart":  # two `colocate launch` runs; each variant checked here first, one line if refused
        from colocate.bench.restart import DEFAULT_FAULT, RESTART_DEFAULTS, VARIANTS, restart_overrides, \
            run_restart_bench

        fault = args.fault or DEFAULT_FAULT
        for adds in VARIANTS.values():
            check_job(load_config(paths, ([] if paths else RESTART_DEFAULTS) + overrides + restart_overrides(fault)
                                  + adds(1)))
        run_restart_bench(paths, overrides, fault=fault, out_dir=args.out, name=args.name or "restart")
        return 0
    # the bench's own arguments first: a bad one is named before the job's checks (and its memory preflight,
    # which depends on what the machine has free) can speak
    only = _variants(args.variants, args.which) if args.which in ("train", "async") and args.variants else None
    lengths = _lengths(args.lengths) if args.which in ("train", "train-memory") and args.lengths else None
    defaults = {"rollout": ROLLOUT_DEFAULTS, "async": ASYNC_DEFAULTS,
                "consistency": CONSISTENCY_DEFAULTS, "routing": ROUTING_DEFAULTS,
                "delta": DELTA_DEFAULTS}.get(args.which, BENCH_DEFAULTS)
    cfg = check_job(load_config(paths, ([] if paths else defaults) + overrides)).config
    # SIGTERM unwinds as Ctrl-C does: a bench's runtime closes, and the processes that measure (bench train and
    # train-memory run each variant in a daemon process) go with it. Python's default for SIGTERM ends the
    # process on the spot, and a measuring process would run on alone, taking the memory and cores it measures.
    restore = catch_stop_signals()
    try:
        _run_bench(args, cfg, only=only, lengths=lengths)
    except (KeyboardInterrupt, Terminated) as e:
        said, code = stop_outcome(e)
        print(f"colocate: bench {args.which} {said}", file=sys.stderr)
        return code
    finally:
        restore()
    return 0


def _run_bench(args, cfg: JobConfig, *, only: list[str] | None, lengths: list[int] | None) -> None:
    if args.which == "sync":
        from colocate.bench.sync import run_sync_bench

        run_sync_bench(cfg, num_syncs=args.repeats, num_warmup=args.warmup, out_dir=args.out,
                       name=args.name or "sync")
    elif args.which == "switch":
        from colocate.bench.switch import run_switch_bench

        run_switch_bench(cfg, num_cycles=args.repeats, out_dir=args.out, name=args.name or "switch")
    elif args.which == "train" and args.updates:
        from colocate.bench.train_updates import run_updates_bench

        run_updates_bench(cfg, num_updates=args.updates, out_dir=args.out, name=args.name or "train_updates")
    elif args.which == "train":
        from colocate.bench.train import DEFAULT_LENGTHS, run_train_bench

        run_train_bench(cfg, lengths=lengths or list(DEFAULT_LENGTHS), out_dir=args.out, name=args.name or "train",
                        only=only)
    elif args.which == "train-memory":
        from colocate.bench.train_memory import DEFAULT_LENGTHS, run_train_memory_bench

        run_train_memory_bench(cfg, lengths=lengths or list(DEFAULT_LENGTHS), out_dir=args.out,
                               name=args.name or "train_memory")
    elif args.which == "rollout":
        from colocate.bench.rollout import run_rollout_bench

        run_rollout_bench(cfg, num_steps=args.repeats, out_dir=args.out, name=args.name or "rollout")
    elif args.which == "async":
        from colocate.bench.overlap import run_async_bench

        run_async_bench(cfg, num_steps=args.repeats, out_dir=args.out, name=args.name or "async", variants=only)
    elif args.which == "consistency":
        from colocate.bench.consistency import run_consistency_bench

        run_consistency_bench(cfg, num_prompts=cfg.rollout.num_prompts, num_samples=cfg.rollout.num_samples,
                              max_tokens=args.max_tokens, out_dir=args.out, name=args.name or "consistency")
    elif args.which == "delta":
        from colocate.bench.delta import run_delta_bench

        run_delta_bench(cfg, num_steps=args.repeats, out_dir=args.out, name=args.name or "delta")
    elif args.which == "routing":
        from colocate.bench.routing import run_routing_bench

        run_routing_bench(cfg, num_prompts=cfg.rollout.num_prompts, num_samples=cfg.rollout.num_samples,
                          max_tokens=args.max_tokens, out_dir=args.out, name=args.name or "routing")
    else:
        from colocate.bench.mismatch import run_mismatch_bench

        run_mismatch_bench(cfg, num_prompts=cfg.rollout.num_prompts, num_samples=cfg.rollout.num_samples,
                           max_tokens=args.max_tokens, out_dir=args.out, name=args.name or "mismatch")


def _variants(text: str, which: str) -> list[str]:
    """bench train's variants (today among them) or bench async's (sync among them): each ratio is taken against
    the first."""
    if which == "async":
        from colocate.bench.overlap import VARIANTS as known
    else:
        from colocate.bench.train import variants

        known = list(variants(bf16=True))
    base, asked = known[0], [v.strip() for v in text.split(",") if v.strip()]
    if base not in asked or any(v not in known for v in asked):
        raise ConfigError(f"--variants {text!r} is invalid: expected a comma-separated subset of {', '.join(known)} "
                          f"that includes {base} (every ratio is taken against it)")
    return asked


def _lengths(text: str) -> list[int]:
    try:
        lengths = [int(x) for x in text.split(",")]
    except ValueError:
        lengths = []
    if not lengths or any(n <= 64 for n in lengths) or lengths != sorted(set(lengths)):
        raise ConfigError(f"--lengths {text!r} is invalid: expected ascending token counts above 64 (the prompt), "
                          "e.g. 256,512,1024,2048")
    return lengths


def cmd_plot(args) -> int:
    from colocate.telemetry.plot import plot_run

    print(plot_run(args.run_dir, args.out))
    return 0


def cmd_clean(args) -> int:
    from colocate.host.clean import clean_runs

    return clean_runs(args.run_dirs, dry_run=args.dry_run)


def cmd_export(args) -> int:
    from colocate.checkpoint.export import export_hf, find_checkpoint

    print(export_hf(find_checkpoint(args.checkpoint), args.out, dtype=args.dtype, merged=args.merged))
    return 0


def config_docs() -> str:
    """docs/config.md: every key's docstring, and the model presets from their registry."""
    from colocate.models.sources import preset_docs

    return config_docs_markdown(notes=preset_docs())


def cmd_simulate(args) -> int:
    from pathlib import Path

    from colocate.simulate.command import run_simulate

    paths, overrides = _split(args.items)
    if args.calibrate or args.calibration:  # this machine's CPU, measured (or a saved measurement)
        from colocate.simulate.calibrate import run_calibrate

        name = args.name if args.name != "simulate" else "simulate_cpu"
        run_calibrate(paths, overrides, out=Path(args.out), name=name, against=args.against, num_steps=args.repeats,
                      calibration=Path(args.calibration) if args.calibration and not args.calibrate else None)
        return 0
    run_simulate(paths, overrides, gpus=args.gpus, gpu_name=args.gpu, lengths_spec=args.lengths,
                 prompt_tokens=args.prompt_tokens, out=Path(args.out), speculative=args.speculative, name=args.name)
    return 0


def cmd_config_docs(args) -> int:
    print(config_docs(), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="colocate", description="Co-located RL training: FSDP2 trainers and "
                                     "vLLM engines taking turns on the same devices.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    items_help = "optional YAML config file, then key=value overrides (e.g. engine.tp=2 algo.num_steps=10)"

    launch = sub.add_parser("launch", help="run an RL job (no arguments: the embedded CPU default)",
                            description="Run an RL job: rollout -> score -> train -> sync, repeated algo.num_steps "
                            "times. Metrics go to <logging.output_dir>/metrics.jsonl.")
    launch.add_argument("items", nargs="*", metavar="[CONFIG] [key=value]", help=items_help)
    launch.add_argument("--address", help="join an existing Ray cluster (default: $RAY_ADDRESS, else a local Ray)")
    launch.set_defaults(func=cmd_launch)

    validate = sub.add_parser("validate", help="print the resolved config and placement; starts nothing",
                              description="Resolve and check a config (YAML + overrides) without starting anything; "
                              "print the placement, the switch plan and each phase's predicted memory, for this "
                              "machine or (--gpus, --gpu-memory-gib) for a GPU node that need not be this one.")
    validate.add_argument("items", nargs="*", metavar="[CONFIG] [key=value]", help=items_help)
    validate.add_argument("--address", help="the Ray cluster the job will run on")
    validate.add_argument("--gpus", type=int, help="predict for a GPU node that need not be this machine: its "
                          "number of GPUs (with --gpu-memory-gib; placement.num_slots still says how many are used)")
    validate.add_argument("--gpu", default="h100", help="with --gpus: the GPU kind the step's time, and "
                          "placement.engine_slots=auto's split, are predicted for (h100, h200, a100, b200, l20; "
                          "default h100)")
    validate.add_argument("--gpu-memory-gib", type=float, help="that node's memory per GPU in GiB (e.g. 79.6 for "
                          "an 80 GB H100)")
    validate.set_defaults(func=cmd_validate)

    submit = sub.add_parser("submit", help="submit a job to a Ray cluster (Job Submission API)",
                            description="Validate the config here, then submit `colocate launch` with the resolved "
                            "config to a Ray cluster's job server and (by default) follow its logs.")
    submit.add_argument("items", nargs="*", metavar="[CONFIG] [key=value]", help=items_help)
    _job_server_args(submit, "--dashboard")
    submit.add_argument("--no-wait", action="store_true", help="print the job id and return at once")
    # address=None: the job server's URL is args.job_server, never the job's placement.ray_address.
    submit.set_defaults(func=cmd_submit, address=None)

    jobs = sub.add_parser("jobs", help="list the jobs on a Ray cluster",
                          description="List the jobs on a Ray cluster's job server: id, status, start time, command.")
    _job_server_args(jobs)
    jobs.set_defaults(func=cmd_jobs)

    logs = sub.add_parser("logs", help="print a job's logs (-f: follow them until it ends)",
                          description="Print a job's logs. With --follow, print them as they come until the job "
                          "ends, and exit with its status (0 succeeded, 1 failed, 143 stopped; Ctrl-C: 130, the job "
                          "keeps running).")
    logs.add_argument("job", metavar="JOB", help="the job's id (as `colocate submit` and `colocate jobs` print it)")
    logs.add_argument("-f", "--follow", action="store_true", help="follow the logs until the job ends")
    _job_server_args(logs)
    logs.set_defaults(func=cmd_logs)

    stop = sub.add_parser("stop", help="stop a job and wait until it has ended",
                          description="Stop a job (Ray sends its entrypoint SIGTERM, then SIGKILL) and wait until "
                          "it has ended; exit 1 if it is still running after --timeout.")
    stop.add_argument("job", metavar="JOB", help="the job's id")
    stop.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the job to end (default 60)")
    _job_server_args(stop)
    stop.set_defaults(func=cmd_stop)

    bench = sub.add_parser("bench", help="benchmarks: sync (weight sync), switch (sleep/wake), mismatch (logprobs), "
                           "consistency (where engine and trainer logprobs first differ; batch invariance), "
                           "routing (a MoE's mismatch with and without router replay), delta (how much of the "
                           "weights change from sync to sync, and what sending only that would cost), "
                           "rollout (long tail), async (sync against one_step_off and async), soak, train (tokens/s "
                           "and memory of each long-answer feature), train-memory (the preflight against a train "
                           "step's peak), restart (an engine's fault: the engine replaced alone against the whole "
                           "job restarted)",
                           description="Benchmark against the floor measured in the same run; writes JSON and a PNG "
                           "plot. Without a CONFIG, the bench preset (24 layers, >= 0.4 GB bf16, TP=2); rollout and "
                           "async: the tiny model with long-tailed answer lengths.")
    bench.add_argument("which", choices=["sync", "switch", "mismatch", "consistency", "routing", "delta", "rollout",
                                         "async", "soak", "train", "train-memory", "restart"])
    bench.add_argument("items", nargs="*", metavar="[CONFIG] [key=value]", help=items_help)
    bench.add_argument("--repeats", type=int, default=5,
                       help="timed syncs per method / switch cycles / rollout steps per mode / async: steps per "
                       "mode, the first and last untimed / delta: steps (default 5)")
    bench.add_argument("--warmup", type=int, default=1, help="untimed syncs first (sync; default 1)")
    bench.add_argument("--out", default="benchmarks/results", help="output directory (default benchmarks/results)")
    bench.add_argument("--name", default="", help="result file name without extension (default: the benchmark)")
    bench.add_argument("--max-tokens", type=int, default=120,
                       help="mismatch, consistency, routing: longest sampled answer (default 120, as in the published "
                       "measurement)")
    bench.add_argument("--variants", default="",
                       help="train: the variants to run, a subset including today; async: of sync, one_step_off, "
                       "async, sync_split, async_split, async_split_in_pass, async_split_stream, including sync "
                       "(default: every one)")
    bench.add_argument("--lengths", default="",
                       help="train: longest answer lengths, ascending (default 128,512,1024,2048,4096); "
                       "train-memory: sequence lengths in tokens, ascending (default 256,512,1024,2048)")
    bench.add_argument("--updates", type=int, default=0,
                       help="train: instead of the answer lengths, one step of this many optimizer steps, with and "
                       "without PPO's critic: their cost, and the critic's share of time and memory")
    bench.add_argument("--fault", default="",
                       help="restart: the faults both runs meet, as fault.inject (default SIGKILL:engine0:rollout:2)")
    bench.set_defaults(func=cmd_bench, command="bench")

    plot = sub.add_parser("plot", help="draw a run's metrics (reward, mismatch, phase times, memory) as a PNG",
                          description="Draw RUN_DIR/metrics.jsonl per step: reward (and each named reward), the "
                          "training/inference mismatch, phase times and memory. Writes RUN_DIR/metrics.png.")
    plot.add_argument("run_dir", metavar="RUN_DIR", help="the run's logging.output_dir, e.g. outputs/default")
    plot.add_argument("--out", help="where to write the PNG (default RUN_DIR/metrics.png)")
    plot.set_defaults(func=cmd_plot)

    clean = sub.add_parser("clean", help="remove what a killed job left: its segments, processes and actors",
                           description="For each RUN_DIR (default: every job under outputs/ that did not close) "
                           "whose controller is dead, remove what the job left on this machine: its /dev/shm "
                           "segments, its processes and Ray actors, the Ray it started. Nothing of another job "
                           "or user is touched; a running job is refused.")
    clean.add_argument("run_dirs", nargs="*", metavar="RUN_DIR", help="a job's logging.output_dir (its job.json)")
    clean.add_argument("--dry-run", action="store_true", help="print what would be removed; remove nothing")
    clean.set_defaults(func=cmd_clean)

    export = sub.add_parser("export", help="write a checkpoint as a Hugging Face model (safetensors, config, "
                            "tokenizer)", description="Write CKPT (a step_<N> checkpoint folder, or a checkpoint "
                            "directory: its newest) as a Hugging Face model in OUT, which vLLM and transformers load "
                            "as is; a LoRA job's checkpoint as its adapter in PEFT's format (or merged: --merged). "
                            "Reads the trainer shards a few tensors at a time: no GPU, no process group.")
    export.add_argument("checkpoint", metavar="CKPT", help="e.g. outputs/default/checkpoints/step_00000149")
    export.add_argument("out", metavar="OUT", help="the model directory to write")
    export.add_argument("--dtype", default="bfloat16", help="bfloat16 (default), float16 or float32")
    export.add_argument("--merged", action="store_true", help="a LoRA job's checkpoint: write the model with the "
                        "adapter merged into its weights, instead of the adapter alone in PEFT's format")
    export.set_defaults(func=cmd_export)

    simulate = sub.add_parser("simulate", help="predict each mode's step on a GPU node (a model: docs/simulate.md)",
                              description="Predict the RL step of the job on --gpus GPUs of one --gpu kind for each "
                              "mode and placement, print the best with the keys to set, write JSON and a PNG.")
    simulate.add_argument("items", nargs="*", metavar="[CONFIG] [key=value]", help=items_help)
    simulate.add_argument("--gpus", type=int, default=8, help="GPUs of the node (default 8)")
    simulate.add_argument("--gpu", default="h100", help="h100, h200, a100, b200 or l20 (default h100)")
    simulate.add_argument("--lengths", default="lognormal:1500,0.9,64,16384",
                          help="answer lengths: lognormal:MEDIAN,SIGMA[,MIN,MAX], fixed:N or metrics:PATH "
                          "(default: the rollout chapter's long tail)")
    simulate.add_argument("--prompt-tokens", type=int, default=512, help="tokens of each prompt (default 512)")
    simulate.add_argument("--speculative", default="", help="ACCEPTANCE,DRAFT_TOKENS,DRAFT_COST: speculative "
                          "decoding in the tail (e.g. 0.7,4,0.05)")
    simulate.add_argument("--out", default="benchmarks/results", help="output directory (default benchmarks/results)")
    simulate.add_argument("--name", default="simulate", help="result file name without extension")
    simulate.add_argument("--calibrate", action="store_true", help="measure this machine's engine decode steps, "
                          "train steps, switch and sync on the job (default: bench rollout's), save "
                          "<out>/<name>_calibration.json, and predict bench rollout's modes with the CPU model")
    simulate.add_argument("--calibration", default="", metavar="FILE", help="predict with the CPU model from a "
                          "saved --calibrate file instead of a GPU")
    simulate.add_argument("--against", default="", choices=["", "rollout", "async"], help="with --calibrate or "
                          "--calibration: then run that bench's work for real, write predicted / measured / ratio "
                          "per mode (async: its job's defaults, its split placement calibrated too)")
    simulate.add_argument("--repeats", type=int, default=5, help="with --against: timed steps per mode (default 5)")
    simulate.set_defaults(func=cmd_simulate)

    docs = sub.add_parser("config-docs", help="print the table of every config key (docs/config.md)")
    docs.set_defaults(func=cmd_config_docs)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # `colocate bench sync --repeats 3 sync.bucket_mb=16`: argparse ends a positional list at the first option,
    # so items after an option arrive as extras; they are still items. Anything else extra is an error.
    args, extras = parser.parse_known_args(argv)
    unknown = [e for e in extras if e.startswith("-") or not hasattr(args, "items")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extras:
        args.items = [*args.items, *extras]
    # Dotted paths in the config (tasks, reward functions) name the user's modules, relative to where they run
    # the command, as `python -m` would resolve them.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    take_ctrl_c()  # even when started from a script in the background (colocate/host/signals.py)
    try:
        return args.func(args)
    except ColocateError as e:  # one line, and the exit code its kind carries (colocate/errors.py)
        print(f"colocate: error: {e}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
