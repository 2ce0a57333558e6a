"""Engine integrations: the daemon's tables inside inference engines.

Where the engines are patched, and where a new model goes:

* ``install``: the one install sequence every plugin runs (version gate, daemon probe, failure board,
  patches, one log line) over an *engine adapter* and a *model adapter*, and the ``Plugin`` state it
  passes to every patch;
* ``vllm``, ``sglang``: the engine adapters and their patches (``vllm.patches``, ``sglang.hooks``);
  ``entry``: what their entry points share;
* ``models``: one model adapter per family (``models.deepseek_v41``: DeepSeek-V4.1's Engram);
* ``tables``: :class:`~engram_store.integrations.tables.EngramStoreTables`, the arena mapped as the CPU
  tensors engines' kernels read, and the fetch jobs of cached layers;
* ``failures`` (the failure board every rank of a server maps) and ``agreement`` (ranks that do not
  share one agree per step): how a fetch failure on one rank stops them all;
* ``prompt_hints``: what both plugins send the daemon when a prompt is scheduled (the rows of its
  chunks not computed yet).

Nothing here imports an engine until its plugin runs. Built on ``engram_store.client``,
``engram_store.fetch`` and ``gpu_client``.
"""
