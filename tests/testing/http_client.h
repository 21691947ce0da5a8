// A blocking HTTP/1.1 client for end-to-end tests of the router (Boost.Beast):
// one request per connection, chunked bodies decoded, Server-Sent Events
// split into their data payloads.
//
// Thread safety: the functions are independent; call them from any thread.
#ifndef TANDEM_TESTS_TESTING_HTTP_CLIENT_H_
#define TANDEM_TESTS_TESTING_HTTP_CLIENT_H_

#include <chrono>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace tandem::testing {

struct HttpResponse {
  int status = 0;                              // 0: no response (connection failed or timed out)
  std::string error;                           // why status is 0
  std::map<std::string, std::string> headers;  // names lowercased
  std::string body;

  std::string Header(const std::string& lowercase_name) const;
};

using Headers = std::vector<std::pair<std::string, std::string>>;

// `url_base` is "http://host:port" or "host:port".
HttpResponse HttpCall(const std::string& url_base, const std::string& method, const std::string& target,
                      const std::string& body = "", const Headers& headers = {},
                      std::chrono::milliseconds timeout = std::chrono::seconds(60));

inline HttpResponse HttpGet(const std::string& base, const std::string& target) {
  return HttpCall(base, "GET", target);
}
inline HttpResponse HttpPost(const std::string& base, const std::string& target, const std::string& json,
                             const Headers& headers = {}) {
  return HttpCall(base, "POST", target, json, headers);
}

// The value of an unlabelled Prometheus series (e.g. "x_total" or
// "h_count{pool=\"decode\"}") on base's /metrics; nullopt when absent or
// the page cannot be read.
// `headers` go with the request (an admin key's Authorization).
std::optional<double> ScrapeMetric(const std::string& base, const std::string& series, const Headers& headers = {});

// A loopback TCP port the OS has free now (bound and released: good enough
// for a test); 0 when none could be had.
int FreeTcpPort();

// The "data:" payloads of an SSE body, in order ("[DONE]" included).
std::vector<std::string> SseData(const std::string& body);

// Sends a POST, reads the first `read_bytes` bytes of the response, waits
// `linger`, and closes the connection: a client that goes away.
void PostAndHangUp(const std::string& base, const std::string& target, const std::string& json, size_t read_bytes,
                   std::chrono::milliseconds linger = std::chrono::milliseconds(0));

}  // namespace tandem::testing

#endif  // TANDEM_TESTS_TESTING_HTTP_CLIENT_H_
