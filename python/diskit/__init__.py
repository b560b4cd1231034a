"""diskit for Python: ``diskit.nbd``, an NBD client with libnbd's Python
API, and ``diskit.nbdsh``, nbdsh's command line over it."""

from diskit._diskit import VERSION as __version__  # noqa: F401
