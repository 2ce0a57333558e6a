"""What talks to the kernel or runs in C, below every other layer.

- ``syscalls``: ``O_DIRECT`` files, aligned buffers, memfds, seals, the one ``map_fd``;
- ``shm``: client regions (sealed memfds) and passing fds over a Unix socket;
- ``gather``: the row gather pool (``_gather.c``, numpy fallback) that the daemon,
  clients reading a mapped arena and ``LocalClient`` share;
- ``_uring.c`` (io_uring reads through raw syscalls), ``_pread.c`` (Linux AIO reads),
  both checking pages with ``crc32c.h`` (the one crc32c), and ``_gather.c`` (row
  gathers; its C API in ``_gather_api.h``): optional extensions, each probed once
  where it is used, with a pure-Python fallback that logs.
"""
