"""The Engram test model's state under vLLM's model runner V2 (the default runner).

V2 keeps every request's token history on the device and hands a model what its ``ModelState``
prepares. DeepSeek-V4.1 has a state of its own that adds the Engram lookback window; this is the
same idea for the test model: vLLM's ``DefaultModelState`` plus ``lookback_token_ids``, the raw ids of
the ``depth`` tokens just before each request's chunk (``-1`` before the request's start), gathered
from the runner's ``all_token_ids`` at each request's ``num_computed_tokens``. ``NgramHashState`` then
hashes every position from the chunk and this window, with no slot cache (V2 runs it stateless).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.worker.gpu.model_states.default import DefaultModelState


class EngramTinyModelState(DefaultModelState):
    def __init__(self, vllm_config, model, encoder_cache, device) -> None:
        super().__init__(vllm_config, model, encoder_cache, device)
        self.depth = int(model.token_lookback_depth)
        # Persistent: a captured graph reads it at the same address on every replay.
        self.lookback_token_ids = torch.full((self.max_num_reqs, self.depth), -1, dtype=torch.int32, device=device)
        self._offsets = torch.arange(1, self.depth + 1, dtype=torch.int64, device=device)

    def prepare_inputs(self, input_batch, req_states) -> dict[str, Any]:
        inputs = super().prepare_inputs(input_batch, req_states)
        reqs = input_batch.idx_mapping.to(torch.int64)
        n = reqs.shape[0]
        positions = req_states.num_computed_tokens.gpu[reqs].to(torch.int64)[:, None] - self._offsets[None, :]
        history = req_states.all_token_ids.gpu[reqs[:, None], positions.clamp(min=0)]
        window = self.lookback_token_ids
        window[:n] = torch.where(positions >= 0, history, -1).to(window.dtype)
        window[n:] = -1
        inputs["lookback_token_ids"] = window
        return inputs

    def prepare_dummy_inputs(self, num_reqs: int, num_tokens: int) -> dict[str, Any]:
        inputs = super().prepare_dummy_inputs(num_reqs, num_tokens)
        self.lookback_token_ids.fill_(-1)
        inputs["lookback_token_ids"] = self.lookback_token_ids
        return inputs
