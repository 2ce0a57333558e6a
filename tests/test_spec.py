"""Model specs: prime recipe, pinned multipliers, serialization, validation."""

import numpy as np
import pytest

from engram_store.errors import SpecError
from engram_store.models.spec import MODELS, ModelSpec, derive_multipliers, get_spec


def _is_prime(n: int) -> bool:
    return n > 1 and all(n % f for f in range(2, int(n**0.5) + 1))


def test_v41_primes_match_checkpoint_row_counts():
    spec = get_spec("deepseek-v4.1-flash")
    assert spec.rows(1) == 384_006_168
    assert spec.rows(14) == 384_016_682
    assert spec.primes(1)[0, 0] == 16_000_057 and spec.primes(1)[-1, -1] == 16_000_463
    assert spec.primes(14)[0, 0] == 16_000_477 and spec.primes(14)[-1, -1] == 16_000_889
    spec.check_expected_rows()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_primes_are_distinct_rising_primes(name):
    spec = get_spec(name)
    allp = np.concatenate([spec.primes(layer).reshape(-1) for layer in spec.layers])
    assert len(set(allp.tolist())) == allp.size
    assert (np.diff(allp) > 0).all()
    assert allp[0] >= spec.table_base
    assert spec.size_rule != "primes" or all(_is_prime(int(p)) for p in allp[:8])  # spot-check (LongCat: odd)
    offs = spec.offsets(spec.layers[0]).reshape(-1)
    assert offs[0] == 0 and (offs[1:] == np.cumsum(spec.primes(spec.layers[0]).reshape(-1))[:-1]).all()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_pinned_multipliers_match_their_recipe(name):
    spec = get_spec(name)
    for layer in spec.layers:
        assert spec.derived_multipliers(layer) == spec.multipliers[layer]
        if spec.multiplier_rule == "numpy_rng":  # V4.1's: numpy's random stream
            assert derive_multipliers(layer, spec.compressed_vocab, spec.max_ngram) == spec.multipliers[layer]


def test_scaled_spec_follows_recipe_and_roundtrips():
    spec = get_spec("deepseek-v4.1-flash", scale=0.001)
    assert spec.table_base == 16_000 and spec.scale == pytest.approx(0.001)
    assert all(_is_prime(int(p)) for p in spec.primes(14).reshape(-1))
    again = ModelSpec.from_dict(spec.to_dict())
    assert again == spec and again.rows(1) == spec.rows(1)


def test_bad_specs_are_refused_with_reasons():
    with pytest.raises(SpecError, match="unknown model"):
        get_spec("gpt-9")
    with pytest.raises(SpecError, match="no Engram layer 5"):
        get_spec("tiny").primes(5)
    with pytest.raises(SpecError, match="scale"):
        get_spec("tiny", scale=2.0)
    d = get_spec("tiny").to_dict()
    d["multipliers"]["1"] = [1, 2]
    with pytest.raises(SpecError, match="multipliers"):
        ModelSpec.from_dict(d)
