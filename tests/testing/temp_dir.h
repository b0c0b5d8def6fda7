// A temporary directory for one test (checkpoints, logs), removed with its
// files when the object goes out of scope.
#ifndef GTOPK_TESTS_TESTING_TEMP_DIR_H_
#define GTOPK_TESTS_TESTING_TEMP_DIR_H_

#include <dirent.h>
#include <stdlib.h>
#include <unistd.h>

#include <string>

namespace gtopk {
namespace testing {

// /tmp/gtopk_<name>_XXXXXX; path() is empty when it could not be made.
// Removes the files directly inside it (not subdirectories' contents).
class TempDir {
 public:
  explicit TempDir(const std::string& name) {
    std::string t = "/tmp/gtopk_" + name + "_XXXXXX";
    if (mkdtemp(t.data()) != nullptr) path_ = t;
  }
  ~TempDir() {
    if (path_.empty()) return;
    if (DIR* d = opendir(path_.c_str())) {
      while (const dirent* e = readdir(d)) {
        if (e->d_name[0] != '.') unlink((path_ + "/" + e->d_name).c_str());
      }
      closedir(d);
    }
    rmdir(path_.c_str());
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace testing
}  // namespace gtopk

#endif  // GTOPK_TESTS_TESTING_TEMP_DIR_H_
