"""Model specs as data: Engram layers, n-gram orders, heads, table sizes, row format.

A spec is everything needed to compute row ids and to lay rows out on disk.
Adding a model means adding an entry to :data:`MODELS`, never a code path.

Table sizes follow the recipe of ``shared/ENGRAM.md``: for every layer in order
and every n-gram order, take the next ``heads`` primes above ``table_base - 1``
that no earlier (layer, order, head) used (``size_rule = "primes"``; LongCat's
odd moduli are ``size_rule = "odd"``, :mod:`.longcat`). Multipliers are pinned per layer
because numpy does not promise a stable random stream across versions;
:func:`derive_multipliers` recomputes them so a test can check the pins.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import SpecError
from .longcat import SPECS as LONGCAT_SPECS, odd_sizes, power_multipliers
from .qwen4exp import SPECS as QWEN4EXP_SPECS, splitmix_multipliers

INT64_MAX = np.iinfo(np.int64).max


PAYLOAD_BITS = {"float8_e4m3fn": 8, "bfloat16": 16, "float4_e2m1fn": 4}  # bits per value (E2M1: two a byte)
SCALE_DTYPES = ("float8_e8m0fnu", "float8_e4m3fn")  # one byte per block scale
TABLE_SCALE_DTYPES = ("float32",)


@dataclass(frozen=True)
class RowFormat:
    """Bytes of one table row: ``payload_bytes`` of values then ``scale_count`` block-scale bytes.

    ``scale_block = 0``: no per-row scales. ``table_scale_dtype``: the table also has one scale
    for all its rows (vLLM's per-tensor FP8 ``weight_scale``, NVFP4's ``weight_scale_2``), kept
    beside the rows, never in them; ``""``: none.
    """

    payload_dtype: str = "float8_e4m3fn"  # one of PAYLOAD_BITS
    dim: int = 256  # values per row
    scale_dtype: str = "float8_e8m0fnu"  # one scale byte per block ("" without block scales)
    scale_block: int = 32  # values sharing one scale; 0: no block scales
    table_scale_dtype: str = ""  # one scale per table ("" for none)

    @property
    def scale_count(self) -> int:
        return self.dim // self.scale_block if self.scale_block else 0

    @property
    def payload_bytes(self) -> int:
        """Bytes of a row's values (``dim`` for FP8, the split layout's weights block width)."""
        return self.dim * PAYLOAD_BITS[self.payload_dtype] // 8

    @property
    def row_bytes(self) -> int:
        return self.payload_bytes + self.scale_count

    def problems(self) -> list[str]:
        """Why this format cannot be laid out; empty when it can."""
        out = []
        bits = PAYLOAD_BITS.get(self.payload_dtype)
        if bits is None:
            out.append(f"payload_dtype {self.payload_dtype!r} is not one of {sorted(PAYLOAD_BITS)}")
        elif self.dim < 1 or self.dim * bits % 8:
            out.append(f"dim {self.dim} values of {self.payload_dtype} are not a whole number of bytes")
        if self.scale_block < 0 or (self.scale_block and self.dim % self.scale_block):
            out.append("dim must be a multiple of scale_block")
        if self.scale_block and self.scale_dtype not in SCALE_DTYPES:
            out.append(f"scale_dtype {self.scale_dtype!r} is not one of {list(SCALE_DTYPES)}")
        if self.table_scale_dtype and self.table_scale_dtype not in TABLE_SCALE_DTYPES:
            out.append(f"table_scale_dtype {self.table_scale_dtype!r} is not one of {list(TABLE_SCALE_DTYPES)}")
        return out


@dataclass(frozen=True)
class ModelSpec:
    """One model's Engram geometry. Frozen; build variants with :meth:`scaled`."""

    name: str
    layers: tuple[int, ...]  # Engram layer ids (0-indexed transformer blocks)
    orders: tuple[int, ...]  # n-gram orders, ascending (2, 3, 4)
    heads: int  # hash heads per order
    table_base: int  # prime search starts at table_base - 1
    compressed_vocab: int  # classes of compressed token ids
    pad_id: int  # compressed pad id
    multipliers: dict[int, tuple[int, ...]]  # per layer, one per look-back k
    row_format: RowFormat = RowFormat()
    seed_factor: int = 10007  # rng seed = seed_factor * layer (for derive_multipliers)
    expected_rows: dict[int, int] | None = None  # checkpoint row counts, self-check
    scale: float = 1.0
    pad_token_id: int | None = None  # raw engram_pad_token_id (pad_id is its compressed id); None: unknown
    image_token_id: int | None = None  # raw id of the image placeholder, blocked under the image rule
    # Fields of other families (their defaults are V4.1's; to_dict leaves defaults out):
    row_pad_to: int = 1  # a layer's table rows: the primes' sum rounded up to this (Qwen4Exp pads to 128)
    boundary: str = "blocked"  # see BOUNDARIES
    multiplier_rule: str = "numpy_rng"  # see MULTIPLIER_RULES
    seed: int = 0  # splitmix64 rule: the model's seed
    token_ids: str = "compressed"  # the hash reads "compressed" ids (through a token map) or "raw" ids
    size_rule: str = "primes"  # see SIZE_RULES
    hash_rule: str = "xor_mul"  # see HASH_RULES
    eos_current: str = "offset"  # boundary "eos_cut": an EOS current token's id, see EOS_CURRENT

    def __post_init__(self) -> None:
        if not self.layers or sorted(set(self.layers)) != list(self.layers):
            raise SpecError(f"spec {self.name!r}: layers must be distinct and ascending, got {self.layers}")
        if not self.orders or sorted(set(self.orders)) != list(self.orders) or self.orders[0] < 2:
            raise SpecError(f"spec {self.name!r}: orders must be distinct, ascending and >= 2, got {self.orders}")
        if self.heads < 1 or self.table_base < 3 or self.compressed_vocab < 2:
            raise SpecError(f"spec {self.name!r}: heads, table_base and compressed_vocab must be positive")
        if not 0 <= self.pad_id < self.compressed_vocab:
            raise SpecError(f"spec {self.name!r}: pad_id {self.pad_id} outside the compressed vocab")
        bound = INT64_MAX if self.hash_rule == "poly_mod" else INT64_MAX // self.compressed_vocab
        for layer in self.layers:
            mult = self.multipliers.get(layer)
            if mult is None or len(mult) != self.max_ngram:
                raise SpecError(f"spec {self.name!r}: layer {layer} needs {self.max_ngram} multipliers")
            if any(m <= 0 or m > bound for m in mult):
                raise SpecError(f"spec {self.name!r}: layer {layer} multipliers must be in (0, {bound}]")
        for problem in self.row_format.problems():
            raise SpecError(f"spec {self.name!r}: {problem}")
        for field, value, allowed in (("boundary", self.boundary, BOUNDARIES),
                                      ("multiplier_rule", self.multiplier_rule, MULTIPLIER_RULES),
                                      ("token_ids", self.token_ids, ("compressed", "raw")),
                                      ("size_rule", self.size_rule, SIZE_RULES), ("hash_rule", self.hash_rule, HASH_RULES),
                                      ("eos_current", self.eos_current, EOS_CURRENT)):
            if value not in allowed:
                raise SpecError(f"spec {self.name!r}: {field} {value!r} is not one of {list(allowed)}")
        if self.row_pad_to < 1:
            raise SpecError(f"spec {self.name!r}: row_pad_to must be >= 1, got {self.row_pad_to}")
        if len({self.hash_rule == "poly_mod", self.multiplier_rule == "powers", self.boundary == "eos_cut"}) > 1:
            raise SpecError(f"spec {self.name!r}: hash_rule 'poly_mod' goes with multiplier_rule 'powers' and "
                            f"boundary 'eos_cut', and only with them; got {self.hash_rule!r}, "
                            f"{self.multiplier_rule!r}, {self.boundary!r}")

    # --- derived geometry -------------------------------------------------
    @property
    def max_ngram(self) -> int:
        return self.orders[-1]

    @property
    def history_len(self) -> int:
        """Tokens of history a request carries so decode hashes like prefill."""
        return self.max_ngram - 1

    @property
    def family(self) -> str:
        """The model family whose tables these are, in words (its hash names it): ``DeepSeek-V4.1 Engram``,
        ``Qwen4Exp PLE n-gram``, ``LongCat-Flash n-gram``."""
        return FAMILIES.get(self.multiplier_rule, self.multiplier_rule)

    @property
    def rows_per_token(self) -> int:
        return len(self.orders) * self.heads

    @property
    def row_bytes(self) -> int:
        return self.row_format.row_bytes

    def sizes(self, layer: int) -> np.ndarray:
        """int64 ``[len(orders), heads]`` table sizes (the hash's moduli) of ``layer``: primes
        (``size_rule = "primes"``) or LongCat's odd moduli (``"odd"``)."""
        index = self._index(layer)
        if self.size_rule == "odd":
            return odd_sizes(self.table_base, len(self.orders), self.heads)
        return _primes(self.layers, self.orders, self.heads, self.table_base)[index]

    primes = sizes  # V4.1's name for the sizes

    def poly_weights(self, layer: int) -> np.ndarray:
        """int64 ``[len(orders), heads, max_ngram]``: ``multipliers[d] mod size`` per table, the
        weight of the token ``d`` back (``hash_rule = "poly_mod"``; vLLM's ``ne_weights``)."""
        sizes = [int(s) for s in self.sizes(layer).reshape(-1)]
        weights = [[m % s for m in self.multipliers[layer]] for s in sizes]  # Python ints: powers may pass int64
        return np.asarray(weights, dtype=np.int64).reshape(len(self.orders), self.heads, self.max_ngram)

    def offsets(self, layer: int) -> np.ndarray:
        """int64 ``[len(orders), heads]`` first global row of each (order, head) table."""
        flat = self.sizes(layer).reshape(-1)
        return (np.cumsum(flat) - flat).reshape(len(self.orders), self.heads)

    def rows(self, layer: int) -> int:
        """Rows of ``layer``'s table: its primes' sum, padded to ``row_pad_to`` (rows the hash never names)."""
        return -(-int(self.sizes(layer).sum()) // self.row_pad_to) * self.row_pad_to

    def derived_multipliers(self, layer: int) -> tuple[int, ...]:
        """``layer``'s multipliers recomputed by the spec's rule (only to check the pinned values)."""
        if self.multiplier_rule == "powers":
            self._index(layer)
            return power_multipliers(self.compressed_vocab, self.max_ngram)
        if self.multiplier_rule == "splitmix64":
            return splitmix_multipliers(self._index(layer), self.compressed_vocab, self.max_ngram, self.seed,
                                        self.seed_factor)
        return derive_multipliers(layer, self.compressed_vocab, self.max_ngram, self.seed_factor)

    def multipliers_array(self, layer: int) -> np.ndarray:
        self._index(layer)
        return np.asarray(self.multipliers[layer], dtype=np.int64)

    def _index(self, layer: int) -> int:
        try:
            return self.layers.index(layer)
        except ValueError:
            raise SpecError(f"spec {self.name!r} has no Engram layer {layer}; layers are {list(self.layers)}") from None

    # --- variants and serialization --------------------------------------
    def scaled(self, scale: float) -> "ModelSpec":
        """The same model with ``table_base`` multiplied by ``scale`` (primes follow the recipe)."""
        if not 0 < scale <= 1:
            raise SpecError(f"scale must be in (0, 1], got {scale}")
        base = max(int(round(self.table_base * scale)), 3)
        return dataclasses.replace(self, table_base=base, scale=self.scale * scale, expected_rows=None)

    def to_dict(self) -> dict[str, Any]:
        """Plain data; fields added for other families are left out at their defaults, so a V4.1
        spec reads the same as before they existed."""
        d = {k: v for k, v in dataclasses.asdict(self).items() if k not in _LATER or v != _LATER[k]}
        d["row_format"] = {k: v for k, v in d["row_format"].items() if k != "table_scale_dtype" or v}
        d["multipliers"] = {str(k): list(v) for k, v in self.multipliers.items()}
        d["expected_rows"] = None if self.expected_rows is None else {str(k): v for k, v in self.expected_rows.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelSpec":
        try:
            d = dict(d)
            d["layers"] = tuple(int(x) for x in d["layers"])
            d["orders"] = tuple(int(x) for x in d["orders"])
            d["multipliers"] = {int(k): tuple(int(x) for x in v) for k, v in d["multipliers"].items()}
            if d.get("expected_rows") is not None:
                d["expected_rows"] = {int(k): int(v) for k, v in d["expected_rows"].items()}
            d["row_format"] = RowFormat(**d["row_format"])
            return cls(**d)
        except (KeyError, TypeError, ValueError) as exc:
            raise SpecError(f"invalid model spec in manifest: {exc}") from exc

    def check_expected_rows(self) -> None:
        """Raise if the computed table sizes differ from the pinned checkpoint row counts."""
        for layer, want in (self.expected_rows or {}).items():
            if self.rows(layer) != want:
                raise SpecError(f"spec {self.name!r} layer {layer}: table sizes sum to {self.rows(layer)}, "
                                f"checkpoint has {want}")


# boundary rules of the hash's look-back (engram_store.models.hashing):
# "blocked": V4.1; -1 (a blocked token) and every older token hash as pad_id, positions before the
#            request's start as pad_id.
# "eos":     Qwen4Exp; look-back tokens at or beyond the first pad_id (EOS) looking back, and
#            positions before the start, hash as pad_id; the current token is always kept.
# "eos_cut": LongCat; the gram is cut (shorter, never padded) at the request's start and at the
#            first EOS looking back; an EOS current token as eos_current says.
BOUNDARIES = ("blocked", "eos", "eos_cut")
# "offset": vLLM 0.33 (EOS negated in its token table): the gram is empty, the id is the table's offset.
# "rehash": SGLang 0.5.23: the EOS is hashed with its look-back, as any other current token.
EOS_CURRENT = ("offset", "rehash")
# multiplier rules: "numpy_rng" (V4.1, derive_multipliers), "splitmix64" (Qwen4Exp, .qwen4exp),
# "powers" (LongCat: compressed_vocab**d, .longcat)
MULTIPLIER_RULES = ("numpy_rng", "splitmix64", "powers")
# a spec's multiplier_rule -> the model family whose hash it is
FAMILIES = {"numpy_rng": "DeepSeek-V4.1 Engram", "splitmix64": "Qwen4Exp PLE n-gram", "powers": "LongCat-Flash n-gram"}
SIZE_RULES = ("primes", "odd")  # "odd": table e of a layer has table_base + 2e + 1 rows (.longcat)
# "xor_mul": V4.1 and Qwen4Exp, xor of token * multiplier, mod the size; "poly_mod": LongCat, sum of
# (token * poly_weights) mod the size, mod the size (engram_store.models.hashing)
HASH_RULES = ("xor_mul", "poly_mod")
_LATER = {"row_pad_to": 1, "boundary": "blocked", "multiplier_rule": "numpy_rng", "seed": 0, "token_ids": "compressed",
          "size_rule": "primes", "hash_rule": "xor_mul", "eos_current": "offset"}


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    f = 3
    while f * f <= n:
        if n % f == 0:
            return False
        f += 2
    return True


@functools.cache
def _primes(layers: tuple[int, ...], orders: tuple[int, ...], heads: int, base: int) -> np.ndarray:
    seen: set[int] = set()
    out = np.zeros((len(layers), len(orders), heads), dtype=np.int64)
    for li in range(len(layers)):
        for oi in range(len(orders)):
            candidate = base - 1
            for j in range(heads):
                candidate += 1
                while not _is_prime(candidate) or candidate in seen:
                    candidate += 1
                seen.add(candidate)
                out[li, oi, j] = candidate
    out.setflags(write=False)
    return out


def derive_multipliers(layer: int, compressed_vocab: int, count: int, seed_factor: int = 10007) -> tuple[int, ...]:
    """Recompute a layer's multipliers with numpy (only to check the pinned values)."""
    m_max = INT64_MAX // compressed_vocab
    rng = np.random.default_rng(seed_factor * layer)
    return tuple(int(x) for x in rng.integers(0, m_max // 2, size=count, dtype=np.int64) * 2 + 1)


MODELS: dict[str, ModelSpec] = {
    "deepseek-v4.1-flash": ModelSpec(
        name="deepseek-v4.1-flash",
        layers=(1, 14),
        orders=(2, 3, 4),
        heads=8,
        table_base=16_000_000,
        compressed_vocab=99_092,
        pad_id=2,
        multipliers={
            1: (76632096046245, 4839876093313, 35959672319349, 73987337458391),
            14: (67716810739261, 51510806800915, 30921347202721, 82619226485591),
        },
        expected_rows={1: 384_006_168, 14: 384_016_682},
        pad_token_id=2,
        image_token_id=129_264,
    ),
    # Engram-27B of the paper: two Engram layers, orders 2-3, 8 heads (16 rows per token).
    # Layer ids and table base follow the paper's description; rows use V4.1's format.
    "engram-27b": ModelSpec(
        name="engram-27b",
        layers=(2, 15),
        orders=(2, 3),
        heads=8,
        table_base=2_262_400,
        compressed_vocab=99_092,
        pad_id=2,
        multipliers={
            2: (76507469730479, 37097805264573, 22647385550623),
            15: (28919099099511, 56020370062535, 53929037264533),
        },
    ),
    # A small model for tests: same recipe, small primes, small rows.
    "tiny": ModelSpec(
        name="tiny",
        layers=(1, 3),
        orders=(2, 3, 4),
        heads=4,
        table_base=1_000,
        compressed_vocab=512,
        pad_id=2,
        multipliers={
            1: (14831304026200453, 936705081716061, 6959601268494069, 14319439928568407),
            3: (5327545137947969, 15804252993068197, 2105304604748359, 13605204602324401),
        },
        row_format=RowFormat(dim=64, scale_block=32),
    ),
}


MODELS.update({name: ModelSpec.from_dict(d) for name, d in (QWEN4EXP_SPECS | LONGCAT_SPECS).items()})


# --------------------------------------------------------------------------- from a checkpoint's config.json
# config.json key -> what a spec says about it (``engram_num_embeddings``: rows per layer)
CONFIG_FIELDS: dict[str, Any] = {
    "engram_layer_ids": lambda s: list(s.layers),
    "engram_num_embeddings": lambda s: [s.rows(layer) for layer in s.layers],
    "engram_max_ngram_size": lambda s: s.max_ngram,
    "engram_n_heads": lambda s: s.heads,
    "engram_head_dim": lambda s: s.row_format.dim,
    "engram_compressed_vocab_size": lambda s: s.compressed_vocab,
    "engram_pad_token_id": lambda s: s.pad_token_id,
    "engram_vocab_size": lambda s: s.table_base,
    "image_token_id": lambda s: s.image_token_id,
}
_REQUIRED = ("engram_layer_ids", "engram_max_ngram_size", "engram_n_heads", "engram_compressed_vocab_size",
             "engram_vocab_size")


def engram_config(config: dict[str, Any]) -> dict[str, Any]:
    """The Engram fields of a config.json, from ``text_config`` (V4.1) or the top level, whichever has each."""
    text = config.get("text_config")
    text = text if isinstance(text, dict) else {}
    return {key: text[key] if key in text else config[key] for key in CONFIG_FIELDS if key in text or key in config}


def config_mismatches(fields: dict[str, Any], spec: ModelSpec) -> list[str]:
    """``key = value (spec has X)`` for every field present in ``fields`` that ``spec`` disagrees with."""
    out = []
    for key, value in fields.items():
        want = CONFIG_FIELDS[key](spec)
        if want is not None and value != want:
            out.append(f"{key} = {value!r} (model {spec.name!r} has {want!r})")
    return out


def spec_from_config(config: dict[str, Any], name: str | None = None, pad_id: int | None = None) -> ModelSpec:
    """A spec from a config.json's Engram fields (top level or ``text_config``).

    Multipliers follow the recipe (:func:`derive_multipliers`) and are checked against the pinned
    values of every built-in model with the same compressed vocab and n-gram size; a config
    describing a built-in model exactly gives that model. ``pad_id``: the compressed pad
    (``map[engram_pad_token_id]``); without it the raw pad id is taken as is.
    """
    fields = engram_config(config)
    missing = [key for key in _REQUIRED if key not in fields]
    if missing:
        raise SpecError(f"config.json has no {', '.join(missing)} (looked at the top level and text_config); "
                        "pass --model to name the model instead")
    try:
        layers = tuple(int(x) for x in fields["engram_layer_ids"])
        max_ngram, vocab = int(fields["engram_max_ngram_size"]), int(fields["engram_compressed_vocab_size"])
        raw_pad = int(fields.get("engram_pad_token_id", 2))
        rows = fields.get("engram_num_embeddings")
        expected = None if rows is None else dict(zip(layers, (int(r) for r in rows), strict=True))
        image = fields.get("image_token_id")
        spec = ModelSpec(
            name=name or str(config.get("model_type") or "checkpoint"), layers=layers,
            orders=tuple(range(2, max_ngram + 1)), heads=int(fields["engram_n_heads"]),
            table_base=int(fields["engram_vocab_size"]), compressed_vocab=vocab,
            pad_id=raw_pad if pad_id is None else int(pad_id),
            multipliers={layer: derive_multipliers(layer, vocab, max_ngram) for layer in layers},
            row_format=RowFormat(dim=int(fields.get("engram_head_dim", RowFormat.dim))),
            expected_rows=expected, pad_token_id=raw_pad, image_token_id=None if image is None else int(image),
        )
    except (TypeError, ValueError) as exc:
        raise SpecError(f"config.json engram fields are malformed: {exc}") from exc
    _check_pins(spec)
    spec.check_expected_rows()
    for known in MODELS.values():
        if _geometry(known) == _geometry(spec) and known.multipliers == spec.multipliers:
            return dataclasses.replace(known, image_token_id=spec.image_token_id or known.image_token_id)
    return spec


def _geometry(spec: ModelSpec) -> tuple:
    return (spec.layers, spec.orders, spec.heads, spec.table_base, spec.compressed_vocab, spec.pad_id, spec.row_format)


def _check_pins(spec: ModelSpec) -> None:
    for known in MODELS.values():
        if known.compressed_vocab != spec.compressed_vocab or known.max_ngram != spec.max_ngram:
            continue
        for layer in set(known.layers) & set(spec.layers):
            if known.multipliers[layer] != spec.multipliers[layer]:
                raise SpecError(f"layer {layer}: numpy derives multipliers {list(spec.multipliers[layer])}, model "
                                f"{known.name!r} pins {list(known.multipliers[layer])}: this numpy's random stream "
                                "differs; import with --model to use the pinned values")


def get_spec(name: str, scale: float = 1.0) -> ModelSpec:
    """A registered spec by name, optionally scaled."""
    try:
        spec = MODELS[name]
    except KeyError:
        raise SpecError(f"unknown model {name!r}; known models: {', '.join(sorted(MODELS))}") from None
    return spec if scale == 1.0 else spec.scaled(scale)
