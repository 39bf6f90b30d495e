// A TCP port on 127.0.0.1 that no process holds now, from the kernel (bind to port 0), for
// the tests that start a rendezvous store themselves: ports computed from the process id
// collided when ctest ran two such tests at once (EADDRINUSE). The port is released before
// the store binds it; the kernel hands out ephemeral ports in turn, so another test taking
// it in between is unlikely.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <stdexcept>

namespace titan::test {

inline int free_tcp_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error("free_tcp_port: socket() failed");
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof a;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    ::close(fd);
    throw std::runtime_error("free_tcp_port: bind() failed");
  }
  ::close(fd);
  return ntohs(a.sin_port);
}

}  // namespace titan::test
