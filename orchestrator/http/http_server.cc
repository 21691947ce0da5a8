#include "orchestrator/http/http_server.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <exception>
#include <mutex>
#include <optional>
#include <unordered_map>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "common/logging.h"
#include "common/thread_util.h"

namespace tandem::http {

namespace {

// absl::EqualsIgnoreCase takes absl::string_view, which Debian's Abseil does
// not alias to std::string_view.
bool EqualsIgnoreCase(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (absl::ascii_tolower(static_cast<unsigned char>(a[i])) !=
        absl::ascii_tolower(static_cast<unsigned char>(b[i]))) {
      return false;
    }
  }
  return true;
}

}  // namespace

namespace net = boost::asio;
namespace beast = boost::beast;
namespace bhttp = boost::beast::http;
using tcp = net::ip::tcp;
using error_code = boost::system::error_code;

// ---------------------------------------------------------------------------
// Request

std::string_view Request::Header(std::string_view name) const {
  for (const auto& [key, value] : headers) {
    if (EqualsIgnoreCase(key, name)) return value;
  }
  return {};
}

bool Request::HasHeader(std::string_view name) const {
  for (const auto& header : headers) {
    if (EqualsIgnoreCase(header.first, name)) return true;
  }
  return false;
}

// ---------------------------------------------------------------------------
// Helpers

std::string BaseUrl(std::string_view host, int port) {
  return host.find(':') == std::string_view::npos ? absl::StrFormat("http://%s:%d", host, port)
                                                  : absl::StrFormat("http://[%s]:%d", host, port);
}

std::string JsonErrorBody(std::string_view message, std::string_view type) {
  auto escape = [](std::string_view s) {
    std::string out;
    out.reserve(s.size());
    for (char c : s) {
      switch (c) {
        case '"':
          out += "\\\"";
          break;
        case '\\':
          out += "\\\\";
          break;
        case '\n':
          out += "\\n";
          break;
        case '\r':
          out += "\\r";
          break;
        case '\t':
          out += "\\t";
          break;
        default:
          if (static_cast<unsigned char>(c) < 0x20) {
            out += absl::StrFormat("\\u%04x", static_cast<unsigned char>(c));
          } else {
            out += c;
          }
      }
    }
    return out;
  };
  return absl::StrCat("{\"error\":{\"message\":\"", escape(message), "\",\"type\":\"", escape(type), "\"}}");
}

namespace {

bool ValidHeaderToken(std::string_view s) { return !s.empty() && s.find_first_of("\r\n:") == std::string_view::npos; }
bool ValidHeaderValue(std::string_view s) { return s.find_first_of("\r\n") == std::string_view::npos; }

// Status line and headers, up to and including the blank line.
std::string HeadBlock(int status, std::string_view content_type, const HeaderList& extra, std::string_view framing,
                      bool keep_alive) {
  std::string reason(bhttp::obsolete_reason(static_cast<bhttp::status>(status)));
  std::string out = absl::StrCat("HTTP/1.1 ", status, " ", reason, "\r\n");
  if (!content_type.empty() && ValidHeaderValue(content_type)) {
    absl::StrAppend(&out, "Content-Type: ", std::string(content_type), "\r\n");
  }
  for (const auto& [name, value] : extra) {
    if (!ValidHeaderToken(name) || !ValidHeaderValue(value)) {
      LOG(WARNING) << "http: dropping invalid response header " << name;
      continue;
    }
    absl::StrAppend(&out, name, ": ", value, "\r\n");
  }
  absl::StrAppend(&out, std::string(framing), keep_alive ? "Connection: keep-alive\r\n" : "Connection: close\r\n",
                  "\r\n");
  return out;
}

}  // namespace

// ---------------------------------------------------------------------------
// Server internals

// One io_context per I/O thread, each run by that thread alone: a connection
// lives on one of them (its handlers run in order there: that is the
// connection's strand), and an event is handled by the thread that waited
// for it. A single context shared by all threads hands every event from the
// thread in epoll_wait to another (a futex wake-up per read or write).
//
// Declaration order matters: the registry outlives the io_contexts, because
// destroying an io_context destroys pending handlers, and the Sessions they
// hold unregister themselves.
struct HttpServer::Impl {
  explicit Impl(int threads) : iocs(MakeContexts(threads)) {}
  static std::vector<std::unique_ptr<net::io_context>> MakeContexts(int threads) {
    std::vector<std::unique_ptr<net::io_context>> iocs;
    for (int i = 0; i < std::max(1, threads); ++i) {
      // Concurrency hint 1: one thread runs it (posts from others are fine).
      iocs.push_back(std::make_unique<net::io_context>(1));
    }
    return iocs;
  }

  // std::mutex rather than absl::Mutex: Debian's Abseil is not instrumented
  // for ThreadSanitizer.
  std::mutex mu;
  std::condition_variable sessions_empty;  // notified when the last session ends
  uint64_t next_id ABSL_GUARDED_BY(mu) = 0;
  std::unordered_map<uint64_t, std::weak_ptr<Session>> sessions ABSL_GUARDED_BY(mu);
  size_t counted ABSL_GUARDED_BY(mu) = 0;    // sessions under max_connections
  size_t rejecting ABSL_GUARDED_BY(mu) = 0;  // sessions answering 503
  uint64_t refused ABSL_GUARDED_BY(mu) = 0;
  // The last refusal WARNING (at most one per 10 s); accept handler only.
  std::chrono::steady_clock::time_point last_refusal_log;
  uint64_t refusals_logged = 0;  // accept handler only

  std::vector<std::unique_ptr<net::io_context>> iocs;
  std::vector<net::executor_work_guard<net::io_context::executor_type>> work;
  // The acceptor and its back-off timer live on the first context.
  tcp::acceptor acceptor{*iocs[0]};
  net::steady_timer accept_backoff{*iocs[0]};
  size_t next_ioc = 0;  // the context of the next connection; accept handler only
  std::atomic<bool> stopping{false};
};

// One connection. Every member is touched only on its context's thread (the
// connection's strand), except the output side (see Submit()).
class Session : public std::enable_shared_from_this<Session> {
 public:
  // `refuse`: over max_connections; the session only answers 503.
  Session(HttpServer* server, tcp::socket socket, uint64_t id, bool refuse)
      : server_(server),
        impl_(server->impl_.get()),
        opts_(server->options_),
        socket_(std::move(socket)),
        timer_(socket_.get_executor()),
        id_(id),
        refuse_(refuse) {}

  // May run inside ~Impl (the io_context destroying pending handlers), so it
  // touches only Impl members declared before the io_context.
  ~Session() {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->sessions.erase(id_);
    --(refuse_ ? impl_->rejecting : impl_->counted);
    if (impl_->sessions.empty()) impl_->sessions_empty.notify_all();
  }

  net::any_io_executor executor() { return socket_.get_executor(); }

  void Start() {
    Touch();
    WaitTimer();
    if (refuse_) {
      return Reject(
          503, absl::StrCat("the server is at its limit of ", opts_.max_connections, " open connections; retry later"),
          {{"Retry-After", "1"}}, "server_error");
    }
    ReadHeader();
  }

  // Stop(): idle connections close now; a pending response finishes first.
  void Shutdown() {
    keep_alive_.store(false, std::memory_order_relaxed);
    if (state_ == State::kReading) return Close();
    // Left for the probe (see Submit): finished now, so it drains and closes.
    if (state_ == State::kResponding && ResponseSent()) FinishResponse();
  }

  // Stop()'s deadline passed.
  void ForceClose() { Close(); }

  // --- Called by ResponseWriter, from any thread. ---
  // Output for the pending response. Where no write is in flight and nothing
  // is queued the bytes go straight to the socket from the caller's thread
  // (a non-blocking send under out_mu_), so a token streamed from a gRPC
  // thread costs no hand-off to an I/O thread; what the socket does not take
  // at once is queued for the strand, which writes it asynchronously (and
  // every later chunk behind it, in order). `last` ends the response: the
  // strand finishes it once everything is written.
  void Submit(std::string bytes, bool last) {
    bool wake_strand = false;
    {
      std::lock_guard<std::mutex> lock(out_mu_);
      if (closed_) return;
      std::string_view rest = bytes;
      bool idle = !writing_ && out_.empty();
      if (idle && !send_failed_) {
        while (!rest.empty()) {
          ssize_t n = ::send(socket_.native_handle(), rest.data(), rest.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
          if (n > 0) {
            rest.remove_prefix(static_cast<size_t>(n));
            Touch();
          } else if (n < 0 && errno == EINTR) {
            continue;
          } else {
            // EAGAIN: the strand waits for room. An error: the strand closes.
            if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) send_failed_ = true;
            break;
          }
        }
      }
      if (!rest.empty()) {
        out_.push_back(rest.size() == bytes.size() ? std::move(bytes) : std::string(rest));
        // Queued bytes with no write in flight and none queued before: no
        // strand task is on its way to them yet.
        wake_strand = idle;
      }
      if (last) {
        response_done_ = true;
        // Every byte is out and the probe's read is waiting on the socket:
        // the strand finishes the response when that read completes (the
        // client's next request, or its close), so no I/O thread is woken
        // for it now. Otherwise (bytes queued, no probe, closing) it is.
        wake_strand = !(idle && rest.empty() && probe_waiting_ && keep_alive() && !impl_->stopping.load());
      }
    }
    // No Touch() for queued bytes: only bytes actually written move the
    // deadline, so a client that stops reading is closed after idle_timeout.
    if (wake_strand) net::post(socket_.get_executor(), [self = shared_from_this()] { self->WriteNext(); });
  }

  bool keep_alive() const { return keep_alive_.load(std::memory_order_relaxed); }
  // The response ends with the connection (an HTTP/1.0 stream: no chunks).
  void CloseAfterResponse() { keep_alive_.store(false, std::memory_order_relaxed); }
  // Set on the strand before the handler runs; fixed while it answers.
  int request_version() const { return version_; }

 private:
  enum class State { kReading, kResponding, kDraining };

  // --- Timeout: one wait loop; Touch() moves the deadline. ---
  // Touch() only records the deadline (it runs per written chunk: re-arming
  // the timer there would cancel and requeue a wait each time); the timer
  // wakes at the deadline it was armed with and re-arms if it moved on.
  // Submit() touches from other threads, so the deadline is an atomic count
  // of the steady clock's ticks.
  using Clock = net::steady_timer::clock_type;
  void Touch() { SetDeadline(Clock::now() + opts_.idle_timeout); }
  void SetDeadline(Clock::time_point t) { deadline_.store(t.time_since_epoch().count(), std::memory_order_relaxed); }
  Clock::time_point deadline() const {
    return Clock::time_point(Clock::duration(deadline_.load(std::memory_order_relaxed)));
  }
  void WaitTimer() {
    timer_.expires_at(deadline());
    timer_.async_wait([self = shared_from_this()](error_code) {
      if (self->closed_) return;
      if (self->deadline() <= Clock::now()) {
        self->Close();
        return;
      }
      self->WaitTimer();
    });
  }

  // --- Reading a request: headers first, to decide 413/100-continue. ---
  void ReadHeader() {
    state_ = State::kReading;
    if (impl_->stopping.load()) {
      Close();
      return;
    }
    parser_.emplace();
    parser_->header_limit(static_cast<uint32_t>(std::min<size_t>(opts_.max_header_bytes, UINT32_MAX)));
    parser_->body_limit(opts_.max_body_bytes);
    Touch();
    bhttp::async_read_header(socket_, buffer_, *parser_,
                             [self = shared_from_this()](error_code ec, size_t) { self->OnHeader(ec); });
  }

  void OnHeader(error_code ec) {
    if (closed_) return;
    if (ec) return OnReadError(ec);
    const auto& req = parser_->get();
    if (auto length = parser_->content_length(); length && *length > opts_.max_body_bytes) {
      return Reject(413, "request body too large");
    }
    if (EqualsIgnoreCase(std::string(req[bhttp::field::expect]), "100-continue") && !parser_->is_done()) {
      auto cont = std::make_shared<std::string>("HTTP/1.1 100 Continue\r\n\r\n");
      net::async_write(socket_, net::buffer(*cont), [self = shared_from_this(), cont](error_code ec, size_t) {
        if (self->closed_) return;
        if (ec) return self->Close();
        self->ReadBody();
      });
      return;
    }
    ReadBody();
  }

  void ReadBody() {
    Touch();
    bhttp::async_read(socket_, buffer_, *parser_, [self = shared_from_this()](error_code ec, size_t) {
      if (self->closed_) return;
      if (ec) return self->OnReadError(ec);
      self->Dispatch();
    });
  }

  void OnReadError(error_code ec) {
    if (ec == bhttp::error::end_of_stream || ec == bhttp::error::partial_message ||
        ec.category() != bhttp::make_error_code(bhttp::error::bad_target).category()) {
      Close();  // the peer closed, the socket failed or timed out
    } else if (ec == bhttp::error::body_limit) {
      Reject(413, "request body too large");
    } else if (ec == bhttp::error::header_limit) {
      Reject(431, "request header fields too large");
    } else {
      Reject(400, absl::StrCat("malformed request: ", ec.message()));
    }
  }

  // An error response, then close (the rest of the request is not read).
  void Reject(int status, std::string message, const HeaderList& extra = {},
              std::string_view type = "invalid_request_error") {
    state_ = State::kResponding;
    keep_alive_.store(false, std::memory_order_relaxed);
    std::string body = JsonErrorBody(message, type);
    std::string bytes =
        HeadBlock(status, kJsonContentType, extra, absl::StrCat("Content-Length: ", body.size(), "\r\n"), false);
    bytes += body;
    {
      std::lock_guard<std::mutex> lock(out_mu_);
      out_.push_back(std::move(bytes));
      response_done_ = true;
    }
    Touch();
    WriteNext();
  }

  void Dispatch() {
    auto msg = parser_->release();
    parser_.reset();
    Request req;
    req.method = std::string(msg.method_string());
    req.target = std::string(msg.target());
    size_t q = req.target.find('?');
    req.path = req.target.substr(0, q);
    if (q != std::string::npos) req.query = req.target.substr(q + 1);
    for (const auto& field : msg) {
      req.headers.emplace_back(std::string(field.name_string()), std::string(field.value()));
    }
    req.body = std::move(msg.body());
    req.version = msg.version();
    Touch();
    version_ = msg.version();
    keep_alive_.store(msg.keep_alive() && !impl_->stopping.load(), std::memory_order_relaxed);

    state_ = State::kResponding;
    {
      std::lock_guard<std::mutex> lock(out_mu_);
      response_done_ = false;
    }
    writer_ = std::make_shared<ResponseWriter>(weak_from_this());
    Probe();

    int status = 0;
    std::string allow;
    const Handler* handler = server_->Find(req.method, req.path, &status, &allow);
    if (handler == nullptr) {
      std::string message = status == 404 ? absl::StrCat("no route for ", req.path)
                                          : absl::StrCat("method ", req.method, " not allowed for ", req.path);
      HeaderList extra;
      if (status == 405) extra.emplace_back("Allow", allow);
      writer_->Send(status, kJsonContentType, JsonErrorBody(message), extra);
      return;
    }
    try {
      (*handler)(req, writer_);
    } catch (const std::exception& e) {
      LOG(WARNING) << "http: handler for " << req.path << " threw: " << e.what();
      writer_->Send(500, kJsonContentType, JsonErrorBody("internal error", "server_error"));
    } catch (...) {
      LOG(WARNING) << "http: handler for " << req.path << " threw";
      writer_->Send(500, kJsonContentType, JsonErrorBody("internal error", "server_error"));
    }
  }

  // --- While a response is pending, a read watches for the client leaving.
  // Bytes that arrive (a pipelined request) are kept in buffer_ for later.
  // EOF counts as leaving: a client that half-closes after its request loses
  // the response, as with most servers. Past max_header_bytes of buffered
  // input the watch reads no more and only waits for the client to leave
  // (WatchFull).
  // Submit() may leave a finished response for the probe's completion (see
  // there): the probe then finishes it and reads the next request from what
  // it buffered.
  void Probe() {
    if (probing_ || closed_) return;
    if (buffer_.size() >= opts_.max_header_bytes) return WatchFull();
    probing_ = true;
    {
      // Not with a pipelined request already buffered: nothing more may
      // arrive to complete this read.
      std::lock_guard<std::mutex> lock(out_mu_);
      probe_waiting_ = buffer_.size() == 0;
    }
    socket_.async_read_some(buffer_.prepare(4096), [self = shared_from_this()](error_code ec, size_t n) {
      self->probing_ = false;
      self->buffer_.commit(n);
      bool sent = false;
      {
        std::lock_guard<std::mutex> lock(self->out_mu_);
        self->probe_waiting_ = false;
        sent = self->ResponseSentLocked();
      }
      if (self->closed_) return;
      if (self->read_wanted_) {
        self->read_wanted_ = false;
        // The client's EOF (or an error) came with the read FinishResponse
        // cancelled: it has left. No read may follow an EOF: asio (1.74)
        // counts that read as having drained the socket and waits for the
        // next epoll edge, which never comes, so the connection would wait
        // for its idle timeout.
        if (ec && ec != net::error::operation_aborted) return self->Close();
        return self->ReadHeader();
      }
      if (ec) return self->Close();  // client gone
      // A response Submit() left to this read is over: the next request
      // starts with the bytes that came.
      if (sent && self->state_ == State::kResponding) return self->FinishResponse();
      self->Probe();
    });
  }

  // The pipeline is full (max_header_bytes buffered): nothing more is read
  // until the response is done, but the client leaving must still end it
  // (else a handler that never answers, or a long stream, holds the
  // connection until the idle timeout). PeerGone() asks the kernel whether
  // the peer shut down its side, even with unread bytes before its FIN; a
  // wait for readability wakes on each new segment or the FIN (epoll is
  // edge-triggered: no spinning on the unread bytes).
  bool PeerGone() {
    pollfd p{.fd = socket_.native_handle(), .events = POLLRDHUP, .revents = 0};
    return ::poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
  }
  void WatchFull() {
    probing_ = true;
    {
      std::lock_guard<std::mutex> lock(out_mu_);
      probe_waiting_ = false;
    }
    auto done = [self = shared_from_this()](error_code ec) {
      self->probing_ = false;
      bool sent = false;
      {
        std::lock_guard<std::mutex> lock(self->out_mu_);
        sent = self->ResponseSentLocked();
      }
      if (self->closed_) return;
      if (self->read_wanted_) {
        self->read_wanted_ = false;
        if (self->PeerGone()) return self->Close();
        return self->ReadHeader();
      }
      if ((ec && ec != net::error::operation_aborted) || self->PeerGone()) return self->Close();
      if (sent && self->state_ == State::kResponding) return self->FinishResponse();
      self->Probe();
    };
    if (PeerGone()) {
      // Already gone (its FIN's edge may be past): finish as a read that saw
      // EOF would, from the connection's thread but not from here (Dispatch
      // is still handing the request to its handler).
      net::post(socket_.get_executor(), [done = std::move(done)]() mutable { done(net::error::eof); });
      return;
    }
    socket_.async_wait(tcp::socket::wait_read, std::move(done));
  }

  // The response's last bytes were submitted and all of them written.
  bool ResponseSentLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(out_mu_) {
    return response_done_ && !writing_ && out_.empty();
  }
  bool ResponseSent() {
    std::lock_guard<std::mutex> lock(out_mu_);
    return ResponseSentLocked();
  }

  // --- Writing: one async_write at a time, in queue order. ---
  void WriteNext() {
    std::unique_lock<std::mutex> lock(out_mu_);
    if (writing_ || closed_) return;
    if (send_failed_) {
      lock.unlock();
      return Close();
    }
    if (out_.empty()) {
      bool finish = response_done_ && state_ == State::kResponding;
      lock.unlock();
      if (finish) FinishResponse();
      return;
    }
    writing_ = true;
    // deque::push_back keeps references to elements valid, so Submit may
    // queue behind this buffer while it is being written.
    net::const_buffer front = net::buffer(out_.front());
    lock.unlock();
    net::async_write(socket_, front, [self = shared_from_this()](error_code ec, size_t) {
      {
        std::lock_guard<std::mutex> lock(self->out_mu_);
        self->writing_ = false;
        if (self->closed_) return;
        if (!ec) self->out_.pop_front();
      }
      if (ec) return self->Close();
      self->Touch();
      self->WriteNext();
    });
  }

  void FinishResponse() {
    writer_.reset();
    if (!keep_alive_ || impl_->stopping.load()) return Drain();
    if (probing_) {
      read_wanted_ = true;  // the probe's completion starts the next read
      error_code ignored;
      socket_.cancel(ignored);
      return;
    }
    ReadHeader();
  }

  // Graceful close: stop sending, discard what the client still sends for a
  // short while (so it reads our response instead of a reset), then close.
  void Drain() {
    state_ = State::kDraining;
    error_code ignored;
    socket_.shutdown(tcp::socket::shutdown_send, ignored);
    // 1 s is ample for a client to read a small response and close; during
    // Stop() the bound is shorter so shutdown is not held up by slow clients.
    std::chrono::steady_clock::duration bound =
        impl_->stopping.load() ? std::chrono::milliseconds(100) : std::chrono::seconds(1);
    SetDeadline(Clock::now() + std::min<std::chrono::steady_clock::duration>(opts_.idle_timeout, bound));
    timer_.expires_at(deadline());  // the pending wait ends and re-arms at the earlier deadline
    if (probing_) return;           // the probe sees EOF or the timer closes
    DrainRead();
  }
  void DrainRead() {
    auto scratch = std::make_shared<std::array<char, 4096>>();
    socket_.async_read_some(net::buffer(*scratch), [self = shared_from_this(), scratch](error_code ec, size_t) {
      if (self->closed_) return;
      if (ec) return self->Close();
      self->DrainRead();
    });
  }

  void Close() {
    bool sent = false;
    {
      // Under out_mu_ so that no Submit() is sending on the descriptor while
      // it closes (and could be reused).
      std::lock_guard<std::mutex> lock(out_mu_);
      if (closed_) return;
      closed_ = true;
      sent = ResponseSentLocked();
      error_code ignored;
      socket_.shutdown(tcp::socket::shutdown_both, ignored);
      socket_.close(ignored);
      out_.clear();
    }
    timer_.cancel();
    // A response sent in full (one left for the probe, see Submit) is over:
    // its writer is not told of a close.
    if (writer_) {
      std::shared_ptr<ResponseWriter> writer = std::move(writer_);
      if (!sent) writer->MarkClosed();
    }
  }

  HttpServer* server_;
  HttpServer::Impl* impl_;
  const HttpServer::Options& opts_;
  tcp::socket socket_;
  net::steady_timer timer_;
  std::atomic<Clock::rep> deadline_{0};  // idle deadline; see Touch()
  const uint64_t id_;
  const bool refuse_;

  beast::flat_buffer buffer_;
  std::optional<bhttp::request_parser<bhttp::string_body>> parser_;
  State state_ = State::kReading;
  std::atomic<bool> keep_alive_{true};
  int version_ = 11;
  bool probing_ = false;
  bool read_wanted_ = false;
  std::shared_ptr<ResponseWriter> writer_;

  // The output side, shared with Submit() on other threads. Written under
  // out_mu_; closed_ is also written only on the strand, so the strand may
  // read it without the lock.
  std::mutex out_mu_;
  bool closed_ = false;
  bool writing_ = false;        // an async_write is in flight
  bool send_failed_ = false;    // a direct send hit an error; the strand closes
  bool response_done_ = false;  // the response's last bytes were submitted
  bool probe_waiting_ = false;  // a probe's read is pending (see Submit)
  std::deque<std::string> out_;
};

// ---------------------------------------------------------------------------
// ResponseWriter

namespace {

// Runs `fn(session)` now, on the caller's thread, if the session still
// exists (Session::Submit is thread-safe).
template <typename Fn>
bool WithSession(const std::weak_ptr<Session>& weak, Fn fn) {
  std::shared_ptr<Session> session = weak.lock();
  if (!session) return false;
  fn(*session);
  return true;
}

std::string ChunkFrame(std::string_view data) {
  return absl::StrCat(absl::StrFormat("%x", data.size()), "\r\n", std::string(data), "\r\n");
}

}  // namespace

bool ResponseWriter::Send(int status, std::string_view content_type, std::string body,
                          const HeaderList& extra_headers) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed() || state_ != State::kIdle) return false;
    state_ = State::kSent;
  }
  std::string type(content_type);
  HeaderList extra = extra_headers;
  return WithSession(
      session_, [type = std::move(type), extra = std::move(extra), body = std::move(body), status](Session& s) mutable {
        std::string bytes =
            HeadBlock(status, type, extra, absl::StrCat("Content-Length: ", body.size(), "\r\n"), s.keep_alive());
        bytes += body;
        s.Submit(std::move(bytes), /*last=*/true);
      });
}

bool ResponseWriter::StartStream(int status, std::string_view content_type, const HeaderList& extra_headers) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed() || state_ != State::kIdle) return false;
    state_ = State::kStreaming;
  }
  std::string type(content_type);
  HeaderList extra = extra_headers;
  extra.emplace_back("Cache-Control", "no-cache");
  return WithSession(session_, [type = std::move(type), extra = std::move(extra), status](Session& s) mutable {
    // HTTP/1.0 has no chunked encoding: the body ends when the connection does.
    bool chunked = s.request_version() >= 11;
    if (!chunked) s.CloseAfterResponse();
    std::string bytes = HeadBlock(status, type, extra, chunked ? "Transfer-Encoding: chunked\r\n" : "",
                                  s.keep_alive());  // false without chunks (above)
    s.Submit(std::move(bytes), /*last=*/false);
  });
}

bool ResponseWriter::Write(std::string chunk) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed() || state_ != State::kStreaming) return false;
  }
  if (chunk.empty()) return true;
  return WithSession(session_, [chunk = std::move(chunk)](Session& s) mutable {
    s.Submit(s.request_version() >= 11 ? ChunkFrame(chunk) : std::move(chunk), /*last=*/false);
  });
}

bool ResponseWriter::End() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed() || state_ != State::kStreaming) return false;
    state_ = State::kEnded;
  }
  return WithSession(session_,
                     [](Session& s) { s.Submit(s.request_version() >= 11 ? "0\r\n\r\n" : "", /*last=*/true); });
}

void ResponseWriter::OnClose(std::function<void()> callback) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!closed()) {
      on_close_.push_back(std::move(callback));
      return;
    }
  }
  callback();
}

void ResponseWriter::MarkClosed() {
  std::vector<std::function<void()>> callbacks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_.exchange(true, std::memory_order_acq_rel)) return;
    callbacks.swap(on_close_);
  }
  for (auto& callback : callbacks) callback();
}

// ---------------------------------------------------------------------------
// HttpServer

std::string PercentDecode(std::string_view text) {
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '%' && i + 2 < text.size() && hex(text[i + 1]) >= 0 && hex(text[i + 2]) >= 0) {
      out.push_back(static_cast<char>(hex(text[i + 1]) * 16 + hex(text[i + 2])));
      i += 2;
    } else {
      out.push_back(text[i]);
    }
  }
  return out;
}

HttpServer::HttpServer(Options options) : options_(std::move(options)), impl_(new Impl(options_.threads)) {}

HttpServer::~HttpServer() { Stop(); }

void HttpServer::Route(std::string method, std::string path, Handler handler) {
  CHECK(!started_) << "HttpServer::Route after Start";
  routes_[std::move(path)][std::move(method)] = std::move(handler);
}

const Handler* HttpServer::Find(std::string_view method, std::string_view path, int* status, std::string* allow) const {
  auto it = routes_.find(path);
  if (it == routes_.end()) {
    // The longest "PREFIX/*" route with more path after PREFIX/.
    size_t best = 0;
    for (auto r = routes_.begin(); r != routes_.end(); ++r) {
      const std::string& route = r->first;
      if (route.size() < 2 || !route.ends_with("/*")) continue;
      const std::string_view prefix = std::string_view(route).substr(0, route.size() - 1);
      if (path.size() > prefix.size() && path.starts_with(prefix) && prefix.size() > best) {
        best = prefix.size();
        it = r;
      }
    }
  }
  if (it == routes_.end()) {
    *status = 404;
    return nullptr;
  }
  auto m = it->second.find(std::string(method));
  if (m != it->second.end()) return &m->second;
  *status = 405;
  for (const auto& entry : it->second) {
    if (!allow->empty()) *allow += ", ";
    *allow += entry.first;
  }
  return nullptr;
}

absl::Status HttpServer::Start() {
  if (started_) return absl::FailedPreconditionError("HttpServer already started");
  error_code ec;
  net::ip::address address = net::ip::make_address(options_.host, ec);
  if (ec) return absl::InvalidArgumentError(absl::StrCat("bad HTTP host '", options_.host, "'"));
  if (options_.port < 0 || options_.port > 65535 || options_.threads < 1) {
    return absl::InvalidArgumentError("HTTP port must be in [0, 65535] and threads >= 1");
  }
  tcp::endpoint endpoint(address, static_cast<uint16_t>(options_.port));
  tcp::acceptor& acceptor = impl_->acceptor;
  auto fail = [&](std::string_view what) {
    error_code ignored;
    acceptor.close(ignored);
    return absl::UnavailableError(
        absl::StrCat("HTTP ", std::string(what), " ", options_.host, ":", options_.port, ": ", ec.message()));
  };
  if (acceptor.open(endpoint.protocol(), ec); ec) return fail("open");
  if (acceptor.set_option(net::socket_base::reuse_address(true), ec); ec) return fail("setsockopt");
  if (acceptor.bind(endpoint, ec); ec) return fail("bind");
  if (acceptor.listen(net::socket_base::max_listen_connections, ec); ec) return fail("listen");
  bound_port_ = acceptor.local_endpoint(ec).port();
  started_ = true;

  for (auto& ioc : impl_->iocs) impl_->work.push_back(net::make_work_guard(*ioc));
  StartAccept();
  for (auto& ioc : impl_->iocs) {
    threads_.emplace_back([ioc = ioc.get()] {
      SetThreadName("http_io");
      ioc->run();
    });
  }
  return absl::OkStatus();
}

void HttpServer::StartAccept() {
  net::io_context& ioc = *impl_->iocs[impl_->next_ioc++ % impl_->iocs.size()];
  impl_->acceptor.async_accept(ioc, [this](error_code ec, tcp::socket socket) {
    if (!impl_->acceptor.is_open() || impl_->stopping.load()) return;
    if (ec) {
      // Typically EMFILE: back off instead of spinning on the error.
      LOG(WARNING) << "http: accept failed: " << ec.message();
      impl_->accept_backoff.expires_after(std::chrono::milliseconds(100));
      impl_->accept_backoff.async_wait([this](error_code) { StartAccept(); });
      return;
    } else {
      // TCP_NODELAY: with Nagle's algorithm a chunk written while the
      // previous one is unacknowledged waits for the peer's delayed ACK
      // (40 ms on Linux once a keep-alive connection has left quick-ACK
      // mode), which stalls every SSE stream after a connection's first.
      error_code nodelay_ec;
      socket.set_option(tcp::no_delay(true), nodelay_ec);
      // At most this many 503 answers pending; connections beyond are
      // closed at once (a flood must not buy memory with refusals).
      constexpr size_t kMaxRejecting = 64;
      std::shared_ptr<Session> session;
      bool refused = false;
      uint64_t refused_total = 0;
      {
        std::lock_guard<std::mutex> lock(impl_->mu);
        uint64_t id = impl_->next_id++;
        refused = options_.max_connections > 0 && impl_->counted >= options_.max_connections;
        if (refused) refused_total = ++impl_->refused;
        if (!refused || impl_->rejecting < kMaxRejecting) {
          ++(refused ? impl_->rejecting : impl_->counted);
          session = std::make_shared<Session>(this, std::move(socket), id, refused);
          impl_->sessions.emplace(id, session);
        }
      }
      if (refused) {
        const auto now = std::chrono::steady_clock::now();
        if (now - impl_->last_refusal_log > std::chrono::seconds(10)) {
          LOG(WARNING) << "http: at the limit of " << options_.max_connections << " open connections: refused "
                       << refused_total - impl_->refusals_logged << " connection(s) since the last report";
          impl_->last_refusal_log = now;
          impl_->refusals_logged = refused_total;
        }
      }
      if (session != nullptr) {
        net::post(session->executor(), [session] { session->Start(); });
      } else {
        error_code ignored;
        socket.close(ignored);
      }
    }
    StartAccept();
  });
}

HttpServer::ConnectionStats HttpServer::connection_stats() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return ConnectionStats{impl_->next_id, impl_->counted, impl_->refused};
}

void HttpServer::Stop() {
  if (!started_ || stopped_) return;
  stopped_ = true;
  impl_->stopping.store(true);
  net::post(impl_->acceptor.get_executor(), [impl = impl_.get()] {
    error_code ignored;
    impl->acceptor.close(ignored);
    impl->accept_backoff.cancel();
  });

  auto for_each_session = [this](void (Session::*method)()) {
    std::vector<std::shared_ptr<Session>> live;
    {
      std::lock_guard<std::mutex> lock(impl_->mu);
      for (auto& [id, weak] : impl_->sessions) {
        if (auto session = weak.lock()) live.push_back(std::move(session));
      }
    }
    for (auto& session : live) {
      net::post(session->executor(), [session, method] { ((*session).*method)(); });
    }
  };
  for_each_session(&Session::Shutdown);
  {
    std::unique_lock<std::mutex> lock(impl_->mu);
    impl_->sessions_empty.wait_for(lock, options_.stop_grace,
                                   [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return impl_->sessions.empty(); });
  }
  for_each_session(&Session::ForceClose);
  impl_->work.clear();
  for (auto& thread : threads_) thread.join();
  threads_.clear();
}

}  // namespace tandem::http
