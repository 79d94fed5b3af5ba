"""``python -m evolve``: see evolve/cli.py."""

import sys

from evolve.cli import main

if __name__ == "__main__":
    sys.exit(main())
