"""``python -m kvpush_lab.soak``: the soak command."""

import sys

from kvpush_lab.soak.cli import main

sys.exit(main())
