from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RowIdType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INT64: _ClassVar[RowIdType]
    INT32: _ClassVar[RowIdType]
INT64: RowIdType
INT32: RowIdType

class LookupRequest(_message.Message):
    __slots__ = ("layer", "row_ids", "dtype")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    ROW_IDS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    layer: int
    row_ids: bytes
    dtype: RowIdType
    def __init__(self, layer: _Optional[int] = ..., row_ids: _Optional[bytes] = ..., dtype: _Optional[_Union[RowIdType, str]] = ...) -> None: ...

class LookupReply(_message.Message):
    __slots__ = ("rows", "first_row", "row_count", "row_bytes", "total_rows")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    FIRST_ROW_FIELD_NUMBER: _ClassVar[int]
    ROW_COUNT_FIELD_NUMBER: _ClassVar[int]
    ROW_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_ROWS_FIELD_NUMBER: _ClassVar[int]
    rows: bytes
    first_row: int
    row_count: int
    row_bytes: int
    total_rows: int
    def __init__(self, rows: _Optional[bytes] = ..., first_row: _Optional[int] = ..., row_count: _Optional[int] = ..., row_bytes: _Optional[int] = ..., total_rows: _Optional[int] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LayerInfo(_message.Message):
    __slots__ = ("layer", "rows")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    rows: int
    def __init__(self, layer: _Optional[int] = ..., rows: _Optional[int] = ...) -> None: ...

class InfoReply(_message.Message):
    __slots__ = ("layers", "row_bytes", "mode", "spec_json", "max_request_rows", "chunk_bytes", "protocol_version", "version", "bad_pages_json", "token_map_json", "placement_json", "table_scales_json")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    ROW_BYTES_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUEST_ROWS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BAD_PAGES_JSON_FIELD_NUMBER: _ClassVar[int]
    TOKEN_MAP_JSON_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_JSON_FIELD_NUMBER: _ClassVar[int]
    TABLE_SCALES_JSON_FIELD_NUMBER: _ClassVar[int]
    layers: _containers.RepeatedCompositeFieldContainer[LayerInfo]
    row_bytes: int
    mode: str
    spec_json: str
    max_request_rows: int
    chunk_bytes: int
    protocol_version: int
    version: str
    bad_pages_json: str
    token_map_json: str
    placement_json: str
    table_scales_json: str
    def __init__(self, layers: _Optional[_Iterable[_Union[LayerInfo, _Mapping]]] = ..., row_bytes: _Optional[int] = ..., mode: _Optional[str] = ..., spec_json: _Optional[str] = ..., max_request_rows: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., protocol_version: _Optional[int] = ..., version: _Optional[str] = ..., bad_pages_json: _Optional[str] = ..., token_map_json: _Optional[str] = ..., placement_json: _Optional[str] = ..., table_scales_json: _Optional[str] = ...) -> None: ...

class HintRequest(_message.Message):
    __slots__ = ("layer", "row_ids", "dtype", "key")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    ROW_IDS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    layer: int
    row_ids: bytes
    dtype: RowIdType
    key: int
    def __init__(self, layer: _Optional[int] = ..., row_ids: _Optional[bytes] = ..., dtype: _Optional[_Union[RowIdType, str]] = ..., key: _Optional[int] = ...) -> None: ...

class HintReply(_message.Message):
    __slots__ = ("rows_queued",)
    ROWS_QUEUED_FIELD_NUMBER: _ClassVar[int]
    rows_queued: int
    def __init__(self, rows_queued: _Optional[int] = ...) -> None: ...

class WithdrawRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: int
    def __init__(self, key: _Optional[int] = ...) -> None: ...

class WithdrawReply(_message.Message):
    __slots__ = ("rows_dropped",)
    ROWS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    rows_dropped: int
    def __init__(self, rows_dropped: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("values",)
    class ValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.ScalarMap[str, float]
    def __init__(self, values: _Optional[_Mapping[str, float]] = ...) -> None: ...
