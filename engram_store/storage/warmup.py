"""A TieredStore's access profiles: warming the row cache up from one, and the hottest rows written as
one (the cache's rows, then rows sampled from live traffic). :class:`ProfileWarmUp` is a component of
:class:`~engram_store.storage.tiered.TieredStore`, which delegates these methods to it."""

from __future__ import annotations

import logging
import os
import time

from typing import Collection, Mapping

import numpy as np

from .layer_file import LayerFile
from .parts import PageChecks
from .profile import AccessSampler, merge_hottest, open_profile, read_profile, write_profile
from .row_cache import LAYER_SHIFT, ROW_MASK, RowCache

log = logging.getLogger(__name__)


class ProfileWarmUp:
    """Access profiles in and out of a store's cache. Thread-safe as its parts are."""

    def __init__(self, files: Mapping[int, LayerFile], resident: Collection[int], cache: RowCache | None,
                 sampler: AccessSampler, checks: PageChecks) -> None:
        self._files, self._resident, self._cache, self._sampler, self._checks = files, resident, cache, sampler, checks

    def warm_up(self, profile: str | os.PathLike | np.ndarray) -> int:
        """Load the rows of an access profile (a path or int64 ``[n, 2]`` pairs, hottest
        first) into the cache, up to its capacity. Returns rows loaded (0 when resident).
        The caller is inside the store's close gate."""
        if self._cache is None:
            if not isinstance(profile, np.ndarray):
                open_profile(profile)  # a bad file is an error all the same
            log.info("warm-up skipped: resident mode holds every row already")
            return 0
        if isinstance(profile, np.ndarray):
            pairs = profile.reshape(-1, 2).astype(np.int64)
            pairs = pairs[~np.isin(pairs[:, 0], list(self._resident))]  # resident layers hold every row already
        else:  # read only as far as the cache can use
            pairs = read_profile(profile, self._cache.n_slots, skip_layers=self._resident)
        pairs = pairs[: self._cache.n_slots]
        loaded = 0
        t0 = time.perf_counter()
        for layer in np.unique(pairs[:, 0]):
            lf = self._files.get(int(layer))
            if lf is None or lf.file is None:
                log.warning("warm-up: skipping layer %d (%s)", layer, "not in table set" if lf is None else lf.error)
                continue
            rows = np.unique(pairs[pairs[:, 0] == layer, 1])
            valid = rows[(rows >= 0) & (rows < lf.layout.rows)]
            if len(valid) < len(rows):
                log.warning("warm-up: layer %d: %d row ids out of range ignored", layer, len(rows) - len(valid))
            for lo in range(0, len(valid), self._cache.admit_limit):
                part = valid[lo : lo + self._cache.admit_limit]
                part, data, _ = self._checks.read_verified(int(layer), part, "the warm-up")
                loaded += self._cache.admit(int(layer), part, data, main=True)
        log.info("warm-up: %d rows loaded in %.2fs", loaded, time.perf_counter() - t0)
        return loaded

    def hot_rows(self) -> np.ndarray:
        """int64 ``[n, 2]`` (layer, row), hottest first: the cache's rows (cached mode)
        then rows sampled from live traffic."""
        parts = []
        if self._cache is not None:
            keys = self._cache.cached_keys()
            index = self._cache.layer_index  # layer -> its index in the cache's keys
            layers = np.asarray(sorted(index, key=index.get), dtype=np.int64)[keys >> LAYER_SHIFT]
            parts.append(np.stack([layers, keys & ROW_MASK], axis=1))
        parts.append(self._sampler.hottest())
        return merge_hottest(*parts)

    def write_profile(self, path: str | os.PathLike) -> int:
        """Write :meth:`hot_rows` as an access profile; returns the number of rows."""
        n = write_profile(path, self.hot_rows())
        log.info("access profile %s: %d rows", path, n)
        return n
