"""`mmreuse.integrations.plugin_config`: the plug-ins' settings under vLLM's
`additional_config["mmreuse"]`, read in one place (no vLLM needed: a config is duck-typed)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from mmreuse.errors import InvalidArgument, InvalidArgumentType
from mmreuse.integrations.plugin_config import CONFIG_KEY, DEMAND_ID_KEY, read_config, read_flag


def test_the_keys():
    # user-facing: written in --additional-config and in every proxied P request's vllm_xargs
    assert (CONFIG_KEY, DEMAND_ID_KEY) == ("mmreuse", "mmreuse_demand_id")


def test_our_settings_are_read_and_copied():
    ours = {"demand_endpoint": "tcp://*:7000", "admission_records": True}
    cfg = SimpleNamespace(additional_config={CONFIG_KEY: ours, "other_plugin": {"x": 1}})
    got = read_config(cfg)
    assert got == ours
    got["demand_endpoint"] = "changed"
    assert ours["demand_endpoint"] == "tcp://*:7000"  # a copy: the engine's config untouched


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
def test_nothing_of_ours_is_empty(config):
    assert read_config(config) == {}


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
    assert ours["demand_endpoint"] == "tcp://*:6"
    assert ours["encoder_cache_events_endpoint"] == "tcp://*:4"


def test_a_flag_is_a_json_boolean():
    def cfg(**ours):
        return SimpleNamespace(additional_config={CONFIG_KEY: ours})

    assert read_flag(cfg(), "snapshot_identifiers") is False  # absent: the default
    assert read_flag(cfg(), "snapshot_identifiers", default=True) is True
    assert read_flag(SimpleNamespace(), "snapshot_identifiers") is False
    assert read_flag(cfg(snapshot_identifiers=True), "snapshot_identifiers") is True
    assert read_flag(cfg(snapshot_identifiers=False), "snapshot_identifiers", True) is False
    for value in ("false", 0, 1, None, "true"):  # never a feature switched by a lookalike
        with pytest.raises(InvalidArgumentType, match=r"\['snapshot_identifiers'\] must be true"):
            read_flag(cfg(snapshot_identifiers=value), "snapshot_identifiers")
