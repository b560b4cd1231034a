/* The few settings of the reference implementation's configure that the
 * tester's sources read, for Debian/Linux with GnuTLS (written by hand:
 * diskit builds only the tester, not nbd-server). */
#define HAVE_GNUTLS 1
#define HAVE_MKSTEMP 1
#define HAVE_FDATASYNC 1
#define NBD_LFS 1
#define PACKAGE_VERSION "diskit-test"
