"""The table set on disk and the arena in shared memory, as bytes: what every layer agrees on.

- ``layout``: ``RowFormat`` rows in ``PageLayout`` pages (4 KiB, ``4096 // row_bytes`` rows each);
- ``manifest``: the table set's declared contents (format version, layers, files, token map);
- ``checksums``: the crc32c of every page (``layer_NNN.crc``) and how pages are checked;
- ``writer``: writing a table set atomically (temp directory, fsync, manifest last), ``write_file_atomic``;
- ``tableset``: ``TableSet``, the plain reference reader every correctness test compares against;
- ``arena_layout``: the resident arena's layout (the engines' weights and scales blocks),
  declared once and sent with the arena, and ``ArenaView``, the one class that reads a mapped arena.

Depends only on ``engram_store.{errors,spec}`` and ``engram_store.native``.
"""
