"""The engines' fetch job: one cached Engram layer's rows of each step, fetched by native code a CUDA
host function can run (no GIL, no CUDA call, no Python), hedged between the daemon and direct reads.

- ``job``: :class:`~engram_store.fetch.job.FetchJob`, the Python façade an engine holds (its staging,
  its daemon connection, its table files);
- ``budget``: the node's budget of direct page reads in flight that every job reading one device shares;
- ``_fetch.c`` and its units (``core``, ``direct_budget``, ``reader``, ``daemon``, ``writer``, ``board``,
  ``run``: a ``.c`` each with a header of prototypes): the extension ``engram_store.fetch._fetch``, linking
  the shared units of :mod:`engram_store.native` (``common/``: crc32c, the frame header, the staging gate,
  the test hooks; ``readers/``: Linux AIO and the read calls' checks; ``gpu_runtime/``: the host-function
  launch).

Imports the base layers and :mod:`engram_store.client` (table files, the Unix transport); the engine
integrations import it.
"""
