"""``python -m metasync.simulator``: what ``bin/simulate`` runs."""

import sys

from metasync.simulator.cli import main

sys.exit(main())
