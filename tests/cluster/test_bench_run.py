"""One bench-cluster run (mmreuse.cluster.bench_run): its options checked, by the command
(`mmreuse bench-cluster`, flags named) and in code, before any cluster starts."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")  # the workload is the simulator's (mmreuse.sim), which needs it

from mmreuse import cli
from mmreuse.cluster.bench_run import BenchOptions, bench_workload
from mmreuse.errors import InvalidArgument


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--rate", "0"], "--rate: must be a finite number of requests/s > 0"),
        (["--rate", "nan"], "--rate"),
        (["--image-tokens", "fixed:0"], "image_tokens"),
        (["--requests", "0"], "--requests"),
        (
            ["--encode-urls", "http://e:1", "--pd-urls", "http://p:1"],
            "--demand-endpoints: 0 for 1 --pd-urls",
        ),
        (
            ["--pd-urls", "http://p:1", "--demand-endpoints", "tcp://p:2"],
            "--encode-urls and --pd-urls",
        ),
        (["--repeats", "0"], "--repeats: must be >= 1"),
        (
            ["--servegen-client", "client-12"],
            "--servegen-client: only with --workload servegen-photos",
        ),
        (
            ["--workload", "servegen-photos", "--servegen-client", "x"],
            "servegen_client must be one of",
        ),
        (["--pace-store"], "--pace-store: paces the local Mooncake Store's link"),  # tiny: none
    ],
)
def test_bench_cluster_refuses_bad_arguments_before_starting(capsys, argv, words):
    assert cli.main(["bench-cluster", *argv]) == 2
    assert words in capsys.readouterr().err


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"policies": ()}, "policies must name at least one policy"),
        ({"policies": ("eager", "eagre")}, "policies[1] must be one of"),
        ({"policies": ("eager", "reference", "eager")}, "policies[2]: 'eager' is named twice"),
        ({"repeats": 0}, "--repeats"),
        ({"rate": float("inf")}, "--rate: must be a finite number of requests/s > 0, got inf"),
        ({"servegen_client": "client-12"}, "--servegen-client: only with --workload"),
        ({"pace_store": True}, "(profiles with one: ['serving']); got profile 'tiny'"),
        (
            {"pace_store": True, "profile": "serving", "ec_connector": "example"},
            "--ec-connector 'example'",
        ),
        (
            {"pace_store": True, "encode_urls": ("http://e:1",), "pd_urls": ("http://p:1",)},
            "a deployment given by URL",
        ),
    ],
)
def test_options_built_in_code_are_checked_as_the_flags_are(options, words):
    with pytest.raises(InvalidArgument) as exc:
        BenchOptions(**{"policies": ("eager",), **options})
    assert words in str(exc.value)


def test_the_workload_is_the_simulators_sized_for_the_tiny_model():
    workload = bench_workload(BenchOptions(("eager",), workload="fanout", requests=7))
    assert (workload.kind, workload.requests, workload.mean_turns) == ("fanout", 7, 4.0)
    with pytest.raises(InvalidArgument, match="image_tokens"):
        bench_workload(BenchOptions(("eager",), image_tokens="fixed:0"))


def test_the_commands_defaults_are_the_options_defaults(monkeypatch):
    from mmreuse.decision import POLICIES

    seen = []
    monkeypatch.setattr(cli, "bench_cluster", lambda args: seen.append(args) or 0)
    assert cli.main(["bench-cluster"]) == 0
    assert cli._bench_options(seen[0]) == BenchOptions(POLICIES)
    assert (
        cli.main(["bench-cluster", "--policy", "index", "--policy", "eager", "--policy", "index"])
        == 0
    )
    assert cli._bench_options(seen[1]).policies == ("index", "eager")  # a flag repeated: once


def test_proxy_flags_reach_the_local_clusters_proxy(monkeypatch):
    # --proxy-flags go to every mmreuse proxy of a run on the local cluster (a deployment
    # given by URL carries them in its own proxy_args)
    from mmreuse.cluster import bench_drive, bench_run

    seen = []

    def run_policy(cluster, policy, reqs, **kw):
        seen.append((policy, kw.get("proxy_args")))
        return {"outcomes": [], "row": {}, "result": None}

    class Local:
        def proxy_args(self):
            return ["--encode-servers-urls", "http://e:1"]

    monkeypatch.setattr(bench_drive, "run_policy", run_policy)
    opts = BenchOptions(policies=("index",), repeats=2, proxy_flags=("--encode-on-p", "single"))
    bench_run._drive_all(Local(), opts, [], None, None)
    want = ["--encode-servers-urls", "http://e:1", "--encode-on-p", "single"]
    assert seen == [("index", want)] * 2
