"""The oracle fork server (tools/oracle/forkserver.py, driven by tests/support/oracle.py): a job
run in a fork behaves as `python ARGS` in a fresh interpreter would (output, exit code, stdin,
environment, working directory, argv, sys.path, `__main__`), no job sees another's state, a
job past its timeout is killed with its children, and a server that cannot fork safely is not
used. Run here on this venv's python, with a light module preloaded in place of vLLM."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from tests.support.oracle import _ForkServer


@pytest.fixture
def server():
    s = _ForkServer(sys.executable, dict(os.environ), preload=("json",))
    assert s.ready
    yield s
    s.close()


def _run(server, *args, stdin=None, env=None, cwd=None, timeout=30.0):
    return server.run(list(args), dict(env or os.environ), str(cwd or os.getcwd()), stdin, timeout)


def test_a_job_is_what_a_fresh_interpreter_would_do(server, tmp_path):
    code = textwrap.dedent(
        """
        import os, sys
        print(sys.argv, repr(sys.path[0]), __name__, os.getcwd(), os.environ["ORACLE_T"])
        print("err", file=sys.stderr)
        print(sys.stdin.read())
        raise SystemExit(3)
        """
    )
    env = {**os.environ, "ORACLE_T": "x"}
    rc, out, err = _run(server, "-c", code, "a", "b", stdin="in", env=env, cwd=tmp_path)
    want = subprocess.run(
        [sys.executable, "-c", code, "a", "b"], input="in", capture_output=True, text=True,
        env=env, cwd=tmp_path,
    )  # fmt: skip
    assert (
        (rc, out, err) == (want.returncode, want.stdout, want.stderr) == (3, want.stdout, "err\n")
    )


def test_a_script_runs_as_main_with_its_folder_first_on_the_path(server, tmp_path):
    (tmp_path / "helper.py").write_text("VALUE = 7\n")
    script = tmp_path / "job.py"
    script.write_text(
        "import sys, helper\nif __name__ == '__main__':\n    print(sys.argv[1:], helper.VALUE)\n"
    )
    assert _run(server, str(script), "x") == (0, "['x'] 7\n", "")


def test_jobs_never_see_each_others_state(server):
    code = "import json, sys; print(hasattr(json, 'mark'), 'jobmod' in sys.modules); json.mark = 1"
    first = _run(server, "-c", code + "; import tokenize as jobmod")
    second = _run(server, "-c", code)
    assert first == second == (0, "False False\n", "")


def test_an_exception_exits_1_with_its_traceback_and_signals_are_negative(server):
    rc, _, err = _run(server, "-c", "raise ValueError('boom')")
    assert rc == 1 and "ValueError: boom" in err and "Traceback" in err
    assert _run(server, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)")[0] == -15
    assert _run(server, "-c", "import sys; sys.exit('bye')") == (1, "", "bye\n")


def test_a_job_past_its_timeout_is_killed_with_its_children(server, tmp_path):
    pidfile = tmp_path / "child.pid"
    code = (
        "import subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"open({str(pidfile)!r}, 'w').write(str(p.pid)); time.sleep(60)"
    )
    with pytest.raises(subprocess.TimeoutExpired):
        _run(server, "-c", code, timeout=3.0)
    child = int(pidfile.read_text())
    for _ in range(50):  # the grandchild, in the job's session, got SIGKILL too
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the job's child {child} outlived its timeout")
    assert _run(server, "-c", "print(1)") == (0, "1\n", "")  # the server serves on


def test_a_server_whose_preload_fails_or_starts_threads_is_not_used(tmp_path):
    assert not _ForkServer(sys.executable, dict(os.environ), preload=("no_such_module_x",)).ready
    # a module that starts a thread at import: forking it is unsafe, so the server refuses
    (tmp_path / "oracle_threaded_mod.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
    )
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    assert not _ForkServer(sys.executable, env, preload=("oracle_threaded_mod",)).ready
