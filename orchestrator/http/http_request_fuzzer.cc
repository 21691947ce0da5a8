// libFuzzer target: the router's HTTP/1.1 front (HttpServer) reading what a
// client sends. One server runs for the whole process, on a loopback port,
// with small limits (2 KiB of headers, 4 KiB of body) so that 413 and 431
// are within reach of short inputs. Each input is one connection: its bytes
// are written (any number of pipelined requests), the write side is closed,
// and the response bytes are read until the server closes. Handlers answer
// whole, streamed (chunked), late from another thread, or not at all.
//
// Checks beyond ASan/UBSan: the server must close every connection at the
// client's EOF, well before its idle timeout (5 s here; a close that takes 4 s
// fails), leave no connection open, and start every response with a status
// line. The close check found a hang (a read issued after asio had seen EOF
// waited for the idle timeout); its reproducer is the seed
// slow-close-pipelined-after-health.bin.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "orchestrator/http/http_server.h"

namespace tandem::http {
namespace {

HttpServer* StartServer() {
  HttpServer::Options options;
  options.port = 0;
  options.threads = 1;
  options.max_body_bytes = 4096;
  options.max_header_bytes = 2048;
  // The server's own bound on a connection that stalls: the check below
  // allows it plus 5 s.
  options.idle_timeout = std::chrono::seconds(5);
  auto* server = new HttpServer(options);
  // Echoes what was parsed, so that every field of Request is read.
  server->Route("POST", "/v1/chat/completions", [](const Request& req, std::shared_ptr<ResponseWriter> w) {
    std::string out = absl::StrCat(req.method, " ", req.path, "?", req.query, " v", req.version, " ",
                                   std::string(req.Header("content-type")), req.HasHeader("x-a") ? "1" : "0", "\n");
    for (const auto& [name, value] : req.headers) absl::StrAppend(&out, name, "=", value, "\n");
    out += req.body;
    w->Send(200, "text/plain", std::move(out), {{"X-Echo", std::string(req.Header("x-echo"))}});
  });
  // A stream of a few chunks, one of them empty (ignored).
  server->Route("POST", "/v1/completions", [](const Request& req, std::shared_ptr<ResponseWriter> w) {
    w->StartStream(200);
    w->Write("data: " + req.body.substr(0, 64) + "\n\n");
    w->Write("");
    w->Write("data: [DONE]\n\n");
    w->End();
  });
  // Answered later from another thread, as the router does.
  server->Route("GET", "/health", [](const Request&, std::shared_ptr<ResponseWriter> w) {
    std::thread([w] { w->Send(200, "application/json", "{}"); }).detach();
  });
  // Never answered: the client's EOF must still end the connection.
  server->Route("GET", "/hang", [](const Request&, std::shared_ptr<ResponseWriter> w) { w->OnClose([] {}); });
  if (absl::Status s = server->Start(); !s.ok()) {
    std::fprintf(stderr, "cannot start the server: %s\n", s.ToString().c_str());
    std::abort();
  }
  return server;
}

HttpServer* server = StartServer();

// A connected client socket. Many fuzzing processes at once (fork mode on
// 13 cores: ~20,000 connections a second) can run the loopback out of
// ephemeral ports, their last connections still in TIME_WAIT: connect()
// then fails with EADDRNOTAVAIL for a moment, which is the harness's limit,
// not the server's, so it waits and tries again (for up to 10 s). A signal
// (libFuzzer's timers) may interrupt connect() too: it starts over then.
int Connect() {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(server->port()));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  for (int attempt = 0;; ++attempt) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      std::fprintf(stderr, "socket: %s\n", std::strerror(errno));
      std::abort();
    }
    if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) return fd;
    const int err = errno;
    ::close(fd);
    if ((err != EADDRNOTAVAIL && err != EAGAIN && err != EINTR) || attempt == 1000) {
      std::fprintf(stderr, "connect to the server: %s\n", std::strerror(err));
      std::abort();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

void OneConnection(const uint8_t* data, size_t size) {
  const int fd = Connect();
  // The input is at most a few KiB: one send fits the socket buffer. A send
  // that fails (the server closed after a 413 already) is fine.
  size_t sent = 0;
  while (sent < size) {
    const ssize_t n = ::send(fd, data + sent, size - sent, MSG_NOSIGNAL);
    if (n <= 0) break;
    sent += static_cast<size_t>(n);
  }
  ::shutdown(fd, SHUT_WR);
  std::string response;
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + std::chrono::seconds(10);
  char buf[4096];
  for (;;) {
    pollfd p{.fd = fd, .events = POLLIN, .revents = 0};
    const int left = static_cast<int>(
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count());
    if (left <= 0 || ::poll(&p, 1, left) == 0) {
      std::fprintf(stderr, "the server kept the connection open 10 s after the client's EOF (idle timeout 5 s)\n");
      std::abort();
    }
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) break;  // closed (or reset after an error response)
    response.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  if (const auto took = std::chrono::steady_clock::now() - start; took > std::chrono::seconds(4)) {
    std::fprintf(stderr, "slow close: the server closed %lld ms after the client's EOF (idle timeout 5 s)\n",
                 static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(took).count()));
    std::abort();
  }
  if (!response.empty() && !response.starts_with("HTTP/1.")) {
    std::fprintf(stderr, "response without a status line: %s\n", response.substr(0, 200).c_str());
    std::abort();
  }
  // Wait for the server to drop the connection (its Session is freed on
  // the I/O thread), so that no input's state lingers into the next.
  while (server->connection_stats().open != 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      std::fprintf(stderr, "a closed connection is still counted open\n");
      std::abort();
    }
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

}  // namespace
}  // namespace tandem::http

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  tandem::http::OneConnection(data, size);
  return 0;
}
