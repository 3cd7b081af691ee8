"""Jobs on a Ray cluster through Ray's Job Submission API: `colocate submit`, `jobs`, `logs`, `stop`.

    colocate submit --address http://HEAD:8265 configs/default.yaml algo.num_steps=100   # job id, then its logs
    colocate submit --address http://HEAD:8265 --no-wait configs/default.yaml            # print the job id, return
    colocate jobs | logs JOB [--follow] | stop JOB

`submit` resolves and checks the config here first (a bad key never reaches the cluster). The job's entrypoint is
`colocate launch --address auto` with every resolved key as an override, so the cluster runs exactly what was
validated. The job server's URL (the dashboard's, port 8265) is only where the job is sent: it never becomes
`placement.ray_address`, since the job joins the cluster from inside it.

The job server: `--address`, else $RAY_API_SERVER_ADDRESS, else $RAY_ADDRESS when it is an http(s) URL (as
`ray job submit` reads them), else http://127.0.0.1:8265. The token (Ray's RAY_AUTH_MODE=token): `--token-file`,
else Ray's own variables (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token with RAY_AUTH_MODE=token).
The server is probed with a short timeout before anything else, so an unreachable address or a refused token is
one line (exit 2) within seconds, not a traceback after minutes. See docs/jobs.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shlex
import stat
import sys
import time
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from urllib.parse import urlsplit

from colocate.config import JobConfig, to_dict
from colocate.errors import ConfigError, JobServerError

DEFAULT_JOB_SERVER = "http://127.0.0.1:8265"
PROBE_TIMEOUT_S = 3.0
TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}
EXCLUDES = [".venv/", ".git/", "outputs/", ".cache/", "__pycache__/"]
# What `colocate submit` and `colocate logs --follow` exit with once the job ends; 130: Ctrl-C stopped following
# (the job keeps running). A stopped job is 143 (128 + SIGTERM, what Ray sends it), so a script can tell "someone
# stopped it" from "it failed".
EXIT_CODES = {"SUCCEEDED": 0, "FAILED": 1, "STOPPED": 143}
EXIT_INTERRUPTED = 130
ENTRYPOINT_WIDTH = 60
STOP_WAIT_S = 60  # a stopped job's time to release its actors and segments (host.signals.catch_stop_signals)
NO_AGENT = "No available agent to submit job"  # Ray 2.60's 500 body, dashboard/modules/job/job_head.py
AGENT_WAIT_S = 60.0  # how long submit waits for the head's agent, beyond the 10 s the server waits itself


# --- where the job server is, and the token ------------------------------------------------------------------


def job_server_address(flag: str | None, environ=None) -> str:
    """The job server's URL: the flag, else the variables `ray job submit` reads, else the local default."""
    environ = os.environ if environ is None else environ
    ray_address = environ.get("RAY_ADDRESS", "")
    if flag:
        source, value = "--address", flag
    elif environ.get("RAY_API_SERVER_ADDRESS"):
        source, value = "RAY_API_SERVER_ADDRESS", environ["RAY_API_SERVER_ADDRESS"]
    elif ray_address.startswith(("http://", "https://")):
        # RAY_ADDRESS usually holds the cluster's GCS address (`auto`, HOST:6379) for `colocate launch`; only a
        # URL is the job server's.
        source, value = "RAY_ADDRESS", ray_address
    else:
        return DEFAULT_JOB_SERVER
    return _checked_url(source, value.strip())


def _checked_url(source: str, value: str) -> str:
    expected = ("expected the job server's URL, http(s)://HOST:PORT (the Ray dashboard, port 8265 by default, as "
                "`ray start --head` prints it)")
    if value == "auto" or value.startswith("ray://"):
        raise ConfigError(f"{source}={value!r} is not a job server: {expected}; `auto` and ray:// address the "
                          "cluster itself")
    # As `ray job submit` does: HOST:PORT without a scheme is plain http.
    url = value if "://" in value else f"http://{value}"
    try:
        parts = urlsplit(url)
        _ = parts.port  # a port that is not a number raises here
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or re.search(r"\s", value):
        raise ConfigError(f"{source}={value!r} is not a URL: {expected}")
    return url.rstrip("/")


def token_headers(token_file: str | None) -> tuple[dict[str, str], str]:
    """The Authorization header for the job server and where its token came from (for error messages).

    `--token-file` is read here and sent as a header, for this client only: Ray's token loader caches the first
    token it finds per process, and the environment would pass the token on to anything this process starts."""
    if token_file:
        return {"Authorization": f"Bearer {_read_token(token_file)}"}, f"--token-file {token_file}"
    from ray._private.authentication.http_token_authentication import get_auth_headers_if_auth_enabled
    from ray.exceptions import AuthenticationError

    try:
        headers = get_auth_headers_if_auth_enabled({})
    except AuthenticationError as e:  # RAY_AUTH_MODE=token with a token file that cannot be read
        raise ConfigError(f"no token for the job server: {_first_sentence(e)}") from None
    if not headers:
        return {}, "no token (RAY_AUTH_MODE is not 'token' and no --token-file)"
    if os.environ.get("RAY_AUTH_TOKEN"):
        return headers, "RAY_AUTH_TOKEN"
    return headers, f"RAY_AUTH_TOKEN_PATH={os.environ.get('RAY_AUTH_TOKEN_PATH', '~/.ray/auth_token')}"


def _read_token(path: str) -> str:
    try:
        token = Path(path).read_text().strip()
        mode = os.stat(path).st_mode
    except OSError as e:
        raise ConfigError(f"--token-file {path}: cannot read it ({e.strerror})") from None
    if not token:
        raise ConfigError(f"--token-file {path} is empty: expected the cluster's token (the head's "
                          "RAY_AUTH_TOKEN_PATH, or `ray get-auth-token` on the head)")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        # A warning, not an error: secrets mounted by orchestrators are often 0644 inside a private container.
        print(f"colocate: warning: --token-file {path} is readable by others (mode {stat.S_IMODE(mode):o}); "
              f"chmod 600 {shlex.quote(path)}", file=sys.stderr)
    return token


def probe(address: str, headers: dict[str, str], token_source: str, timeout_s: float = PROBE_TIMEOUT_S) -> str:
    """Ask the job server its Ray version with a short timeout; returns it, or raises ConfigError with one line.

    Ray's client connects without any timeout (a firewalled address hangs for minutes) and reports a refused
    token as a paragraph; /api/version needs the token too, so this one request checks address and token."""
    import requests

    check = ("check that the head is running, that its dashboard listens there (`ray start --head "
             "--dashboard-host=0.0.0.0 --dashboard-port=8265`), and that no firewall is in the way")
    try:
        r = requests.get(f"{address}/api/version", headers=headers, timeout=timeout_s)
    except requests.exceptions.SSLError as e:
        raise ConfigError(f"TLS with the job server at {address} failed ({_reason(e)}): a certificate the system "
                          "does not trust? (REQUESTS_CA_BUNDLE=PATH names a CA)") from None
    except requests.exceptions.Timeout:
        raise ConfigError(f"the job server at {address} did not answer within {timeout_s:g} s: {check}") from None
    except requests.exceptions.RequestException as e:
        raise ConfigError(f"cannot reach the job server at {address} ({_reason(e)}): {check}") from None
    if r.status_code in (401, 403):
        raise ConfigError(_refused(address, r.status_code, token_source))
    try:
        return r.json()["ray_version"]
    except (ValueError, KeyError, TypeError):
        raise ConfigError(f"{address} answered HTTP {r.status_code} to /api/version, which a Ray job server does "
                          "not: is it the dashboard's URL (port 8265 by default, not the GCS port 6379)?") from None


def _refused(address: str, status: int, token_source: str) -> str:
    if status == 401:
        why = ("HTTP 401, no token sent: pass --token-file PATH, or set RAY_AUTH_MODE=token with "
               "RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN")
    else:
        why = (f"HTTP {status}: the token from {token_source} is not this cluster's; use the head's "
               "(its RAY_AUTH_TOKEN_PATH, or `ray get-auth-token` on the head)")
    return f"the job server at {address} refused the token ({why})"


def connect(address_flag: str | None, token_file: str | None):
    """(JobSubmissionClient, its URL), after the probe; user mistakes raise ConfigError."""
    address = job_server_address(address_flag)
    headers, token_source = token_headers(token_file)
    probe(address, headers, token_source, timeout_s=PROBE_TIMEOUT_S)
    from ray.job_submission import JobSubmissionClient

    # Ray's client replaces the address it is given by $RAY_API_SERVER_ADDRESS or $RAY_ADDRESS (a GCS address
    # there makes it look for a local cluster); the address above already applied those rules, so it must win.
    with _hidden_env("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS"), server_errors(address, token_source):
        client = JobSubmissionClient(address, headers=headers)
    return client, address


@contextmanager
def _hidden_env(*names: str):
    saved = {n: os.environ.pop(n) for n in names if n in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


@contextmanager
def server_errors(address: str, token_source: str = ""):
    """Ray client failures as one line: a refused token is the user's (ConfigError, exit 2), anything else the
    server's (JobServerError, exit 1). An unknown job is told apart earlier, by _job_info."""
    import requests
    from ray.exceptions import AuthenticationError

    try:
        yield
    except AuthenticationError as e:
        status = 401 if "required" in str(e).split(":")[0].lower() else 403
        raise ConfigError(_refused(address, status, token_source)) from None
    except requests.exceptions.RequestException as e:
        raise JobServerError(f"lost the job server at {address} ({_reason(e)})") from None
    except RuntimeError as e:  # Ray's client: "Request failed with status code N: <body>"
        raise JobServerError(f"the job server at {address} failed: {_first_line(e)}") from None


def _reason(exc: Exception) -> str:
    """The useful end of a requests error ('Connection refused'), not its chain of reprs."""
    text = str(exc)
    errno = re.search(r"\[Errno -?\d+\] ([^'\")]+)", text)
    if errno:
        return errno.group(1).strip()
    return _first_line(text)[:200] or type(exc).__name__


def _first_line(text) -> str:
    return str(text).strip().splitlines()[0] if str(text).strip() else ""


def _first_sentence(exc) -> str:
    return _first_line(exc).split(". ")[0].rstrip(".")


def _again(address: str, token_file: str | None) -> str:
    """The flags that reach the same server again, for the hints printed after Ctrl-C."""
    return f"--address {address}" + (f" --token-file {shlex.quote(token_file)}" if token_file else "")


# --- submit and follow -------------------------------------------------------------------------------------


def submit_job(cfg: JobConfig, items: list[str], *, address: str | None, token_file: str | None,
               wait: bool) -> int:
    client, address = connect(address, token_file)
    try:
        with server_errors(address):
            job_id = _submit_once_agent_is_up(
                client,
                entrypoint=entrypoint(cfg),
                # The user's own modules (tasks, reward functions) travel with the working directory; colocate
                # itself must be installed in the cluster's environment (see docker/).
                # RAY_JOB_STOP_WAIT_TIME_S: how long Ray's job supervisor (which runs with these variables) waits
                # after `stop`'s SIGTERM before SIGKILL; its default, 3 s, is shorter than releasing the engines.
                runtime_env={"working_dir": os.getcwd(), "excludes": EXCLUDES,
                             "env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": str(STOP_WAIT_S)}},
                # What the user typed, for `colocate jobs` (the entrypoint spells out every key).
                metadata={"colocate_command": shlex.join(["colocate", "launch", *items])},
            )
    except KeyboardInterrupt:
        print("colocate: interrupted while submitting; `colocate jobs` shows whether the job reached the cluster",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    print(job_id, flush=True)
    if not wait:
        print(f"colocate: submitted {job_id} to {address}", file=sys.stderr)
        return 0
    print(f"colocate: submitted {job_id} to {address}; following its logs (Ctrl-C stops following, not the job)",
          file=sys.stderr)
    return follow_or_detach(client, job_id, address=address, token_file=token_file)


def _submit_once_agent_is_up(client, **job) -> str:
    """client.submit_job, tried again while the head's dashboard agent has not registered.

    The job server hands each job to the agent on the head node. Right after `ray start --head`, on a loaded
    node, that agent can take longer to come up than the 10 s the server waits for it
    (WAIT_AVAILABLE_AGENT_TIMEOUT); the server then answers 500 "No available agent to submit job, please try
    again later", having submitted nothing. Any other failure is the server's, at once (server_errors)."""
    deadline = time.monotonic() + AGENT_WAIT_S
    said = False
    while True:
        try:
            return client.submit_job(**job)
        except RuntimeError as e:
            if NO_AGENT not in str(e):
                raise
        if time.monotonic() >= deadline:
            # An agent whose HTTP port was taken stays alive without serving, and never registers (Ray 2.60,
            # dashboard/agent.py, run: "the HTTP service will be disabled").
            raise JobServerError(f"the job server at {client.get_address()} still has no agent on its head after "
                                 f"{AGENT_WAIT_S:g} s: the head's dashboard agent did not start (its port, "
                                 "--dashboard-agent-listen-port, 52365 by default, taken by another Ray on that "
                                 "host?); see dashboard_agent.log in the head's Ray logs")
        if not said:
            print(f"colocate: the job server has no agent on the head yet (a head just started?); trying again for "
                  f"up to {AGENT_WAIT_S:g} s", file=sys.stderr)
            said = True
        time.sleep(1.0)


def follow_or_detach(client, job_id: str, *, address: str, token_file: str | None) -> int:
    """follow_job, where Ctrl-C leaves the job running and says how to reach it again."""
    again = _again(address, token_file)
    try:
        with server_errors(address):
            return follow_job(client, job_id)
    except KeyboardInterrupt:
        print(f"\ncolocate: stopped following {job_id}; the job keeps running (stop it: colocate stop {job_id} "
              f"{again}; follow again: colocate logs {job_id} --follow {again})", file=sys.stderr)
        return EXIT_INTERRUPTED


def follow_job(client, job_id: str, *, out=None) -> int:
    """Print the job's logs as they come (each chunk once: Ray's log stream starts at the first line and closes
    when the job ends), then its final status on stderr; returns the exit code for that status (EXIT_CODES)."""
    import aiohttp

    # Ray's client logs "WebSocket closed ..." at INFO on stderr when the stream ends; our own line says it.
    logging.getLogger("ray.dashboard.modules.job.sdk").setLevel(logging.WARNING)
    out = out or sys.stdout
    _job_info(client, job_id)  # an unknown job is one line, not a failed websocket handshake

    async def tail():
        async for chunk in client.tail_job_logs(job_id):
            out.write(chunk)
            out.flush()

    try:
        asyncio.run(tail())
    except BrokenPipeError:  # our reader left (`colocate logs JOB -f | head`), not the server
        raise
    except (aiohttp.ClientError, RuntimeError, OSError, TimeoutError) as e:
        # The server went away mid-stream (Ray raises RuntimeError for an abnormal close, aiohttp its own).
        raise JobServerError(f"lost the log stream of {job_id} ({_reason(e)}); the job may still be running: "
                             f"colocate logs {job_id} --follow") from None
    return _report_end(client, job_id)


def _report_end(client, job_id: str, timeout_s: float = 10.0) -> int:
    # The stream closes once the job is terminal, but its status may take a moment more to read as such.
    info = _job_info(client, job_id)
    deadline = time.monotonic() + timeout_s
    while str(info.status) not in TERMINAL:
        if time.monotonic() > deadline:
            raise JobServerError(f"the log stream of {job_id} closed while the job is still {info.status}; "
                                 f"colocate logs {job_id} --follow resumes it")
        time.sleep(0.5)
        info = _job_info(client, job_id)
    status = str(info.status)
    if status == "SUCCEEDED":
        print(f"colocate: job {job_id} succeeded", file=sys.stderr)
    elif status == "STOPPED":
        print(f"colocate: job {job_id} was stopped", file=sys.stderr)
    else:
        # Ray's message repeats the last logs after its first line; they were just printed.
        why = _first_line(info.message or "no message from Ray").split(", last available logs")[0]
        print(f"colocate: job {job_id} failed: {why}", file=sys.stderr)
    return EXIT_CODES[status]


def _job_info(client, job_id: str):
    # Ray's client raises RuntimeError("... status code 404 ...") for an unknown job; server_errors maps it.
    try:
        return client.get_job_info(job_id)
    except RuntimeError as e:
        if "status code 404" in str(e):
            raise ConfigError(f"no job {job_id!r} on this job server (`colocate jobs` lists them)") from None
        raise


def entrypoint(cfg: JobConfig) -> str:
    """`colocate launch` with every resolved key as an override: the cluster runs exactly what was validated."""
    overrides = [f"{section}.{key}={_override_value(value)}" for section, fields in to_dict(cfg).items()
                 for key, value in fields.items() if key != "ray_address"]
    # `python -m`: the cluster's Python must have colocate installed; its console script need not be on PATH
    return " ".join(["python", "-m", "colocate.cli", "launch", "--address", "auto", *map(shlex.quote, overrides)])


def _override_value(value) -> str:
    """`value` as an override reads it back: a string that the override's YAML would turn into something else
    (a mapping like reward_model.judge_prompt's "question: {prompt}", a number, a boolean) goes double-quoted."""
    from omegaconf import OmegaConf

    if value is None:
        return "null"
    if isinstance(value, str):
        try:
            plain = OmegaConf.to_container(OmegaConf.from_dotlist([f"k={value}"]))["k"] == value
        except Exception:  # not even YAML (e.g. "[0-9]+", "Question: {prompt} Answer: ..."): quoted it is
            plain = False
        return value if plain else json.dumps(value)  # a JSON string is a YAML double-quoted scalar
    return str(value)


# --- jobs, logs, stop --------------------------------------------------------------------------------------


def show_jobs(*, address: str | None, token_file: str | None) -> int:
    client, address = connect(address, token_file)
    with server_errors(address):
        jobs = client.list_jobs()
    for line in jobs_table(jobs):
        print(line)
    return 0


def jobs_table(jobs) -> list[str]:
    """One row per job, oldest first: id (the submission id that `logs` and `stop` take), status, start time,
    what was run (colocate's own command line for its jobs, else the entrypoint), shortened."""
    rows = [("JOB", "STATUS", "START", "ENTRYPOINT")]
    for job in sorted(jobs, key=lambda j: j.start_time or 0):
        started = datetime.fromtimestamp(job.start_time / 1000).strftime("%Y-%m-%d %H:%M:%S") \
            if job.start_time else "-"
        command = (job.metadata or {}).get("colocate_command") or job.entrypoint or ""
        rows.append((job.submission_id or job.job_id or "-", str(job.status), started, _shorten(command)))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return [f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}".rstrip() for r in rows]


def _shorten(text: str, width: int = ENTRYPOINT_WIDTH) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 3] + "..."


def show_logs(job_id: str, *, follow: bool, address: str | None, token_file: str | None) -> int:
    client, address = connect(address, token_file)
    if follow:
        return follow_or_detach(client, job_id, address=address, token_file=token_file)
    with server_errors(address):
        _job_info(client, job_id)
        sys.stdout.write(client.get_job_logs(job_id))
    return 0


def stop_job(job_id: str, *, timeout_s: float, address: str | None, token_file: str | None) -> int:
    """Ask Ray to stop the job (SIGTERM to its entrypoint, SIGKILL after the cluster's RAY_JOB_STOP_WAIT_TIME_S)
    and wait until it is terminal: 0 once it is (or already was), 1 if it is still running after timeout_s."""
    client, address = connect(address, token_file)
    with server_errors(address):
        status = str(_job_info(client, job_id).status)
        if status in TERMINAL:
            print(f"colocate: job {job_id} had already ended ({status}); nothing to stop", file=sys.stderr)
            return 0
        client.stop_job(job_id)
        deadline = time.monotonic() + timeout_s
        while status not in TERMINAL and time.monotonic() < deadline:
            time.sleep(0.5)
            status = str(_job_info(client, job_id).status)
    if status not in TERMINAL:
        print(f"colocate: job {job_id} is still {status} {timeout_s:g} s after the stop request; run "
              f"`colocate stop {job_id}` again, or `ray job stop` on the head", file=sys.stderr)
        return 1
    print(f"colocate: job {job_id} {'stopped' if status == 'STOPPED' else f'ended ({status})'}", file=sys.stderr)
    return 0
