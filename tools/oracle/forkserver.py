"""A fork server for the oracle venvs: import vLLM once, then run each oracle script in a fork.

Importing vLLM's scheduler takes ~12 s on the CI machines, and the oracle tests used to start a
fresh interpreter for each script they run. This process imports the modules named on its
command line once, then, for each job read from its control pipe, forks a child that runs the
job as `python ARGS` would (`SCRIPT ARGS...`, `-c CODE ARGS...` or `-m MODULE ARGS...`), in a
session of its own, with the job's environment, working directory, stdin and output files. The
child starts from the imported modules, never from another job's state: each job is a fresh
copy of this process.

It is a test harness (tests/support/oracle.py `oracle_run` starts it, per venv and per set of
interpreter-start variables, and falls back to a plain subprocess where it cannot serve). It is
not part of mmreuse and never runs outside the tests.

Protocol, one JSON object per line: the client writes {"args", "env", "cwd", "stdin", "stdout",
"stderr"} (paths; stdin may be null); the server answers {"pid": N} once the child runs, then
{"rc": N} when it ends (a negative N: killed by that signal, as `subprocess` reports it). The
first line the server writes is {"ready": true, "threads": N} or {"ready": false, "error": ...}.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import runpy
import sys
import threading
import traceback
import types


def _run_job(job: dict) -> None:
    """In the child: run as `python ARGS` would (its exit code: a SystemExit, or 0)."""
    args = list(job["args"])
    if args[0] == "-c":
        sys.argv = ["-c", *args[2:]]
        sys.path[0] = ""
        main = types.ModuleType("__main__")
        main.__dict__["__builtins__"] = __builtins__
        sys.modules["__main__"] = main
        exec(compile(args[1], "<string>", "exec"), main.__dict__)
    elif args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = args
        sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
        runpy.run_path(args[0], run_name="__main__")


def _exit_code(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def _child(job: dict, control: tuple[int, int]) -> None:
    os.setsid()
    for fd in control:
        os.close(fd)
    fd = os.open(job["stdin"] or os.devnull, os.O_RDONLY)
    os.dup2(fd, 0)
    os.close(fd)
    for name, target in (("stdout", 1), ("stderr", 2)):
        fd = os.open(job[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(fd, target)
        os.close(fd)
    code = 1
    try:
        os.chdir(job["cwd"])
        os.environ.clear()
        os.environ.update(job["env"])
        _run_job(job)
        code = 0
    except SystemExit as e:
        code = _exit_code(e)
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()  # what the interpreter runs at exit
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code & 0xFF)


def main() -> None:
    # the control channel on fds of its own; 0 and 1 become /dev/null and stderr, so that
    # nothing a child inherits reads or writes the protocol
    cin, cout = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    reader = os.fdopen(cin, "r", buffering=1)
    writer = os.fdopen(cout, "w", buffering=1)
    try:
        for name in sys.argv[1:]:
            importlib.import_module(name)
    except BaseException as e:
        writer.write(json.dumps({"ready": False, "error": f"{type(e).__name__}: {e}"}) + "\n")
        return
    threads = threading.active_count()
    writer.write(json.dumps({"ready": threads == 1, "threads": threads}) + "\n")
    if threads != 1:  # forking a process with threads is not safe: the client falls back
        return
    for line in reader:
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(job, (cin, cout))
        writer.write(json.dumps({"pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        writer.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")


if __name__ == "__main__":
    main()
