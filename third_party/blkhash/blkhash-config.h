/* What blkhash's meson build writes into blkhash-config.h, for the build
 * scripts/blksum.sh makes: NBD support (libnbd), no BLAKE3 (Debian 12 has
 * no libblake3), and the cache line size of x86-64 and most arm64. */
#define HAVE_NBD
#undef HAVE_BLAKE3
#define CACHE_LINE_SIZE 64
