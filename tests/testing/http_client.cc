#include "tests/testing/http_client.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <boost/asio/connect.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <thread>

namespace tandem::testing {
namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;

std::pair<std::string, std::string> HostPort(const std::string& base) {
  std::string s = base;
  if (s.rfind("http://", 0) == 0) s = s.substr(7);
  const size_t colon = s.rfind(':');
  return {s.substr(0, colon), s.substr(colon + 1)};
}

}  // namespace

std::string HttpResponse::Header(const std::string& name) const {
  auto it = headers.find(name);
  return it == headers.end() ? "" : it->second;
}

HttpResponse HttpCall(const std::string& base, const std::string& method, const std::string& target,
                      const std::string& body, const Headers& headers, std::chrono::milliseconds timeout) {
  HttpResponse out;
  try {
    asio::io_context ioc;
    beast::tcp_stream stream(ioc);
    const auto [host, port] = HostPort(base);
    asio::ip::tcp::resolver resolver(ioc);
    stream.expires_after(timeout);
    stream.connect(resolver.resolve(host, port));
    http::request<http::string_body> req(http::string_to_verb(method), target, 11);
    req.set(http::field::host, host);
    if (!body.empty()) req.set(http::field::content_type, "application/json");
    for (const auto& [k, v] : headers) req.set(k, v);
    req.body() = body;
    req.prepare_payload();
    http::write(stream, req);
    beast::flat_buffer buffer;
    http::response_parser<http::string_body> parser;
    parser.body_limit(1 << 30);
    http::read(stream, buffer, parser);
    const auto& res = parser.get();
    out.status = static_cast<int>(res.result_int());
    for (const auto& f : res) {
      std::string name(f.name_string());
      std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::tolower(c); });
      out.headers[name] = std::string(f.value());
    }
    out.body = res.body();
    beast::error_code ec;
    stream.socket().shutdown(asio::ip::tcp::socket::shutdown_both, ec);
  } catch (const std::exception& e) {
    out.status = 0;
    out.error = e.what();
  }
  return out;
}

std::vector<std::string> SseData(const std::string& body) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos < body.size()) {
    size_t end = body.find("\n\n", pos);
    if (end == std::string::npos) end = body.size();
    const std::string event = body.substr(pos, end - pos);
    if (event.rfind("data: ", 0) == 0) out.push_back(event.substr(6));
    pos = end + 2;
  }
  return out;
}

void PostAndHangUp(const std::string& base, const std::string& target, const std::string& json, size_t read_bytes,
                   std::chrono::milliseconds linger) {
  try {
    asio::io_context ioc;
    asio::ip::tcp::socket socket(ioc);
    const auto [host, port] = HostPort(base);
    asio::ip::tcp::resolver resolver(ioc);
    asio::connect(socket, resolver.resolve(host, port));
    http::request<http::string_body> req(http::verb::post, target, 11);
    req.set(http::field::host, host);
    req.set(http::field::content_type, "application/json");
    req.body() = json;
    req.prepare_payload();
    http::write(socket, req);
    std::string got(read_bytes, '\0');
    if (read_bytes > 0) asio::read(socket, asio::buffer(got));
    std::this_thread::sleep_for(linger);
    beast::error_code ec;
    socket.shutdown(asio::ip::tcp::socket::shutdown_both, ec);
    socket.close(ec);
  } catch (const std::exception&) {
  }
}

std::optional<double> ScrapeMetric(const std::string& base, const std::string& series, const Headers& headers) {
  const HttpResponse r = HttpCall(base, "GET", "/metrics", "", headers);
  if (r.status != 200) return std::nullopt;
  const std::string needle = "\n" + series + " ";
  const size_t at = ("\n" + r.body).find(needle);
  if (at == std::string::npos) return std::nullopt;
  return std::strtod(r.body.c_str() + at + series.size() + 1, nullptr);
}

int FreeTcpPort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  int port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
    port = ntohs(a.sin_port);
  }
  close(fd);
  return port;
}

}  // namespace tandem::testing
