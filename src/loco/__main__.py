"""``python -m loco`` (what ``torchrun -m loco train`` runs on every rank)."""

import sys

from loco.cli import main

sys.exit(main())
