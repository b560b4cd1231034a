/* The floor of "copy from an NBD source to a file" on this machine: the
 * least a client can do. One thread per connection, each reading its own
 * contiguous part of the export in 1 MiB requests (DEPTH in flight), with
 * plain NBD_OPT_EXPORT_NAME and simple replies (no structured replies, no
 * block status, no zero detection, no checks beyond the reply header),
 * receiving each reply into one reused buffer and writing it with pwrite.
 * A real copier cannot beat it; bench/README.md says what it showed.
 *
 *   cc -O2 -pthread -o /tmp/nbd-read-floor bench/nbd-read-floor.c
 *   /tmp/nbd-read-floor SOCKET OUTPUT [CONNECTIONS [DEPTH]]
 *
 * OUTPUT is created (truncated) and may be /dev/null. The export's size
 * must be a multiple of CONNECTIONS MiB. Not a tool: a measuring stick.
 */
#define _GNU_SOURCE
#include <endian.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#define REQUEST (1 << 20)

static const char *sock_path;
static int out_fd, depth = 8, conns = 2;
static uint64_t export_size;

static void die(const char *what) { perror(what); exit(1); }

static void read_all(int s, void *buf, size_t n) {
  size_t got = 0;
  while (got < n) {
    ssize_t r = recv(s, (char *)buf + got, n - got, MSG_WAITALL);
    if (r <= 0) die("recv");
    got += r;
  }
}

static void write_all(int s, const void *buf, size_t n) {
  if (send(s, buf, n, MSG_NOSIGNAL) != (ssize_t)n) die("send");
}

/* Connects and negotiates the default export with NBD_OPT_EXPORT_NAME. */
static int dial(uint64_t *size) {
  int s = socket(AF_UNIX, SOCK_STREAM, 0);
  struct sockaddr_un a = {.sun_family = AF_UNIX};
  strncpy(a.sun_path, sock_path, sizeof a.sun_path - 1);
  if (connect(s, (void *)&a, sizeof a)) die("connect");
  char greeting[18];
  read_all(s, greeting, sizeof greeting);
  uint32_t flags = htobe32(3); /* fixed newstyle, no zeroes */
  write_all(s, &flags, 4);
  char opt[16];
  uint64_t magic = htobe64(0x49484156454F5054ULL);
  uint32_t export_name = htobe32(1), len = 0;
  memcpy(opt, &magic, 8);
  memcpy(opt + 8, &export_name, 4);
  memcpy(opt + 12, &len, 4);
  write_all(s, opt, sizeof opt);
  char reply[10];
  read_all(s, reply, sizeof reply);
  memcpy(size, reply, 8);
  *size = be64toh(*size);
  return s;
}

static void send_read(int s, uint64_t offset) {
  char rq[28];
  uint32_t magic = htobe32(0x25609513), length = htobe32(REQUEST);
  uint16_t flags = 0, type = 0;
  uint64_t cookie = htobe64(offset), off = htobe64(offset);
  memcpy(rq, &magic, 4);
  memcpy(rq + 4, &flags, 2);
  memcpy(rq + 6, &type, 2);
  memcpy(rq + 8, &cookie, 8);
  memcpy(rq + 16, &off, 8);
  memcpy(rq + 24, &length, 4);
  write_all(s, rq, sizeof rq);
}

static void *run(void *arg) {
  long me = (long)arg;
  uint64_t size;
  int s = dial(&size);
  uint64_t part = size / conns, next = me * part, end = next + part, done = next;
  char *buf = aligned_alloc(4096, REQUEST);
  int in_flight = 0;
  while (done < end) {
    while (next < end && in_flight < depth) {
      send_read(s, next);
      next += REQUEST;
      in_flight++;
    }
    char head[16];
    read_all(s, head, sizeof head);
    uint32_t error;
    uint64_t offset;
    memcpy(&error, head + 4, 4);
    memcpy(&offset, head + 8, 8);
    if (error) { fprintf(stderr, "server error %u\n", be32toh(error)); exit(1); }
    read_all(s, buf, REQUEST);
    if (pwrite(out_fd, buf, REQUEST, be64toh(offset)) != REQUEST) die("pwrite");
    in_flight--;
    done += REQUEST;
  }
  close(s);
  return NULL;
}

int main(int argc, char **argv) {
  if (argc < 3) { fprintf(stderr, "usage: %s SOCKET OUTPUT [CONNECTIONS [DEPTH]]\n", argv[0]); return 2; }
  sock_path = argv[1];
  if (argc > 3) conns = atoi(argv[3]);
  if (argc > 4) depth = atoi(argv[4]);
  if (conns < 1 || conns > 64 || depth < 1) { fprintf(stderr, "bad arguments\n"); return 2; }
  close(dial(&export_size));
  if (export_size % ((uint64_t)conns * REQUEST)) { fprintf(stderr, "size not a multiple\n"); return 2; }
  out_fd = open(argv[2], O_CREAT | O_WRONLY | O_TRUNC, 0644);
  if (out_fd < 0) die(argv[2]);
  if (strcmp(argv[2], "/dev/null") && ftruncate(out_fd, export_size)) die("ftruncate");
  pthread_t t[64];
  for (long i = 0; i < conns; i++) pthread_create(&t[i], NULL, run, (void *)i);
  for (int i = 0; i < conns; i++) pthread_join(t[i], NULL);
  return 0;
}
