"""Ctrl-C stops `colocate logs --follow` even when the command inherited SIGINT ignored, as anything started in the
background by a non-interactive shell does (`make test &`, CI runners): the CLI takes SIGINT back."""

import signal
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import asyncio, sys
    from types import SimpleNamespace
    import colocate.cluster.submit as submit
    from colocate.cli import main

    class Client:  # Ray's JobSubmissionClient at the boundary: a job that prints one line and keeps running
        def get_job_info(self, job_id):
            return SimpleNamespace(status="RUNNING", message="")

        async def tail_job_logs(self, job_id):
            yield "hello\\n"
            await asyncio.Event().wait()

    submit.connect = lambda address, token_file: (Client(), "http://h:8265")
    sys.exit(main(["logs", "raysubmit_1", "--follow"]))
""")


def _sigint_ignored():
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited through exec, as from `cmd &` in a script


def test_ctrl_c_stops_following_when_sigint_was_inherited_ignored():
    follower = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                preexec_fn=_sigint_ignored)
    try:
        assert follower.stdout.readline() == b"hello\n"
        follower.send_signal(signal.SIGINT)
        _, err = follower.communicate(timeout=20)
    finally:
        follower.kill()
    assert follower.returncode == 130 and b"keeps running" in err, err.decode()
