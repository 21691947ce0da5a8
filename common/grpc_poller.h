// GrpcPoller: one gRPC completion queue and the thread that drains it, for
// the asynchronous (completion-queue) API on the token path.
//
// Why not gRPC's callback API: with the Linux epoll1 engine of gRPC 1.51 the
// callback API runs on a hidden completion queue drained by at least two
// "nexting" threads, and whichever thread polls hands the poller role to
// another before running a completion -- a futex wake-up per message, on
// each side of every stream. A process whose calls all go through one
// GrpcPoller has one thread in epoll: the thread that reads a message runs
// its completion, with no hand-off. (Any other thread blocked in a gRPC
// wait -- a synchronous call, a callback-API call -- joins the polling and
// brings the hand-offs back: keep a process on one API.)
//
// Tags: every operation started on cq() takes a GrpcTag* as its tag; the
// poller thread calls tag->Done(ok) when the operation completes (ok as
// CompletionQueue::Next reports it). Done runs on the poller thread: it
// must not block. GrpcPoller::Unary runs a unary call to its end and hands
// the status to a function; GrpcReader reads a server stream to its end.
//
// Lifetime: Shared() is created on first use and never destroyed (calls end
// on their own or are cancelled by their owners; the process exit stops the
// thread). A GrpcPoller made for a test is shut down by its destructor,
// which waits for every operation already started to complete: cancel long
// calls first.
#ifndef TANDEM_COMMON_GRPC_POLLER_H_
#define TANDEM_COMMON_GRPC_POLLER_H_

#include <grpcpp/grpcpp.h>

#include <functional>
#include <memory>
#include <thread>
#include <utility>

namespace tandem {

class GrpcTag {
 public:
  virtual void Done(bool ok) = 0;

 protected:
  ~GrpcTag() = default;
};

// A tag that calls obj->fn(ok): for objects with several operations in
// flight at once (a server stream's writes and its done notification).
template <class T>
class MemberTag final : public GrpcTag {
 public:
  MemberTag(T* obj, void (T::*fn)(bool)) : obj_(obj), fn_(fn) {}
  void Done(bool ok) override { (obj_->*fn_)(ok); }

 private:
  T* const obj_;
  void (T::*const fn_)(bool);
};

// A server-streaming call read to its end, one operation at a time (the
// object is its own tag): OnMessage for each message -- false stops reading
// (cancel the call first, or its status may read OK) -- then OnEnd with the
// call's status, once and last; a derived object may delete itself there.
template <class Response>
class GrpcReader : public GrpcTag {
 public:
  void Done(bool ok) final {
    switch (state_) {
      case State::kStarting:
      case State::kReading:
        if (state_ == State::kReading && ok) ok = OnMessage(message_);
        if (ok) {
          state_ = State::kReading;
          reader_->Read(&message_, this);
          return;
        }
        // The stream ended (or never started): its status says why.
        state_ = State::kFinishing;
        reader_->Finish(&status_, this);
        return;
      case State::kFinishing:
        // The reader lives in the call's arena, which goes with the call's
        // ClientContext: a derived object's member, destroyed before this
        // base's. So the reader goes first, now that the call is over.
        reader_.reset();
        OnEnd(status_);  // may delete this
        return;
    }
  }

 protected:
  ~GrpcReader() = default;

  // Starts a call made with the stub's PrepareAsync<Method>(ctx, request, cq)
  // on a poller's cq(). OnMessage and OnEnd may run before this returns.
  void StartReading(std::unique_ptr<grpc::ClientAsyncReader<Response>> reader) {
    reader_ = std::move(reader);
    reader_->StartCall(this);
  }
  virtual bool OnMessage(const Response& message) = 0;
  virtual void OnEnd(const grpc::Status& status) = 0;

 private:
  enum class State { kStarting, kReading, kFinishing };
  std::unique_ptr<grpc::ClientAsyncReader<Response>> reader_;
  State state_ = State::kStarting;
  Response message_;
  grpc::Status status_;
};

class GrpcPoller {
 public:
  // Drains a completion queue of its own.
  GrpcPoller();
  // Drains `cq` (a server's, from ServerBuilder::AddCompletionQueue), which
  // must outlive the poller.
  explicit GrpcPoller(grpc::CompletionQueue* cq);
  // Shuts the queue down and drains it: waits for every operation already
  // started to complete.
  ~GrpcPoller();
  GrpcPoller(const GrpcPoller&) = delete;
  GrpcPoller& operator=(const GrpcPoller&) = delete;

  // The process's poller (created on first use, never destroyed).
  static GrpcPoller& Shared();

  grpc::CompletionQueue* cq() { return cq_; }

  // On a poller's thread, inside a tag's Done: queues `task` to run on this
  // thread right after that Done returns (in order, with none of Done's
  // callers' locks held) and returns true. Work that must not run under the
  // caller's locks -- releasing the object whose callback holds them -- then
  // costs no other thread's wake-up; `task` is left empty. Anywhere else:
  // returns false and leaves `task` alone (post it elsewhere).
  static bool RunAfterThisCompletion(std::function<void()>& task);

  // Starts a unary call made with the stub's PrepareAsync<Method>(ctx, request,
  // cq()) and runs done(status) on the poller thread when it ends; *response
  // is filled by then. The context, request and response must outlive it.
  template <class Response>
  static void Unary(std::unique_ptr<grpc::ClientAsyncResponseReader<Response>> rpc, Response* response,
                    std::function<void(const grpc::Status&)> done) {
    auto* tag = new UnaryTag<Response>(std::move(rpc), std::move(done));
    tag->rpc->StartCall();
    tag->rpc->Finish(response, &tag->status, tag);
  }

 private:
  template <class Response>
  struct UnaryTag final : GrpcTag {
    UnaryTag(std::unique_ptr<grpc::ClientAsyncResponseReader<Response>> r, std::function<void(const grpc::Status&)> d)
        : rpc(std::move(r)), done(std::move(d)) {}
    void Done(bool /*ok: always true for Finish*/) override {
      // The reader lives in the call's arena, which goes with the caller's
      // ClientContext: `done` may destroy that, so the reader goes first.
      rpc.reset();
      done(status);
      delete this;
    }
    std::unique_ptr<grpc::ClientAsyncResponseReader<Response>> rpc;
    std::function<void(const grpc::Status&)> done;
    grpc::Status status;
  };

  void Run();

  std::unique_ptr<grpc::CompletionQueue> owned_;
  grpc::CompletionQueue* const cq_;
  std::thread thread_;  // last: starts after cq_ exists
};

}  // namespace tandem

#endif  // TANDEM_COMMON_GRPC_POLLER_H_
