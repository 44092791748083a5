"""`mmreuse.integrations.plugin_config`: the plug-ins' settings under vLLM's
`additional_config["mmreuse"]`, one typed record decoded in one place (no vLLM needed: a config
is duck-typed)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from mmreuse.demand_query import DEMAND_ID_KEY
from mmreuse.errors import InvalidArgument, InvalidArgumentType
from mmreuse.integrations.plugin_config import CONFIG_KEY, PluginSettings, read_config
from tests.support.paths import REPO


def test_the_keys():
    # user-facing: written in --additional-config and in every proxied P request's vllm_xargs
    assert (CONFIG_KEY, DEMAND_ID_KEY) == ("mmreuse", "mmreuse_demand_id")


def test_our_settings_are_read_typed_and_frozen():
    ours = {"demand_endpoint": "tcp://*:7000", "admission_records": True}
    cfg = SimpleNamespace(additional_config={CONFIG_KEY: ours, "other_plugin": {"x": 1}})
    got = read_config(cfg)
    assert got == PluginSettings(demand_endpoint="tcp://*:7000", admission_records=True)
    assert got.snapshot_identifiers is False and got.encoder_cache_events_topic == "ec"
    with pytest.raises(AttributeError):
        got.demand_endpoint = "changed"  # type: ignore[misc]
    assert ours == {"demand_endpoint": "tcp://*:7000", "admission_records": True}  # untouched


def test_every_key_is_documented():
    import mmreuse.integrations.plugin_config as module

    doc = (REPO / "docs/vllm-plugins.md").read_text()
    for key in PluginSettings.__struct_fields__:
        assert f"`{key}`" in (module.__doc__ or ""), key
        assert f"`{key}`" in doc, key


@pytest.mark.parametrize("typo", ["demand_endpiont", "admission_record", "Demand_endpoint", ""])
def test_an_unknown_key_is_refused_by_name(typo):
    cfg = SimpleNamespace(additional_config={CONFIG_KEY: {typo: "tcp://*:7000"}})
    with pytest.raises(InvalidArgument, match=rf"^additional_config\['mmreuse'\] has no key '{typo}'"):  # fmt: skip
        read_config(cfg)


def test_endpoints_are_non_empty_and_a_snapshot_endpoint_needs_the_events():
    def cfg(**ours):
        return SimpleNamespace(additional_config={CONFIG_KEY: ours})

    with pytest.raises(InvalidArgument, match=r"\['demand_endpoint'\] must be a non-empty str"):
        read_config(cfg(demand_endpoint=""))
    assert read_config(cfg(demand_endpoint=None)).demand_endpoint is None  # JSON null: absent
    with pytest.raises(
        InvalidArgumentType, match=r"\['demand_endpoint'\] must be a str, got int 7"
    ):
        read_config(cfg(demand_endpoint=7))
    with pytest.raises(InvalidArgument, match=r"snapshot_endpoint'\] needs .*events_endpoint'\]"):
        read_config(cfg(encoder_cache_snapshot_endpoint="tcp://*:1"))
    with pytest.raises(InvalidArgument, match=r"snapshot_endpoint'\] needs"):  # in code too
        PluginSettings(encoder_cache_snapshot_endpoint="tcp://*:1")
    both = cfg(
        encoder_cache_events_endpoint="tcp://*:1", encoder_cache_snapshot_endpoint="tcp://*:2"
    )
    assert read_config(both).encoder_cache_snapshot_endpoint == "tcp://*:2"


def test_a_process_may_answer_ec_snapshots_on_both_endpoints_but_not_one_port_twice():
    """A demand endpoint and an encoder-cache snapshot endpoint together (a cluster's E: its
    admission records, its snapshots) are allowed: both answer ECSnapshotQuery from the same
    thread-safe snapshots (tests/integrations/test_snapshots.py). Two keys naming one endpoint
    are refused, naming both."""
    ours = {
        "demand_endpoint": "tcp://*:7000",
        "encoder_cache_events_endpoint": "tcp://*:7001",
        "encoder_cache_snapshot_endpoint": "tcp://*:7002",
    }
    got = read_config(SimpleNamespace(additional_config={CONFIG_KEY: ours}))
    assert (got.demand_endpoint, got.encoder_cache_snapshot_endpoint) == (
        "tcp://*:7000",
        "tcp://*:7002",
    )
    same = {**ours, "encoder_cache_snapshot_endpoint": "tcp://*:7000"}
    with pytest.raises(
        InvalidArgument,
        match=r"^additional_config\['mmreuse'\]\['demand_endpoint'\] and "
        r"additional_config\['mmreuse'\]\['encoder_cache_snapshot_endpoint'\] must differ "
        r".*got 'tcp://\*:7000' for both",
    ):
        read_config(SimpleNamespace(additional_config={CONFIG_KEY: same}))
    with pytest.raises(InvalidArgument, match="must differ"):  # in code too
        PluginSettings(encoder_cache_events_endpoint="tcp://*:1", encoder_cache_events_replay_endpoint="tcp://*:1")  # fmt: skip


class _Hashable:
    """A platform's own additional_config (vLLM: `dict | SupportsHash`)."""

    def compute_hash(self) -> str:
        return "0"


@pytest.mark.parametrize(
    "config",
    [
        SimpleNamespace(),  # no additional_config at all
        SimpleNamespace(additional_config=None),
        SimpleNamespace(additional_config={}),  # vLLM's default
        SimpleNamespace(additional_config={"other_plugin": {"demand_endpoint": "tcp://*:1"}}),
        SimpleNamespace(additional_config=_Hashable()),
    ],
)
def test_nothing_of_ours_is_the_defaults(config):
    assert read_config(config) == PluginSettings()


@pytest.mark.parametrize("value", [None, "tcp://*:7000", ["demand_endpoint"], 1, True])
def test_a_value_that_is_not_an_object_is_refused(value):
    cfg = SimpleNamespace(additional_config={CONFIG_KEY: value})
    with pytest.raises(InvalidArgumentType) as exc:
        read_config(cfg)
    assert isinstance(exc.value, InvalidArgument)  # one `except ValueError` for callers
    assert str(exc.value).startswith("additional_config['mmreuse'] must be a dict")


def test_what_the_cluster_writes_is_what_the_plugins_read(tmp_path):
    from mmreuse.cluster.instance import InstanceSpec, server_argv

    spec = InstanceSpec(
        name="P0", role="prefill", port=1, kv_events_port=2, replay_port=3,
        ec_events_port=4, ec_replay_port=5, demand_port=6,
    )  # fmt: skip
    argv = server_argv(spec, Path("python"), tmp_path, tmp_path)
    extra = json.loads(argv[argv.index("--additional-config") + 1])
    ours = read_config(SimpleNamespace(additional_config=extra))
    assert ours.demand_endpoint == "tcp://*:6" and ours.admission_records
    assert ours.snapshot_identifiers and ours.encoder_cache_snapshot_endpoint is None
    assert ours.encoder_cache_events_endpoint == "tcp://*:4"
    # E: its encoder cache manager serves its snapshot; no scheduler plug-in without records
    spec = InstanceSpec(
        name="E0", role="encoder", port=1, ec_events_port=4, ec_replay_port=5, ec_snapshot_port=6
    )
    argv = server_argv(spec, Path("python"), tmp_path, tmp_path)
    extra = json.loads(argv[argv.index("--additional-config") + 1])
    ours = read_config(SimpleNamespace(additional_config=extra))
    assert ours.encoder_cache_snapshot_endpoint == "tcp://*:6" and ours.demand_endpoint is None
    assert "--scheduler-cls" not in argv and spec.ec_snapshot_endpoint == "tcp://127.0.0.1:6"


def test_a_flag_is_a_json_boolean():
    def cfg(**ours):
        return SimpleNamespace(additional_config={CONFIG_KEY: ours})

    assert read_config(cfg()).snapshot_identifiers is False  # absent: the default
    assert read_config(SimpleNamespace()).snapshot_identifiers is False
    assert read_config(cfg(snapshot_identifiers=True)).snapshot_identifiers is True
    assert read_config(cfg(snapshot_identifiers=False)).snapshot_identifiers is False
    for key in ("snapshot_identifiers", "admission_records", "allow_unverified_vllm"):
        for value in ("false", 0, 1, None, "true"):  # never a feature switched by a lookalike
            with pytest.raises(InvalidArgumentType, match=rf"\['{key}'\] must be true or false"):
                read_config(cfg(**{key: value}))
