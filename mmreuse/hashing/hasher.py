"""vLLM's prefix-cache block hashes for a request, one-shot and incremental.

`BlockHasher` reproduces `get_request_block_hasher(hash_block_size, hash_fn,
num_hash_lookahead_tokens)` of a vLLM generation (`HashScheme`) for a request whose
`all_token_ids` are the given tokens. Two paths compute the same bytes: a plain
Python reference that builds vLLM's exact objects and pickles / CBOR-encodes them,
and a C++ fast path (`mmreuse._hashcore`) that writes the same serialization
directly and digests it with OpenSSL's SHA-256 or XXH3-128.

The fast path is configured by names, never by ids: each BlockHasher builds one
`_hashcore.HashSpec` from its hash function, sizes, NONE_HASH and its scheme's key-shape
names (validated in C), each request one `RequestKeys` from its occurrences, LoRA and salt,
and `RequestKeys.hash_blocks` hashes the blocks after those already hashed. Limits such as
`MAX_BLOCK_TOKENS` are read from `_hashcore`, not restated here.
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import os
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

from ..blockhash import BlockHash, to_event_id  # noqa: F401  (re-exported by mmreuse.hashing)
from ..errors import InvalidArgument
from ..occurrence import MMOccurrence
from ..validate import check_bool, check_int, check_str, fail_type, fail_value, show
from .functions import DIGEST_SIZE, NON_CRYPTO_HASH_FUNCTIONS, check_hash_fn, get_hash_fn
from .schemes import DEFAULT_SCHEME, HashScheme, get_scheme

try:  # the C++ fast path; absent only when the package was built without OpenSSL headers
    from .. import _hashcore
except ImportError:  # pragma: no cover - exercised only on such builds
    _hashcore = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

# vLLM's fixed NONE_HASH seed for cryptographic hash functions when PYTHONHASHSEED is unset.
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"

MAX_TOKEN_ID = 2**63 - 1


def fast_path_available() -> bool:
    """Whether the C++ hashing fast path was built into this installation."""
    return _hashcore is not None


def fresh_str(s: str) -> str:
    """A new str object equal to `s`, as vLLM gets after decoding a request off the wire.

    Pickle memoizes by object identity: two equal identifiers are two objects in vLLM
    (msgspec decodes each) except CPython's cached empty and single-Latin-1 strings.
    """
    return s.encode("utf-8", "surrogatepass").decode("utf-8", "surrogatepass")


def _check_utf8(field: str, s: str) -> None:
    """CBOR (sha256_cbor / xxhash_cbor) hashes a str as its UTF-8: one without it (a lone
    surrogate) cannot be hashed. Pickle can (surrogatepass), so the pickle functions take it."""
    if not s.isascii():
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidArgument(
                f"{field} must be encodable as UTF-8 to be hashed with CBOR, got {show(s)} "
                f"({exc.reason} at index {exc.start})"
            ) from None


def _check_cbor_strings(
    scheme: HashScheme, mm: list[MMOccurrence], name: Any, path: Any, salt: Any
) -> None:
    """`_check_utf8` on every str a CBOR hash function would encode for this request."""
    for i, m in enumerate(mm):
        _check_utf8(f"mm[{i}].identifier", m.identifier)
    if name is not None and scheme.lora_key != "int_id":
        _check_utf8("lora_name", name)
        if path is not None and scheme.lora_key == "tagged":
            _check_utf8("lora_path", path)
    if salt:
        _check_utf8("cache_salt", salt)


def _as_token_list(tokens: Any) -> list[int]:
    """A new list of a token sequence's items: a list, tuple, range, or a 1-D numpy array /
    torch tensor / array.array (via tolist). Sets, dicts, str, bytes, bytearray, memoryview
    and scalars are refused (the items themselves are checked later, by index)."""
    if type(tokens) is list or type(tokens) is tuple:
        return list(tokens)
    if isinstance(tokens, (str, bytes, bytearray, memoryview)) or not hasattr(tokens, "__len__"):
        fail_type("tokens", "a sequence of ints", tokens)
    if hasattr(tokens, "tolist"):  # numpy / torch / array.array
        out = tokens.tolist()
        if not isinstance(out, list):  # a 0-d array: one value, not a sequence
            fail_type("tokens", "a sequence of ints", tokens)
        return out
    if not isinstance(tokens, Sequence):  # a set or dict has no token order
        fail_type("tokens", "a sequence of ints", tokens)
    return list(tokens)


def _check_token(i: int, t: Any, allow_any: bool) -> None:
    if type(t) is not int:  # exact ints only, as the fast path reads them (no bool, no numpy)
        fail_type(f"tokens[{i}]", "an int token id", t)
    if not allow_any and not 0 <= t <= MAX_TOKEN_ID:
        raise InvalidArgument(
            f"tokens[{i}] must be a token id in [0, 2**63-1], got {t} "
            "(pass allow_any_token_id=True to hash what vLLM's hasher would)"
        )


def check_occurrences(mm: Iterable[MMOccurrence], num_prompt: int) -> list[MMOccurrence]:
    """`mm` as a list, each an MMOccurrence inside a prompt of `num_prompt` tokens, sorted by
    offset and not overlapping (as vLLM requires); else InvalidArgument naming `mm[i]`."""
    out = list(mm)
    prev_end = 0
    for i, m in enumerate(out):
        if not isinstance(m, MMOccurrence):
            fail_type(f"mm[{i}]", "an MMOccurrence", m)
        end = m._end  # MMOccurrence.end, read without the property call (hot: every request)
        if end > num_prompt:
            raise InvalidArgument(
                f"mm[{i}] ({m.identifier!r}) spans [{m.offset}, {m.end}) outside the "
                f"prompt of {num_prompt} tokens"
            )
        if m.offset < prev_end:
            raise InvalidArgument(
                f"mm[{i}] offset {m.offset} is before the end {prev_end} of mm[{i - 1}]: vLLM "
                "requires occurrences sorted by offset and non-overlapping"
            )
        prev_end = end
    return out


def _check_lora(scheme: HashScheme, name: Any, path: Any, int_id: Any) -> None:
    if name is None:
        if path is not None or int_id is not None:
            raise InvalidArgument(
                f"lora_path={show(path)} / lora_int_id={show(int_id)} given without lora_name"
            )
        return
    check_str("lora_name", name, nonempty=True)
    if path is not None:
        check_str("lora_path", path)
    if scheme.lora_key == "tagged" and not path:
        fail_value(
            "lora_path",
            f"given with lora_name under scheme {scheme.name!r} (vLLM hashes ('lora', name, path))",
            path,
        )
    if scheme.lora_key == "int_id" and (type(int_id) is not int or int_id < 1):
        fail_value(
            "lora_int_id",
            f"an int >= 1 under scheme {scheme.name!r} (vLLM hashes the LoRA int id)",
            int_id,
        )


def _check_salt(cache_salt: Any) -> None:
    if cache_salt is not None:
        check_str("cache_salt", cache_salt)


def make_spec(
    hash_fn: str,
    block_size: int,
    lookahead: int,
    none_hash: bytes,
    scheme: HashScheme,
    allow_any_token_id: bool,
) -> Any:
    """The `_hashcore.HashSpec` of one hasher, or None where only the reference path can hash
    (no fast path built, blocks or lookahead beyond what one pickle frame holds)."""
    if _hashcore is None:
        return None
    if block_size > _hashcore.MAX_BLOCK_TOKENS or lookahead > _hashcore.MAX_LOOKAHEAD:
        return None
    return _hashcore.HashSpec(
        hash_fn,
        block_size,
        lookahead,
        none_hash,
        mm_key=scheme.mm_key,
        mm_bounds=scheme.mm_bounds,
        lora_key=scheme.lora_key,
        salt_key=scheme.salt_key,
        embeds_key=scheme.embeds_key,
        incremental_mm=scheme.incremental_mm,
        allow_any_token_id=allow_any_token_id,
    )


def _lora_key_value(scheme: HashScheme, name: str | None, path: str | None, int_id: Any) -> Any:
    """What vLLM hashes for the LoRA request: None, its int id, or (name, path)."""
    if name is None:
        return None
    if scheme.lora_key == "int_id":
        return int_id
    return (fresh_str(name), fresh_str(path or ""))


class BlockHasher:
    """vLLM's `request_block_hasher` for one configuration.

    Args:
        hash_fn: "sha256" | "sha256_cbor" | "xxhash" | "xxhash_cbor" (vLLM's --prefix-caching-hash-algo).
        block_size: vLLM's hash block size (cache_config.hash_block_size), >= 1.
        seed: the PYTHONHASHSEED string of the vLLM process; None means unset.
        lookahead: num_hash_lookahead_tokens (EAGLE), >= 0.
        scheme: a `SCHEMES` name ("vllm-0.33", "vllm-0.30", "vllm-0.11") or a `HashScheme`.
        allow_random_seed: with seed None where vLLM would seed randomly, opt in to a random
            NONE_HASH (hashes then match no other process); otherwise that raises.
        allow_any_token_id: hash ints outside [0, 2**63-1] as vLLM's hasher would
            (its renderer rejects them earlier); otherwise they raise.
        use_fast_path: use the C++ path when built (the result is identical).
    """

    __slots__ = (
        "_cbor",
        "_fn",
        "_spec",
        "allow_any_token_id",
        "block_size",
        "hash_fn",
        "lookahead",
        "none_hash",
        "scheme",
        "seed",
        "use_fast_path",
    )

    def __init__(
        self,
        hash_fn: str = "sha256",
        block_size: int = 16,
        seed: str | None = None,
        lookahead: int = 0,
        scheme: str | HashScheme = DEFAULT_SCHEME,
        *,
        allow_random_seed: bool = False,
        allow_any_token_id: bool = False,
        use_fast_path: bool = True,
    ) -> None:
        self.scheme = get_scheme(scheme)
        check_hash_fn(hash_fn)
        if hash_fn not in self.scheme.hash_fns:
            raise InvalidArgument(
                f"hash_fn {hash_fn!r} does not exist in scheme {self.scheme.name!r} "
                f"(vLLM {self.scheme.vllm_versions}); it offers {self.scheme.hash_fns}"
            )
        block_size = check_int("block_size", block_size, 1)
        lookahead = check_int("lookahead", lookahead, 0)
        if lookahead and not self.scheme.supports_lookahead:
            fail_value(
                "lookahead", f"0: scheme {self.scheme.name!r} has no lookahead hashing", lookahead
            )
        if seed is not None and not isinstance(seed, str):
            fail_type("seed", "the PYTHONHASHSEED string or None", seed)
        if seed is not None and hash_fn.endswith("_cbor"):
            _check_utf8("seed", seed)
        check_bool("allow_random_seed", allow_random_seed)
        self.hash_fn = hash_fn
        self.block_size = block_size
        self.seed = seed
        self.lookahead = lookahead
        self.allow_any_token_id = check_bool("allow_any_token_id", allow_any_token_id)
        self.use_fast_path = check_bool("use_fast_path", use_fast_path) and _hashcore is not None
        self._fn = get_hash_fn(hash_fn)
        self._cbor = hash_fn.endswith("_cbor")  # strs are hashed as UTF-8: see _check_utf8
        self.none_hash: bytes = self._none_hash(allow_random_seed)
        # One validated C spec per hasher (None: the reference path hashes everything).
        self._spec = (
            make_spec(
                hash_fn, block_size, lookahead, self.none_hash, self.scheme, self.allow_any_token_id
            )
            if self.use_fast_path
            else None
        )

    def _none_hash(self, allow_random_seed: bool) -> bytes:
        if self.seed is not None:
            return self._fn(self.seed)
        crypto = self.hash_fn not in NON_CRYPTO_HASH_FUNCTIONS
        if self.scheme.unset_seed == "default-seed" and crypto:
            return self._fn(DEFAULT_NONE_HASH_SEED)
        if not allow_random_seed:
            raise InvalidArgument(
                f"seed=None with hash_fn={self.hash_fn!r} under scheme {self.scheme.name!r}: vLLM "
                "then seeds NONE_HASH randomly per process, so its hashes cannot be reproduced "
                "(and a public seed would let an attacker precompute collisions for xxhash). "
                "Pass the PYTHONHASHSEED string the vLLM process uses, or "
                "allow_random_seed=True for a random, process-local seed."
            )
        warnings.warn(
            "BlockHasher: random NONE_HASH seed; these block hashes match no vLLM process",
            stacklevel=3,
        )
        if self.scheme.unset_seed == "random":
            return os.urandom(32)
        return self._fn(os.urandom(32).hex())

    @property
    def digest_size(self) -> int:
        """Bytes per block hash: 32 for sha256*, 16 for xxhash*."""
        return DIGEST_SIZE[self.hash_fn]

    def request(
        self,
        prompt_token_ids: Sequence[int],
        *,
        mm: Iterable[MMOccurrence] = (),
        lora_name: str | None = None,
        lora_path: str | None = None,
        lora_int_id: int | None = None,
        cache_salt: str | None = None,
        prompt_embeds: Any = None,
    ) -> RequestHasher:
        """Start hashing a request whose prompt is `prompt_token_ids` (incremental form)."""
        return RequestHasher(
            self,
            prompt_token_ids,
            mm=mm,
            lora_name=lora_name,
            lora_path=lora_path,
            lora_int_id=lora_int_id,
            cache_salt=cache_salt,
            prompt_embeds=prompt_embeds,
        )

    def hash_prompt(
        self,
        tokens: Sequence[int],
        *,
        mm: Iterable[MMOccurrence] = (),
        lora_name: str | None = None,
        lora_path: str | None = None,
        lora_int_id: int | None = None,
        cache_salt: str | None = None,
        prompt_embeds: Any = None,
    ) -> list[bytes]:
        """One hash per full block of `tokens`, as vLLM gives for that `all_token_ids`."""
        spec = self._spec
        if spec is not None and prompt_embeds is None and type(tokens) is list:
            # The one-shot fast path without a RequestHasher (same checks, same C call); the
            # request state below takes whatever this cannot hash.
            occurrences = check_occurrences(mm, len(tokens))
            scheme = self.scheme
            _check_lora(scheme, lora_name, lora_path, lora_int_id)
            _check_salt(cache_salt)
            if self._cbor:
                _check_cbor_strings(scheme, occurrences, lora_name, lora_path, cache_salt)
            keys = spec.request(
                occurrences,
                _lora_key_value(scheme, lora_name, lora_path, lora_int_id),
                cache_salt,
            )
            if keys is not None:
                out = keys.hash_blocks(tokens)
                if out is not None:
                    return out
            mm = occurrences
        return RequestHasher(
            self,
            tokens,
            mm=mm,
            lora_name=lora_name,
            lora_path=lora_path,
            lora_int_id=lora_int_id,
            cache_salt=cache_salt,
            prompt_embeds=prompt_embeds,
            _borrow_tokens=True,
        ).block_hashes

    def block_extra_keys(self, tokens: Sequence[int], **request: Any) -> list[tuple | None]:
        """The extra keys vLLM hashes into each full block (for display and debugging)."""
        state = RequestHasher(self, tokens, _collect_keys=True, **request)
        assert state._collected_keys is not None  # _collect_keys=True
        return state._collected_keys

    def hash_block(
        self, parent: bytes | None, token_ids: Sequence[int], extra_keys: tuple | None
    ) -> bytes:
        """One block's hash, as vLLM's `hash_block_tokens(hash_fn, parent_block_hash,
        curr_block_token_ids, extra_keys)`: the digest of (parent or NONE_HASH, tokens, keys).

        `extra_keys` is the tuple vLLM hashes (tagged keys under vllm-0.33; with lookahead,
        `(keys, *next tokens)`) or None for a block without keys; it is hashed as given. Used
        to re-hash what a KV event published (`mmreuse.events.hashcheck`)."""
        if parent is not None and (type(parent) is not bytes or len(parent) != self.digest_size):
            if type(parent) is not bytes:
                fail_type("parent", f"None or a {self.digest_size}-byte block hash", parent)
            fail_value("parent", f"a {self.digest_size}-byte block hash ({self.hash_fn})", parent)
        if type(token_ids) is list or type(token_ids) is tuple:
            items: Sequence[Any] = token_ids
        elif isinstance(token_ids, (str, bytes, bytearray, memoryview)):
            fail_type("token_ids", "a sequence of int token ids", token_ids)
        elif hasattr(token_ids, "tolist"):  # numpy / torch / array.array
            items = token_ids.tolist()
            if not isinstance(items, list):  # a 0-d array
                fail_type("token_ids", "a sequence of int token ids", token_ids)
        elif isinstance(token_ids, Sequence):
            items = token_ids
        else:
            fail_type("token_ids", "a sequence of int token ids", token_ids)
        if len(items) != self.block_size:
            raise InvalidArgument(
                f"token_ids must hold block_size={self.block_size} token ids, got {len(items)}"
            )
        hi = None if self.allow_any_token_id else MAX_TOKEN_ID
        lo = None if self.allow_any_token_id else 0
        tokens = tuple([check_int(f"token_ids[{i}]", t, lo, hi) for i, t in enumerate(items)])
        if extra_keys is not None and type(extra_keys) is not tuple:
            fail_type("extra_keys", "None or a tuple of extra keys", extra_keys)
        return self._fn((parent if parent is not None else self.none_hash, tokens, extra_keys))


class RequestHasher:
    """Block hashes of one request, extended as tokens are appended.

    Mirrors a vLLM `Request` built with a block hasher: the prompt is hashed at
    construction and `append_output_token_ids` hashes the blocks that new tokens
    complete. `block_hashes` always equals the one-shot `hash_prompt` of all tokens
    (for schemes whose `incremental_mm` is "window"; the older "last" schemes keep
    vLLM's own incremental shortcut).
    """

    def __init__(
        self,
        hasher: BlockHasher,
        prompt_token_ids: Sequence[int],
        *,
        mm: Iterable[MMOccurrence] = (),
        lora_name: str | None = None,
        lora_path: str | None = None,
        lora_int_id: int | None = None,
        cache_salt: str | None = None,
        prompt_embeds: Any = None,
        _collect_keys: bool = False,
        _borrow_tokens: bool = False,
    ) -> None:
        self._h = hasher
        scheme = hasher.scheme
        # A one-shot hash never appends, so it may read the caller's list without copying it.
        if _borrow_tokens and type(prompt_token_ids) is list:
            tokens = prompt_token_ids
        else:
            tokens = _as_token_list(prompt_token_ids)
        self._tokens: list[int] = tokens
        self._validated = 0
        self.block_hashes: list[bytes] = []
        self._collected_keys: list[Any] | None = [] if _collect_keys else None
        self._mm = check_occurrences(mm, len(tokens))
        self._mm_ends = [m.end for m in self._mm]
        _check_lora(scheme, lora_name, lora_path, lora_int_id)
        _check_salt(cache_salt)
        if hasher._cbor:
            _check_cbor_strings(scheme, self._mm, lora_name, lora_path, cache_salt)
        self._embeds_bytes, self._row_bytes = self._check_embeds(prompt_embeds, len(tokens))
        self._embeds_digests: dict[tuple[int, int], bytes] = {}

        # Objects exactly as vLLM holds them (fresh strings: see `fresh_str`).
        self._mm_ids = [fresh_str(m.identifier) for m in self._mm]
        self._lora = _lora_key_value(scheme, lora_name, lora_path, lora_int_id)
        self._salt = fresh_str(cache_salt) if cache_salt else None  # "" is falsy in vLLM: no key
        self._fast_keys = self._make_fast_keys()
        self.block_hashes = self._new_blocks()  # the first list is ours: no copy

    # ---- validation -------------------------------------------------------------------------

    def _check_embeds(self, embeds: Any, num_prompt: int) -> tuple[memoryview | None, int]:
        if embeds is None:
            return None, 0
        scheme = self._h.scheme
        if scheme.embeds_key is None:
            raise InvalidArgument(
                f"prompt_embeds given but scheme {scheme.name!r} (vLLM {scheme.vllm_versions}) "
                "does not hash prompt embeddings"
            )
        import torch

        if not isinstance(embeds, torch.Tensor):
            fail_type("prompt_embeds", "a torch.Tensor", embeds)
        if not embeds.is_floating_point():
            raise InvalidArgument(f"prompt_embeds must have a floating dtype, got {embeds.dtype}")
        if embeds.dim() != 2:
            raise InvalidArgument(
                f"prompt_embeds must be 2-D (rows, hidden), got shape {tuple(embeds.shape)}"
            )
        if embeds.shape[0] > num_prompt:
            raise InvalidArgument(
                f"prompt_embeds has {embeds.shape[0]} rows but the prompt has {num_prompt} tokens"
            )
        # vLLM's tensor_data(): flatten().cpu().contiguous().view(uint8); a row slice of a
        # row-major tensor is a byte slice of the whole.
        flat = embeds.detach().cpu().contiguous().flatten().view(torch.uint8).numpy()
        row_bytes = embeds.shape[1] * embeds.element_size()
        return memoryview(flat).cast("B"), row_bytes  # type: ignore[arg-type]  # ndarray is a buffer

    # ---- public -----------------------------------------------------------------------------

    @property
    def num_tokens(self) -> int:
        """Tokens seen so far (vLLM's `request.num_tokens`)."""
        return len(self._tokens)

    def append_output_token_ids(self, token_ids: int | Sequence[int]) -> list[bytes]:
        """Append tokens; return the hashes of the blocks they complete (possibly none).

        A rejected call (a bad token anywhere in it) leaves the request as it was."""
        tokens = self._tokens
        before = len(tokens)
        try:
            if type(token_ids) is int:
                tokens.append(token_ids)
            elif isinstance(token_ids, (int, float, complex)) or getattr(token_ids, "ndim", 1) == 0:
                # a bool, float or numpy / torch scalar: one token, but not an int token id
                fail_type("tokens", "an int token id or a sequence of them", token_ids)
            else:
                tokens.extend(_as_token_list(token_ids))
            new = self._new_blocks()
        except BaseException:
            del tokens[before:]
            raise
        self.block_hashes.extend(new)
        return new

    # ---- hashing ----------------------------------------------------------------------------

    def _embeds_digest(self, start: int, end: int) -> bytes:
        key = (start, end)
        d = self._embeds_digests.get(key)
        if d is None:
            rb, data = self._row_bytes, self._embeds_bytes
            assert data is not None  # only called with prompt embeds
            d = hashlib.sha256(data[start * rb : end * rb]).digest()
            self._embeds_digests[key] = d
        return d

    def _new_blocks(self) -> list[bytes]:
        """Hashes of the full blocks past `block_hashes` (not appended: the caller does)."""
        h = self._h
        bs, la = h.block_size, h.lookahead
        tokens = self._tokens
        start = len(self.block_hashes) * bs
        num_tokens = len(tokens) - la
        new = None
        if self._fast_keys is not None and self._collected_keys is None:
            new = self._hash_fast(start, num_tokens)
        if new is None:  # the reference path; C may have stopped validating part-way
            for i in range(self._validated, len(tokens)):
                _check_token(i, tokens[i], h.allow_any_token_id)
            new = self._hash_reference(start, num_tokens)
        self._validated = len(tokens)
        return new

    def _initial_mm_idx(self, start: int) -> int:
        if start == 0 or not self._mm:
            return 0
        if self._h.scheme.incremental_mm == "last":
            return -1
        if self._mm_ends[-1] > start:  # vLLM's get_mm_features_in_window(...)[0]
            return bisect.bisect_left(self._mm_ends, start + 1)
        return 0

    def _hash_reference(self, start: int, num_tokens: int) -> list[bytes]:
        h = self._h
        bs, la, fn = h.block_size, h.lookahead, h._fn
        tokens = self._tokens
        new: list[bytes] = []
        if start + bs > num_tokens:
            return new
        mm_idx = self._initial_mm_idx(start)
        parent = self.block_hashes[-1] if self.block_hashes else h.none_hash
        while start + bs <= num_tokens:
            end = start + bs
            if la:
                hend = end + la
                inner, mm_idx = self._extra_keys(start, hend, mm_idx)
                while mm_idx > 0 and self._mm[mm_idx - 1].end > end:
                    mm_idx -= 1
                extra: tuple[Any, ...] | None = (
                    (inner, tokens[end]) if la == 1 else (inner, *tokens[end:hend])
                )
            else:
                extra, mm_idx = self._extra_keys(start, end, mm_idx)
            if self._collected_keys is not None:
                self._collected_keys.append(extra)
            parent = fn((parent, tuple(tokens[start:end]), extra))
            new.append(parent)
            start = end
        return new

    def _mm_keys(self, start: int, end: int, idx: int) -> tuple[list[Any], int]:
        """vLLM's `_gen_mm_extra_hash_keys`, for this scheme's key shape and boundaries."""
        mm = self._mm
        keys: list[Any] = []
        if not mm:
            return keys, idx
        scheme = self._h.scheme
        inclusive = scheme.mm_bounds == "inclusive"
        last_end = self._mm_ends[-1]
        if (last_end < start) if inclusive else (last_end <= start):
            return keys, idx
        if idx < 0:
            idx += len(mm)
        while idx < len(mm):
            m = mm[idx]
            if end > m.offset:
                if (start > m.end) if inclusive else (start >= m.end):
                    idx += 1
                    continue
                ident = self._mm_ids[idx]
                if scheme.mm_key == "tagged":
                    keys.append(("mm", ident, m.offset - start))
                elif scheme.mm_key == "pair":
                    keys.append((ident, m.offset - start))
                else:
                    keys.append(ident)
                if end >= m.end:
                    idx += 1
                else:
                    break
            else:
                break
        return keys, idx

    def _extra_keys(self, start: int, end: int, idx: int) -> tuple[tuple | None, int]:
        """vLLM's `generate_block_hash_extra_keys`: lora + mm + salt + embeds, None if empty."""
        scheme = self._h.scheme
        mm_keys, idx = self._mm_keys(start, end, idx)
        keys: list[Any] = []
        if self._lora is not None:
            if scheme.lora_key == "tagged":
                keys.append(("lora", self._lora[0], self._lora[1]))
            elif scheme.lora_key == "name":
                keys.append(self._lora[0])
            else:
                keys.append(self._lora)
        keys.extend(mm_keys)
        if start == 0 and self._salt:
            keys.append(("cache_salt", self._salt) if scheme.salt_key == "tagged" else self._salt)
        if self._embeds_bytes is not None:
            if scheme.embeds_key == "raw":  # vLLM 0.11.1 - 0.16.0: tensor_data(block).tobytes()
                rb = self._row_bytes
                keys.append(self._embeds_bytes[start * rb : end * rb].tobytes())
            else:
                d = self._embeds_digest(start, end)
                keys.append(("prompt_embeds", d) if scheme.embeds_key == "tagged" else d)
        return (tuple(keys) if keys else None), idx

    # ---- fast path --------------------------------------------------------------------------

    def _make_fast_keys(self) -> Any:
        """This request's `_hashcore.RequestKeys`, or None where only the reference path hashes."""
        h = self._h
        if h._spec is None:
            return None
        if self._embeds_bytes is not None and h.scheme.embeds_key == "raw":
            return None  # whole tensor slices in the key: the reference path pickles them
        return h._spec.request(self._mm, self._lora, self._salt)

    def _hash_fast(self, start: int, num_tokens: int) -> list[bytes] | None:
        h = self._h
        bs, la = h.block_size, h.lookahead
        embeds = None
        if self._embeds_bytes is not None:
            nblocks = max(0, (num_tokens - start) // bs)
            embeds = [
                self._embeds_digest(s, s + bs + la) for s in range(start, start + nblocks * bs, bs)
            ]
        return self._fast_keys.hash_blocks(self._tokens, self.block_hashes, self._validated, embeds)
