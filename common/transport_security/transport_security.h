// Transport security of every gRPC hop (docs/security.md): TLS or mutual TLS
// with gRPC's own SSL credentials, and the shared-secret token alternative.
// One place for the server (server credentials, the token a shard sends to
// the other shards) and the worker client (channel credentials, the token a
// worker sends).
//
// TransportSecurityOptions is what the flags say (file paths only, never a
// secret); TransportSecurity::Load reads and checks the files once, at
// start, so that a bad file is a clear error before anything listens or
// dials. The loaded object is immutable and shared.
#ifndef GTOPK_COMMON_TRANSPORT_SECURITY_H_
#define GTOPK_COMMON_TRANSPORT_SECURITY_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/support/channel_arguments.h"

namespace gtopk {

// --tls: how the gRPC connections are secured.
enum class TlsMode {
  kOff,     // "off": plaintext; a WARNING at start (nothing is protected)
  kServer,  // "server": TLS, the server proves itself with its certificate;
            // clients are not asked for one (pair it with --token-file)
  kMutual,  // "mutual": mTLS, both sides present certificates signed by the
            // CA bundle; the client certificate's CN names its role
};

// "off" | "server" | "mutual"; INVALID_ARGUMENT naming the choices.
absl::StatusOr<TlsMode> ParseTlsMode(absl::string_view name);
const char* TlsModeName(TlsMode mode);

// Metadata key of the token (call metadata, lowercase as gRPC requires).
// The value is "Bearer <token>".
inline constexpr char kTokenMetadataKey[] = "authorization";

// Certificate common names that carry a role under mutual TLS
// (docs/security.md, "Identities"): kShardCnPrefix + s is shard s;
// kWorkerCn is a worker of any rank (bound to it by the member token);
// kWorkerCn + "-" + r is a worker that may act only as rank r.
inline constexpr char kShardCnPrefix[] = "gtopk-shard-";
inline constexpr char kWorkerCn[] = "gtopk-worker";

// The flags of docs/security.md, as given (paths, not contents).
struct TransportSecurityOptions {
  TlsMode tls = TlsMode::kOff;
  // PEM certificate chain and private key of this process (--tls-cert,
  // --tls-key): required for kServer on a server and for kMutual.
  std::string cert_file;
  std::string key_file;
  // PEM CA bundle (--tls-ca) that peers' certificates must chain to:
  // required whenever TLS is on (a server also dials the other shards).
  std::string ca_file;
  // File holding the workers' shared token (--token-file); empty: none.
  std::string token_file;
  // Server only (--shard-token-file): the token shards present to each
  // other; required on a server when token_file is set (only shards may
  // call the shard RPCs). Must differ from the workers' token.
  std::string shard_token_file;
};

// Which end of the connections a process is (what Load requires).
enum class SecurityRole { kServer, kWorker };

// Loaded and checked security material. Immutable; thread-safe; shared by
// every channel and the server of a process.
class TransportSecurity {
 public:
  // Reads and checks every file `options` names, for a process of `role`.
  // INVALID_ARGUMENT naming the flag and the file for: a file that cannot be
  // read or is empty; a certificate or key that is not PEM; a key that does
  // not match the certificate; an expired or not yet valid certificate; a
  // certificate not signed by the CA bundle (kMutual); a token shorter than
  // 16 bytes; a missing file the mode requires; a certificate flag given
  // with --tls=off (say --tls=mutual or drop it); the workers' and shards'
  // tokens being equal. Never logs a token.
  static absl::StatusOr<std::shared_ptr<const TransportSecurity>> Load(
      const TransportSecurityOptions& options, SecurityRole role);

  TlsMode tls() const { return options_.tls; }
  const TransportSecurityOptions& options() const { return options_; }
  // The tokens (empty when not configured). Secrets: never log them.
  const std::string& worker_token() const { return worker_token_; }
  const std::string& shard_token() const { return shard_token_; }
  // What this process sends on its own calls: the worker token for a
  // worker, the shard token for a server.
  const std::string& outgoing_token() const {
    return role_ == SecurityRole::kWorker ? worker_token_ : shard_token_;
  }
  // True when the server must authenticate callers (mutual TLS or tokens).
  bool authenticates() const {
    return options_.tls == TlsMode::kMutual || !worker_token_.empty();
  }

  // Server credentials for ServerBuilder::AddListeningPort: insecure for
  // kOff, SSL with this certificate for kServer, SSL requesting and
  // verifying a client certificate against the CA bundle for kMutual.
  std::shared_ptr<grpc::ServerCredentials> ServerCredentials() const;
  // Channel credentials for a client: insecure for kOff, SSL verifying the
  // server against the CA bundle (kServer), plus this certificate (kMutual).
  std::shared_ptr<grpc::ChannelCredentials> ChannelCredentials() const;

  // One line for the start-up log: the mode and the files, never a token.
  std::string Describe() const;
  // The WARNING line to print at start, or "" when none is due: plaintext
  // (--tls=off), or tokens sent in plaintext.
  std::string Warning() const;

 private:
  TransportSecurity() = default;
  TransportSecurityOptions options_;
  SecurityRole role_ = SecurityRole::kServer;
  std::string cert_pem_, key_pem_, ca_pem_;
  std::string worker_token_, shard_token_;
};

// A channel to `address` with `args`, secured by `security` (null: plaintext)
// and, when it has an outgoing token, sending it as call metadata on every
// call (a client interceptor). Never fails here; a refused handshake shows
// up as UNAVAILABLE on the first call.
std::shared_ptr<grpc::Channel> CreateSecureChannel(
    const std::string& address, const grpc::ChannelArguments& args,
    const std::shared_ptr<const TransportSecurity>& security);

// Constant-time comparison of two byte strings (the time depends on the
// lengths only): for tokens.
bool ConstantTimeEquals(absl::string_view a, absl::string_view b);

}  // namespace gtopk

#endif  // GTOPK_COMMON_TRANSPORT_SECURITY_H_
