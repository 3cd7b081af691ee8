"""`colocate submit | jobs | logs | stop` without a Ray cluster: arguments, the job server's address and token,
and the one-line errors for addresses that are wrong, closed, silent, or not a Ray job server."""

from __future__ import annotations

import http.server
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import colocate.cluster.submit as jobs
from colocate.cli import build_parser, main
from colocate.errors import ConfigError

BIN = Path(sys.executable).parent


@pytest.fixture(autouse=True)
def no_ray_env(monkeypatch):
    """Nothing from the shell running the tests: addresses and tokens are what each test sets."""
    for name in list(os.environ):
        if name.startswith(("RAY_ADDRESS", "RAY_API_SERVER", "RAY_AUTH")):
            monkeypatch.delenv(name)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once it is closed


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("colocate: error: "), err
    return lines[0]


# --- arguments -------------------------------------------------------------------------------------------


def test_submit_takes_address_or_its_dashboard_alias_and_keeps_it_out_of_the_job_config():
    parser = build_parser()
    for flag in ("--address", "--dashboard"):
        args = parser.parse_args(["submit", flag, "http://head:8265", "cfg.yaml", "algo.num_steps=3"])
        assert args.job_server == "http://head:8265" and args.address is None
        assert args.items == ["cfg.yaml", "algo.num_steps=3"] and not args.no_wait and args.token_file is None


def test_jobs_logs_stop_arguments():
    parser = build_parser()
    args = parser.parse_args(["jobs", "--token-file", "/t"])
    assert args.job_server is None and args.token_file == "/t"
    args = parser.parse_args(["logs", "raysubmit_1", "-f", "--address", "http://h:1"])
    assert (args.job, args.follow, args.job_server) == ("raysubmit_1", True, "http://h:1")
    assert not parser.parse_args(["logs", "raysubmit_1"]).follow
    args = parser.parse_args(["stop", "raysubmit_1", "--timeout", "5"])
    assert (args.job, args.timeout) == ("raysubmit_1", 5.0)
    assert parser.parse_args(["stop", "raysubmit_1"]).timeout == 60.0


def test_stop_refuses_a_timeout_that_is_not_positive(capsys):
    assert main(["stop", "raysubmit_1", "--timeout", "0"]) == 2
    assert "--timeout 0 is invalid" in one_error_line(capsys)


def test_submit_sends_neither_its_address_nor_ray_address_into_the_config(monkeypatch):
    seen = {}
    monkeypatch.setattr(jobs, "submit_job", lambda cfg, items, **kw: seen.update(cfg=cfg, items=items, **kw) or 0)
    monkeypatch.setenv("RAY_ADDRESS", "http://other:8265")
    assert main(["submit", "--address", "http://head:8265", "--no-wait", "algo.num_steps=3"]) == 0
    assert seen["address"] == "http://head:8265" and seen["wait"] is False and seen["token_file"] is None
    assert seen["cfg"].placement.ray_address == "" and seen["cfg"].algo.num_steps == 3
    assert seen["items"] == ["algo.num_steps=3"]


def test_submit_checks_the_config_before_any_server(capsys):
    # A bad key stops it here, before the (closed) address is even tried.
    assert main(["submit", "--address", f"http://127.0.0.1:{closed_port()}", "algo.no_such_key=1"]) == 2
    assert "algo.no_such_key" in one_error_line(capsys)


# --- the job server's address ----------------------------------------------------------------------------


def test_address_flag_then_api_server_variable_then_http_ray_address_then_default():
    full = {"RAY_API_SERVER_ADDRESS": "http://api:8265", "RAY_ADDRESS": "http://ray:8265"}
    assert jobs.job_server_address("http://flag:8265", full) == "http://flag:8265"
    assert jobs.job_server_address(None, full) == "http://api:8265"
    assert jobs.job_server_address(None, {"RAY_ADDRESS": "https://ray:443/"}) == "https://ray:443"
    assert jobs.job_server_address(None, {}) == "http://127.0.0.1:8265" == jobs.DEFAULT_JOB_SERVER
    # RAY_ADDRESS as `colocate launch` uses it (the cluster itself) says nothing about the job server.
    for gcs in ("auto", "10.0.0.1:6379", "ray://head:10001"):
        assert jobs.job_server_address(None, {"RAY_ADDRESS": gcs}) == jobs.DEFAULT_JOB_SERVER
    # HOST:PORT without a scheme is http, as `ray job submit` takes it.
    assert jobs.job_server_address("head:8265", {}) == "http://head:8265"


@pytest.mark.parametrize("bad", ["auto", "ray://head:10001", "http://head:port", "ftp://head:8265", "http://",
                                 "http://head :8265"])
def test_an_address_that_is_not_a_job_server_url_is_one_line(bad, capsys):
    with pytest.raises(ConfigError, match="--address=.*(not a URL|not a job server)"):
        jobs.job_server_address(bad, {})
    assert main(["jobs", "--address", bad]) == 2
    assert "http(s)://HOST:PORT" in one_error_line(capsys)


def test_a_bad_api_server_variable_is_named(monkeypatch, capsys):
    monkeypatch.setenv("RAY_API_SERVER_ADDRESS", "ray://head:10001")
    assert main(["jobs"]) == 2
    assert "RAY_API_SERVER_ADDRESS='ray://head:10001' is not a job server" in one_error_line(capsys)


# --- servers that cannot be used -------------------------------------------------------------------------


def test_a_closed_port_is_one_line_and_exit_2_within_seconds():
    address = f"http://127.0.0.1:{closed_port()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_API_SERVER", "RAY_AUTH"))}
    start = time.monotonic()
    result = subprocess.run([str(BIN / "colocate"), "jobs", "--address", address], env=env, capture_output=True,
                            text=True, timeout=30, check=False)
    assert time.monotonic() - start < 5
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith(f"colocate: error: cannot reach the job server at {address} (Connection refused)")
    assert result.stderr.count("\n") == 1, result.stderr


def test_a_server_that_never_answers_times_out(monkeypatch, capsys):
    monkeypatch.setattr(jobs, "PROBE_TIMEOUT_S", 0.5)
    with socket.socket() as silent:  # listens (the kernel completes the handshake) but never reads or answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        address = f"http://127.0.0.1:{silent.getsockname()[1]}"
        start = time.monotonic()
        assert main(["logs", "raysubmit_1", "--address", address]) == 2
        assert time.monotonic() - start < 5
    assert f"the job server at {address} did not answer within 0.5 s" in one_error_line(capsys)


class _AgentComingUp:
    """Ray's client on a head whose dashboard agent registers after `num_refusals` submissions."""

    def __init__(self, num_refusals: int):
        self.num_refusals, self.calls = num_refusals, []

    def get_address(self) -> str:
        return "http://h:1"

    def submit_job(self, **job):
        self.calls.append(job)
        if len(self.calls) <= self.num_refusals:
            # what Ray 2.60's client raises for the server's 500 (dashboard_sdk.py, _raise_error)
            raise RuntimeError(f"Request failed with status code 500: {jobs.NO_AGENT}, please try again later..")
        return "raysubmit_7"


def test_submit_waits_for_the_heads_agent_then_submits_once(monkeypatch, capsys):
    monkeypatch.setattr(jobs.time, "sleep", lambda s: None)
    client = _AgentComingUp(num_refusals=3)
    assert jobs._submit_once_agent_is_up(client, entrypoint="python -m colocate.cli launch") == "raysubmit_7"
    assert len(client.calls) == 4 and all(c == {"entrypoint": "python -m colocate.cli launch"} for c in client.calls)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "no agent on the head yet" in err[0]  # said once, not at every try


def test_an_agent_that_never_comes_is_one_line_after_the_wait(monkeypatch, capsys):
    monkeypatch.setattr(jobs, "AGENT_WAIT_S", 0.0)
    client = _AgentComingUp(num_refusals=10**6)
    with pytest.raises(jobs.JobServerError) as raised:
        with jobs.server_errors("http://h:1"):
            jobs._submit_once_agent_is_up(client, entrypoint="x")
    assert len(client.calls) == 1
    line = str(raised.value)
    assert "\n" not in line and line.startswith("the job server at http://h:1 still has no agent on its head after 0 s")
    assert "--dashboard-agent-listen-port" in line


def test_other_server_failures_are_not_tried_again():
    class Broken:
        calls = 0

        def submit_job(self, **job):
            Broken.calls += 1
            raise RuntimeError("Request failed with status code 500: Traceback ...")

    with pytest.raises(RuntimeError, match="Traceback"):
        jobs._submit_once_agent_is_up(Broken(), entrypoint="x")
    assert Broken.calls == 1


class _Answer(http.server.BaseHTTPRequestHandler):
    status, body = 200, b""

    def do_GET(self):
        self.send_response(self.status)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    """A local HTTP server answering every GET with the status and body a test sets."""
    handler = type("Handler", (_Answer,), {})
    httpd = http.server.HTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield SimpleNamespace(url=f"http://127.0.0.1:{httpd.server_port}", handler=handler)
    httpd.shutdown()
    httpd.server_close()


def test_a_server_that_is_not_a_ray_job_server_is_one_line(server, capsys):
    server.handler.status, server.handler.body = 404, b"not found"
    assert main(["jobs", "--address", server.url]) == 2
    assert "answered HTTP 404 to /api/version" in one_error_line(capsys)


def test_a_refused_token_is_one_line(server, tmp_path, capsys):
    token = tmp_path / "token"
    token.write_text("secret\n")
    token.chmod(0o600)
    server.handler.status = 401
    assert main(["stop", "raysubmit_1", "--address", server.url]) == 2
    assert one_error_line(capsys) == (f"colocate: error: the job server at {server.url} refused the token (HTTP 401, "
                                      "no token sent: pass --token-file PATH, or set RAY_AUTH_MODE=token with "
                                      "RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN)")
    server.handler.status = 403
    assert main(["jobs", "--address", server.url, "--token-file", str(token)]) == 2
    assert f"refused the token (HTTP 403: the token from --token-file {token} is not" in one_error_line(capsys)


# --- the token -------------------------------------------------------------------------------------------


def test_token_file_is_sent_as_a_bearer_header_and_checked(tmp_path, capsys):
    token = tmp_path / "token"
    token.write_text("abc123\n")
    token.chmod(0o600)
    assert jobs.token_headers(str(token)) == ({"Authorization": "Bearer abc123"}, f"--token-file {token}")
    assert capsys.readouterr().err == ""
    token.chmod(0o644)
    jobs.token_headers(str(token))
    assert "readable by others (mode 644)" in capsys.readouterr().err
    token.write_text("")
    with pytest.raises(ConfigError, match="is empty"):
        jobs.token_headers(str(token))
    with pytest.raises(ConfigError, match="cannot read it"):
        jobs.token_headers(str(tmp_path / "missing"))


def test_token_from_rays_variables_only_in_token_mode(tmp_path, monkeypatch):
    token = tmp_path / "token"
    token.write_text("fromfile")
    token.chmod(0o600)
    # Read in a child each time: Ray's token loader caches per process, and a Ray started earlier in this
    # process (the e2e tests run before the unit tests) switches it to token mode.
    probe = ("import colocate.cluster.submit as j; h, s = j.token_headers(None); "
             "print(list(h.values())[0] if h else '', s, sep='|')")
    base = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_API_SERVER", "RAY_AUTH"))}
    for extra, expected in [({}, "|no token (RAY_AUTH_MODE is not 'token' and no --token-file)"),
                            ({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)},
                             f"Bearer fromfile|RAY_AUTH_TOKEN_PATH={token}"),
                            ({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "fromenv", "RAY_AUTH_TOKEN_PATH": str(token)},
                             "Bearer fromenv|RAY_AUTH_TOKEN")]:
        out = subprocess.run([sys.executable, "-c", probe], env={**base, **extra},
                             capture_output=True, text=True, timeout=60, check=False)
        assert out.stdout.strip() == expected, out.stderr


# --- the jobs table --------------------------------------------------------------------------------------


def test_jobs_table_oldest_first_with_colocate_commands_and_short_entrypoints():
    def job(sid, status, start, entrypoint, metadata=None):
        return SimpleNamespace(submission_id=sid, job_id=None, status=status, start_time=start,
                               entrypoint=entrypoint, metadata=metadata)

    long = "python -c " + "x" * 200
    rows = jobs.jobs_table([
        job("raysubmit_b", "RUNNING", 2_000_000_000_000, "python -m colocate.cli launch --address auto " + "k=v " * 50,
            {"colocate_command": "colocate launch configs/default.yaml algo.num_steps=3"}),
        job("raysubmit_a", "SUCCEEDED", 1_000_000_000_000, long),
        job(None, "PENDING", None, "echo hi"),
    ])
    assert rows[0].split() == ["JOB", "STATUS", "START", "ENTRYPOINT"]
    assert [r.split()[0] for r in rows[1:]] == ["-", "raysubmit_a", "raysubmit_b"]
    assert rows[2].endswith("...") and len(rows[2].split("  ")[-1]) <= jobs.ENTRYPOINT_WIDTH
    assert rows[3].endswith("colocate launch configs/default.yaml algo.num_steps=3")
    assert len({r.index(r.split()[1]) for r in rows}) == 1  # columns aligned
