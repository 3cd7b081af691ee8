"""`colocate submit`: run a job on a Ray cluster through Ray's Job Submission API.

    colocate submit --address http://127.0.0.1:8265 configs/default.yaml algo.num_steps=100
    colocate submit --address http://head:8265 --no-wait configs/default.yaml    # print the job id and return

The config is resolved and checked here first (a bad key never reaches the cluster). The job's entrypoint is
`colocate launch --address auto` with every resolved key as an override, so the cluster runs exactly what was
validated. Ray's token authentication (RAY_AUTH_MODE=token) is honoured:
the client reads the same RAY_AUTH_TOKEN_PATH as the head.
"""

from __future__ import annotations

import os
import shlex
import sys
import time

from colocate.config import JobConfig, to_dict

TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}
EXCLUDES = [".venv/", ".git/", "outputs/", ".cache/", "__pycache__/"]


def submit_job(cfg: JobConfig, *, address: str, wait: bool) -> int:
    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(address)
    job_id = client.submit_job(
        entrypoint=entrypoint(cfg),
        # The user's own modules (tasks, reward functions) travel with the working directory; colocate itself
        # must be installed in the cluster's environment (see docker/).
        runtime_env={"working_dir": os.getcwd(), "excludes": EXCLUDES},
    )
    print(f"colocate: submitted {job_id} to {address}", file=sys.stderr)
    if not wait:
        print(job_id)
        return 0
    printed = 0
    while True:
        status = str(client.get_job_status(job_id)).split(".")[-1]
        logs = client.get_job_logs(job_id)
        sys.stderr.write(logs[printed:])
        printed = len(logs)
        if status in TERMINAL:
            print(f"colocate: job {job_id} {status.lower()}", file=sys.stderr)
            return 0 if status == "SUCCEEDED" else 1
        time.sleep(2)


def entrypoint(cfg: JobConfig) -> str:
    """`colocate launch` with every resolved key as an override: the cluster runs exactly what was validated."""
    overrides = [f"{section}.{key}={value}" for section, fields in to_dict(cfg).items()
                 for key, value in fields.items() if key != "ray_address"]
    # `python -m`: the cluster's Python must have colocate installed; its console script need not be on PATH
    return " ".join(["python", "-m", "colocate.cli", "launch", "--address", "auto", *map(shlex.quote, overrides)])
