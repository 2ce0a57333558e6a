"""Runnable examples of the GPU client (``python -m gpu_client.examples.tiny_engram --help``)."""
