"""Three `mmreuse proxy --policy index` replicas behind HAProxy (round-robin, health-checked),
started at different times and restarted one after another while requests flow: each
replica's decision for a request equals what P's `DemandScheduler` answers for it, and the E
side (from E's own encoder-cache events) is the same for all. Skipped unless MMREUSE_LIVE=1.

R0 starts before P0 (P0 is restarted under it), serves the warm-up alone; R1 and R2 start
after it. Then, for each request, one replica in turn is stopped, the request goes through the
balancer to the two others, and the stopped one starts again (a late replica: its views come
from P0's and E0's snapshots) before the next: a rolling restart, every request during one.
"""

from __future__ import annotations

import time
from collections import Counter
from contextlib import ExitStack

import pytest

from mmreuse.cluster.balancer import haproxy
from mmreuse.cluster.client import post_json, render
from mmreuse.cluster.instance import free_ports
from mmreuse.cluster.proxy import proxy_process
from mmreuse.cluster.workload import conversations
from mmreuse.demand_query import DemandAnswer, DemandQuery, decode_answer, encode, query_for
from mmreuse.events.snapshot import fetch_snapshot
from mmreuse.proxy.metrics import sample_sum
from tests.support.live_proxy import metrics_text, until_complete

pytestmark = pytest.mark.live

SESSIONS, TURNS, WARM_TURNS = 3, 4, 1
E_BOUND = ("e_cached", "e_compute")  # what goes to E: the two agree on it whatever E holds
CLASSES = ("kv_covered", "no_embeds", "p_local", "p_external", "e_cached", "e_compute", "duplicate")


def _classes(url: str) -> Counter:
    text = metrics_text(url)
    return Counter(
        {k: sample_sum(text, "mmreuse_proxy_occurrences_total", klass=k) for k in CLASSES}
    )


def _ask(cluster, body, qid: str) -> tuple[DemandQuery, DemandAnswer]:
    import zmq

    p = cluster.instances["P0"].spec
    query = query_for(render(p.url, body), qid)
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    try:
        dealer.connect(p.demand_endpoint)
        dealer.send(encode(query))
        assert dealer.poll(30_000), "P0 did not answer within 30 s"
        answer = decode_answer(dealer.recv(), query if isinstance(query, DemandQuery) else None)
    finally:
        dealer.close(0)
    assert isinstance(answer, DemandAnswer), answer
    return query, answer


def test_replicas_behind_a_balancer_decide_as_p_answers_through_a_rolling_restart(
    cluster, proxy_flags, tmp_path
):
    run = f"replicas-{time.time_ns()}"
    requests = conversations(run, SESSIONS, TURNS)
    args = [*proxy_flags(["P0"]), "--policy", "index"]
    ports = free_ports(3)
    e0 = cluster.instances["E0"].spec
    with ExitStack() as stack:
        replicas: dict[int, ExitStack] = {}
        urls = [f"http://127.0.0.1:{p}" for p in ports]

        def start(i: int) -> None:
            s = ExitStack()
            s.enter_context(proxy_process(args, tmp_path / f"r{i}-{time.time_ns()}.log", port=ports[i]))  # fmt: skip
            replicas[i] = s
            until_complete(urls[i])

        def stop(i: int) -> None:
            replicas.pop(i).close()

        stack.callback(lambda: [s.close() for s in replicas.values()])
        start(0)
        took = cluster.restart("P0")  # R0 was there before P0
        until_complete(urls[0])
        lb = stack.enter_context(haproxy(urls, tmp_path / "haproxy"))
        for _s, t, body in requests:
            if t < WARM_TURNS:
                assert post_json(lb + "/v1/chat/completions", body, timeout=300)["choices"]
        start(1)
        start(2)
        time.sleep(0.5)  # the balancer's health checks (every 200 ms) take them in
        rows, differ, failed = [], 0, 0
        for k, (_s, t, body) in enumerate(r for r in requests if r[1] >= WARM_TURNS):
            down = k % 3
            stop(down)  # the rolling restart: this one is out while the request is served
            query, answer = _ask(cluster, body, f"{run}-{k}")
            held = {
                e.identifier for e in fetch_snapshot(e0.ec_snapshot_endpoint, kind="ec").entries
            }
            before = {i: _classes(urls[i]) for i in replicas}
            try:
                assert post_json(lb + "/v1/chat/completions", body, timeout=300)["choices"]
            except Exception:  # counted, asserted below
                failed += 1
            deltas = {i: _classes(urls[i]) - before[i] for i in replicas}
            (who,) = [i for i, d in deltas.items() if d]  # one replica decided it
            got = deltas[who]
            want = Counter(x.item_class.value for x in answer.items)
            p_side = {c: want[c] for c in CLASSES if c not in E_BOUND}
            same = {c: got[c] for c in CLASSES if c not in E_BOUND} == p_side and sum(
                got[c] for c in E_BOUND
            ) == sum(want[c] for c in E_BOUND)
            # the E side is E's own record, whichever replica decided: e_cached = held by E
            e_items = [
                i.identifier for i, x in zip(query.items, answer.items, strict=True)
                if x.item_class in E_BOUND
            ]  # fmt: skip
            same = same and got["e_cached"] == sum(1 for i in e_items if i in held)
            differ += not same
            rows.append((k, t, who, down, dict(got), dict(want)))
            start(down)
    n = len(rows)
    print(
        f"P0 restarted under R0 in {took:.1f} s; {n} requests through HAProxy during a rolling restart"
    )
    for row in rows:
        k, t, who, down, got, want = row
        print(f"  request {k} (turn {t}): R{who} decided (R{down} restarting): {got}; P: {want}")
    print(f"decisions differing from P's answers: {differ} of {n}; requests failed: {failed}")
    assert failed == 0 and differ == 0, rows
    assert len({r[2] for r in rows}) == 3  # every replica decided some, each after a restart
    assert sum(r[4].get("kv_covered", 0) for r in rows) >= SESSIONS * (TURNS - WARM_TURNS)
