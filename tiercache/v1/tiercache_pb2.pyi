from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_DEVICE: _ClassVar[Tier]
    TIER_HOST: _ClassVar[Tier]
    TIER_DISK: _ClassVar[Tier]
    TIER_REMOTE: _ClassVar[Tier]

class StopReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STOP_REASON_UNSPECIFIED: _ClassVar[StopReason]
    END_OF_PROMPT: _ClassVar[StopReason]
    MISSING_PAGE: _ClassVar[StopReason]
    NO_CHECKPOINT: _ClassVar[StopReason]
    GROUP_INCOMPLETE: _ClassVar[StopReason]
TIER_UNSPECIFIED: Tier
TIER_DEVICE: Tier
TIER_HOST: Tier
TIER_DISK: Tier
TIER_REMOTE: Tier
STOP_REASON_UNSPECIFIED: StopReason
END_OF_PROMPT: StopReason
MISSING_PAGE: StopReason
NO_CHECKPOINT: StopReason
GROUP_INCOMPLETE: StopReason

class BufferSpec(_message.Message):
    __slots__ = ("name", "rows", "row_shape", "dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    ROW_SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    rows: int
    row_shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, name: _Optional[str] = ..., rows: _Optional[int] = ..., row_shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class Layout(_message.Message):
    __slots__ = ("page_tokens", "paged", "slots", "tp_rank", "tp_size")
    PAGE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PAGED_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    page_tokens: int
    paged: _containers.RepeatedCompositeFieldContainer[BufferSpec]
    slots: _containers.RepeatedCompositeFieldContainer[BufferSpec]
    tp_rank: int
    tp_size: int
    def __init__(self, page_tokens: _Optional[int] = ..., paged: _Optional[_Iterable[_Union[BufferSpec, _Mapping]]] = ..., slots: _Optional[_Iterable[_Union[BufferSpec, _Mapping]]] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ...) -> None: ...

class SharedMemoryBuffer(_message.Message):
    __slots__ = ("offset", "ticket")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    offset: int
    ticket: bytes
    def __init__(self, offset: _Optional[int] = ..., ticket: _Optional[bytes] = ...) -> None: ...

class CudaIpcBuffer(_message.Message):
    __slots__ = ("handle", "offset", "device_uuid")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    handle: bytes
    offset: int
    device_uuid: str
    def __init__(self, handle: _Optional[bytes] = ..., offset: _Optional[int] = ..., device_uuid: _Optional[str] = ...) -> None: ...

class BufferLocation(_message.Message):
    __slots__ = ("name", "nbytes", "shm", "cuda")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    CUDA_FIELD_NUMBER: _ClassVar[int]
    name: str
    nbytes: int
    shm: SharedMemoryBuffer
    cuda: CudaIpcBuffer
    def __init__(self, name: _Optional[str] = ..., nbytes: _Optional[int] = ..., shm: _Optional[_Union[SharedMemoryBuffer, _Mapping]] = ..., cuda: _Optional[_Union[CudaIpcBuffer, _Mapping]] = ...) -> None: ...

class Group(_message.Message):
    __slots__ = ("id", "rank", "size")
    ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    id: str
    rank: int
    size: int
    def __init__(self, id: _Optional[str] = ..., rank: _Optional[int] = ..., size: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("model_id", "layout", "buffers", "extra_keys", "hash", "group", "signals")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEYS_FIELD_NUMBER: _ClassVar[int]
    HASH_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    SIGNALS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    layout: Layout
    buffers: _containers.RepeatedCompositeFieldContainer[BufferLocation]
    extra_keys: _containers.RepeatedScalarFieldContainer[str]
    hash: str
    group: Group
    signals: BufferLocation
    def __init__(self, model_id: _Optional[str] = ..., layout: _Optional[_Union[Layout, _Mapping]] = ..., buffers: _Optional[_Iterable[_Union[BufferLocation, _Mapping]]] = ..., extra_keys: _Optional[_Iterable[str]] = ..., hash: _Optional[str] = ..., group: _Optional[_Union[Group, _Mapping]] = ..., signals: _Optional[_Union[BufferLocation, _Mapping]] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("worker_id", "namespace_root", "layout_fingerprint", "hash", "reads_packed_rows", "reads_signals", "pid", "started", "takes_calls", "takes_lanes")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ROOT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    HASH_FIELD_NUMBER: _ClassVar[int]
    READS_PACKED_ROWS_FIELD_NUMBER: _ClassVar[int]
    READS_SIGNALS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    TAKES_CALLS_FIELD_NUMBER: _ClassVar[int]
    TAKES_LANES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    namespace_root: bytes
    layout_fingerprint: str
    hash: str
    reads_packed_rows: bool
    reads_signals: bool
    pid: int
    started: int
    takes_calls: bool
    takes_lanes: bool
    def __init__(self, worker_id: _Optional[str] = ..., namespace_root: _Optional[bytes] = ..., layout_fingerprint: _Optional[str] = ..., hash: _Optional[str] = ..., reads_packed_rows: _Optional[bool] = ..., reads_signals: _Optional[bool] = ..., pid: _Optional[int] = ..., started: _Optional[int] = ..., takes_calls: _Optional[bool] = ..., takes_lanes: _Optional[bool] = ...) -> None: ...

class OpenLaneRequest(_message.Message):
    __slots__ = ("worker_id", "lane")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    lane: SharedMemoryBuffer
    def __init__(self, worker_id: _Optional[str] = ..., lane: _Optional[_Union[SharedMemoryBuffer, _Mapping]] = ...) -> None: ...

class OpenLaneResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CallRequest(_message.Message):
    __slots__ = ("match", "load", "store", "timeout_seconds", "request_id")
    MATCH_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    match: MatchRequest
    load: LoadRequest
    store: StoreRequest
    timeout_seconds: float
    request_id: str
    def __init__(self, match: _Optional[_Union[MatchRequest, _Mapping]] = ..., load: _Optional[_Union[LoadRequest, _Mapping]] = ..., store: _Optional[_Union[StoreRequest, _Mapping]] = ..., timeout_seconds: _Optional[float] = ..., request_id: _Optional[str] = ...) -> None: ...

class CallReply(_message.Message):
    __slots__ = ("match", "load", "store", "code", "details", "request_id")
    MATCH_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    match: MatchResponse
    load: LoadResponse
    store: StoreResponse
    code: int
    details: str
    request_id: str
    def __init__(self, match: _Optional[_Union[MatchResponse, _Mapping]] = ..., load: _Optional[_Union[LoadResponse, _Mapping]] = ..., store: _Optional[_Union[StoreResponse, _Mapping]] = ..., code: _Optional[int] = ..., details: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class Signal(_message.Message):
    __slots__ = ("slot", "value")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    slot: int
    value: int
    def __init__(self, slot: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...

class SettleRequest(_message.Message):
    __slots__ = ("worker_id", "signal")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    signal: Signal
    def __init__(self, worker_id: _Optional[str] = ..., signal: _Optional[_Union[Signal, _Mapping]] = ...) -> None: ...

class SettleResponse(_message.Message):
    __slots__ = ("handled",)
    HANDLED_FIELD_NUMBER: _ClassVar[int]
    handled: bool
    def __init__(self, handled: _Optional[bool] = ...) -> None: ...

class UnregisterRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class UnregisterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MatchRequest(_message.Message):
    __slots__ = ("worker_id", "keys", "prefetch", "checks", "group")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_FIELD_NUMBER: _ClassVar[int]
    CHECKS_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    keys: bytes
    prefetch: bool
    checks: bytes
    group: str
    def __init__(self, worker_id: _Optional[str] = ..., keys: _Optional[bytes] = ..., prefetch: _Optional[bool] = ..., checks: _Optional[bytes] = ..., group: _Optional[str] = ...) -> None: ...

class MatchResult(_message.Message):
    __slots__ = ("pages", "tokens", "prompt_pages", "page_tiers", "checkpoint_tier", "stop", "kv_pages")
    PAGES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_TIERS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_TIER_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_FIELD_NUMBER: _ClassVar[int]
    pages: int
    tokens: int
    prompt_pages: int
    page_tiers: bytes
    checkpoint_tier: Tier
    stop: StopReason
    kv_pages: int
    def __init__(self, pages: _Optional[int] = ..., tokens: _Optional[int] = ..., prompt_pages: _Optional[int] = ..., page_tiers: _Optional[bytes] = ..., checkpoint_tier: _Optional[_Union[Tier, str]] = ..., stop: _Optional[_Union[StopReason, str]] = ..., kv_pages: _Optional[int] = ...) -> None: ...

class MatchResponse(_message.Message):
    __slots__ = ("match",)
    MATCH_FIELD_NUMBER: _ClassVar[int]
    match: MatchResult
    def __init__(self, match: _Optional[_Union[MatchResult, _Mapping]] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ("worker_id", "keys", "kv_rows", "slot", "ready_event", "asynchronous", "checks", "kv_rows_packed", "done_event", "signal")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    KV_ROWS_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    READY_EVENT_FIELD_NUMBER: _ClassVar[int]
    ASYNCHRONOUS_FIELD_NUMBER: _ClassVar[int]
    CHECKS_FIELD_NUMBER: _ClassVar[int]
    KV_ROWS_PACKED_FIELD_NUMBER: _ClassVar[int]
    DONE_EVENT_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    keys: bytes
    kv_rows: _containers.RepeatedScalarFieldContainer[int]
    slot: int
    ready_event: bytes
    asynchronous: bool
    checks: bytes
    kv_rows_packed: bytes
    done_event: bytes
    signal: Signal
    def __init__(self, worker_id: _Optional[str] = ..., keys: _Optional[bytes] = ..., kv_rows: _Optional[_Iterable[int]] = ..., slot: _Optional[int] = ..., ready_event: _Optional[bytes] = ..., asynchronous: _Optional[bool] = ..., checks: _Optional[bytes] = ..., kv_rows_packed: _Optional[bytes] = ..., done_event: _Optional[bytes] = ..., signal: _Optional[_Union[Signal, _Mapping]] = ...) -> None: ...

class TierBytes(_message.Message):
    __slots__ = ("tier", "bytes")
    TIER_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    bytes: int
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., bytes: _Optional[int] = ...) -> None: ...

class LoadResponse(_message.Message):
    __slots__ = ("match", "bytes_from", "damaged", "done_event")
    MATCH_FIELD_NUMBER: _ClassVar[int]
    BYTES_FROM_FIELD_NUMBER: _ClassVar[int]
    DAMAGED_FIELD_NUMBER: _ClassVar[int]
    DONE_EVENT_FIELD_NUMBER: _ClassVar[int]
    match: MatchResult
    bytes_from: _containers.RepeatedCompositeFieldContainer[TierBytes]
    damaged: int
    done_event: bytes
    def __init__(self, match: _Optional[_Union[MatchResult, _Mapping]] = ..., bytes_from: _Optional[_Iterable[_Union[TierBytes, _Mapping]]] = ..., damaged: _Optional[int] = ..., done_event: _Optional[bytes] = ...) -> None: ...

class Checkpoint(_message.Message):
    __slots__ = ("pages", "slot")
    PAGES_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    pages: int
    slot: int
    def __init__(self, pages: _Optional[int] = ..., slot: _Optional[int] = ...) -> None: ...

class StoreRequest(_message.Message):
    __slots__ = ("worker_id", "keys", "kv_rows", "checkpoints", "ready_event", "checks", "durable", "event_tokens", "first_page", "kv_rows_packed", "done_event", "signal", "asynchronous")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    KV_ROWS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    READY_EVENT_FIELD_NUMBER: _ClassVar[int]
    CHECKS_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_PAGE_FIELD_NUMBER: _ClassVar[int]
    KV_ROWS_PACKED_FIELD_NUMBER: _ClassVar[int]
    DONE_EVENT_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    ASYNCHRONOUS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    keys: bytes
    kv_rows: _containers.RepeatedScalarFieldContainer[int]
    checkpoints: _containers.RepeatedCompositeFieldContainer[Checkpoint]
    ready_event: bytes
    checks: bytes
    durable: bool
    event_tokens: bytes
    first_page: int
    kv_rows_packed: bytes
    done_event: bytes
    signal: Signal
    asynchronous: bool
    def __init__(self, worker_id: _Optional[str] = ..., keys: _Optional[bytes] = ..., kv_rows: _Optional[_Iterable[int]] = ..., checkpoints: _Optional[_Iterable[_Union[Checkpoint, _Mapping]]] = ..., ready_event: _Optional[bytes] = ..., checks: _Optional[bytes] = ..., durable: _Optional[bool] = ..., event_tokens: _Optional[bytes] = ..., first_page: _Optional[int] = ..., kv_rows_packed: _Optional[bytes] = ..., done_event: _Optional[bytes] = ..., signal: _Optional[_Union[Signal, _Mapping]] = ..., asynchronous: _Optional[bool] = ...) -> None: ...

class StoreResponse(_message.Message):
    __slots__ = ("stored", "present", "skipped", "checkpoints")
    STORED_FIELD_NUMBER: _ClassVar[int]
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    stored: int
    present: int
    skipped: int
    checkpoints: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, stored: _Optional[int] = ..., present: _Optional[int] = ..., skipped: _Optional[int] = ..., checkpoints: _Optional[_Iterable[int]] = ...) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("worker_id", "keys", "tier")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    keys: bytes
    tier: Tier
    def __init__(self, worker_id: _Optional[str] = ..., keys: _Optional[bytes] = ..., tier: _Optional[_Union[Tier, str]] = ...) -> None: ...

class EvictResponse(_message.Message):
    __slots__ = ("evicted",)
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    evicted: int
    def __init__(self, evicted: _Optional[int] = ...) -> None: ...

class DescribeGroupRequest(_message.Message):
    __slots__ = ("group",)
    GROUP_FIELD_NUMBER: _ClassVar[int]
    group: str
    def __init__(self, group: _Optional[str] = ...) -> None: ...

class DescribeGroupResponse(_message.Message):
    __slots__ = ("namespace_root", "hash", "size", "live_ranks", "model_id", "page_tokens")
    NAMESPACE_ROOT_FIELD_NUMBER: _ClassVar[int]
    HASH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    LIVE_RANKS_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    namespace_root: bytes
    hash: str
    size: int
    live_ranks: _containers.RepeatedScalarFieldContainer[int]
    model_id: str
    page_tokens: int
    def __init__(self, namespace_root: _Optional[bytes] = ..., hash: _Optional[str] = ..., size: _Optional[int] = ..., live_ranks: _Optional[_Iterable[int]] = ..., model_id: _Optional[str] = ..., page_tokens: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("tier", "entries", "used_bytes", "budget_bytes")
    TIER_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    entries: int
    used_bytes: int
    budget_bytes: int
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., entries: _Optional[int] = ..., used_bytes: _Optional[int] = ..., budget_bytes: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("tiers", "counters", "workers")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    TIERS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    counters: _containers.ScalarMap[str, int]
    workers: int
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., counters: _Optional[_Mapping[str, int]] = ..., workers: _Optional[int] = ...) -> None: ...
