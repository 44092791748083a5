// LD_PRELOAD shim for the Mooncake processes the harness starts: a bind(2) to a wildcard
// address (0.0.0.0, ::) binds loopback instead (127.0.0.1, ::ffff:127.0.0.1), so that no
// listener is reachable on another interface. Mooncake's transfer engine binds its RPC and TCP
// transport listeners to the wildcard whatever it advertises (MC_TCP_BIND_ADDRESS only picks
// the advertised address). Built by `mmreuse cluster install` (gcc); every other bind(2) is
// passed through unchanged.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr*, socklen_t);

// IPv4-mapped 127.0.0.1: an IPv4 client of 127.0.0.1 still reaches a dual-stack socket.
static const unsigned char kMappedLoopback[16] = {0, 0, 0,    0,    0,   0, 0, 0,
                                                  0, 0, 0xff, 0xff, 127, 0, 0, 1};

int bind(int fd, const struct sockaddr* addr, socklen_t len) {
  static bind_fn real_bind = 0;
  if (!real_bind) {
    real_bind = (bind_fn)dlsym(RTLD_NEXT, "bind");
  }
  if (addr && addr->sa_family == AF_INET && len >= sizeof(struct sockaddr_in)) {
    struct sockaddr_in in4 = *(const struct sockaddr_in*)addr;
    if (in4.sin_addr.s_addr == htonl(INADDR_ANY)) {
      in4.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      return real_bind(fd, (const struct sockaddr*)&in4, sizeof in4);
    }
  } else if (addr && addr->sa_family == AF_INET6 && len >= sizeof(struct sockaddr_in6)) {
    struct sockaddr_in6 in6 = *(const struct sockaddr_in6*)addr;
    if (!memcmp(&in6.sin6_addr, &in6addr_any, sizeof in6.sin6_addr)) {
      memcpy(&in6.sin6_addr, kMappedLoopback, sizeof kMappedLoopback);
      return real_bind(fd, (const struct sockaddr*)&in6, sizeof in6);
    }
  }
  return real_bind(fd, addr, len);
}
