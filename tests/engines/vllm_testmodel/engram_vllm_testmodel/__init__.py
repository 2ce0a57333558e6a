"""Test-only vLLM plugin: registers :class:`.model.EngramTinyForCausalLM` (``tests/engines/vllm_testmodel``).

vLLM calls :func:`register` in each of its processes (entry point ``engram_testmodel``
of ``vllm.general_plugins``). Two registrations, nothing else:

* the architecture, lazily by name, with vLLM's ``ModelRegistry``;
* the architecture as one whose ``engram_layer_ids`` names n-gram embedding layers
  (``vllm.config.engram``'s table of such architectures), so that vLLM builds its
  ``EngramConfig`` for it exactly as it does for ``DeepseekV41ForCausalLM``.
"""

from __future__ import annotations

ARCHITECTURE = "EngramTinyForCausalLM"


def register() -> None:
    from vllm import ModelRegistry
    from vllm.config import engram

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "engram_vllm_testmodel.model:EngramTinyForCausalLM")
    engram._NGRAM_LAYER_FIELDS.setdefault(ARCHITECTURE, "engram_layer_ids")
