"""`mmreuse proxy` flags: the reference proxy's static-mode flags with its names, defaults and
meaning (vLLM 0.33.0 `disagg_epd_proxy.py`, its `__main__` block), the environment it reads
(ENCODER_MAX_BATCH_SIZE), and the usage errors: exit 2 with `mmreuse proxy: error: ...`."""

from __future__ import annotations

import dataclasses
import re

import pytest

from mmreuse import cli
from mmreuse.errors import InvalidArgument
from mmreuse.proxy.config import (
    FLAGS,
    EncodeInstance,
    PlanningConfig,
    PrefillInstance,
    ProxyConfig,
    build_parser,
    parse_args,
)
from tests.support.proxy_config import config_of

E = "http://e0:8001"
PD = "http://pd0:8002"
BASE = ["--encode-servers-urls", E, "--decode-servers-urls", PD]


def usage_error(capsys, argv, env=None) -> str:
    """parse_args must refuse `argv` as argparse does: SystemExit(2), the message on stderr."""
    with pytest.raises(SystemExit) as exc:
        parse_args(argv, env={} if env is None else env)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "mmreuse proxy: error:" in err
    return err


def test_reference_defaults():
    # The reference: --host 0.0.0.0, --port 8000, --prefill-servers-urls "none" (E + PD),
    # --decode-retries 1, --no-rewrite and --log-requests off, ENCODER_MAX_BATCH_SIZE 0.
    cfg = parse_args(BASE, env={})
    assert cfg == ProxyConfig(encode_urls=(E,), decode_urls=(PD,))
    assert (cfg.serving.host, cfg.serving.port, cfg.serving.decode_retries) == ("0.0.0.0", 8000, 1)
    assert (
        cfg.serving.no_rewrite,
        cfg.serving.log_requests,
        cfg.serving.encoder_max_batch_size,
    ) == (False, False, 0)
    assert cfg.prefill_urls == ()
    assert cfg.prefill_instances == (PD,)  # in E + PD the decode instances prefill
    assert (cfg.planning.policy, cfg.planning.routing) == ("eager", "random")
    defaults = {a.dest: a.default for a in build_parser()._actions}
    assert defaults["prefill_servers_urls"] == "none"
    assert defaults["encode_servers_urls"] == defaults["decode_servers_urls"] == ""


def test_every_reference_flag_is_read():
    cfg = parse_args(
        [
            "--host", "127.0.0.1",
            "--port", "9100",
            "--encode-servers-urls", "http://e0:1, http://e1:2/",
            "--prefill-servers-urls", "http://p0:3,http://p1:4",
            "--decode-servers-urls", "http://d0:5",
            "--decode-retries", "3",
            "--no-rewrite",
            "--log-requests",
        ],
        env={"ENCODER_MAX_BATCH_SIZE": "4"},
    )  # fmt: skip
    assert cfg.serving.host == "127.0.0.1" and cfg.serving.port == 9100
    # Comma-separated, stripped as the reference strips them (and a trailing slash dropped).
    assert cfg.encode_urls == ("http://e0:1", "http://e1:2")
    assert cfg.prefill_urls == ("http://p0:3", "http://p1:4")
    assert cfg.decode_urls == ("http://d0:5",)
    assert cfg.prefill_instances == cfg.prefill_urls  # E + P + D: P holds the prefix cache
    assert cfg.serving.decode_retries == 3
    assert cfg.serving.no_rewrite and cfg.serving.log_requests
    assert cfg.serving.encoder_max_batch_size == 4


@pytest.mark.parametrize("value", ["none", "disable", "", "NONE", "Disable"])
def test_no_prefill_means_e_plus_pd(value):
    # The reference: `args.prefill_servers_urls.lower() in ("disable", "none", "")`.
    cfg = parse_args([*BASE, "--prefill-servers-urls", value], env={})
    assert cfg.prefill_urls == ()
    assert cfg.prefill_instances == (PD,)


def test_decode_retries_zero_disables():
    assert parse_args([*BASE, "--decode-retries", "0"], env={}).serving.decode_retries == 0


def test_environment_defaults_to_os_environ(monkeypatch):
    monkeypatch.setenv("ENCODER_MAX_BATCH_SIZE", "7")
    assert parse_args(BASE).serving.encoder_max_batch_size == 7


@pytest.mark.parametrize("value", ["-1", "two", "1.5", " "])
def test_encoder_max_batch_size_refused(capsys, value):
    # The reference raises at import for a negative or non-integer value.
    err = usage_error(capsys, BASE, env={"ENCODER_MAX_BATCH_SIZE": value})
    assert "ENCODER_MAX_BATCH_SIZE" in err


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--encode-servers-urls", E],
        ["--decode-servers-urls", PD],
        ["--encode-servers-urls", "", "--decode-servers-urls", PD],
        ["--encode-servers-urls", " , ", "--decode-servers-urls", PD],
    ],
)
def test_missing_url_flags_refused(capsys, argv):
    err = usage_error(capsys, argv)
    assert "Static routing requires --encode-servers-urls and --decode-servers-urls" in err


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--decode-retries", "-1"], "--decode-retries"),
        (["--port", "0"], "--port"),
        (["--port", "70000"], "--port"),
        (["--port", "http"], "--port"),
        (["--block-size", "0"], "--block-size"),
        (["--e-cache-items", "0"], "--e-cache-items"),
        (["--e-cache-ttl", "0"], "--e-cache-ttl"),
        (["--e-cache-ttl", "nan"], "--e-cache-ttl"),
        (["--policy", "lazy"], "--policy"),
        (["--routing", "sticky"], "--routing"),
        (["--hash-algo", "md5"], "--hash-algo"),
        (["--render-url", "pd0:8002"], "--render-url"),
        (["--prefill-servers-urls", "p0:8003"], "--prefill-servers-urls"),
        (["--kv-events-endpoints", "127.0.0.1:5557"], "--kv-events-endpoints"),
        # parsed before, failed at start-up with a traceback:
        (["--e-cache-ttl", "inf"], "--e-cache-ttl=inf must be a finite number"),
        (["--kv-events-endpoints", "tcp://127.0.0.1:notaport"], "PORT in 1..65535"),
        (["--kv-events-endpoints", "tcp://127.0.0.1:0"], "PORT in 1..65535"),
        (["--kv-events-endpoints", "tcp://:5557"], "tcp://HOST:PORT"),
        (["--kv-events-endpoints", "ipc://"], "names no ipc address"),
        (["--encoder-cache-events-endpoints", "tcp://h:99999"], "--encoder-cache-events-endpoints"),
        (["--demand-endpoints", "tcp://h:x"], "--demand-endpoints"),
        (["--metrics-port", "0"], "--metrics-port=0 is not a TCP port"),
        (["--port", "9000", "--metrics-port", "9000"], "--metrics-port=9000 is --port's"),
        (["--metrics-host", "127.0.0.1"], "--metrics-host without --metrics-port"),
    ],
)
def test_bad_values_refused(capsys, argv, words):
    assert words in usage_error(capsys, [*BASE, *argv])


def test_bad_url_refused(capsys):
    err = usage_error(capsys, ["--encode-servers-urls", "e0:8001", "--decode-servers-urls", PD])
    assert "--encode-servers-urls" in err and "'e0:8001'" in err


def test_kv_events_endpoints_aligned_with_the_prefill_instances(capsys):
    two = ["--encode-servers-urls", E, "--decode-servers-urls", "http://d0:1,http://d1:2"]
    cfg = parse_args([*two, "--kv-events-endpoints", "tcp://d0:5557,"], env={})
    assert [i.kv_events for i in cfg.instances] == ["tcp://d0:5557", None]  # empty: no view
    err = usage_error(capsys, [*two, "--kv-events-endpoints", "tcp://d0:5557"])
    assert "--kv-events-endpoints has 1 entries but --decode-servers-urls has 2" in err
    # E + P + D: aligned with the P URLs, not the D ones.
    epd = [*two, "--prefill-servers-urls", "http://p0:3"]
    cfg = parse_args([*epd, "--kv-events-endpoints", "tcp://p0:1"], env={})
    assert cfg.instances == (PrefillInstance("http://p0:3", kv_events="tcp://p0:1"),)
    err = usage_error(capsys, [*epd, "--kv-events-endpoints", "tcp://p0:1,tcp://p1:1"])
    assert "--prefill-servers-urls has 1" in err
    err = usage_error(capsys, [*epd, "--kv-events-replay-endpoints", "tcp://p0:2"])
    assert "--kv-events-replay-endpoints needs --kv-events-endpoints" in err
    err = usage_error(
        capsys,
        [*epd, "--kv-events-endpoints", "tcp://p0:1", "--kv-events-replay-endpoints", ","],
    )
    assert "--kv-events-replay-endpoints has 2 entries" in err


ALIGNED = {  # flag -> the PrefillInstance field it fills
    "--kv-events-endpoints": "kv_events",
    "--kv-events-replay-endpoints": "kv_replay",
    "--encoder-cache-events-endpoints": "ec_events",
    "--encoder-cache-events-replay-endpoints": "ec_replay",
    "--demand-endpoints": "demand",
}


@pytest.mark.parametrize("prefill", [False, True], ids=["E+PD", "E+P+D"])
def test_one_record_per_instance_from_the_aligned_flags(prefill):
    urls = ["http://x0:1", "http://x1:2"]
    argv = ["--encode-servers-urls", E, "--decode-servers-urls", "http://d0:9" if prefill else ",".join(urls)]  # fmt: skip
    if prefill:
        argv += ["--prefill-servers-urls", ",".join(urls)]
    for flag, name in ALIGNED.items():
        argv += [flag, f"tcp://x0-{name}:5557,"]  # the second instance: an empty slot each
    argv += ["--policy", "index"]
    cfg = parse_args(argv, env={})
    first = {name: f"tcp://x0-{name}:5557" for name in ALIGNED.values()}
    assert cfg.instances == (PrefillInstance(urls[0], **first), PrefillInstance(urls[1]))
    assert cfg.prefill_instances == tuple(urls)  # what policy.Planner indexes
    # one frozen record each: nothing to keep in step
    with pytest.raises(AttributeError):
        cfg.instances[0].url = "http://elsewhere:1"  # type: ignore[misc]


@pytest.mark.parametrize("flag", list(ALIGNED))
@pytest.mark.parametrize("prefill", [False, True], ids=["E+PD", "E+P+D"])
def test_a_count_that_differs_from_the_instances_is_named(capsys, flag, prefill):
    argv = ["--encode-servers-urls", E, "--decode-servers-urls", "http://d0:1,http://d1:2"]
    which, n = "--decode-servers-urls", 2
    if prefill:
        argv += ["--prefill-servers-urls", "http://p0:1,http://p1:2,http://p2:3"]
        which, n = "--prefill-servers-urls", 3
    if "replay" in flag:  # a replay flag needs its events flag (right-sized here)
        argv += [flag.replace("-replay", ""), ",".join(["tcp://a:1"] * n)]
    err = usage_error(capsys, [*argv, flag, "tcp://a:1,tcp://b:2,tcp://c:3,tcp://d:4"])
    assert f"{flag} has 4 entries but {which} has {n}" in err


def test_a_config_built_in_code_gets_one_record_per_url():
    cfg = ProxyConfig(encode_urls=(E,), decode_urls=("http://d0:1", "http://d1:2"))
    assert cfg.instances == (PrefillInstance("http://d0:1"), PrefillInstance("http://d1:2"))
    epd = ProxyConfig(encode_urls=(E,), decode_urls=(PD,), prefill_urls=("http://p0:1",))
    assert epd.instances == (PrefillInstance("http://p0:1"),)
    assert epd.prefill_instances == ("http://p0:1",)
    moved = dataclasses.replace(epd, planning=PlanningConfig(seed=3))  # derived again, equal
    assert moved.prefill_instances == epd.prefill_instances and moved.instances == epd.instances
    with pytest.raises(InvalidArgument, match="instances are for"):
        ProxyConfig(encode_urls=(E,), decode_urls=(PD,), instances=(PrefillInstance("http://x:1"),))
    with pytest.raises(InvalidArgument, match="instances are for"):  # one missing
        dataclasses.replace(cfg, instances=cfg.instances[:1])
    with pytest.raises(InvalidArgument, match="has no demand endpoint"):
        config_of(encode_urls=(E,), decode_urls=(PD,), policy="demand")
    asks = config_of(
        encode_urls=(E,), decode_urls=(PD,), policy="demand",
        instances=(PrefillInstance(PD, demand="tcp://pd0:7000"),),
    )  # fmt: skip
    assert asks.instances[0].demand == "tcp://pd0:7000"


@pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor"])
def test_xxhash_needs_a_hash_seed(capsys, algo):
    err = usage_error(capsys, [*BASE, "--hash-algo", algo])
    assert "--hash-seed" in err
    cfg = parse_args([*BASE, "--hash-algo", algo, "--hash-seed", "0"], env={})
    assert (cfg.views.hash_algo, cfg.views.hash_seed) == (algo, "0")


@pytest.mark.parametrize("algo", ["sha256_cbor", "xxhash_cbor"])
def test_a_hash_seed_cbor_cannot_hash_is_a_usage_error(capsys, algo):
    # A non-UTF-8 argv byte reaches Python as a lone surrogate, which CBOR cannot encode: the
    # flag is refused at parse time, not with a traceback when P's block size is learned.
    seed = b"\xff\xfe".decode("utf-8", "surrogateescape")
    err = usage_error(capsys, [*BASE, "--hash-algo", algo, "--hash-seed", seed])
    assert "--hash-seed b'\\xff\\xfe' is not UTF-8" in err and f"--hash-algo {algo}" in err
    assert "Traceback" not in err
    # pickle (sha256) hashes it as vLLM does; a UTF-8 seed is taken under CBOR
    assert parse_args([*BASE, "--hash-seed", seed], env={}).views.hash_seed == seed
    cfg = parse_args([*BASE, "--hash-algo", algo, "--hash-seed", "sé"], env={})
    assert cfg.views.hash_seed == "sé"


def test_a_bad_hash_seed_exits_2_from_the_command_line(capsys):
    seed = b"\xff".decode("utf-8", "surrogateescape")
    with pytest.raises(SystemExit) as exc:
        cli.main(["proxy", *BASE, "--hash-algo", "sha256_cbor", "--hash-seed", seed,
                  "--block-size", "16"])  # fmt: skip
    assert exc.value.code == 2
    assert "mmreuse proxy: error: --hash-seed b'\\xff' is not UTF-8" in capsys.readouterr().err


def test_demand_aware_flags():
    cfg = parse_args(
        [
            *BASE,
            "--policy", "index",
            "--routing", "affine",
            "--render-url", "http://render:1/",
            "--kv-events-endpoints", "tcp://pd0:5557",
            "--kv-events-replay-endpoints", "tcp://pd0:5558",
            "--hash-algo", "sha256_cbor",
            "--hash-seed", "42",
            "--block-size", "32",
            "--e-cache-items", "10",
            "--e-cache-ttl", "2.5",
        ],
        env={},
    )  # fmt: skip
    assert cfg == (
        config_of(
            encode_urls=(E,),
            decode_urls=(PD,),
            policy="index",
            routing="affine",
            render_url="http://render:1",
            instances=(
                PrefillInstance(PD, kv_events="tcp://pd0:5557", kv_replay="tcp://pd0:5558"),
            ),
            hash_algo="sha256_cbor",
            hash_seed="42",
            block_size=32,
            e_cache_items=10,
            e_cache_ttl_s=2.5,
        )
    )
    assert parse_args(BASE, env={}).views.hash_seed is None  # unset, as vLLM without PYTHONHASHSEED


@pytest.mark.parametrize("policy", ["demand", "opportunistic"])
def test_demand_policies_flags(policy):
    two = ["--encode-servers-urls", E, "--decode-servers-urls", "http://d0:1,http://d1:2"]
    cfg = parse_args(
        [*two, "--policy", policy, "--demand-endpoints", "tcp://d0:7000, ipc:///tmp/d1"],
        env={},
    )
    assert cfg.planning.policy == policy
    assert [i.demand for i in cfg.instances] == ["tcp://d0:7000", "ipc:///tmp/d1"]
    assert cfg.views.demand_timeout_s == 1.0  # the default
    cfg = parse_args(
        [*BASE, "--policy", policy, "--demand-endpoints", "tcp://pd0:7000",
         "--demand-timeout", "0.25", "--routing", "affine"],
        env={},
    )  # fmt: skip
    assert (cfg.views.demand_timeout_s, cfg.planning.routing) == (0.25, "affine")
    # E + P + D: aligned with the P URLs.
    epd = [*two, "--prefill-servers-urls", "http://p0:3", "--policy", policy]
    cfg = parse_args([*epd, "--demand-endpoints", "tcp://p0:7000"], env={})
    assert cfg.instances == (PrefillInstance("http://p0:3", demand="tcp://p0:7000"),)
    assert parse_args(BASE, env={}).instances == (PrefillInstance(PD),)


@pytest.mark.parametrize("policy", ["demand", "opportunistic"])
@pytest.mark.parametrize(
    "extra, words",
    [
        ([], "--policy {policy} needs --demand-endpoints"),
        (["--demand-endpoints", ""], "--demand-endpoints: entry 0 (for http://pd0:8002) is empty"),
        (["--demand-endpoints", "tcp://a:1,tcp://b:2"], "--demand-endpoints has 2 entries but "
         "--decode-servers-urls has 1"),
        (["--demand-endpoints", "tcp://a:1,"], "--demand-endpoints has 2 entries"),
        (["--demand-endpoints", "127.0.0.1:7000"], "--demand-endpoints: '127.0.0.1:7000' is not"),
        (["--demand-endpoints", "tcp://a:1", "--demand-timeout", "0"], "--demand-timeout=0.0"),
        (["--demand-endpoints", "tcp://a:1", "--demand-timeout", "-1"], "--demand-timeout"),
        (["--demand-endpoints", "tcp://a:1", "--demand-timeout", "nan"], "--demand-timeout"),
        (["--demand-endpoints", "tcp://a:1", "--demand-timeout", "inf"], "--demand-timeout"),
        (["--demand-endpoints", "tcp://a:1", "--no-rewrite"], "--no-rewrite with --policy"),
    ],
)  # fmt: skip
def test_demand_policies_refused(capsys, policy, extra, words):
    err = usage_error(capsys, [*BASE, "--policy", policy, *extra])
    assert words.format(policy=policy) in err


def test_demand_endpoint_slots_must_all_be_given(capsys):
    two = ["--encode-servers-urls", E, "--decode-servers-urls", "http://d0:1,http://d1:2"]
    err = usage_error(capsys, [*two, "--policy", "demand", "--demand-endpoints", "tcp://d0:1,"])
    assert "--demand-endpoints: entry 1 (for http://d1:2) is empty" in err


@pytest.mark.parametrize("policy, asked", [("eager", []), ("index", ["PD0"])])
def test_demand_endpoints_accepted_under_any_policy(capsys, policy, asked):
    # one flag set serves every policy (mmreuse.cluster's proxy_args); checked all the same.
    # eager never asks; index asks an instance that has one while its view is incomplete.
    two = ["--encode-servers-urls", E, "--decode-servers-urls", "http://d0:1,http://d1:2"]
    cfg = parse_args([*two, "--policy", policy, "--demand-endpoints", "tcp://a:1,"], env={})
    assert [i.demand for i in cfg.instances] == ["tcp://a:1", None]
    from mmreuse.proxy.app import Proxy  # aiohttp: only here

    assert [c.name for c in Proxy(cfg).demand] == asked
    err = usage_error(capsys, [*BASE, "--policy", policy, "--demand-endpoints", "a:1"])
    assert "--demand-endpoints: 'a:1' is not a ZMQ endpoint" in err


def test_mmreuse_proxy_help(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["proxy", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: mmreuse proxy")
    for flag in (
        "--host", "--port", "--encode-servers-urls", "--prefill-servers-urls",
        "--decode-servers-urls", "--decode-retries", "--no-rewrite", "--log-requests",
        "--policy", "--kv-events-endpoints", "--hash-seed", "--demand-endpoints",
        "--demand-timeout",
    ):  # fmt: skip
        assert flag in out


def test_mmreuse_proxy_usage_error_exits_2(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["proxy", "--encode-servers-urls", E])
    assert exc.value.code == 2
    assert "Static routing requires" in capsys.readouterr().err


@pytest.mark.parametrize(
    "endpoint",
    [
        "tcp://127.0.0.1:5557",
        "tcp://[::1]:5557",
        "tcp://*:5557",
        "tcp://h:*",
        "ipc:///tmp/kv",
        "inproc://kv",
    ],
)
def test_zmq_endpoints_of_every_form_accepted(endpoint):
    cfg = parse_args([*BASE, "--kv-events-endpoints", endpoint], env={})
    assert cfg.instances[0].kv_events == endpoint


E2 = ["--encode-servers-urls", "http://e0:1,http://e1:2", "--decode-servers-urls", "http://d:3"]


def test_each_e_gets_its_encoder_cache_events_and_snapshot_endpoint():
    cfg = parse_args([*E2, "--policy", "index",
                      "--e-cache-events-endpoints", "tcp://e0:5,tcp://e1:6",
                      "--e-cache-events-replay-endpoints", "tcp://e0:7,",
                      "--e-snapshot-endpoints", ",tcp://e1:8"], env={})  # fmt: skip
    assert cfg.e_events
    assert cfg.encoders == (
        EncodeInstance("http://e0:1", "tcp://e0:5", "tcp://e0:7", None),
        EncodeInstance("http://e1:2", "tcp://e1:6", None, "tcp://e1:8"),
    )
    plain = parse_args(E2, env={})
    assert not plain.e_events and plain.encoders == (
        EncodeInstance("http://e0:1"), EncodeInstance("http://e1:2"),
    )  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (
            ["--e-cache-events-endpoints", "tcp://e0:5"],
            "has 1 entries but --encode-servers-urls has 2",
        ),
        (["--e-cache-events-endpoints", "tcp://e0:5,"], "entry 1 (for http://e1:2) is empty"),
        (["--e-cache-events-endpoints", "tcp://e0:5,e1:6"], "is not a ZMQ endpoint"),
        (["--e-snapshot-endpoints", "tcp://e0:5,tcp://e1:6"], "needs --e-cache-events-endpoints"),
        (["--e-cache-events-replay-endpoints", "tcp://e0:5,"], "needs --e-cache-events-endpoints"),
    ],
)
def test_e_event_flags_refused(capsys, extra, words):
    assert words in usage_error(capsys, [*E2, *extra])


def test_a_config_built_in_code_names_every_es_events_or_none():
    with pytest.raises(InvalidArgument, match="some encoders only"):
        ProxyConfig(
            encode_urls=("http://e0", "http://e1"),
            decode_urls=("http://d",),
            encoders=(EncodeInstance("http://e0", "tcp://e0:5"), EncodeInstance("http://e1")),
        )
    with pytest.raises(InvalidArgument, match="one record each"):
        ProxyConfig(
            encode_urls=("http://e0",), decode_urls=("http://d",),
            encoders=(EncodeInstance("http://e1"),),
        )  # fmt: skip


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("port", 0, "serving.port=0 is not a TCP port"),
        ("metrics_host", "127.0.0.1", "serving.metrics_host without serving.metrics_port"),
        ("decode_retries", -1, "serving.decode_retries=-1 must be an int >= 0"),
        ("block_size", 0, "views.block_size=0 must be an int >= 1"),
        ("e_cache_items", 0, "store.e_cache_items=0"),
        ("e_cache_ttl_s", float("inf"), "store.e_cache_ttl_s=inf must be a finite number"),
        ("render_url", "pd0:8002", "planning.render_url: 'pd0:8002' is not an http(s) URL"),
        ("render_timeout_s", 0, "planning.render_timeout_s=0 must be > 0"),
        ("demand_timeout_s", float("nan"), "views.demand_timeout_s=nan"),
        ("hash_algo", "md5", "views.hash_algo='md5' must be one of"),
        ("hash_algo", "xxhash", "views.hash_algo xxhash needs views.hash_seed"),
        ("routing", "sticky", "planning.routing='sticky' must be one of random, affine"),
        ("uuid_policy", "all", "media.uuid_policy='all' must be one of reference, tenant, content"),
        ("encoder_max_batch_size", -1, "serving.encoder_max_batch_size=-1 must be non-negative"),
        ("backend_keep_alive_s", -1.0, "serving.backend_keep_alive_s=-1.0 must be seconds >= 0"),
        ("prefill_urls", ("p0:1",), "prefill_urls: 'p0:1' is not an http(s) URL"),
    ],
)
def test_a_config_built_in_code_is_held_to_the_cli_rules(field, value, words):
    # Every rule lives in the record: what the parser refuses, a config built in code (the
    # bench, tests) is refused too, naming the field instead of the flag.
    with pytest.raises(InvalidArgument, match="^" + re.escape(words)):
        config_of(encode_urls=(E,), decode_urls=(PD,), **{field: value})


def test_instance_records_check_their_endpoints():
    with pytest.raises(InvalidArgument, match=r"PrefillInstance\.demand: 'a:1' is not a ZMQ"):
        PrefillInstance(PD, demand="a:1")
    with pytest.raises(InvalidArgument, match=r"PrefillInstance\.kv_replay needs .*kv_events"):
        PrefillInstance(PD, kv_replay="tcp://a:1")
    with pytest.raises(InvalidArgument, match=r"EncodeInstance\.snapshot needs .*ec_events"):
        EncodeInstance(E, snapshot="tcp://a:1")


def test_every_field_flag_is_a_flag_or_the_environment():
    flags = {s for a in build_parser()._actions for s in a.option_strings}
    fields = {f.name for f in dataclasses.fields(ProxyConfig)}
    env = {"ENCODER_MAX_BATCH_SIZE", "VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "OPENAI_API_KEY"}
    for name, flag in FLAGS.items():
        assert flag in flags or flag in env, (name, flag)
        assert name.split(".")[0] in fields, name


def test_the_environment_is_read_into_the_config():
    cfg = parse_args(BASE, env={"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "2", "OPENAI_API_KEY": "k"})
    assert (cfg.serving.backend_keep_alive_s, cfg.serving.api_key) == (2.0, "k")
    assert "'k'" not in repr(cfg)  # the key is never logged with the config
    assert parse_args(BASE, env={}).serving.backend_keep_alive_s == 5.0  # vLLM's default


@pytest.mark.parametrize("value", ["soon", ""])
def test_a_bad_keep_alive_is_refused(capsys, value):
    err = usage_error(capsys, BASE, env={"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": value})
    assert "VLLM_HTTP_TIMEOUT_KEEP_ALIVE" in err


# ---- refusals the argparse layer made, kept now that the records check -----------------------

P2 = ["--encode-servers-urls", E, "--decode-servers-urls", PD]
P2 += ["--prefill-servers-urls", "http://p0:1,http://p1:2"]
CONTENT = ["--uuid-policy", "content"]


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        # A media flag under a policy that fetches nothing, at its default value too.
        *(
            ([*BASE, "--uuid-policy", policy, flag, value],
             f"{flag} bounds what --uuid-policy content fetches: it does nothing under "
             f"--uuid-policy {policy}")
            for policy in ("reference", "tenant")
            for flag, value in (
                ("--media-max-bytes", "33554432"), ("--media-fetch-timeout", "5"),
                ("--media-request-timeout", "30"), ("--media-max-redirects", "5"),
                ("--allowed-media-domains", "a.com"),
                ("--allow-private-media-networks", "10.0.0.0/8"),
            )
        ),
        # An aligned flag given with every slot empty: no endpoint at all, not a choice.
        *(
            ([*E2, flag, ","], f"{flag}: ',' has no endpoint in any entry")
            for flag in (
                "--e-cache-events-endpoints", "--e-cache-events-replay-endpoints",
                "--e-snapshot-endpoints",
            )
        ),
        *(([*P2, flag, ","], f"{flag}: ',' has no endpoint in any entry") for flag in ALIGNED),
        ([*BASE, "--kv-events-endpoints", ""], "--kv-events-endpoints: '' has no endpoint"),
        (
            [*E2, "--e-cache-events-endpoints", "tcp://e0:5,tcp://e1:6", "--e-snapshot-endpoints", ","],
            "--e-snapshot-endpoints: ',' has no endpoint in any entry: give at least one "
            "(aligned with --encode-servers-urls), or leave the flag out",
        ),
        # Empty or blank media domains: named by the flag, as the user wrote them.
        ([*BASE, *CONTENT, "--allowed-media-domains", ""],
         "--allowed-media-domains: [''] must be host names (no scheme, port or path)"),
        ([*BASE, *CONTENT, "--allowed-media-domains", "a.com", " "],
         "--allowed-media-domains: ['a.com', ' '] must be host names (no scheme, port or path)"),
    ],
)  # fmt: skip
def test_a_refusal_of_the_flags_is_kept(capsys, argv, words):
    assert words in usage_error(capsys, argv)


def test_media_limits_are_content_only_in_code_too():
    from mmreuse.proxy.content import MediaLimits

    base = {"encode_urls": (E,), "decode_urls": (PD,)}
    assert ProxyConfig(**base).media.fetch is None  # nothing fetched, nothing to bound
    content = config_of(**base, uuid_policy="content")
    assert content.media.fetch == MediaLimits()  # the record's defaults apply under content
    moved = dataclasses.replace(content, planning=PlanningConfig(seed=1))
    assert moved.media.fetch == MediaLimits()
    assert config_of(**base, seed=1).media.fetch is None
    with pytest.raises(
        InvalidArgument, match=r"^media\.fetch bounds what media\.uuid_policy content fetches"
    ):
        config_of(**base, fetch=MediaLimits())  # set, even to the defaults: refused
    with pytest.raises(InvalidArgument, match=r"under media\.uuid_policy tenant"):
        config_of(**base, uuid_policy="tenant", fetch=MediaLimits(max_redirects=0))
    assert parse_args(BASE, env={}).media.fetch is None
    assert parse_args([*BASE, *CONTENT], env={}).media.fetch == MediaLimits()
