"""``python -m tandem`` runs the command line."""

import sys

from tandem.cli import main

sys.exit(main())
