// Test-only: caps this process's virtual address space (RLIMIT_AS) at what
// it maps now plus `headroom_bytes`, for the scope's lifetime, so that a
// large allocation fails with std::bad_alloc on any machine (the tests of
// allocations sized by remote input: a shard's range of the cluster's n).
// The previous limit is restored on destruction. Not for sanitizer builds
// (their shadow mappings exceed any cap: skip the test there). Not
// thread-safe against other code changing RLIMIT_AS.
#ifndef GTOPK_TESTS_TESTING_ADDRESS_SPACE_CAP_H_
#define GTOPK_TESTS_TESTING_ADDRESS_SPACE_CAP_H_

#include <sys/resource.h>

#include <cstdint>
#include <fstream>
#include <string>

namespace gtopk {
namespace testing {

// This process's virtual memory size in bytes (/proc/self/status VmSize);
// 0 when it cannot be read.
inline uint64_t VmSizeBytes() {
  std::ifstream status("/proc/self/status");
  std::string key;
  while (status >> key) {
    if (key == "VmSize:") {
      uint64_t kib = 0;
      status >> kib;
      return kib * 1024;
    }
  }
  return 0;
}

class ScopedAddressSpaceCap {
 public:
  explicit ScopedAddressSpaceCap(uint64_t headroom_bytes) {
    const uint64_t vm = VmSizeBytes();
    if (vm == 0 || getrlimit(RLIMIT_AS, &saved_) != 0) return;
    rlimit capped = saved_;
    capped.rlim_cur = vm + headroom_bytes;
    ok_ = setrlimit(RLIMIT_AS, &capped) == 0;
  }
  ~ScopedAddressSpaceCap() {
    if (ok_) setrlimit(RLIMIT_AS, &saved_);
  }
  ScopedAddressSpaceCap(const ScopedAddressSpaceCap&) = delete;
  ScopedAddressSpaceCap& operator=(const ScopedAddressSpaceCap&) = delete;

  // Whether the cap is in force (assert it: an uncapped run proves nothing).
  bool ok() const { return ok_; }

 private:
  rlimit saved_{};
  bool ok_ = false;
};

}  // namespace testing
}  // namespace gtopk

#endif  // GTOPK_TESTS_TESTING_ADDRESS_SPACE_CAP_H_
