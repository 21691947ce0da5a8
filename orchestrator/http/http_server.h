// HttpServer: a small asynchronous HTTP/1.1 server on Boost.Beast. Transport
// only: it parses requests, routes them by exact (method, path) to a Handler
// and writes what the handler answers, whole or streamed (chunked encoding,
// for Server-Sent Events). The OpenAI API sits on top of it, elsewhere.
//
// Contract:
//  - Routes are registered with Route() before Start(); lookups are exact on
//    the path (the query string is split off), except that a route path
//    ending in "/*" takes every longer path under it (the handler reads the
//    rest from Request::path). Unknown path: 404; known path,
//    other method: 405 with an Allow header. Both carry OpenAI's error JSON
//    (JsonErrorBody). Body over max_body_bytes: 413, decided from the headers
//    (Content-Length) or while reading a chunked body, without buffering it
//    all; header block over max_header_bytes: 431; anything unparsable: 400.
//    After 400/413/431 the connection is closed.
//  - Keep-alive is HTTP/1.1's default; "Connection: close" (and HTTP/1.0
//    without keep-alive) closes after the response. Requests on a connection
//    are served one at a time, in order: a pipelined request is read only once
//    the previous response has been fully written. Sockets are TCP_NODELAY, so
//    each streamed chunk leaves at once (no Nagle wait for the peer's ACK).
//  - Every handler gets a ResponseWriter and must eventually Send() once, or
//    StartStream() / Write()... / End(). While a response is pending the
//    server watches the socket: if the client goes away the writer becomes
//    closed() and its OnClose callbacks run, so the caller can cancel upstream
//    work. A handler that never answers does not hold the connection forever:
//    with no bytes written for idle_timeout the connection is closed (and
//    OnClose fires). The same timeout closes idle keep-alive connections.
//  - Stop() stops accepting, closes idle connections at once, lets in-flight
//    responses finish for up to stop_grace, then closes what is left and joins
//    the threads.
//
// Thread safety: Route() before Start() only. Start(), Stop() and port() from
// one controlling thread. Handlers run on the server's I/O threads and must
// not block (hand long work to another thread and answer through the writer).
// ResponseWriter is thread-safe and its calls take effect in call order: when
// the connection has nothing queued, the bytes go to the socket at once from
// the caller's thread (a non-blocking send, so a token streamed from another
// thread costs no hand-off to an I/O thread); what the socket does not take
// is queued and written by the connection's strand. Writes are not flow-controlled: a client
// that reads slower than the handler writes makes the queue grow; one that
// stops reading is closed after idle_timeout. A writer may outlive its connection
// (calls then return false / do nothing) and even Stop(); do not call it
// concurrently with the HttpServer's destructor.
#ifndef TANDEM_ORCHESTRATOR_HTTP_HTTP_SERVER_H_
#define TANDEM_ORCHESTRATOR_HTTP_HTTP_SERVER_H_

#include <atomic>
#include <chrono>
#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"

namespace tandem::http {

using HeaderList = std::vector<std::pair<std::string, std::string>>;

// The Content-Type of a JSON body.
inline constexpr char kJsonContentType[] = "application/json";

// One parsed request. Owned by the server for the duration of the handler
// call; copy what must outlive it.
struct Request {
  std::string method;  // "GET", "POST", ...
  std::string target;  // as sent: "/v1/models?x=1"
  std::string path;    // target before '?': "/v1/models"
  std::string query;   // target after '?', undecoded: "x=1"
  HeaderList headers;  // in arrival order, names as sent
  std::string body;
  int version = 11;  // 10 or 11

  // The first header named `name`, compared case-insensitively; "" if absent.
  std::string_view Header(std::string_view name) const;
  bool HasHeader(std::string_view name) const;
};

// `text` with each %XX (hex) replaced by its byte; a '%' not followed by two
// hex digits stays as it is. ('+' is not a space: this is for paths.)
std::string PercentDecode(std::string_view text);

class Session;  // one connection; defined in http_server.cc

// How a handler answers. Use exactly one of: Send(...) once; or
// StartStream(...), any number of Write(...), then End(). Calls that break
// this order, or come after the connection closed, return false and do
// nothing. Thread-safe; see the file comment.
class ResponseWriter {
 public:
  explicit ResponseWriter(std::weak_ptr<Session> session) : session_(std::move(session)) {}
  ResponseWriter(const ResponseWriter&) = delete;
  ResponseWriter& operator=(const ResponseWriter&) = delete;

  // A complete response with Content-Length.
  bool Send(int status, std::string_view content_type, std::string body, const HeaderList& extra_headers = {});

  // Starts a chunked response (HTTP/1.0 clients: unframed, closed at End).
  bool StartStream(int status, std::string_view content_type = "text/event-stream",
                   const HeaderList& extra_headers = {});
  // Queues one chunk; it is flushed to the socket on its own. An empty chunk
  // is ignored (it would end the chunked body).
  bool Write(std::string chunk);
  // Ends the stream (writes the last chunk).
  bool End();

  // True once the connection is gone (client disconnect, idle timeout, write
  // error, Stop()).
  bool closed() const { return closed_.load(std::memory_order_acquire); }
  // Runs `callback` once when the connection closes before the response was
  // fully written, or right away (on the caller's thread) if already closed.
  // Callbacks otherwise run on an I/O thread and must not block.
  void OnClose(std::function<void()> callback);

 private:
  friend class Session;
  enum class State { kIdle, kSent, kStreaming, kEnded };

  // Called by the Session on its strand.
  void MarkClosed();

  std::weak_ptr<Session> session_;
  std::atomic<bool> closed_{false};
  std::mutex mu_;
  State state_ ABSL_GUARDED_BY(mu_) = State::kIdle;
  std::vector<std::function<void()>> on_close_ ABSL_GUARDED_BY(mu_);
};

using Handler = std::function<void(const Request&, std::shared_ptr<ResponseWriter>)>;

// OpenAI's error JSON: {"error":{"message":...,"type":"invalid_request_error"}}.
// "http://host:port", the host in brackets when it is an IPv6 address.
std::string BaseUrl(std::string_view host, int port);

std::string JsonErrorBody(std::string_view message, std::string_view type = "invalid_request_error");

class HttpServer {
 public:
  struct Options {
    std::string host = "127.0.0.1";  // numeric IPv4/IPv6 address to bind
    int port = 8000;                 // 0: the OS picks; see port()
    // I/O threads running handlers. Each owns the connections it accepted
    // (round-robin), so a handler that hogs its thread delays those only.
    int threads = 2;
    size_t max_body_bytes = 8 << 20;        // larger bodies get 413
    std::chrono::seconds idle_timeout{60};  // no traffic this long: close
    size_t max_header_bytes = 64 << 10;     // larger header blocks get 431
    // Stop() waits this long for in-flight responses before closing them.
    std::chrono::milliseconds stop_grace{5000};
    // Connections open at once; 0: no cap. A connection accepted beyond it
    // is answered 503 with Retry-After: 1 (without reading its request) and
    // closed; at most 64 such answers are pending at once, connections
    // beyond those are closed at accept. Each counts as refused.
    size_t max_connections = 0;
  };

  explicit HttpServer(Options options);
  ~HttpServer();  // Stop()s
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // REQUIRES: before Start(). A second handler for the same pair replaces
  // the first. `method` is matched exactly ("GET", "POST").
  void Route(std::string method, std::string path, Handler handler);

  // Binds, listens and starts the I/O threads. InvalidArgument for a bad
  // host, Unavailable if the address cannot be bound (port taken).
  absl::Status Start();
  // The bound port (the OS's choice when Options::port was 0); 0 before Start.
  int port() const { return bound_port_; }
  // See the file comment. Idempotent.
  void Stop();

  struct ConnectionStats {
    uint64_t accepted = 0;  // since Start(), refused ones included
    uint64_t open = 0;      // now, refused ones excluded
    uint64_t refused = 0;   // since Start(): over max_connections
  };
  ConnectionStats connection_stats() const;

 private:
  friend class Session;
  struct Impl;

  // The handler for (method, path); sets *status to 404 or 405 (and *allow
  // to the allowed methods) when there is none. Routes are immutable after
  // Start(), so this needs no lock.
  const Handler* Find(std::string_view method, std::string_view path, int* status, std::string* allow) const;
  void StartAccept();

  Options options_;
  std::map<std::string, std::map<std::string, Handler>, std::less<>> routes_;
  std::unique_ptr<Impl> impl_;
  std::vector<std::thread> threads_;
  int bound_port_ = 0;
  bool started_ = false;
  bool stopped_ = false;
};

}  // namespace tandem::http

#endif  // TANDEM_ORCHESTRATOR_HTTP_HTTP_SERVER_H_
