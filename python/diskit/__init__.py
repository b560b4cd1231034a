"""diskit for Python: ``diskit.nbd``, an NBD client with libnbd's Python
API; ``diskit.nbdsh``, nbdsh's command line over it; and ``diskit.Image``,
any image diskit reads (``Image(name, format=None, writable=False)``:
``size``, ``format``, ``chain()``, ``read``, ``write``, ``zero``,
``flush``, ``map``, ``close``)."""

from diskit._diskit import VERSION as __version__  # noqa: F401
from diskit._diskit import Error, Image  # noqa: F401
