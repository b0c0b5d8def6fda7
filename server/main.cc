// gtopk-server: one aggregator shard (shard 0 is also the leader). Every flag
// is documented in server/flags.md. Flags are read here only and copied into
// a validated ServerConfig.
//
// Exit codes (cli/exit_codes.h, server/flags.md): kExitOk (0) after a
// graceful shutdown (SIGTERM/SIGINT) or a SERVING health check;
// kExitFailure (1) for a health check that is not SERVING or fails;
// kExitUsage (2) for an invalid command line or a failed startup;
// kExitCheckpointFailed (3) when the final checkpoint cannot be written.
#include <pthread.h>
#include <signal.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "cli/command_line.h"
#include "cli/exit_codes.h"
#include "cli/tls_flag.h"
#include "common/codec.h"
#include "common/host_port.h"
#include "common/metrics/exposer.h"
#include "common/metrics/process_collector.h"
#include "common/optimizer.h"
#include "common/status_macros.h"
#include "common/transport_security/transport_security.h"
#include "server/aggregator_server.h"
#include "server/server_config.h"
#include "server/shard_aggregator.h"

ABSL_FLAG(std::string, listen, "0.0.0.0:50051",
          "host:port to listen on; port 0 picks a free port");
ABSL_FLAG(int64_t, shard_id, 0, "this shard, 0..num-shards-1 (0 = leader)");
ABSL_FLAG(int64_t, num_shards, 1, "S, shards in the cluster");
ABSL_FLAG(int64_t, workers, 1, "P, workers in the cluster");
ABSL_FLAG(std::string, peers, "",
          "comma-separated host:port of all S shards in shard order");
ABSL_FLAG(absl::Duration, step_timeout, absl::Seconds(30),
          "deadline of every step wait, e.g. 30s or 500ms");
ABSL_FLAG(std::string, checkpoint_dir, "",
          "directory for this shard's checkpoint (empty: none)");
ABSL_FLAG(int64_t, checkpoint_every, 0,
          "checkpoint every N steps (0: only on shutdown)");
ABSL_FLAG(int, checkpoint_keep, 2,
          "checkpoints retained per shard for crash recovery rollbacks");
ABSL_FLAG(std::string, mode, "gtopk", "gtopk | topk | dense");
ABSL_FLAG(std::string, selection, "threshold",
          "threshold | quota | layerwise (gtopk mode; \"exact\" is the old "
          "name of threshold)");
constexpr double kDefaultBucketMb = 25.0;
ABSL_FLAG(double, bucket_mb, kDefaultBucketMb,
          "--selection=layerwise: MiB of fp32 gradient per bucket (as "
          "PyTorch DDP's bucket_cap_mb); each bucket keeps its own top-k and "
          "can be pushed while the backward pass goes on");
ABSL_FLAG(std::string, selector, "exact",
          "workers' local selector: exact | gaussiank | dgc | randomk");
ABSL_FLAG(uint64_t, seed, 0, "seed of the workers' randomised selectors");
ABSL_FLAG(std::string, index_codec, "delta-varint",
          "raw | delta-varint | delta-bitpack");
ABSL_FLAG(std::string, value_codec, "fp32", "fp32 | fp16 | bf16");
ABSL_FLAG(std::string, apply, "servers",
          "who applies the global top-k: servers (the servers' optimizer "
          "flags) | workers (gradient aggregation: each worker runs its own "
          "optimizer; --lr, --momentum, --momentum-mode, --momentum-masking, "
          "--weight-decay, --lr-warmup-steps are ignored)");
ABSL_FLAG(int64_t, checksum_every, -1,
          "every N steps the shards compare the workers' parameter "
          "checksums and fail the step when they differ; 0: never; "
          "default (-1): 100 with --apply=workers, 0 with --apply=servers");
ABSL_FLAG(double, lr, 0.1, "base learning rate, > 0");
ABSL_FLAG(double, momentum, 0.9, "momentum coefficient in [0, 1)");
ABSL_FLAG(std::string, momentum_mode, "dgc", "none | dgc | global");
ABSL_FLAG(bool, momentum_masking, true, "DGC momentum factor masking");
ABSL_FLAG(double, weight_decay, 0.0, "L2 weight decay, >= 0");
ABSL_FLAG(int64_t, lr_warmup_steps, 0, "linear lr warm-up steps (0: none)");
ABSL_FLAG(double, density, 0.001, "target density k/n in (0, 1]");
ABSL_FLAG(std::string, density_warmup, "",
          "per-epoch warm-up densities, comma list, or 'dgc'");
ABSL_FLAG(int64_t, steps_per_epoch, 0,
          "steps per epoch (> 0 when --density-warmup is set)");
ABSL_FLAG(uint64_t, max_message_bytes, uint64_t{64} << 20,
          "gRPC send/receive limit in bytes");
// Resource bounds (docs/resource-limits.md); 0 = computed from P and S.
ABSL_FLAG(int64_t, max_concurrent_calls, 0,
          "calls (streams included) in flight on this server; 0: 4P+8S+64");
ABSL_FLAG(int64_t, max_calls_per_peer, 0,
          "calls in flight from one peer (rank, shard or client host); "
          "0: P+4S+16");
ABSL_FLAG(int64_t, max_streams_per_connection, 0,
          "HTTP/2 streams per client connection; 0: the effective "
          "--max-concurrent-calls");
ABSL_FLAG(int64_t, metrics_port, 0,
          "serve Prometheus GET /metrics on <metrics-host>:<port> (0: off)");
ABSL_FLAG(std::string, metrics_host, "0.0.0.0",
          "address the metrics port binds (0.0.0.0: all; 127.0.0.1: "
          "loopback only)");
ABSL_FLAG(absl::Duration, drain_timeout, absl::Seconds(5),
          "on SIGTERM/SIGINT, keep serving (health NOT_SERVING) until the "
          "round in progress completes, at most this long");
ABSL_FLAG(std::string, health_check, "",
          "client mode: check grpc.health.v1 at this host:port and exit "
          "(--tls is required here too: --tls=off for a plaintext port such "
          "as --health-listen's, the --tls flags when the port needs them)");
ABSL_FLAG(std::string, health_listen, "",
          "also serve grpc.health.v1 only, in plaintext, on this host:port "
          "(probes that cannot present a client certificate; empty: off)");
// Transport security (docs/security.md).
ABSL_FLAG(std::string, tls, "",
          "required, no default: off | server | mutual: plaintext on a "
          "trusted network only (a WARNING at start), TLS, or mutual TLS on "
          "every gRPC hop");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate (chain) of this shard; CN gtopk-shard-<id>");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls-cert");
ABSL_FLAG(std::string, tls_ca, "",
          "PEM CA bundle that clients' and peers' certificates chain to");
ABSL_FLAG(std::string, token_file, "",
          "file holding the workers' shared token (the secret itself is "
          "never a flag); needs --shard-token-file");
ABSL_FLAG(std::string, shard_token_file, "",
          "file holding the shards' token, for the shard-to-shard RPCs");

namespace {

using gtopk::cli::kExitCheckpointFailed;
using gtopk::cli::kExitFailure;
using gtopk::cli::kExitOk;
using gtopk::cli::kExitUsage;
using gtopk::server::ServerConfig;

absl::Status InRange(const char* flag, int64_t value, int64_t lo, int64_t hi) {
  if (value < lo || value > hi) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--", flag, " must be in [", lo, ", ", hi, "], got ", value));
  }
  return absl::OkStatus();
}

// The --tls, certificate and token flags, loaded and checked.
// role kWorker: the --health-check client mode, which only dials (a
// certificate only under --tls=mutual; tokens are not sent: the health
// service is never checked).
absl::StatusOr<std::shared_ptr<const gtopk::TransportSecurity>>
SecurityFromFlags(gtopk::SecurityRole role = gtopk::SecurityRole::kServer) {
  gtopk::TransportSecurityOptions o;
  absl::StatusOr<gtopk::TlsMode> mode =
      gtopk::cli::ParseTlsFlag(absl::GetFlag(FLAGS_tls));
  if (!mode.ok()) return mode.status();
  o.tls = *mode;
  o.cert_file = absl::GetFlag(FLAGS_tls_cert);
  o.key_file = absl::GetFlag(FLAGS_tls_key);
  o.ca_file = absl::GetFlag(FLAGS_tls_ca);
  o.token_file = absl::GetFlag(FLAGS_token_file);
  o.shard_token_file = absl::GetFlag(FLAGS_shard_token_file);
  if (role == gtopk::SecurityRole::kWorker) {
    o.token_file.clear();
    o.shard_token_file.clear();
  }
  return gtopk::TransportSecurity::Load(o, role);
}

// Prefixes a parse error with the flag's name.
absl::Status FlagError(const char* flag, const absl::Status& status) {
  return absl::InvalidArgumentError(
      absl::StrCat("--", flag, ": ", status.message()));
}

absl::StatusOr<ServerConfig> ConfigFromFlags() {
  ServerConfig c;
  const int64_t shard_id = absl::GetFlag(FLAGS_shard_id);
  const int64_t num_shards = absl::GetFlag(FLAGS_num_shards);
  const int64_t workers = absl::GetFlag(FLAGS_workers);
  GTOPK_RETURN_IF_ERROR(InRange("num-shards", num_shards, 1, 1 << 16));
  GTOPK_RETURN_IF_ERROR(InRange("shard-id", shard_id, 0, num_shards - 1));
  GTOPK_RETURN_IF_ERROR(InRange("workers", workers, 1, 1 << 16));
  c.shard_id = static_cast<uint32_t>(shard_id);
  c.num_shards = static_cast<uint32_t>(num_shards);
  c.num_workers = static_cast<uint32_t>(workers);

  const std::string peers = absl::GetFlag(FLAGS_peers);
  if (peers.empty() && num_shards == 1) {
    c.peers = {""};  // a single shard: its own address
  } else {
    c.peers = absl::StrSplit(peers, ',');
  }
  if (c.peers.size() != c.num_shards) {
    return absl::InvalidArgumentError(
        absl::StrCat("--peers must list ", num_shards,
                     " comma-separated host:port addresses (one per shard, "
                     "shard order), got ",
                     peers.empty() ? 0 : c.peers.size()));
  }

  c.step_timeout = absl::GetFlag(FLAGS_step_timeout);
  c.checkpoint_dir = absl::GetFlag(FLAGS_checkpoint_dir);
  c.checkpoint_every = absl::GetFlag(FLAGS_checkpoint_every);
  c.checkpoint_keep = absl::GetFlag(FLAGS_checkpoint_keep);
  c.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  c.max_concurrent_calls = absl::GetFlag(FLAGS_max_concurrent_calls);
  c.max_calls_per_peer = absl::GetFlag(FLAGS_max_calls_per_peer);
  c.max_streams_per_connection =
      absl::GetFlag(FLAGS_max_streams_per_connection);
  c.selector = absl::GetFlag(FLAGS_selector);
  c.selector_seed = absl::GetFlag(FLAGS_seed);

  auto mode = gtopk::ParseAggregationMode(absl::GetFlag(FLAGS_mode));
  if (!mode.ok()) return FlagError("mode", mode.status());
  c.mode = *mode;
  auto selection = gtopk::ParseSelectionKind(absl::GetFlag(FLAGS_selection));
  if (!selection.ok()) return FlagError("selection", selection.status());
  c.selection = *selection;
  c.bucket_mb = absl::GetFlag(FLAGS_bucket_mb);
  // A bucket size outside layer-wise selection is a mistake (the other
  // selections have no buckets), the default's value given too.
  if (c.selection != gtopk::SelectionKind::kLayerwise &&
      gtopk::cli::FlagGiven("bucket_mb")) {
    return FlagError("bucket-mb",
                     absl::InvalidArgumentError(
                         "applies to --selection=layerwise only (the other "
                         "selections have no buckets)"));
  }
  auto index_codec = gtopk::ParseIndexCodec(absl::GetFlag(FLAGS_index_codec));
  if (!index_codec.ok()) return FlagError("index-codec", index_codec.status());
  c.index_codec = *index_codec;
  auto value_codec = gtopk::ParseValueCodec(absl::GetFlag(FLAGS_value_codec));
  if (!value_codec.ok()) return FlagError("value-codec", value_codec.status());
  c.value_codec = *value_codec;

  auto apply = gtopk::ParseApplyMode(absl::GetFlag(FLAGS_apply));
  if (!apply.ok()) return FlagError("apply", apply.status());
  c.apply = *apply;
  c.checksum_every = absl::GetFlag(FLAGS_checksum_every);
  if (c.checksum_every < 0 && c.checksum_every != -1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--checksum-every must be >= 0 (0: never), got ", c.checksum_every));
  }

  gtopk::OptimizerOptions& o = c.optimizer;
  o.lr = static_cast<float>(absl::GetFlag(FLAGS_lr));
  o.momentum = static_cast<float>(absl::GetFlag(FLAGS_momentum));
  auto momentum_mode =
      gtopk::ParseMomentumMode(absl::GetFlag(FLAGS_momentum_mode));
  if (!momentum_mode.ok()) {
    return FlagError("momentum-mode", momentum_mode.status());
  }
  o.momentum_mode = *momentum_mode;
  o.momentum_factor_masking = absl::GetFlag(FLAGS_momentum_masking);
  o.weight_decay = static_cast<float>(absl::GetFlag(FLAGS_weight_decay));
  o.lr_warmup_steps = absl::GetFlag(FLAGS_lr_warmup_steps);
  o.density = absl::GetFlag(FLAGS_density);
  o.steps_per_epoch = absl::GetFlag(FLAGS_steps_per_epoch);
  GTOPK_ASSIGN_OR_RETURN(o.density_warmup,
                         gtopk::server::ParseDensityWarmupFlag(
                             absl::GetFlag(FLAGS_density_warmup)));
  GTOPK_RETURN_IF_ERROR(
      InRange("metrics-port", absl::GetFlag(FLAGS_metrics_port), 0, 65535));
  GTOPK_RETURN_IF_ERROR(
      gtopk::MetricsBindAddress(absl::GetFlag(FLAGS_metrics_host), 0).status());
  GTOPK_RETURN_IF_ERROR(
      gtopk::ValidateHostPort("listen", absl::GetFlag(FLAGS_listen), 0));
  GTOPK_RETURN_IF_ERROR(gtopk::server::ValidateServerConfig(c));
  return c;
}

}  // namespace

namespace {

// --health-check=`target`: asks a running shard for its health, prints
// SERVING or NOT_SERVING (and why), and returns the exit code.
int RunHealthCheck(const std::string& health_target) {
  const absl::Status target =
      gtopk::ValidateHostPort("health-check", health_target, 1);
  if (!target.ok()) {
    std::fprintf(stderr, "gtopk-server: invalid flags: %s\n",
                 std::string(target.message()).c_str());
    return kExitUsage;
  }
  absl::StatusOr<std::shared_ptr<const gtopk::TransportSecurity>> security =
      SecurityFromFlags(gtopk::SecurityRole::kWorker);
  if (!security.ok()) {
    std::fprintf(stderr, "gtopk-server: invalid flags: %s\n",
                 std::string(security.status().message()).c_str());
    return kExitUsage;
  }
  absl::StatusOr<bool> serving = gtopk::server::CheckHealth(
      health_target, absl::Seconds(5), "", *security);
  if (!serving.ok()) {
    std::fprintf(stderr, "gtopk-server: %s\n",
                 serving.status().ToString().c_str());
    return kExitFailure;
  }
  std::printf("%s\n", *serving ? "SERVING" : "NOT_SERVING");
  if (!*serving) {
    // Why: a shard whose settings or run differ from the leader's says so
    // in its answer to GetClusterSpec (docs/errors.md).
    const absl::Status why =
        gtopk::server::ExplainNotServing(health_target, *security);
    if (!why.ok()) {
      std::fprintf(stderr, "gtopk-server: %s\n", why.ToString().c_str());
    }
  }
  return *serving ? kExitOk : kExitFailure;
}

// --apply=workers: the servers' optimizer flags have no effect; say so when
// any was set.
void WarnIgnoredOptimizerFlags(const ServerConfig& config) {
  // The workers run their own optimizer: the servers' optimizer flags
  // have no effect (the cluster spec carries the identity rule).
  const gtopk::OptimizerOptions defaults;
  const gtopk::OptimizerOptions& o = config.optimizer;
  if (o.lr != defaults.lr || o.momentum != defaults.momentum ||
      o.momentum_mode != defaults.momentum_mode ||
      o.momentum_factor_masking != defaults.momentum_factor_masking ||
      o.weight_decay != defaults.weight_decay ||
      o.lr_warmup_steps != defaults.lr_warmup_steps) {
    std::fprintf(stderr,
                 "gtopk-server: --apply=workers: --lr, --momentum, "
                 "--momentum-mode, --momentum-masking, --weight-decay and "
                 "--lr-warmup-steps are ignored in workers-apply mode (each "
                 "worker runs its own optimizer)\n");
  }
}

// The --metrics-port endpoint: its registry (the shard's metrics), the
// process collector and the exposer, alive while the shard runs.
struct MetricsEndpoint {
  std::shared_ptr<prometheus::Registry> registry;
  std::shared_ptr<gtopk::metrics::ProcessCollector> process_metrics;
  std::unique_ptr<prometheus::Exposer> exposer;
};

// Starts the metrics endpoint on --metrics-host:`metrics_port` (> 0) and
// points `config` at its registry; kExitUsage (after a message) when the
// port cannot be bound.
std::optional<int> StartMetrics(int64_t metrics_port, ServerConfig* config,
                                MetricsEndpoint* out) {
  std::shared_ptr<prometheus::Registry>& registry = out->registry;
  std::shared_ptr<gtopk::metrics::ProcessCollector>& process_metrics =
      out->process_metrics;
  std::unique_ptr<prometheus::Exposer>& exposer = out->exposer;
  registry = std::make_shared<prometheus::Registry>();
  gtopk::metrics::RegisterBuildInfo(*registry, "gtopk-server");
  process_metrics = std::make_shared<gtopk::metrics::ProcessCollector>();
  const std::string metrics_host = absl::GetFlag(FLAGS_metrics_host);
  absl::StatusOr<std::unique_ptr<prometheus::Exposer>> started =
      gtopk::metrics::StartExposer(
          *gtopk::MetricsBindAddress(metrics_host, metrics_port));
  if (!started.ok()) {
    std::fprintf(stderr,
                 "gtopk-server: --metrics-host=%s --metrics-port=%lld: %s\n",
                 metrics_host.c_str(), static_cast<long long>(metrics_port),
                 started.status().ToString().c_str());
    return kExitUsage;
  }
  exposer = *std::move(started);
  exposer->RegisterCollectable(registry);
  exposer->RegisterCollectable(process_metrics);
  config->metrics_registry = registry;
  return std::nullopt;
}

// The lines a started shard prints (scripts read them first), then its
// security settings on stderr. With the metrics `exposer` (may be null),
// also registers the shard's checkpoint age with it.
void PrintStartLines(gtopk::server::AggregatorServer& started,
                     const std::string& health_listen,
                     prometheus::Exposer* exposer) {
  gtopk::server::AggregatorServer* const server = &started;
  const uint32_t shard_id = server->service()->config().shard_id;
  std::printf("listening on %s\n", server->address().c_str());
  if (server->health_port() != 0) {
    std::printf("health on %s:%d (plaintext, grpc.health.v1 only)\n",
                health_listen.substr(0, health_listen.rfind(':')).c_str(),
                server->health_port());
  }
  if (exposer != nullptr) {
    exposer->RegisterCollectable(server->service()->metrics().checkpoint_age());
    std::printf("metrics on %s\n",
                gtopk::MetricsBindAddress(absl::GetFlag(FLAGS_metrics_host),
                                          gtopk::metrics::BoundPort(*exposer))
                    ->c_str());
  }
  // What a restart came back with: the operator's (and the compose test's)
  // evidence that the checkpoint volume was read.
  const int64_t restored_step = server->service()->next_step();
  if (restored_step >= 0) {
    std::printf("restored checkpoint from %s: next step %lld\n",
                server->service()->config().checkpoint_dir.c_str(),
                static_cast<long long>(restored_step));
  } else if (!server->service()->config().checkpoint_dir.empty()) {
    std::printf("no checkpoint in %s: starting empty\n",
                server->service()->config().checkpoint_dir.c_str());
  }
  std::fflush(stdout);
  // After the start lines above (scripts read them first): the security
  // settings, and the WARNING when plaintext was chosen.
  const std::shared_ptr<const gtopk::TransportSecurity>& security =
      server->service()->config().security;
  std::fprintf(stderr, "gtopk-server shard %u: %s\n", shard_id,
               security->Describe().c_str());
  const std::string warning = security->Warning();
  if (!warning.empty()) {
    std::fprintf(stderr, "gtopk-server shard %u: %s\n", shard_id,
                 warning.c_str());
  }
}

// Waits for SIGTERM or SIGINT (blocked in `signals`), then drains and shuts
// the shard down with its final checkpoint; the exit code.
int ServeUntilSignal(gtopk::server::AggregatorServer& server,
                     const sigset_t& signals, absl::Duration drain_timeout) {
  const uint32_t shard_id = server.service()->config().shard_id;
  int signal_number = 0;
  sigwait(&signals, &signal_number);
  std::fprintf(stderr, "gtopk-server shard %u: signal %d, shutting down\n",
               shard_id, signal_number);
  // Drain (health NOT_SERVING, the round in progress may complete), then
  // stop with 5 s for running calls (server/flags.md).
  const absl::Status checkpoint = server.Shutdown(
      absl::Seconds(5), /*write_checkpoint=*/true, drain_timeout);
  if (!checkpoint.ok()) {
    // Exit 3, not 0 (kExitCheckpointFailed): the state of the last applied
    // steps is not on disk (server/flags.md). The previous checkpoint, if any,
    // is intact.
    std::fprintf(stderr,
                 "gtopk-server shard %u: final checkpoint failed: %s; "
                 "exiting with code 3 (a restart restores the previous "
                 "checkpoint)\n",
                 shard_id, checkpoint.ToString().c_str());
    return kExitCheckpointFailed;
  }
  return kExitOk;
}

}  // namespace

int main(int argc, char** argv) {
  // Block SIGTERM/SIGINT before any thread starts, so that every thread
  // inherits the mask and the main thread receives them with sigwait.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  const absl::Status parsed = gtopk::cli::ParseCommandLine(
      {"One gTop-k aggregator shard (shard 0 is the leader).\n"
       "Flags are spelled with dashes or underscores; every flag is "
       "documented in server/flags.md.",
       "server/main.cc"},
      argc, argv);
  if (!parsed.ok()) {
    std::fprintf(stderr, "gtopk-server: invalid flags: %s\n",
                 std::string(parsed.message()).c_str());
    return kExitUsage;
  }

  const std::string health_target = absl::GetFlag(FLAGS_health_check);
  if (!health_target.empty()) {
    return RunHealthCheck(health_target);
  }

  absl::StatusOr<ServerConfig> config = ConfigFromFlags();
  if (!config.ok()) {
    std::fprintf(stderr, "gtopk-server: invalid flags: %s\n",
                 std::string(config.status().message()).c_str());
    return kExitUsage;
  }
  if (config->apply == gtopk::ApplyMode::kWorkers) {
    WarnIgnoredOptimizerFlags(*config);
  }
  {
    absl::StatusOr<std::shared_ptr<const gtopk::TransportSecurity>> security =
        SecurityFromFlags();
    if (!security.ok()) {
      std::fprintf(stderr, "gtopk-server: invalid flags: %s\n",
                   std::string(security.status().message()).c_str());
      return kExitUsage;
    }
    config->security = *std::move(security);
  }
  const std::string health_listen = absl::GetFlag(FLAGS_health_listen);
  if (!health_listen.empty()) {
    const absl::Status valid =
        gtopk::ValidateHostPort("health-listen", health_listen, 0);
    if (!valid.ok()) {
      std::fprintf(stderr, "gtopk-server: invalid flags: %s\n",
                   std::string(valid.message()).c_str());
      return kExitUsage;
    }
  }
  const absl::Duration drain_timeout = absl::GetFlag(FLAGS_drain_timeout);
  if (drain_timeout < absl::ZeroDuration() || drain_timeout > absl::Hours(1)) {
    std::fprintf(stderr,
                 "gtopk-server: invalid flags: --drain-timeout must be in "
                 "[0, 1h], got %s\n",
                 absl::FormatDuration(drain_timeout).c_str());
    return kExitUsage;
  }
  const uint32_t shard_id = config->shard_id;  // named if Start fails
  // Metrics first: a port that cannot be bound fails before the shard runs.
  const int64_t metrics_port = absl::GetFlag(FLAGS_metrics_port);
  MetricsEndpoint metrics;
  if (metrics_port > 0) {
    if (std::optional<int> failed =
            StartMetrics(metrics_port, &*config, &metrics)) {
      return *failed;
    }
  }
  absl::StatusOr<std::unique_ptr<gtopk::server::AggregatorServer>> server =
      gtopk::server::AggregatorServer::Start(
          *std::move(config), absl::GetFlag(FLAGS_listen), health_listen);
  if (!server.ok()) {
    std::fprintf(stderr, "gtopk-server: cannot start shard %u: %s\n", shard_id,
                 server.status().ToString().c_str());
    return kExitUsage;
  }
  PrintStartLines(**server, health_listen, metrics.exposer.get());
  return ServeUntilSignal(**server, signals, drain_timeout);
}
