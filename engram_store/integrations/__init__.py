"""Engine integrations: the daemon's tables inside inference engines.

``tables``: :class:`~engram_store.integrations.tables.EngramStoreTables`, the
arena mapped as the CPU tensors engines' kernels read. ``vllm``: the vLLM
general plugin; ``sglang``: the SGLang plugin; ``hints``: what both send the daemon
when a prompt is scheduled (the rows of its chunks not computed yet). Nothing here imports an engine
until its plugin runs. Built on ``engram_store.client`` and ``gpu_client``.
"""
