"""`colocate jobs | logs | stop` and the follow/exit-status logic of `colocate submit`, against one Ray head of
our own (token auth, loopback, free ports), with small jobs sent directly through Ray's JobSubmissionClient.

The head is started with `ray start --block` in a session of its own and ended through that process only:
`ray stop` would end every Ray on the machine, including other tests' heads."""

from __future__ import annotations

import io
import os
import secrets
import select
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from colocate.cluster.submit import follow_job
from tests.e2e.conftest import sigint_ignored
from tests.e2e.ray_head import client_env, ray_head, wait_status

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]
BIN = Path(sys.executable).parent
PY = shlex.quote(sys.executable)


@pytest.fixture(scope="module")
def head():
    with ray_head() as head:
        yield head


def _job_output(logs: str) -> list[str]:
    """The entrypoint's own lines: Ray's job log has two of its own (runtime env, entrypoint), which its job
    supervisor writes through another stream than the entrypoint's: under load the second comes after the
    entrypoint's first lines, or not at all by the time the job has ended (seen once in a parallel run)."""
    lines = logs.splitlines()
    assert "Runtime env is setting up" in lines[0], lines[:2]
    return [line for line in lines[1:] if not line.startswith("Running entrypoint for job")]


def _read_until(proc: subprocess.Popen, text: str, timeout_s: float = 30) -> str:
    """Read proc's stdout until `text` appears (without blocking past the deadline)."""
    seen, deadline = "", time.monotonic() + timeout_s
    while text not in seen:
        assert time.monotonic() < deadline, f"{text!r} not in the output after {timeout_s} s: {seen!r}"
        if select.select([proc.stdout], [], [], 0.5)[0]:
            chunk = os.read(proc.stdout.fileno(), 65536).decode()
            assert chunk, f"output closed before {text!r}: {seen!r}"
            seen += chunk
    return seen


def test_jobs_logs_follow_detach_and_stop(head):
    client = head.client()
    job = client.submit_job(entrypoint=f"{PY} -u -c \"print('hello'); import time; time.sleep(120)\"")
    wait_status(client, job, {"RUNNING"})
    flags = ["--address", head.url, "--token-file", str(head.token_file)]

    listed = head.colocate("jobs", *flags)
    assert listed.returncode == 0, listed.stderr
    header, *rows = listed.stdout.splitlines()
    assert header.split() == ["JOB", "STATUS", "START", "ENTRYPOINT"]
    row = next(r for r in rows if r.startswith(job))
    assert row.split()[1] == "RUNNING" and row.endswith("...")  # the long entrypoint is shortened

    # Ctrl-C while following leaves the job running and says how to stop it.
    follower = subprocess.Popen([str(BIN / "colocate"), "logs", job, "--follow", *flags], env=client_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=sigint_ignored)
    _read_until(follower, "hello")
    follower.send_signal(signal.SIGINT)
    _, err = follower.communicate(timeout=30)
    assert follower.returncode == 130, err.decode()
    lines = [line for line in err.decode().splitlines() if line.strip()]
    assert len(lines) == 1 and "keeps running" in lines[0] and f"colocate stop {job}" in lines[0], lines
    assert str(client.get_job_status(job)) == "RUNNING"

    logs = head.colocate("logs", job, *flags)
    assert logs.returncode == 0 and _job_output(logs.stdout) == ["hello"], (logs.stdout, logs.stderr)

    start = time.monotonic()
    stopped = head.colocate("stop", job, "--timeout", "30", *flags)
    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stderr.strip() == f"colocate: job {job} stopped"
    assert time.monotonic() - start < 30
    assert str(client.get_job_status(job)) == "STOPPED"

    # Following a stopped job replays its logs once and exits 143.
    replay = head.colocate("logs", job, "--follow", *flags)
    assert replay.returncode == 143 and _job_output(replay.stdout) == ["hello"], (replay.stdout, replay.stderr)
    again = head.colocate("stop", job, *flags)
    assert again.returncode == 0 and "already ended (STOPPED)" in again.stderr

    unknown = head.colocate("logs", "raysubmit_nope", *flags)
    assert unknown.returncode == 2 and unknown.stderr.count("\n") == 1 and "no job 'raysubmit_nope'" in unknown.stderr


def test_follow_job_prints_each_line_once_and_exits_with_the_status(head, capsys):
    client = head.client()
    count = 40
    # Lines spread over ~2 s, so they come in many chunks of the log stream, not one.
    ok = client.submit_job(entrypoint=f"{PY} -u -c \"import time; "
                                      f"[print('line', i) or time.sleep(0.05) for i in range({count})]\"")
    failing = client.submit_job(entrypoint=f"{PY} -u -c \"import sys; print('about to fail'); sys.exit(3)\"")

    out = io.StringIO()
    assert follow_job(client, ok, out=out) == 0
    assert _job_output(out.getvalue()) == [f"line {i}" for i in range(count)]
    assert f"colocate: job {ok} succeeded" in capsys.readouterr().err

    out = io.StringIO()
    assert follow_job(client, failing, out=out) == 1
    assert _job_output(out.getvalue()) == ["about to fail"]
    err = capsys.readouterr().err
    assert f"colocate: job {failing} failed:" in err and "exit code 3" in err


def test_token_and_address_from_the_environment_and_refused_tokens(head, tmp_path):
    # Ray's own variables: RAY_API_SERVER_ADDRESS, RAY_AUTH_MODE=token with RAY_AUTH_TOKEN_PATH.
    env = client_env(RAY_API_SERVER_ADDRESS=head.url, RAY_AUTH_MODE="token",
                      RAY_AUTH_TOKEN_PATH=str(head.token_file), RAY_ADDRESS="auto")
    listed = head.colocate("jobs", env=env)
    assert listed.returncode == 0 and listed.stdout.startswith("JOB"), listed.stderr

    wrong = tmp_path / "wrong"
    wrong.write_text(secrets.token_hex(32))
    wrong.chmod(0o600)
    for args, env, why in [(["--token-file", str(wrong)], client_env(), "HTTP 403"),
                           ([], client_env(), "HTTP 401, no token sent"),
                           ([], client_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32)),
                            "HTTP 403: the token from RAY_AUTH_TOKEN")]:
        start = time.monotonic()
        refused = head.colocate("jobs", "--address", head.url, *args, env=env)
        assert time.monotonic() - start < 5
        assert refused.returncode == 2 and refused.stdout == ""
        assert refused.stderr.startswith(f"colocate: error: the job server at {head.url} refused the token ({why}")
        assert refused.stderr.count("\n") == 1, refused.stderr


def test_submit_prints_the_job_id_follows_it_and_exits_with_its_status(head, tmp_path):
    # A real `colocate submit`, with a job the cluster refuses at once (more slots than its 2 CPUs): the job
    # runs `colocate launch --address auto` there, which exits 2 before any actor starts -> FAILED -> exit 1.
    root = Path(__file__).resolve().parents[2]
    submitted = subprocess.run([str(BIN / "colocate"), "submit", "--address", head.url, "--token-file",
                                str(head.token_file), "placement.num_slots=64", "engine.tp=2",
                                f"model.cache_dir={root / '.cache' / 'models'}"],
                               cwd=tmp_path, env=client_env(), capture_output=True, text=True, timeout=180,
                               check=False)
    assert submitted.returncode == 1, submitted.stderr[-3000:]
    job, *job_logs = submitted.stdout.splitlines()
    assert job.startswith("raysubmit_")
    assert any("placement.num_slots=64" in line for line in job_logs), submitted.stdout[-3000:]
    assert f"colocate: job {job} failed: Job entrypoint command failed with exit code 2" in submitted.stderr

    listed = head.colocate("jobs", "--address", head.url, "--token-file", str(head.token_file))
    row = next(r for r in listed.stdout.splitlines() if r.startswith(job))
    assert row.split()[1] == "FAILED" and "colocate launch placement.num_slots=64 engine.tp=2" in row
