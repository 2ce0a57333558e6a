"""``python -m engram_store.deploy``: print the directory holding the deploy files."""

from . import DIR

print(DIR)
