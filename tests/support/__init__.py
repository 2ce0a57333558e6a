"""What the tests share that is not a test: helpers, fakes and stand-ins, imported as ``support.<module>``
(pytest puts ``tests/`` on ``sys.path``; see ``tests/conftest.py``).

- ``daemon_helpers``: table sets, a real daemon subprocess (``DaemonProcess``), raw protocol frames.
- ``storage_helpers``: table sets and row checks for the storage-engine tests; ``flip`` corrupts a page.
- ``faults``: the one way tests reach the fault hooks built into production code (a stuck device, no pidfds).
- ``staging_fakes``: a scripted stand-in daemon for a fetch job's one-copy protocol (also run as a process).
- ``gpu_standins``: stand-ins for the GPU runtimes' libraries, built from a few lines of C.
- ``interrupt``: kills a writer process mid-write.
- ``engine_checkpoint``: a checkpoint directory laid out as the engines' loaders see DeepSeek-V4.1's.
- ``vllm_cpu_checkpoint``: the Engram test model's checkpoint for the real vLLM engine tests.
- ``vllm_engram_ref``: vLLM's own Engram hashing as an independent reference, run in a fresh process.

The scripts that run an engine's own code in processes of their own live apart, in ``tests/engines/``.
"""
