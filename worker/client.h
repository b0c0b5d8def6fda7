// The worker client library: joins a gTop-k cluster, keeps the worker's error
// feedback and momentum state, and runs one synchronous step per call against
// the S aggregator shards (docs/design.md; Shi et al., "A Distributed
// Synchronous SGD Algorithm with Global Top-k Sparsification for Low
// Bandwidth Networks", ICDCS 2019, arXiv:1901.04359; momentum correction and
// masking from Lin et al., "Deep Gradient Compression", arXiv:1712.01887).
//
// Framework-free: gradients and parameters are flat float buffers of length
// n, owned by the caller, in host memory or (builds with GTOPK_HAVE_CUDA) in
// CUDA device memory through the Step overload taking device pointers.
//
// Usage:
//   ClientOptions o;
//   o.leader_address = "10.0.0.1:7000";
//   o.n = params.size();
//   GTOPK_ASSIGN_OR_RETURN(auto client, WorkerClient::Connect(o));
//   GTOPK_ASSIGN_OR_RETURN(int64_t step,
//                          client->SynchronizeParameters(params));
//   for (;; ++step) {
//     ComputeGradient(params, grad);
//     GTOPK_ASSIGN_OR_RETURN(StepStats stats, client->Step(grad, params));
//   }
#ifndef GTOPK_WORKER_CLIENT_H_
#define GTOPK_WORKER_CLIENT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/buckets.h"
#include "common/cluster_modes.h"
#include "common/codec.h"
#include "common/error_feedback.h"
#include "common/optimizer.h"
#include "common/selector.h"
#include "common/sparse_vector.h"
#include "common/transport_security/transport_security.h"
#include "gtopk/v1/gtopk.grpc.pb.h"
#include "gtopk/v1/gtopk.pb.h"
#include "worker/cancellation.h"

#if GTOPK_HAVE_CUDA
// For callers that name cudaStream_t (python/_gtopk.cc); nothing below
// depends on it, so WorkerClient is the same in every build.
#include <cuda_runtime_api.h>
#endif

// CUDA's stream handle: cudaStream_t is CUstream_st* (worker/device_step.h).
struct CUstream_st;

namespace gtopk {
namespace worker {

class DeviceStep;  // worker/device_step.h

// How a worker reaches the cluster. Every field is validated by Connect.
struct ClientOptions {
  // host:port of the leader (shard 0), where the worker joins. The other
  // shards are dialled at the addresses the cluster spec names.
  std::string leader_address;
  // The rank this worker wants (e.g. JOB_COMPLETION_INDEX), or -1 for any
  // free rank.
  int requested_rank = -1;
  // The worker's parameter count; must equal the cluster's n.
  uint64_t n = 0;
  // The run length this worker trains (JoinRequest.run_length), e.g.
  // "--epochs=5 --steps=0 --batch-size=64 --train-limit=0"; empty: not
  // stated. A Join stating another than the cluster's first is refused
  // FAILED_PRECONDITION naming the flags that differ.
  std::string run_length;
  // Deadline of every non-step RPC (Join, InitParams, DownloadParams), > 0.
  absl::Duration rpc_timeout = absl::Seconds(30);
  // Added to the cluster's step timeout to form the step watchdog: a step
  // whose pulls have not all arrived by step_timeout + margin after its
  // pushes started is cancelled. The margin lets the servers' own
  // (better-informed) DEADLINE_EXCEEDED arrive first. >= 0.
  absl::Duration step_watchdog_margin = absl::Seconds(2);
  // Optional: every RPC of Connect and of the client it returns registers
  // here, so that another thread can cancel the blocking call in progress
  // (Cancellation::Cancel; the call returns CANCELLED under its failure
  // contract). Shared: the caller keeps it to cancel and Reset it.
  std::shared_ptr<Cancellation> cancellation;
  // Transport security of every channel
  // (common/transport_security/transport_security.h, docs/security.md): TLS or
  // mutual TLS credentials and the workers' token. Null: plaintext without a
  // token. Shared, immutable.
  std::shared_ptr<const TransportSecurity> security;
};

// A worker's own optimizer state, for checkpoints (ExportState /
// ImportState): what a run needs, beside the servers' parameters, to
// continue bit-identically.
struct WorkerState {
  int64_t next_step = 0;        // the step Step() runs next
  std::vector<float> residual;  // error-feedback residual, length n
  // DGC local velocity (momentum correction), length n; all zero in the
  // other momentum modes.
  std::vector<float> velocity;
};

// What one successful Step did. Durations are wall-clock.
struct StepStats {
  int64_t step = 0;             // the step that was applied
  uint64_t k = 0;               // the step's k (OptimizerRule::KAt)
  uint64_t sent_pairs = 0;      // pairs pushed (dense: values pushed)
  uint64_t received_pairs = 0;  // pairs pulled, all shards (dense: values)
  // Serialized Push / Pull message sizes, indexed by shard id (size S).
  std::vector<uint64_t> bytes_sent;
  std::vector<uint64_t> bytes_received;
  absl::Duration accumulate;  // momentum correction + error feedback
  absl::Duration select;      // local top-k (+ codec round trip, MarkSent)
  absl::Duration encode;      // slicing and encoding the S pushes
  absl::Duration push_wait;   // pushes out until the last pull decoded
  // push_wait split: until the last push was written to its stream, and
  // from then until the last pull was decoded (the servers' round).
  absl::Duration push;
  absl::Duration wait;
  absl::Duration apply;  // put-back, masking, parameter update
  // Overlapped steps: the Push messages sent in parts (Push.piece_end > 0),
  // all shards; 0 when every push went whole (the other steps, or servers
  // that do not take parts: WorkerClient::servers_take_push_parts()).
  uint64_t parts_sent = 0;
  // Server side, the slowest shard's (from the pulls): sum of the P pushes,
  // and selection (gtopk exact: with the leader's threshold exchange).
  absl::Duration server_merge;
  absl::Duration server_select;
  // Overlapped steps (FinishOverlappedStep) only: how long Finish waited
  // for the selection and the round (the communication not hidden behind
  // the backward pass); `accumulate`, `select`, `encode` are then the
  // selection thread's busy time and `push_wait` runs from the first piece
  // taken to the last pull decoded.
  absl::Duration exposed;
};

// One worker of a gTop-k cluster.
//
// Thread-safety: not thread-safe; use an instance from one thread at a time
// (calls block, see each method). Distinct instances are independent (the
// tests run several in one process).
//
// State owned here: the cluster spec, one gRPC channel per shard, the
// worker's residual (error feedback), local velocity (DGC momentum
// correction), global velocity (MomentumMode::kGlobal) and the step counter.
// The caller owns the gradient and parameter buffers; nothing is retained
// between calls.
//
// Errors are absl::Status with the server's code kept where a server
// answered (ABORTED: another worker's push failed the step;
// INVALID_ARGUMENT: this worker's push was rejected; DEADLINE_EXCEEDED: a
// missing worker or a stalled shard; UNAVAILABLE: a shard cannot be
// reached; FAILED_PRECONDITION: a shard's or the leader's cluster settings
// differ, or the leader no longer knows this rank -- Recover re-registers
// it; PERMISSION_DENIED: another worker joined this rank since), and the
// message prefixed with the shard's id and address.
class PushGate;  // worker/client_internal.h

class WorkerClient {
 public:
  // Joins the cluster through options.leader_address (blocks up to
  // rpc_timeout), keeps the returned cluster spec and prepares the channels,
  // optimizer rule, selector and codecs. Does not touch parameters: call
  // SynchronizeParameters next.
  // Then asks every other shard for the cluster spec (GetClusterSpec; a
  // shard still starting is waited for, within rpc_timeout): a shard whose
  // own settings differ from the leader's refuses, so a mixed cluster fails
  // here, not with diverged parameters after the run. Finally opens the
  // step stream to the leader with this worker's rank and member token in
  // its metadata, so the rank is alive (a second Join of it: ALREADY_EXISTS)
  // from here on, not only from the first push. Every push, InitParams
  // chunk and Recover carries the member token and the cluster fingerprint
  // (ClusterSpec.cluster_fingerprint); a step refused for another
  // fingerprint fails with FAILED_PRECONDITION, and its message lists every
  // setting in which the leader's current spec differs from the one this
  // worker joined with, when it does.
  // Errors: INVALID_ARGUMENT for bad options or an unusable cluster spec
  // (the field named); the Join's status otherwise (FAILED_PRECONDITION for
  // a parameter-count mismatch or a taken rank, DEADLINE_EXCEEDED /
  // UNAVAILABLE when the leader cannot be reached), prefixed with the
  // leader's address; FAILED_PRECONDITION "shard s (host:port):
  // GetClusterSpec: shard s is configured differently from the leader ...:
  // --lr is 0.5 here but 0.1 on the leader; ..." for a mismatched shard,
  // or its GetClusterSpec status (DEADLINE_EXCEEDED when unreachable).
  static absl::StatusOr<std::unique_ptr<WorkerClient>> Connect(
      const ClientOptions& options);

  // Cancels any open streams and closes them (no RPC waits longer than the
  // cancellation takes).
  ~WorkerClient();

  WorkerClient(const WorkerClient&) = delete;
  WorkerClient& operator=(const WorkerClient&) = delete;

  // This worker's rank, 0..P-1.
  uint32_t rank() const { return rank_; }
  // The member token Join granted for rank() (sent with every push,
  // InitParams chunk and Recover; see the proto's JoinResponse).
  uint64_t member_token() const { return member_token_; }
  // The cluster spec from Join (fixed for the cluster's life, except
  // next_step, which is the value at Join time).
  const v1::ClusterSpec& cluster() const { return cluster_; }
  // The next step Step() will run.
  int64_t next_step() const { return next_step_; }
  // The error-feedback residual (length n): what this worker accumulated
  // but has not had applied. For diagnostics and tests; valid until the
  // next non-const call.
  absl::Span<const float> residual() const { return feedback_.residual(); }

  // A copy of this worker's residual, local velocity and next step (from
  // the GPU when the device Step holds them). The global velocity
  // (MomentumMode::kGlobal) is not included: the servers keep it and
  // SynchronizeParameters downloads it.
  // Errors: INTERNAL with file:line when a device copy fails.
  absl::StatusOr<WorkerState> ExportState();
  // Replaces the residual and local velocity with `state`'s (for a run
  // resumed from a checkpoint, after SynchronizeParameters).
  // state.next_step must equal next_step(): the state belongs to the step
  // the servers are at, or continuing would not be the run that was saved.
  // Errors: INVALID_ARGUMENT for a length other than n or a non-finite value
  // (the position named); FAILED_PRECONDITION for another step ("the
  // servers are at step X, the state is from step Y"). Nothing changes on
  // error. With the device Step in use, the device copy is dropped and the
  // next device Step uploads the imported state.
  absl::Status ImportState(const WorkerState& state);

  // The selector seed a worker of `rank` uses for the cluster's
  // selector_seed, so that workers' randomized selectors differ while every
  // run with the same seed repeats (SplitMix64 of seed and rank).
  static uint64_t SelectorSeedForRank(uint64_t cluster_seed, uint32_t rank);

  // Makes `params` (length n) equal to the servers' parameters and returns
  // the step to continue from (also stored as next_step()).
  // Rank 0 first offers `params` to every shard as the initial values
  // (InitParams, in chunks below 4 MB and max_message_bytes; a shard that
  // already has parameters keeps them). Then every rank downloads every
  // shard's range into `params`, so all replicas equal the servers even
  // after a restart. Blocks: each RPC up to rpc_timeout (a download waits on
  // the server until rank 0 has initialised the shard).
  // Errors: INVALID_ARGUMENT for a wrong length or a non-finite value (rank
  // 0); a shard's RPC status prefixed with the shard; INTERNAL for a
  // malformed download (gap, overlap, wrong shard); FAILED_PRECONDITION when
  // the shards disagree on the next step. On error `params` may be partly
  // overwritten: call again.
  absl::StatusOr<int64_t> SynchronizeParameters(absl::Span<float> params);

  // One synchronous step (docs/design.md) at next_step():
  //   gradient  length n, finite; the local gradient (not scaled by lr).
  //   params    length n; this replica's parameters, updated in place with
  //             exactly the update every other replica and the servers apply.
  // Sequence: AccumulateLocal -> Select(residual, k, step) -> codec round
  // trip -> MarkSent -> one push per shard (all S sent before any pull is
  // awaited) -> pulls -> union G -> (gtopk) PutBack -> MaskMomentum ->
  // ApplyAggregated. Dense mode pushes the whole accumulated vector and
  // applies the dense sum.
  // Blocks until every shard answered, at most the cluster's step timeout
  // plus options.step_watchdog_margin after the pushes start; a stalled
  // shard is cancelled and named. Once one shard fails the step, the other
  // shards' streams are cancelled 250 ms later (the step cannot be
  // committed anywhere) and the error names the shard(s) that failed.
  // On error nothing is applied to `params`, the step counter is unchanged,
  // and the residual still holds everything accumulated (including this
  // gradient's contribution), so the caller may call Step again with its
  // next gradient added on top. The streams are reopened by the next call.
  // Errors: INVALID_ARGUMENT for a wrong length or non-finite gradient
  // (nothing changed); otherwise a shard's status (code kept, message
  // "shard <id> (<address>): ..."; when several shards failed, all are
  // listed); INTERNAL for a malformed pull.
  absl::StatusOr<StepStats> Step(absl::Span<const float> gradient,
                                 absl::Span<float> params);

  // The same step with the gradient and parameters in CUDA device memory
  // (worker/device_step.h): the fused residual update, the selection and
  // the residual/momentum bookkeeping run on the GPU (common/cuda/), and
  // only the selected pairs go to the host (and the pulled global top-k
  // back), so the dense gradient never crosses. Same arithmetic, so a
  // device replica stays bit-identical to host replicas.
  //   gradient  device pointer, n floats, finite; not modified.
  //   params    device pointer, n floats, updated in place.
  //   n         must equal the cluster's n.
  //   stream    a cudaStream_t: the stream the caller's producer of
  //             `gradient` used; all work is ordered on it, and the call
  //             returns after it synchronized (params updated).
  // The residual and momentum state moves to the device at the first call
  // (residual() then no longer reflects it); use one kind of Step per
  // client. Dense mode sends the whole accumulated vector by definition:
  // there the gradient is copied to the host and the host Step runs.
  // Under --selection=layerwise each bucket piece (bucket_pieces()) gets
  // the GPU selector's top PieceK of its range, as the host Step selects
  // per piece: with `exact` the parameters are bit-identical to the host
  // layer-wise Step's. A piece whose k is 0 is copied to the host to be
  // checked finite (it holds fewer than n / (2k) values).
  // Selectors: exact, gaussiank, dgc (randomk: FAILED_PRECONDITION).
  // Declared in every build; a build without CUDA (GTOPK_HAVE_CUDA off)
  // answers FAILED_PRECONDITION "... built without CUDA ..." after the
  // argument check.
  // Errors and the failure contract as the host Step's; a non-finite
  // gradient is INVALID_ARGUMENT with the position, and leaves the device
  // state unchanged; CUDA errors are INTERNAL/RESOURCE_EXHAUSTED with the
  // file:line of the failing call.
  absl::StatusOr<StepStats> Step(const float* gradient, float* params,
                                 uint64_t n, CUstream_st* stream);

  // Workers apply (ClusterSpec.apply = APPLY_WORKERS; gradient aggregation,
  // as Horovod and BytePS; the gTop-k step of Shi et al., ICDCS 2019,
  // arXiv:1901.04359, with the optimizer left to the caller): one
  // synchronous step at next_step() that returns the averaged sparse
  // gradient instead of applying an update.
  //   gradient  length n, finite; this worker's local gradient (read only,
  //             before anything else is written).
  //   averaged  length n, may alias `gradient`: on success the global
  //             top-k's average A/P (the sum over the P workers of the
  //             globally selected entries, divided by P with one float
  //             division each, identical on every worker) at the selected
  //             indices and 0 everywhere else; dense mode: sum/P
  //             everywhere. Untouched on error.
  //   params    length n: this replica's parameters, read only to send
  //             their checksum (common/checksum.h) on the steps where
  //             step % cluster().checksum_every() == 0 (the divergence
  //             alarm); may be empty when checksum_every is 0.
  //   buffers   rank 0 only (others: empty): opaque bytes (e.g. BatchNorm
  //             running statistics) sent to shard 0, which returns them in
  //             every worker's pull of this step.
  //   buffers_out  when not null, set to what shard 0 returned this step
  //             (rank 0's buffers; empty when rank 0 sent none).
  // Sequence: u = residual + gradient (error feedback on the gradient: the
  // cluster's identity rule, no lr, no momentum) -> Select(u, k, step) ->
  // codec round trip -> MarkSent -> pushes -> pulls -> PutBack of the sent
  // entries not selected globally -> `averaged`.
  // Blocks as Step. Failure contract as Step's: on error nothing is written
  // to `averaged`, the step counter is unchanged and the residual holds u
  // (this gradient included), so the retry of the same step passes a zero
  // gradient (u + 0 == u: the retry sends exactly what the first attempt
  // did).
  // Errors: FAILED_PRECONDITION when the cluster is not APPLY_WORKERS
  // ("use Step"), or the step's divergence check failed on the shards
  // (their message names the ranks); INVALID_ARGUMENT for a wrong length, a
  // non-finite gradient, or buffers from a rank other than 0; otherwise
  // Step's errors.
  //   state_checksum  when non-zero, combined (CombineChecksums) into the
  //             checksum sent: the caller's checksum of state outside
  //             `params` that must also be equal everywhere (e.g. frozen
  //             parameters).
  absl::StatusOr<StepStats> AggregateStep(absl::Span<const float> gradient,
                                          absl::Span<float> averaged,
                                          absl::Span<const float> params,
                                          absl::string_view buffers = {},
                                          std::string* buffers_out = nullptr,
                                          uint64_t state_checksum = 0);

  // Overlapped steps (--selection=layerwise; docs/overlap.md):
  // AggregateStep (--apply=workers), or the host or device Step
  // (--apply=servers; the overloads after this one), cut in three, so that
  // a bucket's error feedback, selection and push run while the caller's
  // backward pass computes the rest of the gradient. The layer-wise gTop-k of
  // S. Shi et al. (LAGS-SGD, ECAI 2020) with the pushes overlapped with
  // backward as PyTorch DDP overlaps its buckets' all-reduce.
  //
  // BeginOverlappedStep(gradient, averaged, params, buffers,
  // state_checksum): opens step next_step(); the arguments as
  // AggregateStep's, except that `gradient` need not be final yet: the
  // caller fills it range by range, calling GradientReady after each, and
  // must keep `gradient`, `averaged` and `params` alive and unwritten
  // (but for the ranges not yet reported) until FinishOverlappedStep or
  // AbandonOverlappedStep returns. Starts one selection thread (it takes
  // every bucket piece whose values are all reported: u = residual + g,
  // the piece's top PieceK, MarkSent) and one thread per shard: each
  // piece's part of its shard's push goes out as soon as the piece is
  // selected (Push.piece_begin/piece_end; docs/overlap.md, "Rounds per
  // bucket"); pieces that were ready together (e.g. one GradientReady
  // covering several) go as one part per run of a shard's consecutive
  // pieces, sent when the run's last piece is selected. When a shard
  // does not take pushes in parts (servers_take_push_parts() is false: a
  // gtopk-server from before the rounds per bucket), every shard's push
  // goes out whole instead, as soon as every piece of its range was
  // selected: selection still overlaps the backward pass, and the result
  // is bit-identical to the plain step's (a line on stderr says so, once
  // per client).
  // Errors (nothing started): AggregateStep's checks; FAILED_PRECONDITION
  // when the cluster's selection is not layerwise, when it applies on the
  // servers (--apply=servers: the overloads below), or when a step
  // is open already.
  absl::Status BeginOverlappedStep(absl::Span<const float> gradient,
                                   absl::Span<float> averaged,
                                   absl::Span<const float> params,
                                   absl::string_view buffers = {},
                                   uint64_t state_checksum = 0);
  // The host Step (above) cut in three, for --selection=layerwise with
  // --apply=servers (docs/overlap.md, "The C++ trainer"):
  //   gradient  length n; need not be final yet: the caller fills it range
  //             by range, calling GradientReady after each, and must not
  //             write a range once reported.
  //   params    length n: this replica's parameters; read (the rule's
  //             weight decay, the divergence alarm's checksum) and, by
  //             FinishOverlappedStep, updated in place with the pulled
  //             global top-k exactly as Step applies it; the caller must not
  //             write them before Finish or Abandon returns.
  // Both must stay alive until FinishOverlappedStep or
  // AbandonOverlappedStep returns. The selection thread runs the cluster's
  // rule (lr, weight decay, the DGC local velocity) on each complete piece,
  // then its top PieceK, as Step does per piece: bit-identical to
  // Step(gradient, params) on the same final gradient. Finish's failure
  // contract is Step's (the round failed: nothing applied to `params`, the
  // residual holds u, retry with the next gradient added on top); a
  // selection failure (a non-finite gradient: INVALID_ARGUMENT) or a
  // reported range written afterwards (FAILED_PRECONDITION) gives the step
  // up as AbandonOverlappedStep, which restores the residual and the local
  // velocity of every piece accumulated (Recover before the retry when a
  // push had gone out). Not thread-safe, as Step: one thread calls Begin,
  // GradientReady, Finish and Abandon (GradientReady may be called from
  // autograd hooks of that thread's backward pass).
  // Errors (nothing started): INVALID_ARGUMENT for a wrong length;
  // FAILED_PRECONDITION when a step is open, when the cluster's selection
  // is not layerwise, or when it applies on the workers (--apply=workers:
  // the overload above).
  absl::Status BeginOverlappedStep(absl::Span<const float> gradient,
                                   absl::Span<float> params);
  // The same on the GPU, for --selection=layerwise with --apply=servers
  // (the device Step, above, cut in three; docs/overlap.md, "On the
  // GPU"): `gradient` (device, n floats, written by the caller's backward
  // pass on `stream` range by range) and `params` (device, n floats,
  // updated in place by FinishOverlappedStep) must stay alive, and each
  // reported range of `gradient` unwritten, until FinishOverlappedStep or
  // AbandonOverlappedStep returns. GradientReady(begin, end) then records
  // an event on `stream` when it completes a piece: the piece's gradient is
  // final once the work queued there so far has run. The selection thread
  // runs each complete piece's residual update and its top PieceK on a
  // side stream of the worker's that waits for that event (the caller's
  // stream is never blocked); nothing is committed until Finish, which
  // marks what was sent, waits for the round and applies the update to
  // `params` as the device Step (ordered on `stream`; blocks): bit-identical
  // to Step(gradient, params, n, stream) on the same gradient. Finish's
  // failure contract is the device Step's; a non-finite gradient is
  // INVALID_ARGUMENT and leaves the device state as before the step (the
  // step is given up as by AbandonOverlappedStep, so Recover before the
  // retry). A write to a reported range is not detected on the device.
  // StepStats.accumulate is 0: `select` holds the device update and
  // selection.
  // Errors (nothing started): INVALID_ARGUMENT for n other than the
  // cluster's or a null pointer; FAILED_PRECONDITION when a step is open,
  // when the cluster is not layerwise with --apply=servers, or in a build
  // without CUDA (the device Step's first-use errors, e.g. a selector
  // without a GPU version); CUDA errors.
  absl::Status BeginOverlappedStep(const float* gradient, float* params,
                                   uint64_t n, CUstream_st* stream);
  // gradient[begin, end) is final. Does not block (the work is queued).
  // Errors: FAILED_PRECONDITION without an open step; INVALID_ARGUMENT for
  // an empty range, one outside [0, n), or one overlapping a range already
  // reported (nothing recorded then).
  absl::Status GradientReady(uint64_t begin, uint64_t end);
  // Ends the open step: the values never reported are taken as they are
  // now (parameters that got no gradient), then waits for the selection and
  // the round like AggregateStep, writes `averaged` and returns the step's
  // stats (`select` and `accumulate` are the selection thread's time, much
  // of it hidden behind the caller's backward pass). Failure contract as
  // AggregateStep's: nothing written to `averaged`, the step counter
  // unchanged; the residual holds u when the round failed (retry with a
  // zero gradient), and is as before the step when the selection failed
  // (e.g. a non-finite gradient: INVALID_ARGUMENT; when some push had gone
  // out, the step is failed on every shard as by AbandonOverlappedStep, so
  // Recover before the retry), or when a reported range of `gradient` was
  // written after GradientReady (FAILED_PRECONDITION naming the index: what
  // was sent is not the gradient the caller ended with, e.g. gradient
  // clipping between backward and the step; the step is given up as by
  // AbandonOverlappedStep). Errors:
  // FAILED_PRECONDITION without an open step; AggregateStep's.
  absl::StatusOr<StepStats> FinishOverlappedStep(
      std::string* buffers_out = nullptr);
  // Gives up the open step (an exception or Ctrl-C in the backward pass):
  // pushes not yet written are never written, the round is cancelled (the
  // other workers' step fails and is retried after Recover), and the
  // residual is restored to what it was before BeginOverlappedStep, so the
  // caller repeats the step with a fresh backward pass. No-op without an
  // open step. Blocks until the step's threads ended (about 250 ms).
  void AbandonOverlappedStep();
  bool overlapped_step_open() const { return overlapped_ != nullptr; }
  // The cluster's layer-wise pieces (common/buckets.h) in index order;
  // empty unless its selection is layerwise.
  const std::vector<BucketPiece>& bucket_pieces() const { return pieces_; }
  // Whether every shard's server said, at Connect and again at each
  // Recover, that it takes pushes in parts (ShardSpec.takes_push_parts,
  // each shard's own answer: Join or GetClusterSpec from the leader,
  // GetClusterSpec from the others; an answer that failed counts as no).
  // False: overlapped steps push each shard's entries whole. A shard
  // replaced by an older server between Recovers is caught by the check
  // of its answer (FAILED_PRECONDITION "predates the rounds per bucket").
  bool servers_take_push_parts() const { return shards_without_parts_.empty(); }

  // Whether the next step sends a parameter checksum: a step of the
  // divergence alarm (next_step() % checksum_every == 0), or the first step
  // after ResumeAt or after Recover renumbered the steps (workers apply),
  // where the shards compare every worker's checksum so that a rank resumed
  // from another step's checkpoint, or one that kept later state, cannot
  // continue. Always false when the cluster's checksum_every is 0.
  bool checksum_due() const;

  // Workers apply: SynchronizeParameters plus rank 0's opaque `state` (the
  // model's buffers and frozen parameters): rank 0 offers `*state` to shard
  // 0 with the initial parameters (ParamsChunk.state, at most 1 GiB); every
  // rank then downloads the parameters and sets `*state` to the blob shard
  // 0 holds. Errors: SynchronizeParameters'; INVALID_ARGUMENT for a state
  // over 1 GiB. Blocks as SynchronizeParameters.
  absl::StatusOr<int64_t> SynchronizeParameters(absl::Span<float> params,
                                                std::string* state);

  // Workers apply, a run restarted from the workers' own checkpoints of step
  // `step` (all ranks): asks the leader to set every shard's next step to
  // `step` (Recover with resume; the shards hold no parameters to roll
  // back) and makes it next_step(). Idempotent across ranks: the first rank
  // moves the shards, the others find them there. Errors:
  // FAILED_PRECONDITION under APPLY_SERVERS ("the servers' checkpoints
  // decide the step"); INVALID_ARGUMENT for a negative step; the leader's
  // status as Recover's. Blocks up to rpc_timeout + the step timeout.
  absl::StatusOr<int64_t> ResumeAt(int64_t step);

  // After a failed Step: asks the leader to bring the shards to one step
  // (Recover RPC; docs/recovery.md), and returns the step to continue from
  // (also next_step()). When the shards are exactly one step ahead (the
  // step committed but this worker lost a pull, e.g. a shard stalled past
  // the step watchdog while it answered), this worker's own step is
  // returned and `params` are untouched: every shard keeps its last
  // committed step's result and answers the retry of that step (a zero
  // gradient; the residual holds the failed attempt's u) with it, so the
  // run stays bit-identical (also when that retry fails otherwise, e.g.
  // stalled again). When a shard refused that retry because it no longer
  // keeps the result (it restarted), or when the shards were rolled back
  // or are further ahead, `params` (length n) are re-downloaded
  // (SynchronizeParameters)
  // so that they equal the servers' again; the residual and momentum are
  // then kept as they are: such a run is not bit-identical to one without
  // the failure. Otherwise `params` are untouched (a failed step applied
  // nothing).
  // A leader that cannot be reached (down, restarting) is waited for, up to
  // the deadline: rpc_timeout plus the cluster's step timeout, or
  // `deadline` in the second form; reconnection is retried every 100 ms to
  // 1 s. Blocks until then (plus a parameter download when one is needed).
  // Errors: INVALID_ARGUMENT for a wrong length; the leader's status,
  // prefixed with it: FAILED_PRECONDITION when the shards cannot be brought
  // to a common step (the message names every shard, its step and its
  // retained checkpoints) -- do not retry; UNAVAILABLE / DEADLINE_EXCEEDED /
  // ABORTED -- retry later; SynchronizeParameters' errors.
  absl::StatusOr<int64_t> Recover(absl::Span<float> params);
  absl::StatusOr<int64_t> Recover(absl::Span<float> params,
                                  absl::Time deadline);
  // Workers apply: the shards hold no current parameters, so Recover
  // downloads nothing (`params` may be empty). When the shards were rolled
  // back to an earlier step, the step is renumbered (the workers keep their
  // parameters, residuals and optimizer state: every worker applied the
  // same committed steps). When the shards are one step ahead of this
  // worker (it lost the pull of a step that committed), the worker's own
  // step is returned: every shard keeps its last committed step's result
  // and answers the retry of that step (AggregateStep with a zero gradient,
  // the failed attempt's u being in the residual) with it, so the run stays
  // bit-identical. More than one step ahead, FAILED_PRECONDITION: this
  // replica missed updates and cannot be repaired from the servers;
  // restart every rank from the checkpoints of one step (the retry gets the
  // same when a shard dropped the kept result: a restart, a rollback).

 private:
  struct ShardConn;       // worker/client_internal.h
  struct PushPullState;   // one PushPullRound's shared state
                          // (push_pull_round.cc)
  struct OverlappedStep;  // an open overlapped step (overlapped_step.cc)

  WorkerClient(const ClientOptions& options, uint32_t rank,
               uint64_t member_token, v1::ClusterSpec cluster,
               OptimizerRule rule, std::unique_ptr<Selector> selector,
               CodecSpec codec, std::vector<std::unique_ptr<ShardConn>> shards);

  // The phases of a step, shared by both Step overloads. Each takes the
  // step's stats (from BeginStep; stats.step is the step) and fills its part.
  //
  // The start of both Step overloads: stats for step next_step_ (k, zeroed
  // per-shard byte counts). Errors: KAt's.
  absl::StatusOr<StepStats> BeginStep(uint64_t n) const;
  // The host Step after AccumulateLocal (the residual holds u), in mode
  // dense and in the sparse modes: pushes, round, check, apply. On error
  // the residual holds u again and nothing else changed.
  absl::Status DenseStepOnHost(absl::Span<float> params, StepStats* stats,
                               absl::Span<float> averaged = {});
  // `averaged` non-empty: workers apply (AggregateStep) -- the update goes
  // there as A/P instead of into `params`.
  absl::Status SparseStepOnHost(absl::Span<float> params, StepStats* stats,
                                absl::Span<float> averaged = {});
  // Workers apply: writes A/P (global, sparse) or sum/P (dense pulls) into
  // `averaged`, zero elsewhere, after checking every value is finite
  // (INTERNAL naming the index otherwise; nothing written then).
  absl::Status CheckAveraged(int64_t step, const SparseVector& global,
                             const std::vector<v1::Pull>& pulls) const;
  void StoreAveraged(const SparseVector& global,
                     const std::vector<v1::Pull>& pulls,
                     absl::Span<float> averaged) const;
  // The local selection of a sparse step: the selector on the whole of `u`,
  // or under layerwise selection on each piece with its PieceK (pieces
  // whose k is 0 contribute nothing), indices global. Errors: Select's.
  absl::Status SelectLocal(absl::Span<const float> u, uint64_t k, int64_t step,
                           SparseVector* sent);
  // Layer-wise: the selector's top PieceK(k) of u[p.begin, p.end),
  // appended to *sent with global indices (nothing when that k is 0).
  absl::Status SelectPieceOf(absl::Span<const float> u, const BucketPiece& p,
                             uint64_t k, int64_t step, SparseVector* sent);
  // An overlapped step's selection thread (overlapped_step.cc): the
  // selection thread's work on the pieces ready together (`batch`,
  // ascending): each selected, each run of a shard's consecutive pieces
  // posted as one part (PostRun) as soon as its last piece is selected.
  absl::Status SelectBatch(OverlappedStep& o, const std::vector<size_t>& batch);
  // Posts pieces [first, end) of pieces_ (selected, consecutive, one
  // shard's) as one part, or counts them towards the whole push when the
  // servers do not take parts. Selection thread only.
  absl::Status PostRun(OverlappedStep& o, size_t first, size_t end);
  // Servers without parts: `selected` more of shard s's pieces are
  // selected; the last ones post the shard's whole push. Selection thread
  // only.
  absl::Status PostWholeIfSelected(OverlappedStep& o, size_t s,
                                   size_t selected);
  // One piece's selection: on the host (u into the residual, the
  // selection, the codec round trip), or on the device (DeviceStep::
  // AccumulateAndSelect, nothing committed).
  absl::Status SelectPieceOnHost(OverlappedStep& o, size_t piece);
  absl::Status SelectPieceOnDevice(OverlappedStep& o, size_t piece);
  // Both BeginOverlappedSteps' end: the pushes, the empty shards' pushes
  // released, the streams, the selection and round threads; `o` holds the
  // step's stats and buffers. Errors: EncodeSparse's (nothing started).
  absl::Status StartOverlappedStep(std::unique_ptr<OverlappedStep> o);
  // The host Step's and BeginOverlappedStep's length check: both of
  // length n, else INVALID_ARGUMENT prefixed with `what`.
  absl::Status CheckLengths(absl::string_view what,
                            absl::Span<const float> gradient,
                            absl::Span<const float> params) const;
  // Every BeginOverlappedStep's checks: no step open, layer-wise
  // selection, the cluster's apply mode is `apply`; FAILED_PRECONDITION
  // prefixed with `what` otherwise.
  absl::Status CheckCanOverlap(absl::string_view what, ApplyMode apply) const;
  // Both host BeginOverlappedSteps' end (after their checks, BeginStep and
  // the checksum): the backups sized, then StartOverlappedStep; exactly one
  // of `params` (--apply=servers) and `averaged` is non-empty.
  absl::Status StartHostOverlappedStep(StepStats stats,
                                       absl::Span<const float> gradient,
                                       absl::Span<float> params,
                                       absl::Span<float> averaged);
  // Copies the backups of every piece `o` accumulated into `residual` and,
  // for a step with params (--apply=servers), `velocity` (length n each):
  // the state as before the step (AbandonOverlappedStep, ExportState).
  void RestoreFromBackups(const OverlappedStep& o, absl::Span<float> residual,
                          absl::Span<float> velocity) const;
  void SelectionLoop(OverlappedStep& o);
  // FinishOverlappedStep's parts: the values never reported go in and the
  // selection thread ends; the gradient must still be what it read
  // (FAILED_PRECONDITION naming the first index written since); the
  // round's outcome into the residual and `averaged` (AggregateStep's
  // failure contract).
  // AggregateStep's and BeginOverlappedStep's argument checks, their
  // messages prefixed with `what`: lengths, the checksum's parameters,
  // buffers from rank 0 only and within the message limit.
  // INVALID_ARGUMENT naming what is wrong.
  absl::Status CheckAggregateArgs(absl::string_view what,
                                  absl::Span<const float> gradient,
                                  absl::Span<float> averaged,
                                  absl::Span<const float> params,
                                  absl::string_view buffers) const;
  void CloseOverlappedSelection(OverlappedStep& o);
  // A device step's end (DeviceStep::Commit, then Apply to `params`, or
  // PutBackAll when the round failed): the device Step's failure contract.
  absl::Status EndOverlappedDeviceRound(const absl::Status& round,
                                        SparseVector sent,
                                        const std::vector<v1::Pull>& pulls,
                                        float* params, CUstream_st* stream,
                                        StepStats* stats);
  absl::Status CheckGradientUnchanged(const OverlappedStep& o) const;
  // A host step's end (MarkSent, then ApplyGlobalOnHost, or RestoreSent
  // when the round failed): the failure contract of Step (params
  // non-empty) or AggregateStep (averaged non-empty).
  absl::Status EndOverlappedRound(const absl::Status& round,
                                  const SparseVector& sent,
                                  const SparseVector& received,
                                  const std::vector<v1::Pull>& pulls,
                                  absl::Span<float> params,
                                  absl::Span<float> averaged, StepStats* stats);
  // A failed sparse host step after MarkSent: every entry sent put back in
  // the residual (it holds u again); returns `status`, or INTERNAL with
  // both messages when that failed.
  absl::Status RestoreSent(const SparseVector& received,
                           const absl::Status& status);
  // The end of a sparse host step (SparseStepOnHost, EndOverlappedRound)
  // once the global top-k is pulled: checked, then the residual's sent
  // entries that were not selected globally put back and the update
  // applied to `params` with the DGC momentum masked (`averaged` empty:
  // --apply=servers), or A/P stored in `averaged`. A failed check restores
  // what was sent (RestoreSent) and changes nothing else.
  absl::Status ApplyGlobalOnHost(int64_t step, const SparseVector& sent,
                                 const SparseVector& received,
                                 const SparseVector& global,
                                 const std::vector<v1::Pull>& pulls,
                                 absl::Span<float> params,
                                 absl::Span<float> averaged, StepStats* stats);
  // The checksum to send at `step` (0: not a check step).
  uint64_t ChecksumFor(int64_t step, absl::Span<const float> params) const;
  // The start of a sparse device step (Step, BeginOverlappedStep with
  // device pointers): the device state made on first use, BeginStep's
  // stats, and step_checksum_ from a host copy of `params` on the
  // divergence alarm's steps. Errors: DeviceStep::Create's, BeginStep's,
  // the copy's CUDA errors.
  absl::StatusOr<StepStats> BeginDeviceStep(const float* gradient,
                                            float* params, CUstream_st* stream);
  // The device Step's sparse modes, from Accumulate to Apply (device_ set).
  // Same failure contract, on the device state.
  absl::Status SparseStepOnDevice(const float* gradient, float* params,
                                  CUstream_st* stream, StepStats* stats);
  // The step's S pushes with everything but the payload: step, rank,
  // epoch, shard id, member token and cluster fingerprint.
  std::vector<v1::Push> NewPushes(int64_t step) const;
  // Pushes carrying `sent` (indices ascending) cut at the shard boundaries
  // and encoded with the cluster's codec; sets stats->encode, bytes_sent.
  // Errors: EncodeSparse's, prefixed with the shard.
  absl::StatusOr<std::vector<v1::Push>> EncodePushes(int64_t step,
                                                     const SparseVector& sent,
                                                     StepStats* stats) const;
  // Dense mode: pushes carrying the residual (u) cut at the shard
  // boundaries; sets stats->sent_pairs (n), encode, bytes_sent.
  std::vector<v1::Push> DensePushes(int64_t step, StepStats* stats) const;
  // PushPullRound, then DecodePulls: the pulls in `pulls` (size S) and,
  // outside dense mode, the global top-k G they carry. Sets
  // stats->push_wait, push, wait and DecodePulls' fields. Errors:
  // PushPullRound's and DecodePulls'.
  absl::StatusOr<SparseVector> PushAndDecodePulls(
      int64_t step, const std::vector<v1::Push>& pushes,
      std::vector<v1::Pull>* pulls, StepStats* stats);
  // A sparse step's round trip, shared by the host and device steps:
  // EncodePushes(sent), then PushAndDecodePulls. Errors: theirs.
  absl::StatusOr<SparseVector> SparseRoundTrip(int64_t step,
                                               const SparseVector& sent,
                                               std::vector<v1::Pull>* pulls,
                                               StepStats* stats);
  // Validates every pull of the step before any state changes (step and
  // shard id; dense: length and finite values; sparse: decodable, indices
  // inside the shard's range) and returns the union of the sparse pulls,
  // the pulled global top-k G (indices ascending: shards are in index
  // order; empty in dense mode). Sets stats->bytes_received,
  // received_pairs, server_merge, server_select.
  // Errors: INTERNAL prefixed with the shard; the streams are closed then.
  absl::StatusOr<SparseVector> DecodePulls(int64_t step,
                                           const std::vector<v1::Pull>& pulls,
                                           StepStats* stats);
  // Whether the servers' update (`pulls` in dense mode, `global` otherwise)
  // applies to `params` and the global velocity with finite results; it
  // does unless this replica diverged from the servers.
  // Errors: INTERNAL "step s: the servers' update cannot be applied to this
  // replica ...".
  absl::Status CheckServersUpdate(int64_t step,
                                  const std::vector<v1::Pull>& pulls,
                                  const SparseVector& global,
                                  absl::Span<const float> params) const;

  // The push/pull round of a step (PushPullRound) and its parts.
  //
  // Writes pushes[s] on shard s's PushPull stream and reads its pull, on
  // every shard concurrently under the step watchdog; fills (*pulls)[s] and
  // *push_time (from its start until the last push was written), or returns
  // the combined error (and closes all streams). Learns the leader's epoch
  // from failed streams.
  // `gate` (overlapped steps): shard s's push goes in the parts the gate
  // releases (PushPartsOnShard; pushes[s] is then the parts' template),
  // its thread ends CANCELLED when the gate is abandoned, and the watchdog
  // starts once every part may go.
  absl::Status PushPullRound(int64_t step, const std::vector<v1::Push>& pushes,
                             std::vector<v1::Pull>* pulls,
                             absl::Duration* push_time,
                             PushGate* gate = nullptr);
  // One shard's part of the round, on its own thread: write (once more on
  // a fresh stream when the open one died), read. The stream's status on
  // failure (its trailers' epoch recorded in `round`).
  absl::Status PushPullOnShard(size_t s, int64_t step, const v1::Push& push,
                               v1::Pull* pull, PushPullState& round);
  // An overlapped step's shard thread (worker/push_parts.cc): writes each
  // part `gate` releases for shard s as it comes (the first once more on a
  // fresh stream when the open one died), then reads the piece pulls and
  // the committed pull, merged into *pull as one whole pull. Abandoned:
  // tells the shard (Push.abandon, from `whole`) when any part of the step
  // went anywhere, and returns CANCELLED.
  absl::Status PushPartsOnShard(size_t s, int64_t step, const v1::Push& whole,
                                PushGate& gate, v1::Pull* pull,
                                PushPullState& round);
  // Writes `push` on shard s's stream (`reopen`: once more on a fresh
  // stream when the open one died); false when it did not go.
  bool WriteOnShard(size_t s, const v1::Push& push, bool reopen,
                    PushPullState& round);
  // Shard s's stream failed (`drain`: reads what is left first): finished,
  // marked broken, its trailers' epoch recorded; the status to report.
  absl::Status ShardStreamFailed(size_t s, int64_t step, bool drain,
                                 PushPullState& round);
  // The piece pulls of shard s (Pull.piece_end) and its committed pull,
  // merged into *final (its sparse: every piece's entries in index order,
  // re-encoded with the pulls' codec). INTERNAL for pieces missing, sent
  // twice, or entries outside their pieces.
  absl::Status MergePiecePulls(size_t s, std::vector<v1::Pull>& pieces,
                               v1::Pull* final) const;
  // Waits for every shard's thread; cancels the shards still out at the
  // watchdog deadline, or kFailureGrace (250 ms) after the first failure.
  void AwaitShards(PushPullState& round) const;
  // The round's outcome from its shards' results: OK, or the step's cause
  // (its code; every failed shard named).
  absl::Status RoundStatus(int64_t step, const PushPullState& round) const;

  // SynchronizeParameters' parts, for shard s.
  //
  // Rank 0's offer of params[begin_s, end_s) (InitParams, in chunks below
  // 4 MB and max_message_bytes). Errors: the RPC's status prefixed with
  // "shard s (host:port): InitParams".
  absl::Status OfferInitialParams(size_t s, absl::Span<const float> params,
                                  absl::string_view state);
  // Recover, or (resume_step >= 0) ResumeAt.
  absl::StatusOr<int64_t> RecoverWith(absl::Span<float> params,
                                      absl::Time deadline, int64_t resume_step);
  // ParamsChunk.state's bound (proto): 1 GiB.
  static constexpr size_t kMaxStateBytes = size_t{1} << 30;
  // Downloads the shard's range into `params` (and into the global velocity
  // when the shard sends it), retrying UNAVAILABLE until rpc_timeout.
  // Returns the shard's step, or -1 when its empty range sent no chunk.
  // Errors: INTERNAL for a malformed chunk or a short stream; the RPC's
  // status; CANCELLED; each prefixed "shard s (host:port): DownloadParams".
  // `state` non-null (shard 0, workers apply): set to the chunks' state
  // pieces, concatenated.
  absl::StatusOr<int64_t> DownloadShardParams(size_t s,
                                              absl::Span<float> params,
                                              std::string* state = nullptr);

  // Cancels and finishes every open step stream (keep_leader: all but
  // shard 0's while that one still works; a broken one is dropped).
  void CloseStreams(bool keep_leader = false);
  // Opens a fresh stream context on `c` (registered with
  // options_.cancellation), and drops one.
  void SetStreamContext(ShardConn& c) const;
  static void ClearStreamContext(ShardConn& c);
  // A context for a PushPull call to shard `s`: wait for ready, and this
  // worker's rank and member token in the metadata (gtopk-rank,
  // gtopk-member-token), so the leader counts the rank alive from the
  // call's start.
  std::unique_ptr<grpc::ClientContext> NewStreamContext() const;
  // Opens the PushPull stream to the leader when it is closed, before any
  // push: from Connect and after Recover, so that the rank stays alive on
  // the leader between Join and the first step (a second Join of it gets
  // ALREADY_EXISTS). Best effort: a stream that fails is reopened by Step.
  void OpenLeaderStream();
  // A step's FAILED_PRECONDITION about the cluster fingerprint: asks the
  // leader for its spec and adds every setting in which it differs from the
  // spec this worker joined with; other statuses unchanged.
  absl::Status ExplainFingerprintRefusal(const absl::Status& status);
  // "shard 1 (host:port)".
  std::string ShardName(size_t s) const;

  const ClientOptions options_;
  const uint32_t rank_;
  const uint64_t member_token_;
  const v1::ClusterSpec cluster_;
  const OptimizerRule rule_;
  std::unique_ptr<Selector> selector_;
  const CodecSpec codec_;
  std::vector<std::unique_ptr<ShardConn>> shards_;
  const AggregationMode mode_;  // from the cluster spec
  const ApplyMode apply_;       // from the cluster spec

  // The step being run's extras, set by Step/AggregateStep before their
  // pushes are built (NewPushes) and cleared after: the parameters'
  // checksum (0: none this step) and rank 0's buffers for shard 0.
  uint64_t step_checksum_ = 0;
  // Set by ResumeAt and by a renumbering Recover: the next step sends a
  // checksum whatever its number (checksum_due); cleared by a step that
  // succeeded.
  bool check_next_step_ = false;
  std::string step_buffers_;
  // Shard 0's Pull.buffers of the last round (DecodePulls).
  std::string received_buffers_;

  ErrorFeedback feedback_;
  std::vector<float> velocity_;         // DGC local velocity, length n
  std::vector<float> global_velocity_;  // kGlobal momentum, length n
  // The device Step's state (worker/device_step.h); null until its first
  // call, and after ImportState. In every build (always null without CUDA),
  // so the layout does not depend on GTOPK_HAVE_CUDA.
  std::unique_ptr<DeviceStep> device_;
  // Layer-wise selection's pieces (empty otherwise) and, per piece, its
  // shard (index into shards_).
  std::vector<BucketPiece> pieces_;
  std::vector<size_t> piece_shard_;
  // The open overlapped step, or null, and the residual as it was before
  // it, per piece accumulated (restored by AbandonOverlappedStep).
  std::unique_ptr<OverlappedStep> overlapped_;
  std::vector<float> overlap_backup_;
  // The same for the DGC local velocity (host steps with --apply=servers).
  std::vector<float> overlap_velocity_backup_;
  // The gradient of every piece as the selection thread read it: Finish
  // refuses a step whose gradient was written after it was reported.
  std::vector<float> overlap_gradient_;
  int64_t next_step_ = 0;
  // The step whose push a shard refused because it no longer keeps that
  // step's result (kResultNotKeptMarker); -1: none. Recover then does not
  // answer with the worker's own step for it (the retry cannot get the
  // result): it downloads (APPLY_SERVERS) or refuses (APPLY_WORKERS).
  int64_t result_not_kept_step_ = -1;
  // The leader's attempt epoch as last heard (Join, Recover), sent in every
  // push: a push older than its step's last failure is refused (ABORTED),
  // so a retry made after Recover never mixes with the failed attempt.
  uint64_t epoch_ = 0;
  // The shards that did not say they take pushes in parts, named and
  // comma-separated (Connect, Recover); empty when all did.
  std::string shards_without_parts_;
  // The stderr line on the first overlapped step pushed whole was written.
  bool whole_pushes_logged_ = false;
};

}  // namespace worker
}  // namespace gtopk

#endif  // GTOPK_WORKER_CLIENT_H_
