// Every conversion between the worker's wire types (proto/tandem/v1/
// worker.proto) and its engine's, in one place: the gRPC calls convert with
// these and hold no field-by-field copies of their own. The absl::Status <->
// grpc::Status pair lives in common/grpc_status.h, which the router shares;
// it is included here so that one include serves a call.
//
// Pure functions; thread-safe.
#ifndef TANDEM_WORKER_SERVER_PROTO_CONVERT_H_
#define TANDEM_WORKER_SERVER_PROTO_CONVERT_H_

#include "common/grpc_status.h"
#include "kvtransfer/transport.h"
#include "tandem/v1/worker.pb.h"
#include "worker/engine/engine.h"
#include "worker/engine/output_sink.h"
#include "worker/kv_cache/kv_event_log.h"
#include "worker/sampling/sampler.h"
#include "worker/sampling/sampling_params.h"
#include "worker/server/kv_handoff.h"

namespace tandem::worker {

tandem::v1::FinishReason ToProto(FinishReason reason);

// A sampled token on the wire. `logprobs` false: the id alone (the request
// asked for no log-probabilities).
void ToProto(const SampledToken& token, bool logprobs, tandem::v1::TokenOutput* out);
SampledToken FromProto(const tandem::v1::TokenOutput& token);

// The wire sampling parameters as the engine's, defaults applied to the
// fields the request left unset.
SamplingParams FromProto(const tandem::v1::SamplingParams& params);
// What the engine runs for a Generate request: its id, prompt, sampling and
// resumed output. The KV transfer parameters are the hand-off's
// (kv_handoff.h), not part of the spec.
GenerateSpec FromProto(const tandem::v1::GenerateRequest& request);

// A finished request's last message: finish reason, stop id, usage and error.
void ToProto(const FinishInfo& info, tandem::v1::GenerateResponse* out);

// The KV event stream's contents.
void ToProto(const KvEvent& event, tandem::v1::KvEvent* out);
void ToProto(const CachedBlock& block, tandem::v1::CachedBlock* out);

// The load report's engine and KV hand-off counters (the service adds its
// own: calls_denied).
void ToProto(const LoadSnapshot& load, tandem::v1::LoadReport* out);
void ToProto(const KvHandoffStats& kv, tandem::v1::LoadReport* out);

// A KV transport's PeerInfo and its wire form, for the metadata exchange.
void ToProto(const kvtransfer::PeerInfo& info, tandem::v1::KvTransferInfo* out);
kvtransfer::PeerInfo FromProto(const tandem::v1::KvTransferInfo& info);

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_SERVER_PROTO_CONVERT_H_
