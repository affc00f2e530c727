"""``python -m kvpush.soak``: the soak command."""

import sys

from kvpush.soak.cli import main

sys.exit(main())
