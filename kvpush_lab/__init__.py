"""kvpush's measurement lab: ``bench`` (configurations side by side),
``soak`` (sustained load with client aborts) and ``project`` (the projection
to the published GPU setup).

Installed with the ``bench`` extra (``pip install 'kvpush[bench]'``, which
adds matplotlib for the plots); the ``kvpush`` command finds its
subcommands through the ``kvpush.commands`` entry points (``pyproject.toml``).
The lab depends on the product (``kvpush``), never the reverse.
"""

from importlib.util import find_spec

# The bench extra: without it, importing the lab (so loading one of its
# commands) fails, and `kvpush bench` says what to install.
if find_spec("matplotlib") is None:
    raise ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib")
