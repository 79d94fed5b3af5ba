"""``python -m fitness.emulator --out DIR --seed 0``: see ``fitness.emulator.cli``."""

import sys

from fitness.emulator.cli import main

sys.exit(main())
