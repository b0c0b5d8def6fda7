// DownloadSlots: the bound on concurrent DownloadParams calls of one shard
// (AggregatorService, server/service.h, owns one; the handler is in
// server/download.cc). DownloadParams copies the shard's range per call; at
// most kMaxConcurrentDownloads copies exist at once (the others wait,
// bounded by their deadline), so clients cannot exhaust the server's
// memory. A download holds its slot at most the wait for initialisation
// (the step timeout) plus DownloadParamsLimits' total. Not an API: nothing
// outside server/ includes it.
#ifndef GTOPK_SERVER_DOWNLOAD_H_
#define GTOPK_SERVER_DOWNLOAD_H_

#include <optional>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/server_context.h"

namespace gtopk {
namespace server {

// Concurrent DownloadParams snapshots per server (each one shard range).
inline constexpr int kMaxConcurrentDownloads = 4;

// Thread-safety: thread-safe.
class DownloadSlots {
 public:
  // A held slot; released when destroyed. Movable.
  class Slot {
   public:
    explicit Slot(DownloadSlots* slots) : slots_(slots) {}
    Slot(Slot&& other) noexcept : slots_(other.slots_) {
      other.slots_ = nullptr;
    }
    Slot(const Slot&) = delete;
    Slot& operator=(const Slot&) = delete;
    Slot& operator=(Slot&&) = delete;
    ~Slot();

   private:
    DownloadSlots* slots_;
  };

  // Waits (polling `context` for cancellation) until a slot is free, up to
  // `deadline`; nullopt when none came.
  std::optional<Slot> Acquire(absl::Time deadline,
                              const grpc::ServerContext* context);

 private:
  absl::Mutex mu_;
  int active_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace server
}  // namespace gtopk

#endif  // GTOPK_SERVER_DOWNLOAD_H_
