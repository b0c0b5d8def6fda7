#include "server/member_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "common/checksum.h"

namespace gtopk {
namespace server {
namespace {

constexpr char kHeader[] = "gtopk-members 1";

absl::Status Errno(const char* op, const std::string& path) {
  const int e = errno;
  return absl::ErrnoToStatus(e, absl::StrCat(op, " ", path));
}

std::string Hex(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx",
                static_cast<unsigned long long>(v));
  return buf;
}

}  // namespace

std::string MemberFilePath(const std::string& dir) {
  return dir + "/members-shard-0.state";
}

absl::Status WriteMemberTokens(const std::string& dir,
                               const std::vector<uint64_t>& tokens,
                               const std::string& run_length) {
  std::string body = absl::StrCat(kHeader, "\nworkers ", tokens.size(), "\n");
  if (!run_length.empty() && run_length.find('\n') == std::string::npos) {
    absl::StrAppend(&body, "run_length ", run_length, "\n");
  }
  for (size_t r = 0; r < tokens.size(); ++r) {
    if (tokens[r] != 0) absl::StrAppend(&body, r, " ", tokens[r], "\n");
  }
  absl::StrAppend(&body, "fnv1a64 ", Hex(Fnv1a64(body.data(), body.size())),
                  "\n");
  const std::string path = MemberFilePath(dir);
  const std::string tmp = path + ".tmp";
  const int fd =
      ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return Errno("open", tmp);
  size_t done = 0;
  while (done < body.size()) {
    const ssize_t w = ::write(fd, body.data() + done, body.size() - done);
    if (w < 0) {
      if (errno == EINTR) continue;
      const absl::Status s = Errno("write", tmp);
      ::close(fd);
      ::unlink(tmp.c_str());
      return s;
    }
    done += static_cast<size_t>(w);
  }
  if (::fsync(fd) != 0) {
    const absl::Status s = Errno("fsync", tmp);
    ::close(fd);
    ::unlink(tmp.c_str());
    return s;
  }
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const absl::Status s = Errno("rename", tmp);
    ::unlink(tmp.c_str());
    return s;
  }
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0) return Errno("open", dir);
  const int synced = ::fsync(dfd);
  ::close(dfd);
  if (synced != 0) return Errno("fsync", dir);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<uint64_t>> ReadMemberTokens(
    const std::string& dir, uint32_t num_workers, std::string* run_length) {
  if (run_length != nullptr) run_length->clear();
  const std::string path = MemberFilePath(dir);
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    if (errno == ENOENT) {
      return absl::NotFoundError(absl::StrCat("no member file ", path));
    }
    return Errno("open", path);
  }
  std::stringstream buffer;
  buffer << in.rdbuf();
  const std::string text = buffer.str();
  const auto corrupt = [&](absl::string_view what) {
    return absl::DataLossError(
        absl::StrCat("member file ", path, " is corrupt: ", what));
  };
  const size_t last = text.rfind("fnv1a64 ");
  if (last == std::string::npos ||
      text.compare(last, std::string::npos,
                   absl::StrCat("fnv1a64 ", Hex(Fnv1a64(text.data(), last)),
                                "\n")) != 0) {
    return corrupt("its checksum does not match (truncated or modified)");
  }
  std::vector<std::string> lines = absl::StrSplit(
      absl::string_view(text).substr(0, last), '\n', absl::SkipEmpty());
  if (lines.size() < 2 || lines[0] != kHeader) {
    return corrupt(absl::StrCat("the first line is not \"", kHeader, "\""));
  }
  uint32_t workers = 0;
  if (!absl::StartsWith(lines[1], "workers ") ||
      !absl::SimpleAtoi(absl::string_view(lines[1]).substr(8), &workers)) {
    return corrupt("the second line is not \"workers <P>\"");
  }
  if (workers != num_workers) {
    return absl::FailedPreconditionError(absl::StrCat(
        "member file ", path, " was written by a leader with --workers=",
        workers, ", this one has --workers=", num_workers));
  }
  std::vector<uint64_t> tokens(num_workers, 0);
  for (size_t i = 2; i < lines.size(); ++i) {
    if (absl::StartsWith(lines[i], "run_length ")) {
      if (run_length != nullptr) *run_length = lines[i].substr(11);
      continue;
    }
    std::vector<absl::string_view> f = absl::StrSplit(lines[i], ' ');
    uint32_t rank = 0;
    uint64_t token = 0;
    if (f.size() != 2 || !absl::SimpleAtoi(f[0], &rank) ||
        !absl::SimpleAtoi(f[1], &token) || token == 0) {
      return corrupt(
          absl::StrCat("line ", i + 1, " is not \"<rank> <token>\""));
    }
    if (rank >= num_workers || tokens[rank] != 0) {
      return corrupt(absl::StrCat("line ", i + 1, ": rank ", rank,
                                  " is out of range or repeated"));
    }
    tokens[rank] = token;
  }
  return tokens;
}

}  // namespace server
}  // namespace gtopk
