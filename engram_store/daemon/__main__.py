"""``python -m engram_store.daemon``: the daemon's subcommands without the main CLI."""

import sys

from .main import main

sys.exit(main())
