"""Test-only vLLM plugin: registers :class:`.model.EngramTinyForCausalLM` and
:class:`.qwen_model.QwenPLETinyForCausalLM` (``tests/engines/vllm_testmodel``).

vLLM calls :func:`register` in each of its processes (entry point ``engram_testmodel``
of ``vllm.general_plugins``). Registrations, nothing else:

* each architecture, lazily by name, with vLLM's ``ModelRegistry``;
* each architecture as one whose ``engram_layer_ids`` (V4.1's field) or ``ple_layer_ids``
  (Qwen4Exp's) names n-gram embedding layers (``vllm.config.engram``'s table of such
  architectures), so that vLLM builds its ``EngramConfig`` for it exactly as it does for
  ``DeepseekV41ForCausalLM`` and ``Qwen4ExpForCausalLM``.
"""

from __future__ import annotations

ARCHITECTURE = "EngramTinyForCausalLM"
QWEN_ARCHITECTURE = "QwenPLETinyForCausalLM"


def register() -> None:
    from vllm import ModelRegistry
    from vllm.config import engram

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "engram_vllm_testmodel.model:EngramTinyForCausalLM")
    engram._NGRAM_LAYER_FIELDS.setdefault(ARCHITECTURE, "engram_layer_ids")
    if QWEN_ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(QWEN_ARCHITECTURE, "engram_vllm_testmodel.qwen_model:QwenPLETinyForCausalLM")
    engram._NGRAM_LAYER_FIELDS.setdefault(QWEN_ARCHITECTURE, "ple_layer_ids")
