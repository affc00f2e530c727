"""``python -m kvpush`` is the ``kvpush`` command."""

import sys

from kvpush.cli import main

sys.exit(main())
