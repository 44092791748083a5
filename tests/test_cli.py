"""The `mmreuse` console command."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")  # hash-demo and simulate load mmreuse.residency, which needs it

from mmreuse.cli import main


def test_hash_demo_prints_every_block(capsys):
    assert main(["hash-demo"]) == 0
    out = capsys.readouterr().out
    assert "NONE_HASH 066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198" in out
    rows = [line for line in out.splitlines() if line.strip().split(" ")[0].isdigit()]
    assert len(rows) == 150 // 16
    assert "('mm'," in out


def test_hash_demo_bad_argument_is_a_clear_error(capsys):
    assert main(["hash-demo", "--hash-fn", "xxhash"]) == 2
    assert "seed=None" in capsys.readouterr().err
    assert main(["hash-demo", "--block-size", "0"]) == 2
    assert "block_size" in capsys.readouterr().err


def test_console_script_runs():
    out = subprocess.run(
        [sys.executable, "-m", "mmreuse.cli", "hash-demo", "--hash-fn", "xxhash", "--seed", "0"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "hash_fn xxhash" in out


def simulate(capsys, monkeypatch, *args):
    """`mmreuse simulate ARGS` that must fail before any policy runs: (status, stderr)."""
    monkeypatch.setattr("mmreuse.sim.Simulation.run", lambda self: pytest.fail("it ran"))
    status = main(["simulate", *args, "--no-progress"])
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err and err.count("\n") == 1, (out, err)
    return status, err


@pytest.mark.parametrize(
    "args,message",
    [
        (["--requests", "0"], "--requests: must be >= 1, got 0"),
        (["--requests", "-5"], "--requests: must be >= 1, got -5"),
        (["--requests", "many"], "--requests: must be an int, got 'many'"),
        (["--requests", "1" + "0" * 12], "--requests: the run would need about"),
        (["--seed", "x"], "--seed: must be an int, got 'x'"),
        (["--seed", "1.5"], "--seed: must be an int, got '1.5'"),
        (["--policy", "sticky"], "--policy: invalid choice: 'sticky'"),
        (["--routing"], "--routing: expected one argument"),
        (["--frobnicate"], "unrecognized arguments: --frobnicate"),
    ],
)
def test_bad_command_line_values(capsys, monkeypatch, args, message):
    status, err = simulate(capsys, monkeypatch, *args)
    assert status == 2 and err.startswith(f"mmreuse: error: {message}"), err


def test_bad_trace_on_the_command_line(tmp_path, capsys, monkeypatch):
    missing = tmp_path / "missing.jsonl"
    status, err = simulate(capsys, monkeypatch, "--trace", str(missing))
    assert status == 2
    assert err.startswith(f"mmreuse: error: {missing}: trace file: cannot be read (No such file")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"session": "a", "arrival_s": 0, "text_tokens": 5}\n{"session": \n')
    status, err = simulate(capsys, monkeypatch, "--trace", str(bad))
    assert status == 2 and err.startswith(f"mmreuse: error: {bad}:2: record: invalid JSON (")


def test_output_paths_are_checked_before_the_run(tmp_path, capsys, monkeypatch):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    cases = [
        ("--json", str(tmp_path), "it is a directory"),
        ("--json", str(tmp_path / "no" / "out.json"), "does not exist"),
        ("--json", str(a_file / "out.json"), "is not a directory"),
        ("--json", "", "must be a file path"),
        ("--plot", str(tmp_path / "out.xyz"), "unknown image format 'xyz'"),
        ("--plot", str(tmp_path), "it is a directory"),
    ]
    if os.path.isdir("/proc"):  # what os.access lets root through, and open does not
        cases.append(("--json", "/proc/mmreuse-out.json", "cannot write"))
    for flag, path, message in cases:
        status, err = simulate(capsys, monkeypatch, flag, path)
        assert status == 2, (flag, path)
        assert err.startswith(f"mmreuse: error: {flag}: ") and message in err, err
    same = str(tmp_path / "out.png")
    status, err = simulate(capsys, monkeypatch, "--json", same, "--plot", same)
    assert status == 2 and "--plot: is the same file as --json" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # the probes left nothing
    assert a_file.read_text() == "x"


def test_an_existing_output_is_left_alone_until_written(tmp_path, capsys, monkeypatch):
    out = tmp_path / "out.json"
    out.write_text("old")
    monkeypatch.setattr("mmreuse.sim.Simulation.run", lambda self: pytest.fail("it ran"))
    assert main(["simulate", "--json", str(out), "--requests", "0", "--no-progress"]) == 2
    assert out.read_text() == "old"


def test_hash_demo_refuses_text_that_is_not_utf8(capsys):
    # argv bytes that are not UTF-8 arrive as lone surrogates, which cannot be hashed
    assert main(["hash-demo", "--seed", "\udcff"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mmreuse: error: --seed: must be valid UTF-8 text")
    assert main(["hash-demo", "--block-size", "x"]) == 2
    assert "--block-size: must be an int" in capsys.readouterr().err


def _proxy(*argv: str) -> subprocess.CompletedProcess:
    code = "import sys; from mmreuse.cli import main; sys.exit(main())"
    flags = [
        "--encode-servers-urls",
        "http://127.0.0.1:1",
        "--decode-servers-urls",
        "http://127.0.0.1:2",
    ]
    return subprocess.run(
        [sys.executable, "-c", code, "proxy", *flags, *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )


def _one_error_line(out: subprocess.CompletedProcess, prefix: str) -> str:
    assert out.returncode == 2, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix), out.stderr  # no traceback, no
    return lines[0]  # "Unclosed client session"


def test_proxy_on_a_taken_port_is_one_error_line():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = _one_error_line(
            _proxy("--host", "127.0.0.1", "--port", str(port)), "mmreuse proxy: error: "
        )
    assert f"cannot listen on 127.0.0.1:{port}" in line and "in use" in line


def test_proxy_on_an_unresolvable_host_is_one_error_line():
    line = _one_error_line(
        _proxy("--host", "no-such-host.invalid", "--port", "18555"), "mmreuse proxy: error: "
    )
    assert "cannot listen on no-such-host.invalid:18555" in line


def test_bench_cluster_against_an_unreachable_deployment_names_the_url():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    code = "import sys; from mmreuse.cli import main; sys.exit(main())"
    out = subprocess.run(
        [sys.executable, "-c", code, "bench-cluster", "--encode-urls", f"http://127.0.0.1:{port}",
         "--pd-urls", f"http://127.0.0.1:{port}", "--demand-endpoints", "tcp://127.0.0.1:1",
         "--policy", "eager", "--requests", "2", "--no-progress"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 1, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(
        f"mmreuse bench-cluster: error: E0 at http://127.0.0.1:{port} does not answer"
    )


def test_proxy_with_its_metrics_port_taken_names_that_address():
    import socket

    with socket.socket() as taken, socket.socket() as free:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        free.bind(("127.0.0.1", 0))
        port, mport = free.getsockname()[1], taken.getsockname()[1]
        free.close()
        out = _proxy("--host", "127.0.0.1", "--port", str(port), "--metrics-port", str(mport))
        line = _one_error_line(out, "mmreuse proxy: error: ")
    assert f"cannot listen on 127.0.0.1:{mport}" in line


def test_cluster_up_store_choices_are_the_clusters():
    from mmreuse import cli
    from mmreuse.cluster import cluster as cl

    assert cli.EC_CONNECTORS == cl.EC_CONNECTORS
    assert cli.DEFAULT_E_STORE_BYTES == cl.DEFAULT_E_STORE_BYTES


def test_cluster_up_refuses_an_unknown_store(capsys):
    from mmreuse.cli import main

    assert main(["cluster", "up", "--ec-connector", "lmcache"]) == 2
    assert "invalid choice: 'lmcache'" in capsys.readouterr().err
