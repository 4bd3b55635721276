"""``python -m metasync.simulator``: what ``bin/simulate`` runs."""

import sys

from metasync.simulator import main

sys.exit(main())
