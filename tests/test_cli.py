"""The `mmreuse` console command."""

import subprocess
import sys

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
