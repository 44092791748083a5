"""A drop-in for vLLM's `get_request_block_hasher`: the same hashes of a `Request`'s new full
blocks, from mmreuse's C fast path.

`fast_request_block_hasher(hash_block_size, caching_hash_fn, num_hash_lookahead_tokens=0)` has
vLLM 0.33.0's signature and contract: the returned function hashes the blocks after
`request.block_hashes` (cost proportional to the new blocks), chained from vLLM's own
`NONE_HASH` as it is when called. The token ids are read where the `Request` keeps them: a list
of ints up to vLLM 0.33, vLLM 0.34's `TokenBuffer` (an int32 `array.array`) in place, without a
copy. Token ids are taken as vLLM takes them (any int: its tests use negative placeholder ids),
and a bool lookahead is an int, as in vLLM.

**Fallbacks, never silent.** Whatever mmreuse cannot reproduce exactly goes to vLLM's own
function, per request, and each such call is counted by its reason; each reason is logged once
per process (WARNING, or INFO for the one expected by design), naming it and what to do, at its
first call (`hash_fn` and `unverified_vllm`: when the hasher is built):
- `token_type`: `Request._all_token_ids` is neither a list nor an int `array.array` (or holds
  something other than int ids): a vLLM whose token container mmreuse does not read;
- `prompt_embeds`: a request with prompt embeddings (by design: vLLM hashes those; INFO);
- `shared_strings`: key strings that are one shared object (pickle memoizes by identity: vLLM's
  engine core sees fresh strings after its msgpack wire, which is what mmreuse writes, but an
  in-process `Request` may share them);
- `mm_features`: multimodal positions mmreuse refuses (outside the prompt, overlapping);
- `limits`: past the fast path's limits (a block or lookahead past `MAX_BLOCK_TOKENS` /
  `MAX_LOOKAHEAD`, key strings past `MAX_KEY_BYTES`, an id beyond int64, a block over one
  pickle frame);
- `hash_fn`: a `caching_hash_fn` that is not one of vLLM's four (every call of that hasher);
- `not_a_request`: called with something that is not a vLLM `Request`;
- `invalid_input`: any other input the fast path refuses (the log line names it);
- `unverified_vllm`: a vLLM in no hash scheme's range (every call; see below).
`fallbacks()` returns the counts by reason (every reason, 0 included), `STATS` the calls served
by each side (`{"fast": N, "vllm": M}`, M the sum of the fallbacks).

`register()` is the `vllm.general_plugins` entry point (`VLLM_PLUGINS=mmreuse_fast_hasher`):
it puts this function where vLLM's engine core looks it up.

The hash scheme is the running vLLM's (`schemes.scheme_for_vllm(vllm.__version__)`: vLLM
0.31.0 - 0.34.0 hash as `vllm-0.33`, and so on back to 0.10.2). A vLLM in no scheme's range
(newer than the newest verified, older than 0.10.2) degrades, never stops vLLM: `register()`
logs a WARNING naming the version and the supported range and leaves vLLM's own hasher in
place, as it does for any other failure (vLLM's plug-in loader calls it without a `try`), and
`fast_request_block_hasher` returns vLLM's own hasher (fallback `unverified_vllm`). With
`MMREUSE_ALLOW_UNVERIFIED_VLLM=1` both use the nearest scheme instead, with a warning.
"""

from __future__ import annotations

import array
import contextlib
import inspect
import logging
import threading
from collections.abc import Callable
from typing import Any

from ..errors import InvalidArgument, InvalidArgumentType
from ..hashing.hasher import check_occurrences, make_spec
from ..hashing.schemes import HashScheme, scheme_for_vllm, vllm_ranges
from ..occurrence import MMOccurrence
from ..validate import check_int, fail_type, fail_value
from .vllm_versions import ALLOW_ENV, override_in_force, unverified_message

# under vLLM's "vllm" logger: its handler and format, so these lines appear in vLLM's log
logger = logging.getLogger(f"vllm.{__name__}")

# vLLM 0.33.0's hash functions (vllm.utils.hashing), by name: mmreuse reproduces these.
_VLLM_HASH_FNS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
_KEYS_ATTR = "_mmreuse_request_keys"
# array.array typecodes the C fast path reads in place (signed 32- / 64-bit; TokenBuffer's 'i').
_INT_TYPECODES = frozenset("ilq")
# Calls answered by mmreuse's fast path and by vLLM's own hasher, in this process.
STATS = {"fast": 0, "vllm": 0}

# Why a call went to vLLM's own hasher: (log level of its one line, what to do about it).
_REASONS: dict[str, tuple[int, str]] = {
    "token_type": (
        logging.WARNING,
        "vLLM hashes these requests, without the speed-up; this vLLM keeps its token ids in a "
        "container mmreuse does not read: report it with your vLLM version",
    ),
    "prompt_embeds": (
        logging.INFO,
        "vLLM hashes requests with prompt embeddings (by design); nothing to do",
    ),
    "shared_strings": (
        logging.WARNING,
        "vLLM hashes this request: two of its keys are one str object (pickle memoizes it); "
        "expected for a Request built in-process, never after vLLM's wire: report it if it "
        "comes from vLLM's engine core",
    ),
    "mm_features": (
        logging.WARNING,
        "vLLM hashes this request: mmreuse refuses its multimodal positions; report it with the "
        "request if vLLM accepted it",
    ),
    "limits": (
        logging.WARNING,
        "vLLM hashes this request: it is past the fast path's limits (block size, lookahead, "
        "key strings, token ids, one pickle frame); nothing to do unless it is frequent",
    ),
    "hash_fn": (
        logging.WARNING,
        "vLLM hashes every request of this hasher: its caching_hash_fn is not one of vLLM's "
        f"({', '.join(_VLLM_HASH_FNS)}); use one of those (--prefix-caching-hash-algo)",
    ),
    "not_a_request": (
        logging.WARNING,
        "vLLM hashes it: the hasher was called with something that is not a vLLM Request",
    ),
    "invalid_input": (
        logging.WARNING,
        "vLLM hashes this request: the fast path refused its input; report it with your vLLM "
        "version",
    ),
    "unverified_vllm": (
        logging.WARNING,
        "vLLM hashes every request with its own hasher: this vLLM is not one the fast hasher "
        f"knows; set {ALLOW_ENV}=1 to hash as the nearest scheme",
    ),
}
_FALLBACKS: dict[str, int] = dict.fromkeys(_REASONS, 0)
_logged: set[str] = set()
_lock = threading.Lock()


def fallbacks() -> dict[str, int]:
    """Calls handed to vLLM's own hasher in this process, by reason (every reason, 0 included;
    see the module docstring). A copy: the counts go on."""
    with _lock:
        return dict(_FALLBACKS)


def _fallback(reason: str, detail: str) -> None:
    """Count one call handed to vLLM's own hasher; the first of its reason is logged."""
    with _lock:
        STATS["vllm"] += 1
        _FALLBACKS[reason] += 1
    _log_once(reason, detail)


def _log_once(reason: str, detail: str) -> None:
    """Log fallback `reason` with what to do, the first time in this process."""
    with _lock:
        first = reason not in _logged
        _logged.add(reason)
    if first:
        level, todo = _REASONS[reason]
        logger.log(
            level,
            "mmreuse: fast hasher fallback %r (%s): %s. Logged once; counted in "
            "mmreuse.integrations.vllm_hasher.fallbacks()",
            reason,
            detail,
            todo,
        )


def _counted(reason: str, detail: str, vllm_hasher: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """vLLM's own hasher, each call counted as a fallback for `reason` (logged now, once)."""
    _log_once(reason, detail)

    def request_block_hasher(request: Any) -> Any:
        _fallback(reason, detail)
        return vllm_hasher(request)

    request_block_hasher.__mmreuse__ = True  # type: ignore[attr-defined]
    return request_block_hasher


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
    `allow_unverified_vllm`: then the nearest scheme, with a warning. (`register()` and
    `fast_request_block_hasher` catch the refusal and leave vLLM's own hasher in place.)"""
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


def _running_version() -> str:
    import vllm  # inside vLLM's process only

    return str(getattr(vllm, "__version__", "unknown"))


def _running_scheme() -> HashScheme:
    return scheme_for_running_vllm(_running_version())


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

    original = _vllm_original(kv_cache_utils)
    if "num_hash_lookahead_tokens" in inspect.signature(original).parameters:
        vllm_hasher = original(hash_block_size, caching_hash_fn, num_hash_lookahead_tokens)
    elif num_hash_lookahead_tokens:  # vLLM before 0.33 hashes no lookahead tokens
        fail_value(
            "num_hash_lookahead_tokens", "0 with this vLLM (it has none)", num_hash_lookahead_tokens
        )
    else:
        vllm_hasher = original(hash_block_size, caching_hash_fn)
    try:
        scheme = _running_scheme()
    except InvalidArgument as exc:  # an unknown vLLM: its own hasher, never a stop
        return _counted("unverified_vllm", str(exc), vllm_hasher)
    name = _mmreuse_hash_fn(caching_hash_fn)
    check_int("hash_block_size", hash_block_size, 1)
    if not isinstance(num_hash_lookahead_tokens, int):  # a bool is an int here, as in vLLM
        fail_type("num_hash_lookahead_tokens", "an int", num_hash_lookahead_tokens)
    lookahead = int(num_hash_lookahead_tokens)
    if lookahead < 0:
        fail_value("num_hash_lookahead_tokens", ">= 0", lookahead)
    if name is None:
        return _counted("hash_fn", f"caching_hash_fn {caching_hash_fn!r}", vllm_hasher)
    specs: dict[bytes, Any] = {}

    def spec_for(none_hash: bytes) -> Any:
        spec = specs.get(none_hash)
        if spec is None:
            spec = specs[none_hash] = make_spec(
                name, hash_block_size, lookahead, none_hash, scheme, True
            )
        return spec

    def keys_for(request: Any, spec: Any) -> Any:
        """The request's RequestKeys for `spec` (built once), or why vLLM hashes it: a
        (spec, reason, detail) tuple."""
        cached = getattr(request, _KEYS_ATTR, None)
        if cached is not None and (cached[0] if type(cached) is tuple else cached.spec) is spec:
            return cached
        keys: Any
        if spec is None:
            keys = (spec, "limits", f"hash block size {hash_block_size}, lookahead {lookahead}")
        elif request.prompt_embeds is not None:
            keys = (spec, "prompt_embeds", "a request with prompt embeddings")
        else:
            strs = _request_strings(request)
            if len({id(s) for s in strs}) != len(strs):
                keys = (spec, "shared_strings", "one str object in two of a request's keys")
            else:
                try:
                    occs = check_occurrences(
                        [MMOccurrence.from_vllm(f) for f in request.mm_features],
                        request.num_prompt_tokens,
                    )
                except InvalidArgument as exc:
                    keys = (spec, "mm_features", str(exc))
                else:
                    lora = request.lora_request
                    lora_key: Any = None
                    if lora and scheme.lora_key == "int_id":  # vLLM 0.10.2 - 0.11.0
                        lora_key = lora.lora_int_id
                    elif lora:
                        lora_key = (lora.lora_name, lora.lora_path)
                    keys = spec.request(occs, lora_key, request.cache_salt or None) or (
                        spec,
                        "limits",
                        "key strings past MAX_KEY_BYTES or not UTF-8",
                    )
        with contextlib.suppress(AttributeError):  # a slotted Request: rebuilt per call
            setattr(request, _KEYS_ATTR, keys)
        return keys

    def request_block_hasher(request: Any) -> list[bytes]:
        try:
            keys = keys_for(request, spec_for(kv_cache_utils.NONE_HASH))
            if type(keys) is tuple:
                _fallback(keys[1], keys[2])
                return vllm_hasher(request)
            tokens = request._all_token_ids
            if type(tokens) is not list and not (
                isinstance(tokens, array.array) and tokens.typecode in _INT_TYPECODES
            ):
                _fallback("token_type", f"Request._all_token_ids is {_describe(tokens)}")
                return vllm_hasher(request)
            start = len(request.block_hashes) * hash_block_size
            out = keys.hash_blocks(tokens, request.block_hashes, start)
        except InvalidArgumentType as exc:
            _fallback("token_type" if str(exc).startswith("tokens") else "invalid_input", str(exc))
            return vllm_hasher(request)
        except InvalidArgument as exc:
            _fallback("invalid_input", str(exc))
            return vllm_hasher(request)
        except (AttributeError, TypeError) as exc:  # not a vLLM Request (a test double)
            _fallback("not_a_request", f"{type(request).__name__}: {type(exc).__name__}: {exc}")
            return vllm_hasher(request)
        if out is None:
            _fallback("limits", "a token id beyond int64 or a block over one pickle frame")
            return vllm_hasher(request)
        STATS["fast"] += 1
        return out

    request_block_hasher.__mmreuse__ = True  # type: ignore[attr-defined]
    return request_block_hasher


def _describe(tokens: Any) -> str:
    """A token container's type (and array typecode), for the log."""
    typecode = getattr(tokens, "typecode", None)
    return f"a {type(tokens).__name__}" + (f" of typecode {typecode!r}" if typecode else "")


def _vllm_original(kv_cache_utils: Any) -> Callable[..., Any]:
    """vLLM's own `get_request_block_hasher`, even after `register()` replaced the name."""
    fn = kv_cache_utils.get_request_block_hasher
    return getattr(fn, "__mmreuse_original__", fn)


def register() -> None:
    """The `vllm.general_plugins` entry point: vLLM's engine core builds its request block
    hasher with `fast_request_block_hasher` from now on (idempotent). Never raises: vLLM's
    plug-in loader calls it without a `try`, so an unknown vLLM, or one whose hasher moved,
    keeps vLLM's own hasher, with a WARNING saying why."""
    try:
        _register()
    except InvalidArgument as exc:  # an unknown vLLM, or a malformed override
        logger.warning(
            "mmreuse: fast hasher not installed, vLLM's own request block hasher stays: %s", exc
        )
    except Exception as exc:
        logger.warning(
            "mmreuse: fast hasher not installed, vLLM's own request block hasher stays: "
            "unexpected %s: %s (vLLM %s; the fast hasher supports %s)",
            type(exc).__name__,
            exc,
            _version_or_unknown(),
            vllm_ranges(),
            exc_info=True,
        )


def _version_or_unknown() -> str:
    try:
        return _running_version()
    except Exception:  # vLLM not importable: say so, never raise from the warning
        return "unknown"


def _register() -> None:
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.engine import core

    scheme = _running_scheme()  # refuses an unknown vLLM before anything is replaced
    if getattr(kv_cache_utils.get_request_block_hasher, "__mmreuse_original__", None):
        return
    original = kv_cache_utils.get_request_block_hasher
    if getattr(core, "get_request_block_hasher", None) is not original:
        raise AttributeError(
            "vllm.v1.engine.core no longer imports get_request_block_hasher by name, so "
            "replacing it would not reach the engine core"
        )

    def get_request_block_hasher(*args: Any, **kwargs: Any) -> Callable[[Any], list[bytes]]:
        return fast_request_block_hasher(*args, **kwargs)

    get_request_block_hasher.__mmreuse_original__ = original  # type: ignore[attr-defined]
    get_request_block_hasher.__doc__ = original.__doc__
    kv_cache_utils.get_request_block_hasher = get_request_block_hasher
    core.get_request_block_hasher = get_request_block_hasher  # imported by name there
    logger.info(
        "mmreuse: vLLM's request block hasher is mmreuse's fast path (vLLM %s, scheme %s)",
        _running_version(),
        scheme.name,
    )
