"""Demand queries: the proxy asks a P "what do you need from E for this request?", P answers.

The wire of `mmreuse.integrations.vllm.DemandScheduler` (the P side) and the proxy's `demand`
and `opportunistic` policies (the client side). One ZMQ ROUTER socket in P, bound to
`additional_config["mmreuse"]["demand_endpoint"]`; a client connects a DEALER and sends one
frame per query, a msgpack map tagged by `"type"`; P answers each query with one frame, in any
order, naming the query's `id`:

- `DemandQuery {id, token_ids, items, cache_salt, lora_name, e_cached, remember}` ->
  `DemandAnswer` or `DemandError`. `items` are the rendered request's multimodal items in
  vLLM's order (by offset), each `{identifier, offset, length, modality, is_embed}`.
- `StatsQuery {id, check_index}` -> `DemandStats` (P's counters; with `check_index`, the
  residency index compared with vLLM's prefix cache, block by block).
- `SnapshotQuery {id, offset}` -> `KVSnapshot` or `DemandError`: P's prefix cache (group 0,
  GPU) as KV-event block ids with their block counts (and, where P follows them, the mm
  identifiers the blocks carry), as of its KV-event batch `stamp` (every batch before it
  applied, none from it on), in chunks of at most MAX_SNAPSHOT_BLOCKS from `offset`; one
  snapshot is taken per `id` (offset 0) and kept for its later chunks.
- `ECSnapshotQuery {id, offset}` -> `ECSnapshot` or `DemandError`: the same for P's encoder
  cache (`EventfulEncoderCacheManager`), stamped with its encoder-cache-event batch.

A query's size is bounded (MAX_* below; `max_query_bytes(max_model_len)` for a whole frame,
which P's ROUTER enforces), so that what any frame costs P is bounded by its max_model_len.
Everything P puts in an answer was read under one lock that vLLM's scheduler methods also hold,
so an answer is one consistent state of P. A query that is not well formed gets a
`DemandError`, never an exception in P's engine; an answer that is not well formed is refused by
`decode_answer` here (`MalformedAnswer`), so a hostile P can cost the client its plan only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any

import msgspec

from .demand import DemandResult, ItemClass
from .errors import InvalidArgument
from .occurrence import MMOccurrence
from .validate import check_int

DEMAND_ID_KEY = "mmreuse_demand_id"  # vllm_xargs[DEMAND_ID_KEY]: the query a P request follows

# Bounds on a query, so that what one costs P is bounded by P's max_model_len (a hostile client
# gets a DemandError naming the field, before P does any work for it).
MAX_ID_CHARS = 128
MAX_ITEMS = 4096  # items, and e_cached entries (the client sends what E holds of this request)
# identifiers (vLLM's mm_hash is 64 hex chars; "<lora_name>:<mm_hash>", user uuids), lora_name
MAX_IDENT_CHARS = 1024
MAX_MODALITY_CHARS = 64
MAX_SALT_CHARS = 1024
# A whole answer frame: each identifier in at most two of its lists (e_demand, p_loads,
# p_local_reuse, p_local_self_evicted), an `AnswerItem` (a class and a dedup index) per item,
# with room to spare.
MAX_ANSWER_BYTES = 4 * MAX_ITEMS * (MAX_IDENT_CHARS + 64)
# items' placeholders, in all, per token id: vLLM overlaps at most two items (use_audio_in_video:
# audio and video over one range, each with its is_embed mask); masks cost P per flag
MAX_OVERLAP = 2

_Id = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_CHARS)]
_Ident = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_IDENT_CHARS)]
_TokenId = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
_Count = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]


class QueryItem(msgspec.Struct, omit_defaults=True, gc=False):
    """One multimodal item of the query (an `MMOccurrence` on the wire)."""

    identifier: _Ident
    offset: _Count
    length: Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)]
    modality: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_MODALITY_CHARS)] = "image"
    is_embed: list[bool] | None = None


class DemandQuery(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """What P is asked about: a rendered request (render's token ids and features).

    `e_cached`: identifiers the client knows E holds (P cannot see E). `remember`: keep the
    answer's proof so that the request, sent with `vllm_xargs.mmreuse_demand_id = id`, is
    checked against it when P admits it.
    """

    id: _Id
    token_ids: list[_TokenId]
    items: Annotated[list[QueryItem], msgspec.Meta(max_length=MAX_ITEMS)] = []
    cache_salt: Annotated[str, msgspec.Meta(max_length=MAX_SALT_CHARS)] | None = None
    lora_name: Annotated[str, msgspec.Meta(max_length=MAX_IDENT_CHARS)] | None = None
    e_cached: Annotated[list[_Ident], msgspec.Meta(max_length=MAX_ITEMS)] = []
    remember: bool = True


class StatsQuery(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    id: _Id
    check_index: bool = False


class AnswerItem(msgspec.Struct, array_like=True, gc=False):
    """What P says of one item of the query (same index): its class (never `unclassified`)
    and, for a `duplicate`, the earlier item whose embedding it shares."""

    item_class: ItemClass
    dedup_of: _Count | None = None


class DemandAnswer(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """P's answer, from one consistent state of P.

    Attributes:
        num_computed_tokens: C: the prefix-cache hit vLLM's own lookup gives now (tokens).
        items: per item of the query (same order), its class and dedup (`AnswerItem`).
        e_demand: (identifier, needs_forward) E must deliver, each once, in P's order.
        p_local_reuse, p_loads: identifiers P reuses from its encoder cache / loads through
            its EC connector.
        p_local_self_evicted: freeable encoder-cache entries this request's own admission
            evicts before it reaches them (they count as needing E).
        encoder_cache_short: P's encoder cache cannot hold this request's new embeddings at
            once: P spreads them over steps, and may encode again an entry it freed in between
            (the classes hold for its first step).
        proof_blocks, proof_generations: the `CoverageProof` of the hit (P's residency index).
        trust_kv_blocks: how many new KV blocks P can allocate before the first block of the
            hit may be evicted (its place in vLLM's free queue); None when every hit block is in
            use by a running request (then only a finished request can expose it), 0 without a
            hit.
        trust_encoder_embeds: encoder-cache space (embeddings) P can allocate before one of the
            entries the answer reuses may be evicted; None when all of them are referenced.
        external_kv: "none" (P has no KV connector) or "not_consulted" (a KV connector may
            add tokens at admission; asking it has side effects, so it is not asked).
        step: P's scheduler step when answered. lock_wait_us, answer_us: time waited for the
            lock, and spent answering under it.
    """

    id: str
    num_computed_tokens: _Count
    items: Annotated[list[AnswerItem], msgspec.Meta(max_length=MAX_ITEMS)]
    e_demand: list[tuple[str, bool]]
    p_local_reuse: list[str] = []
    p_loads: list[str] = []
    p_local_self_evicted: list[str] = []
    encoder_cache_short: bool = False
    proof_blocks: list[_Count] = []
    proof_generations: list[_Count] = []
    trust_kv_blocks: _Count | None = None
    trust_encoder_embeds: _Count | None = None
    external_kv: str = "none"
    step: _Count = 0
    lock_wait_us: float = 0.0
    answer_us: float = 0.0


# The longest a peer may ask to be asked again after (a paced snapshot): past it, a hostile
# or broken peer's answer is refused rather than waited out.
MAX_RETRY_AFTER_S = 60.0


class DemandError(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """The query could not be answered; `error` says why (naming the field). `retry_after_s`:
    set where the same query will be answered after that long (a snapshot paced while the
    cache changes), None where asking again will not help."""

    id: str
    error: str
    retry_after_s: Annotated[float, msgspec.Meta(ge=0, le=MAX_RETRY_AFTER_S)] | None = None


class DemandStats(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """P's demand counters since it started.

    `admitted`: requests admitted that carried an answered query's id; `proof_valid`: of them,
    whose proof still held at admission; `changed`: why the others did not (per cause:
    "eviction" - a hit block lost its content; "block_reuse" - a hit block holds other content;
    "encoder_eviction" - an entry the answer reused left P's encoder cache); `hit_differs`:
    admissions whose C differs from the answer's (it grows when blocks were added since; of them,
    `valid_hit_shorter`: a smaller C although the proof held - an unsound proof, always 0).
    `index_blocks`: blocks the residency index
    holds; `index_mismatches`: with `check_index`, blocks where it differs from vLLM's prefix
    cache (else None); `index_device`: where the index lives. `kv_blocks`, `block_size`,
    `encoder_cache_embeds`: P's sizes (its KV pool, and vLLM's encoder_cache_size).
    """

    id: str
    answers: _Count = 0
    errors: _Count = 0
    admitted: _Count = 0
    proof_valid: _Count = 0
    changed: dict[str, _Count] = {}
    hit_differs: _Count = 0
    valid_hit_shorter: _Count = 0
    index_blocks: _Count = 0
    index_mismatches: _Count | None = None
    index_device: str = "cpu"
    forgotten: _Count = 0
    kv_blocks: _Count = 0
    block_size: _Count = 0
    encoder_cache_embeds: _Count = 0


class RecordsQuery(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """P's admission records from seq `since` on (at most `limit`): needs `admission_records`."""

    id: _Id
    since: _Count = 0
    limit: Annotated[int, msgspec.Meta(ge=1, le=65536)] = 4096


class RecordItem(msgspec.Struct, array_like=True, gc=False):
    """One item of an admitted request (vLLM's order): its identifier and its class, and
    whether P's prefix cache covered part of its embed positions (`partial`: its leading blocks
    cached, its tail not; still uncovered, so P needs the whole embedding)."""

    identifier: str
    item_class: ItemClass
    partial: bool = False  # a trailing default: records without it (older P's) still decode


class AdmissionRecord(msgspec.Struct, omit_defaults=True, gc=False):
    """What P did with one request when it first admitted it, whatever the proxy's policy (one
    record per request: a preempted request that resumes keeps its first record, which also
    gets the items encoded while that first prefill is still open).

    `items`: per item (vLLM's order), its identifier and class: `compute_demand` over P's state
    at admission with the C vLLM admitted it with (the E deliveries already in P's EC connector
    count as `p_external`); `encoded`: the items P ran its own encoder for, over its prefill;
    `demand_id`: the demand query it was sent with, if any; `proof_valid`: whether that answer's
    proof held (None without one).
    """

    seq: int
    request_id: str
    num_prompt_tokens: int
    num_computed_tokens: int
    items: list[RecordItem]
    encoded: list[int] = []
    demand_id: str | None = None
    proof_valid: bool | None = None


class AdmissionRecords(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Records `[since, next)` still held (`dropped`: older ones the bounded ring lost)."""

    id: str
    records: list[AdmissionRecord]
    next: int
    dropped: int = 0
    enabled: bool = True


# One KVSnapshot chunk's ids: 9 bytes each at most in msgpack, ~2.4 MB a chunk.
MAX_SNAPSHOT_BLOCKS = 262_144
_EventId = Annotated[int, msgspec.Meta(ge=0)]  # msgpack ints end below 2**64


class SnapshotQuery(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """P's prefix cache as a KV-event view would hold it: chunk `offset` of snapshot `id`."""

    id: _Id
    offset: _Count = 0


# One KVSnapshot chunk's identifiers: a table of distinct identifiers (MAX_SNAPSHOT_IDENT_BYTES
# in all) and, per block that carries any, indices into it (MAX_SNAPSHOT_IDENT_REFS
# in all, at most MAX_SNAPSHOT_IDENTS_PER_BLOCK a block: ~3.5 MB with their block indices).
# P ends a chunk early to stay within them; with the ids and counts a chunk stays under
# MAX_ANSWER_BYTES.
MAX_SNAPSHOT_IDENTS = 4096
MAX_SNAPSHOT_IDENT_REFS = 2 * MAX_SNAPSHOT_BLOCKS
MAX_SNAPSHOT_IDENTS_PER_BLOCK = 256  # events.index.MAX_EXTRA_KEYS_PER_BLOCK
MAX_SNAPSHOT_IDENT_BYTES = 4 << 20  # the table's UTF-8 bytes (an identifier: up to 4 a char)
_BlockIndex = Annotated[int, msgspec.Meta(ge=0, lt=MAX_SNAPSHOT_BLOCKS)]
_IdentIndex = Annotated[int, msgspec.Meta(ge=0, lt=MAX_SNAPSHOT_IDENTS)]


class KVSnapshot(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """One chunk of P's prefix cache (group 0, the GPU medium) as of KV-event batch `stamp`.

    Applying the whole snapshot (`total` distinct ids over its chunks), then every KV-event
    batch from `stamp` on, gives what applying every batch from 0 gives. `block_ids[i]` is a
    block hash's 64-bit event id and `counts[i]` how many of P's blocks hold it (a hash two
    blocks hold gets two BlockRemoved). `incarnation` names P's process (another one: another
    snapshot, never mixed); `blocks` is P's KV cache size, the bound on `total`.

    The mm identifiers the blocks carry (what BlockStored's `extra_keys` named), so that a view
    bootstrapped from the snapshot knows them as one that applied every batch from 0 does:
    `identifiers_followed` says P followed them (the same in every chunk; False, and nothing
    below, from a P that did not, or an older one: the view's identifiers stay unknown);
    `identifiers` is this chunk's table of them and `carried` lists, for each of this chunk's
    blocks that carries any (by its index in `block_ids`, ascending), the indices of its
    identifiers in the table. A block not listed carries none.
    """

    id: _Id
    stamp: _Count
    incarnation: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_CHARS)]
    total: _Count
    offset: _Count
    blocks: _Count
    block_ids: Annotated[list[_EventId], msgspec.Meta(max_length=MAX_SNAPSHOT_BLOCKS)] = []
    counts: Annotated[
        list[Annotated[int, msgspec.Meta(ge=1, le=2**31)]],
        msgspec.Meta(max_length=MAX_SNAPSHOT_BLOCKS),
    ] = []
    identifiers_followed: bool = False
    identifiers: Annotated[list[_Ident], msgspec.Meta(max_length=MAX_SNAPSHOT_IDENTS)] = []
    carried: Annotated[
        list[
            tuple[
                _BlockIndex,
                Annotated[
                    list[_IdentIndex],
                    msgspec.Meta(min_length=1, max_length=MAX_SNAPSHOT_IDENTS_PER_BLOCK),
                ],
            ]
        ],
        msgspec.Meta(max_length=MAX_SNAPSHOT_BLOCKS),
    ] = []


# One ECSnapshot chunk's entries (identifiers up to MAX_IDENT_CHARS: ~4.5 MB at most).
MAX_SNAPSHOT_ENTRIES = 4096


class ECSnapshotQuery(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """P's encoder cache as an encoder-cache-event view holds it: chunk `offset` of `id`."""

    id: _Id
    offset: _Count = 0


class ECEntry(msgspec.Struct, array_like=True, gc=False):
    """One encoder-cache entry: its identifier, its embeddings, whether it is freeable."""

    identifier: _Ident
    num_embeds: _Count
    freeable: bool


class ECSnapshot(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """One chunk of P's encoder cache as of encoder-cache-event batch `stamp` (every batch
    before it, none from it on). Entries not freeable come first, then the freeable ones in
    vLLM's eviction order (oldest first), as the view needs them."""

    id: _Id
    stamp: _Count
    incarnation: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_CHARS)]
    total: _Count
    offset: _Count
    entries: Annotated[list[ECEntry], msgspec.Meta(max_length=MAX_SNAPSHOT_ENTRIES)] = []


Query = DemandQuery | StatsQuery | RecordsQuery | SnapshotQuery | ECSnapshotQuery
Answer = DemandAnswer | DemandError | DemandStats | AdmissionRecords | KVSnapshot | ECSnapshot

_query_decoder = msgspec.msgpack.Decoder(Query)
_answer_decoder = msgspec.msgpack.Decoder(Answer)
_encoder = msgspec.msgpack.Encoder()


_UNCLASSIFIED = ItemClass.UNCLASSIFIED


class MalformedQuery(InvalidArgument):
    """A frame that is not a well-formed query (the answer is a DemandError with this text)."""


class MalformedAnswer(InvalidArgument):
    """A frame that is not a well-formed answer to the query it names."""


def encode(message: Query | Answer) -> bytes:
    return _encoder.encode(message)


def max_query_bytes(max_model_len: int) -> int:
    """The largest well-formed query frame for a P with this max_model_len, rounded up: token
    ids (9 bytes each at most), MAX_OVERLAP mask flags per token (1 byte each), MAX_ITEMS items
    and e_cached entries at their longest, the strings. P's ROUTER refuses larger frames."""
    n = check_int("max_model_len", max_model_len, 1)
    item = MAX_IDENT_CHARS + MAX_MODALITY_CHARS + 128  # + keys, offset, length, headers
    strings = MAX_SALT_CHARS + MAX_IDENT_CHARS + MAX_ID_CHARS + 1024  # + the other fields
    return (9 + MAX_OVERLAP) * n + MAX_ITEMS * (item + MAX_IDENT_CHARS + 8) + strings


def _bytes(field: str, payload: Any) -> bytes:
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise InvalidArgument(f"{field} must be bytes, got {type(payload).__name__}")
    return bytes(payload)


def decode_query(payload: bytes) -> Query:
    """A query frame, checked: items are valid occurrences inside the token ids, identifiers
    are unique per item slot; raises MalformedQuery naming the field."""
    try:
        query = _query_decoder.decode(_bytes("payload", payload))
    except InvalidArgument as e:
        raise MalformedQuery(str(e)) from None
    except (msgspec.DecodeError, RecursionError) as e:
        raise MalformedQuery(f"not a demand query: {e}") from None
    if isinstance(query, DemandQuery):
        occurrences_of(query)
    return query


def occurrences_of(query: DemandQuery) -> list[MMOccurrence]:
    """The query's items as MMOccurrences (vLLM's order is required: sorted by offset)."""
    n = len(query.token_ids)
    if n == 0:
        raise MalformedQuery("token_ids is empty")
    if len(query.items) > MAX_ITEMS:
        raise MalformedQuery(f"items has {len(query.items)} entries, more than {MAX_ITEMS}")
    last = -1
    total = 0
    for i, item in enumerate(query.items):
        if item.offset + item.length > n:
            raise MalformedQuery(
                f"items[{i}] = [{item.offset}, {item.offset + item.length}) is past the "
                f"{n} token ids"
            )
        if item.offset < last:
            raise MalformedQuery(f"items[{i}].offset {item.offset} is before items[{i - 1}]'s")
        # checked before the mask's flags are: each costs P, and only `length` are used
        if item.is_embed is not None and len(item.is_embed) != item.length:
            raise MalformedQuery(
                f"items[{i}]: is_embed has {len(item.is_embed)} entries but length is {item.length}"
            )
        last = item.offset
        total += item.length
    # what P spends on a query grows with its placeholders: bounded by the token ids
    if total > MAX_OVERLAP * n:
        raise MalformedQuery(
            f"items cover {total} placeholder positions in all, more than {MAX_OVERLAP} per "
            f"token id ({n}): vLLM overlaps at most {MAX_OVERLAP} items"
        )
    out = []
    for i, item in enumerate(query.items):
        mask = None if item.is_embed is None else tuple(item.is_embed)
        try:
            out.append(MMOccurrence(item.identifier, item.offset, item.length, mask, item.modality))
        except InvalidArgument as e:
            raise MalformedQuery(f"items[{i}]: {e}") from None
    return out


def query_for(
    rendered: Any, query_id: str, *, e_cached: Sequence[str] = (), remember: bool = True
) -> DemandQuery:
    """The DemandQuery for a rendered request (`mmreuse.render.RenderedPrompt`: token ids,
    occurrences in vLLM's order, its identity: cache salt and LoRA adapter): what the proxy and
    the tools send P."""
    return DemandQuery(
        id=query_id,
        token_ids=list(rendered.token_ids),
        items=[
            QueryItem(
                occ.identifier,
                occ.offset,
                occ.length,
                occ.modality,
                None if occ.is_embed is None else list(occ.is_embed),
            )
            for occ in rendered.occurrences
        ],
        cache_salt=rendered.identity.cache_salt,
        lora_name=rendered.identity.lora_name,
        e_cached=list(e_cached),
        remember=remember,
    )


def answer_for(
    query_id: str,
    num_computed_tokens: int,
    demand: DemandResult,
    **p_side: Any,
) -> DemandAnswer:
    """P's answer built from its plan at C = `num_computed_tokens`: each item's class
    (`OccurrenceDecision.item_class`) and dedup, e_demand, reuse and loads, rule S's
    self-evictions; `p_side` sets the fields only P knows (proof, trust, external_kv, step)."""
    return DemandAnswer(
        id=query_id,
        num_computed_tokens=num_computed_tokens,
        items=[AnswerItem(d.item_class, d.dedup_of) for d in demand.decisions],
        e_demand=[(ident, bool(fwd)) for ident, fwd in demand.e_demand],
        p_local_reuse=list(demand.p_local_reuse),
        p_loads=list(demand.p_loads),
        p_local_self_evicted=list(demand.self_evicted),
        encoder_cache_short=demand.encoder_cache_short,
        **p_side,
    )


def decode_answer(payload: bytes, query: DemandQuery | None = None) -> Answer:
    """An answer frame, checked (against `query` when given: same id, one class per item,
    e_demand naming only the query's identifiers); raises MalformedAnswer."""
    try:
        answer = _answer_decoder.decode(_bytes("payload", payload))
    except InvalidArgument as e:
        raise MalformedAnswer(str(e)) from None
    except (msgspec.DecodeError, RecursionError) as e:
        raise MalformedAnswer(f"not a demand answer: {e}") from None
    if isinstance(answer, KVSnapshot):
        _check_snapshot(answer)
    if isinstance(answer, AdmissionRecords):
        _check_records(answer)
    if isinstance(answer, ECSnapshot) and answer.offset + len(answer.entries) > answer.total:
        raise MalformedAnswer(
            f"snapshot chunk [{answer.offset}, {answer.offset + len(answer.entries)}) runs past "
            f"its total {answer.total}"
        )
    if query is None or not isinstance(answer, DemandAnswer):
        return answer
    if answer.id != query.id:
        raise MalformedAnswer(f"answer id {answer.id!r} is not the query's {query.id!r}")
    k = len(query.items)
    if len(answer.items) != k:
        raise MalformedAnswer(f"answer has {len(answer.items)} items for the query's {k}")
    for i, item in enumerate(answer.items):
        if item.item_class is _UNCLASSIFIED:
            raise MalformedAnswer(f"items[{i}].item_class = 'unclassified': only the proxy uses it")
        d = item.dedup_of
        if d is not None and not d < i:
            raise MalformedAnswer(f"items[{i}].dedup_of = {d} is not an earlier item")
    if answer.num_computed_tokens >= len(query.token_ids):
        raise MalformedAnswer(
            f"num_computed_tokens {answer.num_computed_tokens} is not below the "
            f"{len(query.token_ids)} prompt tokens"
        )
    idents = {item.identifier for item in query.items}
    for field in ("p_local_reuse", "p_loads"):
        stray = set(getattr(answer, field)) - idents
        if stray:
            raise MalformedAnswer(f"{field} names identifiers not in the query: {sorted(stray)}")
    stray = {ident for ident, _ in answer.e_demand} - idents
    if stray:
        raise MalformedAnswer(f"e_demand names identifiers not in the query: {sorted(stray)}")
    needing = {
        q.identifier for q, a in zip(query.items, answer.items, strict=True) if a.item_class.needs_e
    }
    unneeded = {ident for ident, _ in answer.e_demand} - needing
    if unneeded:
        raise MalformedAnswer(
            f"e_demand names identifiers no item of which needs E (classes): {sorted(unneeded)}"
        )
    if len(answer.proof_blocks) != len(answer.proof_generations):
        raise MalformedAnswer("proof_blocks and proof_generations differ in length")
    return answer


def record_items(demand: DemandResult) -> list[RecordItem]:
    """An admission record's items: each occurrence's identifier, `item_class` and `partial`."""
    return [RecordItem(d.identifier, d.item_class, d.partial) for d in demand.decisions]


def _check_records(answer: AdmissionRecords) -> None:
    """Records name no class a peer may not send (`unclassified`), and encode their own items."""
    for r, rec in enumerate(answer.records):
        for i, item in enumerate(rec.items):
            if item.item_class is _UNCLASSIFIED:
                raise MalformedAnswer(
                    f"records[{r}].items[{i}].item_class = 'unclassified': only the proxy uses it"
                )
        if rec.encoded and not 0 <= min(rec.encoded) <= max(rec.encoded) < len(rec.items):
            raise MalformedAnswer(
                f"records[{r}].encoded = {rec.encoded[:8]} names items outside its "
                f"{len(rec.items)} items"
            )


def _check_snapshot(chunk: KVSnapshot) -> None:
    n = len(chunk.block_ids)
    if len(chunk.counts) != n:
        raise MalformedAnswer(f"snapshot has {n} block_ids and {len(chunk.counts)} counts")
    if chunk.total > chunk.blocks:
        raise MalformedAnswer(f"snapshot total {chunk.total} exceeds P's {chunk.blocks} blocks")
    if chunk.offset + n > chunk.total:
        raise MalformedAnswer(
            f"snapshot chunk [{chunk.offset}, {chunk.offset + n}) runs past its total {chunk.total}"
        )
    if n == 0 and chunk.offset < chunk.total:
        raise MalformedAnswer(f"snapshot chunk at {chunk.offset} of {chunk.total} is empty")
    if chunk.identifiers_followed or chunk.identifiers or chunk.carried:
        _check_snapshot_identifiers(chunk)


def _check_snapshot_identifiers(chunk: KVSnapshot) -> None:
    """A chunk's identifiers: a table of distinct identifiers, each block listed once (in
    ascending order) and naming table entries, each once, MAX_SNAPSHOT_IDENT_REFS in all."""
    if not chunk.identifiers_followed:
        raise MalformedAnswer("snapshot carries identifiers but says it did not follow them")
    table = chunk.identifiers
    if len(set(table)) != len(table):
        raise MalformedAnswer("snapshot identifiers repeat an identifier")
    n, k = len(chunk.block_ids), len(table)
    last, refs = -1, 0
    for j, (block, idents) in enumerate(chunk.carried):
        if not last < block < n:
            raise MalformedAnswer(
                f"snapshot carried[{j}] names block {block}: not after {last} and below {n}"
            )
        last = block
        refs += len(idents)
        if refs > MAX_SNAPSHOT_IDENT_REFS:
            raise MalformedAnswer(
                f"snapshot carried names more than {MAX_SNAPSHOT_IDENT_REFS} identifiers in all"
            )
        if max(idents) >= k or len(set(idents)) != len(idents):
            raise MalformedAnswer(
                f"snapshot carried[{j}] = {idents[:8]}: indices must be distinct and below {k}"
            )


__all__ = [
    "MAX_SNAPSHOT_BLOCKS",
    "MAX_SNAPSHOT_ENTRIES",
    "MAX_SNAPSHOT_IDENTS",
    "MAX_SNAPSHOT_IDENTS_PER_BLOCK",
    "MAX_SNAPSHOT_IDENT_BYTES",
    "MAX_SNAPSHOT_IDENT_REFS",
    "AdmissionRecord",
    "AdmissionRecords",
    "Answer",
    "AnswerItem",
    "DemandAnswer",
    "DemandError",
    "DemandQuery",
    "DemandStats",
    "ECEntry",
    "ECSnapshot",
    "ECSnapshotQuery",
    "KVSnapshot",
    "MalformedAnswer",
    "MalformedQuery",
    "Query",
    "QueryItem",
    "RecordItem",
    "RecordsQuery",
    "SnapshotQuery",
    "StatsQuery",
    "answer_for",
    "decode_answer",
    "decode_query",
    "encode",
    "max_query_bytes",
    "occurrences_of",
    "query_for",
    "record_items",
]
