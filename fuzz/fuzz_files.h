// For harnesses of file readers (checkpoint, IDX): a private scratch folder
// and a write of the fuzzer's bytes into a file there. Test tooling.
#ifndef GTOPK_FUZZ_FUZZ_FILES_H_
#define GTOPK_FUZZ_FUZZ_FILES_H_

#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/string_view.h"
#include "fuzz/fuzz_check.h"

namespace gtopk {
namespace fuzz {

// A folder of this process's own under $TMPDIR (default /tmp), made once;
// removed by the OS's tmp cleaning, not by the harness (libFuzzer exits
// through _exit). The file names inside are fixed, so it stays small.
inline const std::string& ScratchDir() {
  static const std::string dir = [] {
    const char* tmp = std::getenv("TMPDIR");
    std::string templ = std::string(tmp != nullptr && *tmp ? tmp : "/tmp") +
                        "/gtopk-fuzz-XXXXXX";
    FUZZ_CHECK(mkdtemp(templ.data()) != nullptr, "mkdtemp %s", templ.c_str());
    return templ;
  }();
  return dir;
}

// Replaces `path` with exactly `bytes`.
inline void WriteFile(const std::string& path, absl::string_view bytes) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  FUZZ_CHECK(f != nullptr, "open %s", path.c_str());
  FUZZ_CHECK(std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size(),
             "write %s", path.c_str());
  FUZZ_CHECK(std::fclose(f) == 0, "close %s", path.c_str());
}

inline std::string ReadFile(const std::string& path) {
  std::string out;
  std::FILE* f = std::fopen(path.c_str(), "rb");
  FUZZ_CHECK(f != nullptr, "open %s", path.c_str());
  char buf[4096];
  size_t got;
  while ((got = std::fread(buf, 1, sizeof buf, f)) > 0) out.append(buf, got);
  std::fclose(f);
  return out;
}

}  // namespace fuzz
}  // namespace gtopk

#endif  // GTOPK_FUZZ_FUZZ_FILES_H_
