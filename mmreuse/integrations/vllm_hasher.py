"""A drop-in for vLLM's `get_request_block_hasher`: the same hashes of a `Request`'s new full
blocks, from mmreuse's C fast path.

`fast_request_block_hasher(hash_block_size, caching_hash_fn, num_hash_lookahead_tokens=0)` has
vLLM 0.33.0's signature and contract: the returned function hashes the blocks after
`request.block_hashes` (cost proportional to the new blocks), chained from vLLM's own
`NONE_HASH` as it is when called. Whatever mmreuse cannot reproduce exactly falls back to
vLLM's own function, per request: a hash function mmreuse does not have, prompt embeddings, a
block or key past the fast path's limits, and key strings that are one shared object
(pickle memoizes by identity: vLLM's engine core sees fresh strings after its msgpack wire,
which is what mmreuse writes, but an in-process `Request` may share them). Token ids are taken
as vLLM takes them (any int: its tests use negative placeholder ids), and a bool lookahead is
an int, as in vLLM.

`register()` is the `vllm.general_plugins` entry point (`VLLM_PLUGINS=mmreuse_fast_hasher`):
it puts this function where vLLM's engine core looks it up.

The hash scheme is the running vLLM's (`schemes.scheme_for_vllm(vllm.__version__)`: vLLM
0.31.0 - 0.33.0 hash as `vllm-0.33`, and so on back to 0.10.2). A vLLM in no scheme's range
(newer than 0.33.0, older than 0.10.2) is refused, by `register()` before it replaces
anything and by `fast_request_block_hasher`, unless `MMREUSE_ALLOW_UNVERIFIED_VLLM=1`: then
the nearest scheme, with a warning.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable
from typing import Any

from ..errors import InvalidArgument
from ..hashing.hasher import _check_mm, _make_spec
from ..hashing.schemes import HashScheme, scheme_for_vllm, vllm_ranges
from ..occurrence import MMOccurrence
from ..validate import check_int, fail_type, fail_value
from .vllm_versions import ALLOW_ENV, override_in_force, unverified_message

# under vLLM's "vllm" logger: its handler and format, so these lines appear in vLLM's log
logger = logging.getLogger(f"vllm.{__name__}")

# vLLM 0.33.0's hash functions (vllm.utils.hashing), by name: mmreuse reproduces these.
_VLLM_HASH_FNS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
_KEYS_ATTR = "_mmreuse_request_keys"
# Calls answered by mmreuse's fast path and by vLLM's own hasher, in this process.
STATS = {"fast": 0, "vllm": 0}


def _mmreuse_hash_fn(fn: Any) -> str | None:
    """mmreuse's name for vLLM's `caching_hash_fn`, or None when it is not one of vLLM's."""
    name = getattr(fn, "__name__", None)
    if getattr(fn, "__module__", None) == "vllm.utils.hashing" and name in _VLLM_HASH_FNS:
        return name
    return None


def scheme_for_running_vllm(version: str, environ: Any = None) -> HashScheme:
    """The hash scheme of vLLM `version`; one in no scheme's range raises InvalidArgument
    naming it and the supported range, unless MMREUSE_ALLOW_UNVERIFIED_VLLM=1 (in `environ`,
    default os.environ) or a DemandScheduler of this process started with
    `allow_unverified_vllm`: then the nearest scheme, with a warning."""
    try:
        return scheme_for_vllm(version)
    except InvalidArgument:
        nearest = scheme_for_vllm(version, nearest=True)  # a malformed version raises here
        message = unverified_message(
            f"a vLLM whose hash scheme the fast hasher knows ({vllm_ranges()})",
            version,
            [],
            f"{ALLOW_ENV}=1 (it then hashes as {nearest.name}, the nearest)",
        )
        if not override_in_force(environ):
            raise InvalidArgument(message) from None
        logger.warning("mmreuse: fast hasher on an unverified vLLM (%s=1): %s", ALLOW_ENV, message)
        return nearest


def _running_scheme() -> HashScheme:
    import vllm  # inside vLLM's process only

    return scheme_for_running_vllm(str(getattr(vllm, "__version__", "unknown")))


def _request_strings(request: Any) -> list[Any]:
    strs = [f.identifier for f in request.mm_features]
    if request.cache_salt:
        strs.append(request.cache_salt)
    lora = request.lora_request
    if lora:
        strs += [lora.lora_name, lora.lora_path]
    return strs


def fast_request_block_hasher(
    hash_block_size: int,
    caching_hash_fn: Callable[[Any], bytes],
    num_hash_lookahead_tokens: int = 0,
) -> Callable[[Any], list[bytes]]:
    """vLLM's `get_request_block_hasher`, hashed by mmreuse (see the module docstring)."""
    from vllm.v1.core import kv_cache_utils  # inside vLLM's process only

    scheme = _running_scheme()
    original = _vllm_original(kv_cache_utils)
    if "num_hash_lookahead_tokens" in inspect.signature(original).parameters:
        vllm_hasher = original(hash_block_size, caching_hash_fn, num_hash_lookahead_tokens)
    elif num_hash_lookahead_tokens:  # vLLM before 0.33 hashes no lookahead tokens
        fail_value(
            "num_hash_lookahead_tokens", "0 with this vLLM (it has none)", num_hash_lookahead_tokens
        )
    else:
        vllm_hasher = original(hash_block_size, caching_hash_fn)
    name = _mmreuse_hash_fn(caching_hash_fn)
    check_int("hash_block_size", hash_block_size, 1)
    if not isinstance(num_hash_lookahead_tokens, int):  # a bool is an int here, as in vLLM
        fail_type("num_hash_lookahead_tokens", "an int", num_hash_lookahead_tokens)
    lookahead = int(num_hash_lookahead_tokens)
    if lookahead < 0:
        fail_value("num_hash_lookahead_tokens", ">= 0", lookahead)
    if name is None:
        logger.info("mmreuse: %r is not one of vLLM's hash functions; vLLM hashes", caching_hash_fn)
        return vllm_hasher
    specs: dict[bytes, Any] = {}

    def spec_for(none_hash: bytes) -> Any:
        spec = specs.get(none_hash)
        if spec is None:
            spec = specs[none_hash] = _make_spec(
                name, hash_block_size, lookahead, none_hash, scheme, True
            )
        return spec

    def keys_for(request: Any, spec: Any) -> Any:
        """The request's RequestKeys (built once), or False: vLLM hashes this request."""
        cached = getattr(request, _KEYS_ATTR, None)
        if cached is not None and (cached is False or cached.spec is spec):
            return cached
        keys: Any = False
        if spec is not None and request.prompt_embeds is None:
            strs = _request_strings(request)
            if len({id(s) for s in strs}) == len(strs):  # no shared object: pickle as fresh
                try:
                    occs = _check_mm(
                        [MMOccurrence.from_vllm(f) for f in request.mm_features],
                        request.num_prompt_tokens,
                    )
                    lora = request.lora_request
                    lora_key: Any = None
                    if lora and scheme.lora_key == "int_id":  # vLLM 0.10.2 - 0.11.0
                        lora_key = lora.lora_int_id
                    elif lora:
                        lora_key = (lora.lora_name, lora.lora_path)
                    keys = spec.request(occs, lora_key, request.cache_salt or None) or False
                except (InvalidArgument, TypeError, AttributeError):
                    keys = False
        with contextlib.suppress(AttributeError):  # a slotted Request: rebuilt per call
            setattr(request, _KEYS_ATTR, keys)
        return keys

    def request_block_hasher(request: Any) -> list[bytes]:
        spec = spec_for(kv_cache_utils.NONE_HASH)
        try:
            keys = keys_for(request, spec)
        except (AttributeError, TypeError):  # not a vLLM Request (a test double): vLLM hashes
            keys = False
        if keys is not False:
            tokens = getattr(request, "_all_token_ids", None)
            if type(tokens) is list:
                start = len(request.block_hashes) * hash_block_size
                out = keys.hash_blocks(tokens, request.block_hashes, start)
                if out is not None:
                    STATS["fast"] += 1
                    return out
        STATS["vllm"] += 1
        return vllm_hasher(request)

    request_block_hasher.__mmreuse__ = True  # type: ignore[attr-defined]
    return request_block_hasher


def _vllm_original(kv_cache_utils: Any) -> Callable[..., Any]:
    """vLLM's own `get_request_block_hasher`, even after `register()` replaced the name."""
    fn = kv_cache_utils.get_request_block_hasher
    return getattr(fn, "__mmreuse_original__", fn)


def register() -> None:
    """The `vllm.general_plugins` entry point: vLLM's engine core builds its request block
    hasher with `fast_request_block_hasher` from now on (idempotent)."""
    import vllm
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.engine import core

    scheme = _running_scheme()  # refuses an unknown vLLM before anything is replaced
    if getattr(kv_cache_utils.get_request_block_hasher, "__mmreuse_original__", None):
        return
    original = kv_cache_utils.get_request_block_hasher

    def get_request_block_hasher(*args: Any, **kwargs: Any) -> Callable[[Any], list[bytes]]:
        return fast_request_block_hasher(*args, **kwargs)

    get_request_block_hasher.__mmreuse_original__ = original  # type: ignore[attr-defined]
    get_request_block_hasher.__doc__ = original.__doc__
    kv_cache_utils.get_request_block_hasher = get_request_block_hasher
    core.get_request_block_hasher = get_request_block_hasher  # imported by name there
    logger.info(
        "mmreuse: vLLM's request block hasher is mmreuse's fast path (vLLM %s, scheme %s)",
        vllm.__version__,
        scheme.name,
    )
