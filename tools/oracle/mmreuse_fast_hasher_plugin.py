"""A pytest plugin (`-p mmreuse_fast_hasher_plugin`, this folder on PYTHONPATH) that puts
mmreuse's `fast_request_block_hasher` in place of vLLM's `get_request_block_hasher` before
vLLM's own test modules import it: how vLLM's tests (0.33.0, 0.34.0) are run against mmreuse
(tools/oracle/run_vllm_tests.sh). `register()` never raises (it degrades to vLLM's own hasher
with a warning), so the plugin checks that it took effect and stops the run where it did not."""

from vllm.v1.core import kv_cache_utils

from mmreuse.integrations.vllm_hasher import register

register()
if getattr(kv_cache_utils.get_request_block_hasher, "__mmreuse_original__", None) is None:
    raise RuntimeError(
        "mmreuse's register() left vLLM's own request block hasher in place (its warning, "
        "above, says why): these runs would test vLLM's hasher against itself"
    )


def pytest_terminal_summary(terminalreporter):
    from mmreuse.integrations.vllm_hasher import STATS, fallbacks

    reasons = ", ".join(f"{k} {v}" for k, v in fallbacks().items() if v) or "none"
    terminalreporter.write_line(
        f"mmreuse fast hasher: {STATS['fast']} calls hashed by mmreuse, {STATS['vllm']} by "
        f"vLLM's own (fallbacks: {reasons})"
    )
