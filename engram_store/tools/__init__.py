"""Tools that write table sets: ``importer`` (a safetensors checkpoint, streamed, bounded
memory; ``safetensors_io`` reads its headers and tensors) and ``synth`` (synthetic tables)."""
