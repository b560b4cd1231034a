"""``import nbd`` answered by diskit's client (diskit.nbd), for programs
written against libnbd's Python module: put this directory first on
PYTHONPATH."""

from diskit.nbd import *  # noqa: F401,F403
from diskit.nbd import Buffer, Error, NBD  # noqa: F401
