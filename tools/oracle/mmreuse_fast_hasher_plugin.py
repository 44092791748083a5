"""A pytest plugin (`-p mmreuse_fast_hasher_plugin`, this folder on PYTHONPATH) that puts
mmreuse's `fast_request_block_hasher` in place of vLLM's `get_request_block_hasher` before
vLLM's own test modules import it: how vLLM 0.33.0's tests are run against mmreuse."""

from mmreuse.integrations.vllm_hasher import register

register()


def pytest_terminal_summary(terminalreporter):
    from mmreuse.integrations.vllm_hasher import STATS

    terminalreporter.write_line(
        f"mmreuse fast hasher: {STATS['fast']} calls hashed by mmreuse, {STATS['vllm']} by vLLM's own"
    )
