// TransportSecurity (common/transport_security/transport_security.h): loading
// and checking the certificate, key, CA bundle and token files with OpenSSL,
// and the gRPC credentials and token-sending channels made from them.
#include "common/transport_security/transport_security.h"

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509_vfy.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/support/client_interceptor.h"

namespace gtopk {
namespace {

// Shortest token accepted, in bytes (after trimming surrounding
// whitespace): 16 random bytes, e.g. `openssl rand -hex 16` (32 chars).
constexpr size_t kMinTokenBytes = 16;

absl::Status FlagFileError(const char* flag, const std::string& path,
                           absl::string_view what) {
  return absl::InvalidArgumentError(
      absl::StrCat("--", flag, "=", path, ": ", what));
}

// Largest certificate, key, CA bundle or token file read (1 MiB; a CA
// bundle of every public root is about 200 KB): a device such as /dev/zero
// given by mistake is an error, not an unbounded read.
constexpr std::streamsize kMaxFlagFileBytes = 1 << 20;

absl::StatusOr<std::string> ReadFlagFile(const char* flag,
                                         const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    return FlagFileError(flag, path, "is a directory, not a file");
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return FlagFileError(flag, path, "cannot be read");
  std::string s(static_cast<size_t>(kMaxFlagFileBytes) + 1, '\0');
  in.read(s.data(), kMaxFlagFileBytes + 1);
  if (in.bad()) return FlagFileError(flag, path, "read error");
  s.resize(static_cast<size_t>(in.gcount()));
  if (s.size() > static_cast<size_t>(kMaxFlagFileBytes)) {
    return FlagFileError(flag, path,
                         "larger than 1 MiB: not a PEM file or "
                         "token");
  }
  if (s.empty()) return FlagFileError(flag, path, "file is empty");
  return s;
}

std::string OpenSslError() {
  const unsigned long e = ERR_get_error();
  ERR_clear_error();
  if (e == 0) return "no details";
  char buf[256];
  ERR_error_string_n(e, buf, sizeof(buf));
  return buf;
}

struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct KeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
struct StoreFree {
  void operator()(X509_STORE* s) const { X509_STORE_free(s); }
};
struct StoreCtxFree {
  void operator()(X509_STORE_CTX* c) const { X509_STORE_CTX_free(c); }
};
using X509Ptr = std::unique_ptr<X509, X509Free>;

// Every certificate in `pem`, in order; INVALID_ARGUMENT when none parses.
absl::StatusOr<std::vector<X509Ptr>> ParseCertificates(const char* flag,
                                                       const std::string& path,
                                                       const std::string& pem) {
  std::unique_ptr<BIO, BioFree> bio(
      BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
  std::vector<X509Ptr> certs;
  while (X509* x = PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr)) {
    certs.emplace_back(x);
  }
  ERR_clear_error();  // the end of the bundle reads as an error
  if (certs.empty()) {
    return FlagFileError(flag, path, "no PEM certificate in the file");
  }
  return certs;
}

absl::Status CheckValidity(const char* flag, const std::string& path,
                           X509* cert) {
  if (X509_cmp_current_time(X509_get0_notAfter(cert)) <= 0) {
    return FlagFileError(flag, path, "the certificate has expired (renew it)");
  }
  if (X509_cmp_current_time(X509_get0_notBefore(cert)) >= 0) {
    return FlagFileError(flag, path, "the certificate is not valid yet");
  }
  return absl::OkStatus();
}

// The certificate chain in `cert_pem` must chain to a CA of `ca_pem`.
absl::Status CheckSignedBy(const TransportSecurityOptions& o,
                           std::vector<X509Ptr>& chain,
                           std::vector<X509Ptr>& cas) {
  std::unique_ptr<X509_STORE, StoreFree> store(X509_STORE_new());
  for (X509Ptr& ca : cas) X509_STORE_add_cert(store.get(), ca.get());
  STACK_OF(X509)* untrusted = sk_X509_new_null();
  for (size_t i = 1; i < chain.size(); ++i) {
    sk_X509_push(untrusted, chain[i].get());
  }
  std::unique_ptr<X509_STORE_CTX, StoreCtxFree> ctx(X509_STORE_CTX_new());
  X509_STORE_CTX_init(ctx.get(), store.get(), chain[0].get(), untrusted);
  const int ok = X509_verify_cert(ctx.get());
  const int err = X509_STORE_CTX_get_error(ctx.get());
  sk_X509_free(untrusted);
  ERR_clear_error();
  if (ok != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--tls-cert=", o.cert_file, " does not verify against --tls-ca=",
        o.ca_file, ": ", X509_verify_cert_error_string(err)));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadToken(const char* flag,
                                      const std::string& path) {
  absl::StatusOr<std::string> raw = ReadFlagFile(flag, path);
  if (!raw.ok()) return raw.status();
  std::string token(absl::StripAsciiWhitespace(*raw));
  if (token.size() < kMinTokenBytes) {
    return FlagFileError(
        flag, path,
        absl::StrCat("the token is shorter than ", kMinTokenBytes,
                     " bytes (make one with `openssl rand -hex 32`)"));
  }
  for (char c : token) {
    // gRPC metadata values must be printable ASCII.
    if (c < 0x20 || c > 0x7e) {
      return FlagFileError(flag, path,
                           "the token must be printable ASCII on one line");
    }
  }
  return token;
}

// Adds "authorization: Bearer <token>" to every call of a channel.
class TokenInterceptor : public grpc::experimental::Interceptor {
 public:
  explicit TokenInterceptor(const std::string* value) : value_(value) {}
  void Intercept(
      grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::
                PRE_SEND_INITIAL_METADATA)) {
      methods->GetSendInitialMetadata()->emplace(kTokenMetadataKey, *value_);
    }
    methods->Proceed();
  }

 private:
  const std::string* value_;
};

class TokenInterceptorFactory
    : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit TokenInterceptorFactory(
      std::shared_ptr<const TransportSecurity> security)
      : security_(std::move(security)),
        value_(absl::StrCat("Bearer ", security_->outgoing_token())) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(
      grpc::experimental::ClientRpcInfo* /*info*/) override {
    return new TokenInterceptor(&value_);
  }

 private:
  std::shared_ptr<const TransportSecurity> security_;
  const std::string value_;
};

}  // namespace

absl::StatusOr<TlsMode> ParseTlsMode(absl::string_view name) {
  if (name == "off") return TlsMode::kOff;
  if (name == "server") return TlsMode::kServer;
  if (name == "mutual") return TlsMode::kMutual;
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown TLS mode '", name, "'; expected off, server or mutual"));
}

const char* TlsModeName(TlsMode mode) {
  switch (mode) {
    case TlsMode::kOff:
      return "off";
    case TlsMode::kServer:
      return "server";
    case TlsMode::kMutual:
      return "mutual";
  }
  return "?";
}

absl::StatusOr<std::shared_ptr<const TransportSecurity>>
TransportSecurity::Load(const TransportSecurityOptions& o, SecurityRole role) {
  std::shared_ptr<TransportSecurity> s(new TransportSecurity());
  s->options_ = o;
  s->role_ = role;
  const bool server = role == SecurityRole::kServer;
  if (o.tls == TlsMode::kOff) {
    for (const auto& [flag, value] :
         {std::pair<const char*, const std::string*>{"tls-cert", &o.cert_file},
          {"tls-key", &o.key_file},
          {"tls-ca", &o.ca_file}}) {
      if (!value->empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat("--", flag,
                         " is set but --tls=off: say --tls=mutual (or "
                         "--tls=server) to use it, or drop it"));
      }
    }
  } else {
    const bool need_identity = o.tls == TlsMode::kMutual || server;
    if (need_identity && (o.cert_file.empty() || o.key_file.empty())) {
      return absl::InvalidArgumentError(
          absl::StrCat("--tls=", TlsModeName(o.tls),
                       " needs --tls-cert and --tls-key (this process's "
                       "certificate and private key, PEM)"));
    }
    // A server needs the CA too: it dials the leader (and the leader the
    // shards) and must verify their certificates.
    if (o.ca_file.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--tls=", TlsModeName(o.tls),
                       " needs --tls-ca (the PEM CA bundle that peers' "
                       "certificates are signed by)"));
    }
    if (!o.ca_file.empty()) {
      absl::StatusOr<std::string> ca = ReadFlagFile("tls-ca", o.ca_file);
      if (!ca.ok()) return ca.status();
      s->ca_pem_ = *std::move(ca);
    }
    if (!o.cert_file.empty() || !o.key_file.empty()) {
      if (o.cert_file.empty() || o.key_file.empty()) {
        return absl::InvalidArgumentError(
            "--tls-cert and --tls-key go together");
      }
      absl::StatusOr<std::string> cert = ReadFlagFile("tls-cert", o.cert_file);
      if (!cert.ok()) return cert.status();
      absl::StatusOr<std::string> key = ReadFlagFile("tls-key", o.key_file);
      if (!key.ok()) return key.status();
      s->cert_pem_ = *std::move(cert);
      s->key_pem_ = *std::move(key);
      absl::StatusOr<std::vector<X509Ptr>> chain =
          ParseCertificates("tls-cert", o.cert_file, s->cert_pem_);
      if (!chain.ok()) return chain.status();
      std::unique_ptr<BIO, BioFree> key_bio(BIO_new_mem_buf(
          s->key_pem_.data(), static_cast<int>(s->key_pem_.size())));
      std::unique_ptr<EVP_PKEY, KeyFree> pkey(
          PEM_read_bio_PrivateKey(key_bio.get(), nullptr, nullptr, nullptr));
      if (pkey == nullptr) {
        return FlagFileError("tls-key", o.key_file,
                             absl::StrCat("no unencrypted PEM private key (",
                                          OpenSslError(), ")"));
      }
      if (X509_check_private_key((*chain)[0].get(), pkey.get()) != 1) {
        ERR_clear_error();
        return absl::InvalidArgumentError(absl::StrCat(
            "--tls-key=", o.key_file,
            " does not match the certificate --tls-cert=", o.cert_file));
      }
      const absl::Status valid =
          CheckValidity("tls-cert", o.cert_file, (*chain)[0].get());
      if (!valid.ok()) return valid;
      if (!s->ca_pem_.empty()) {
        absl::StatusOr<std::vector<X509Ptr>> cas =
            ParseCertificates("tls-ca", o.ca_file, s->ca_pem_);
        if (!cas.ok()) return cas.status();
        const absl::Status signed_by = CheckSignedBy(o, *chain, *cas);
        if (!signed_by.ok()) return signed_by;
      }
    } else if (!s->ca_pem_.empty()) {
      absl::StatusOr<std::vector<X509Ptr>> cas =
          ParseCertificates("tls-ca", o.ca_file, s->ca_pem_);
      if (!cas.ok()) return cas.status();
    }
  }
  if (!o.token_file.empty()) {
    absl::StatusOr<std::string> t = ReadToken("token-file", o.token_file);
    if (!t.ok()) return t.status();
    s->worker_token_ = *std::move(t);
  }
  if (!o.shard_token_file.empty()) {
    if (!server) {
      return absl::InvalidArgumentError("--shard-token-file is a server flag");
    }
    absl::StatusOr<std::string> t =
        ReadToken("shard-token-file", o.shard_token_file);
    if (!t.ok()) return t.status();
    s->shard_token_ = *std::move(t);
  }
  if (server) {
    if (!s->worker_token_.empty() && s->shard_token_.empty()) {
      return absl::InvalidArgumentError(
          "--token-file needs --shard-token-file on a server (a separate "
          "token for the shard-to-shard RPCs, so that a worker's token "
          "cannot call them)");
    }
    if (s->worker_token_.empty() && !s->shard_token_.empty()) {
      return absl::InvalidArgumentError(
          "--shard-token-file needs --token-file (the workers' token)");
    }
    if (!s->worker_token_.empty() &&
        ConstantTimeEquals(s->worker_token_, s->shard_token_)) {
      return absl::InvalidArgumentError(
          "--token-file and --shard-token-file hold the same token; the "
          "shards' token must differ from the workers'");
    }
  }
  return std::shared_ptr<const TransportSecurity>(std::move(s));
}

std::shared_ptr<grpc::ServerCredentials> TransportSecurity::ServerCredentials()
    const {
  if (options_.tls == TlsMode::kOff) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions ssl(
      options_.tls == TlsMode::kMutual
          ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
          : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  ssl.pem_root_certs = ca_pem_;
  ssl.pem_key_cert_pairs.push_back({key_pem_, cert_pem_});
  return grpc::SslServerCredentials(ssl);
}

std::shared_ptr<grpc::ChannelCredentials>
TransportSecurity::ChannelCredentials() const {
  if (options_.tls == TlsMode::kOff) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = ca_pem_;
  if (options_.tls == TlsMode::kMutual) {
    ssl.pem_private_key = key_pem_;
    ssl.pem_cert_chain = cert_pem_;
  }
  return grpc::SslCredentials(ssl);
}

std::string TransportSecurity::Describe() const {
  std::string line = absl::StrCat("tls=", TlsModeName(options_.tls));
  if (!options_.cert_file.empty()) {
    absl::StrAppend(&line, " cert=", options_.cert_file);
  }
  if (!options_.ca_file.empty())
    absl::StrAppend(&line, " ca=", options_.ca_file);
  if (!worker_token_.empty()) {
    absl::StrAppend(&line, " token-file=", options_.token_file);
  }
  if (!shard_token_.empty()) {
    absl::StrAppend(&line, " shard-token-file=", options_.shard_token_file);
  }
  return line;
}

std::string TransportSecurity::Warning() const {
  if (options_.tls != TlsMode::kOff) return "";
  if (!worker_token_.empty()) {
    return "WARNING: --tls=off with --token-file: the token and all traffic "
           "travel in plaintext; anyone who can read the network can take "
           "the token (use --tls=server or --tls=mutual; docs/security.md)";
  }
  return "WARNING: --tls=off: plaintext and unauthenticated gRPC; anyone who "
         "reaches this port can join, push, read the model (use "
         "--tls=mutual; docs/security.md)";
}

std::shared_ptr<grpc::Channel> CreateSecureChannel(
    const std::string& address, const grpc::ChannelArguments& args,
    const std::shared_ptr<const TransportSecurity>& security) {
  if (security == nullptr) {
    return grpc::CreateCustomChannel(address,
                                     grpc::InsecureChannelCredentials(), args);
  }
  if (security->outgoing_token().empty()) {
    return grpc::CreateCustomChannel(address, security->ChannelCredentials(),
                                     args);
  }
  std::vector<
      std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>>
      interceptors;
  interceptors.push_back(std::make_unique<TokenInterceptorFactory>(security));
  return grpc::experimental::CreateCustomChannelWithInterceptors(
      address, security->ChannelCredentials(), args, std::move(interceptors));
}

bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  // Compare every byte of the longer length, so the time does not reveal
  // where the first difference is.
  const size_t n = std::max(a.size(), b.size());
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= static_cast<unsigned char>(x ^ y);
  }
  return diff == 0;
}

}  // namespace gtopk
