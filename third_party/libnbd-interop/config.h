/* diskit's stand-in for the config.h that libnbd's ./configure writes: the
 * vendored tests need nothing from it. HAVE_GNUTLS is left undefined so that
 * the tests do not link GnuTLS themselves (libnbd still does its own TLS). */
