#include "server/checkpoint.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/types/span.h"
#include "common/status_macros.h"

namespace gtopk {
namespace server {
namespace {

constexpr char kMagic[8] = {'G', 'T', 'O', 'P', 'K', 'C', 'K', '1'};
constexpr size_t kFixedBytes = kCheckpointHeaderBytes + kCheckpointTrailerBytes;
// Payloads move through a staging buffer of this size, so writing or reading a
// checkpoint never holds a second copy of a vector.
constexpr size_t kChunkBytes = size_t{1} << 20;
constexpr size_t kChunkFloats = kChunkBytes / sizeof(float);
constexpr bool kHostLittleEndian =
    __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__;  // GCC and Clang define both
static_assert(sizeof(float) == 4, "IEEE binary32 float required");

// ---------------------------------------------------------------------------
// Little-endian encoding.

void Put32(unsigned char* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}
void Put64(unsigned char* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}
uint32_t Get32(const unsigned char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= uint32_t{p[i]} << (8 * i);
  return v;
}
uint64_t Get64(const unsigned char* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= uint64_t{p[i]} << (8 * i);
  return v;
}

void EncodeFloats(absl::Span<const float> in, unsigned char* out) {
  if constexpr (kHostLittleEndian) {
    std::memcpy(out, in.data(), in.size() * sizeof(float));
  } else {
    for (size_t i = 0; i < in.size(); ++i) {
      uint32_t bits;
      std::memcpy(&bits, &in[i], sizeof(bits));
      Put32(out + 4 * i, bits);
    }
  }
}
void DecodeFloats(const unsigned char* in, absl::Span<float> out) {
  if constexpr (kHostLittleEndian) {
    std::memcpy(out.data(), in, out.size() * sizeof(float));
  } else {
    for (size_t i = 0; i < out.size(); ++i) {
      const uint32_t bits = Get32(in + 4 * i);
      std::memcpy(&out[i], &bits, sizeof(bits));
    }
  }
}

uint32_t Crc(uint32_t crc, const unsigned char* p, size_t len) {
  return static_cast<uint32_t>(crc32_z(crc, p, len));
}

// ---------------------------------------------------------------------------
// POSIX helpers: every failure becomes an absl::Status naming op and path.

absl::Status ErrnoStatus(int err, absl::string_view op,
                         const std::string& path) {
  return absl::ErrnoToStatus(err, absl::StrCat("checkpoint: ", op, " ", path));
}

// Closes a file descriptor on scope exit unless Close() was called.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }
  // Closes now and reports the close error (which may be a deferred write
  // error on some file systems).
  absl::Status Close(const std::string& path) {
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) return ErrnoStatus(errno, "close", path);
    return absl::OkStatus();
  }

 private:
  int fd_;
};

absl::Status WriteAll(int fd, const unsigned char* p, size_t len,
                      const std::string& path) {
  while (len > 0) {
    const ssize_t w = ::write(fd, p, len);
    if (w < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, "write", path);
    }
    if (w == 0) return ErrnoStatus(EIO, "write", path);
    p += w;
    len -= static_cast<size_t>(w);
  }
  return absl::OkStatus();
}

// Reads exactly `len` bytes; DATA_LOSS when the file ends first.
absl::Status ReadAll(int fd, unsigned char* p, size_t len,
                     const std::string& path) {
  while (len > 0) {
    const ssize_t r = ::read(fd, p, len);
    if (r < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, "read", path);
    }
    if (r == 0) {
      return absl::DataLossError(
          absl::StrCat("checkpoint ", path, ": truncated (file ended early)"));
    }
    p += r;
    len -= static_cast<size_t>(r);
  }
  return absl::OkStatus();
}

absl::Status FsyncDir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, "open dir", dir);
  Fd guard(fd);
  if (::fsync(fd) != 0) return ErrnoStatus(errno, "fsync dir", dir);
  return guard.Close(dir);
}

std::string FileName(uint32_t shard_id) {
  return absl::StrCat("shard-", shard_id, ".ckpt");
}
std::string TempPrefix(uint32_t shard_id) {
  return absl::StrCat(FileName(shard_id), ".tmp-");
}

// Removes temp files a crashed or failed writer of this shard left in `dir`.
// Best effort: a leftover that cannot be removed is harmless (readers ignore
// it), so only failing to list `dir` is an error.
absl::Status RemoveStaleTemps(const std::string& dir, uint32_t shard_id) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return ErrnoStatus(errno, "open dir", dir);
  const std::string prefix = TempPrefix(shard_id);
  std::vector<std::string> stale;
  errno = 0;
  while (const struct dirent* e = ::readdir(d)) {
    if (absl::StartsWith(e->d_name, prefix)) stale.emplace_back(e->d_name);
  }
  const int read_errno = errno;
  ::closedir(d);
  if (read_errno != 0) return ErrnoStatus(read_errno, "list dir", dir);
  for (const std::string& name : stale) {
    ::unlink(absl::StrCat(dir, "/", name).c_str());
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Validation.

absl::Status ValidateLayout(uint32_t shard_id, uint32_t num_shards, uint64_t n,
                            uint64_t begin, uint64_t end) {
  if (num_shards == 0) return absl::InvalidArgumentError("num_shards is 0");
  if (shard_id >= num_shards) {
    return absl::InvalidArgumentError(
        absl::StrCat("shard_id ", shard_id, " >= num_shards ", num_shards));
  }
  if (begin > end || end > n) {
    return absl::InvalidArgumentError(absl::StrCat(
        "range [", begin, ", ", end, ") is not within [0, n = ", n, ")"));
  }
  return absl::OkStatus();
}

absl::Status ValidateSizes(const ShardCheckpoint& c) {
  const uint64_t len = c.end - c.begin;
  if (c.params.size() != len) {
    return absl::InvalidArgumentError(
        absl::StrCat("params has ", c.params.size(), " values, range [",
                     c.begin, ", ", c.end, ") needs ", len));
  }
  if (!c.global_velocity.empty() && c.global_velocity.size() != len) {
    return absl::InvalidArgumentError(
        absl::StrCat("global_velocity has ", c.global_velocity.size(),
                     " values, must be empty or ", len));
  }
  return absl::OkStatus();
}

// Index of the first non-finite value, or -1.
int64_t FirstNonFinite(absl::Span<const float> v) {
  for (size_t i = 0; i < v.size(); ++i) {
    if (!std::isfinite(v[i])) return static_cast<int64_t>(i);
  }
  return -1;
}

absl::Status ValidateForWrite(const ShardCheckpoint& c) {
  GTOPK_RETURN_IF_ERROR(
      ValidateLayout(c.shard_id, c.num_shards, c.n, c.begin, c.end));
  GTOPK_RETURN_IF_ERROR(ValidateSizes(c));
  if (c.next_step < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("next_step ", c.next_step, " is negative"));
  }
  if (const int64_t i = FirstNonFinite(c.params); i >= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("params[", i, "] is not finite (", c.params[i], ")"));
  }
  if (const int64_t i = FirstNonFinite(c.global_velocity); i >= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "global_velocity[", i, "] is not finite (", c.global_velocity[i], ")"));
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Payload streaming.

absl::Status WriteFloats(int fd, absl::Span<const float> v,
                         std::vector<unsigned char>& buf, uint32_t& crc,
                         const std::string& path) {
  for (size_t off = 0; off < v.size(); off += kChunkFloats) {
    const absl::Span<const float> chunk = v.subspan(off, kChunkFloats);
    const size_t bytes = chunk.size() * sizeof(float);
    EncodeFloats(chunk, buf.data());
    crc = Crc(crc, buf.data(), bytes);
    GTOPK_RETURN_IF_ERROR(WriteAll(fd, buf.data(), bytes, path));
  }
  return absl::OkStatus();
}

absl::Status ReadFloats(int fd, absl::Span<float> v,
                        std::vector<unsigned char>& buf, uint32_t& crc,
                        const std::string& path) {
  for (size_t off = 0; off < v.size(); off += kChunkFloats) {
    const absl::Span<float> chunk = v.subspan(off, kChunkFloats);
    const size_t bytes = chunk.size() * sizeof(float);
    GTOPK_RETURN_IF_ERROR(ReadAll(fd, buf.data(), bytes, path));
    crc = Crc(crc, buf.data(), bytes);
    DecodeFloats(buf.data(), chunk);
  }
  return absl::OkStatus();
}

// Writes the whole file to the open temp file `fd`, then fsyncs it.
absl::Status WriteContents(int fd, const ShardCheckpoint& c,
                           const std::string& path) {
  unsigned char header[kCheckpointHeaderBytes];
  std::memcpy(header, kMagic, sizeof(kMagic));
  Put32(header + 8, kCheckpointFormatVersion);
  Put32(header + 12, c.shard_id);
  Put32(header + 16, c.num_shards);
  Put32(header + 20, 0);  // reserved
  Put64(header + 24, c.n);
  Put64(header + 32, c.begin);
  Put64(header + 40, c.end);
  Put64(header + 48, static_cast<uint64_t>(c.next_step));
  Put64(header + 56, c.params.size());
  Put64(header + 64, c.global_velocity.size());
  Put64(header + 72, c.cluster_fingerprint);
  Put64(header + 80, c.run_id);
  uint32_t crc = Crc(0, header, sizeof(header));
  GTOPK_RETURN_IF_ERROR(WriteAll(fd, header, sizeof(header), path));

  const size_t payload_floats =
      std::max(c.params.size(), c.global_velocity.size());
  std::vector<unsigned char> buf(std::min(payload_floats, kChunkFloats) *
                                 sizeof(float));
  GTOPK_RETURN_IF_ERROR(WriteFloats(fd, c.params, buf, crc, path));
  GTOPK_RETURN_IF_ERROR(WriteFloats(fd, c.global_velocity, buf, crc, path));

  unsigned char trailer[kCheckpointTrailerBytes];
  Put32(trailer, crc);
  GTOPK_RETURN_IF_ERROR(WriteAll(fd, trailer, sizeof(trailer), path));
  if (::fsync(fd) != 0) return ErrnoStatus(errno, "fsync", path);
  return absl::OkStatus();
}

}  // namespace

std::string CheckpointPath(const std::string& dir, uint32_t shard_id) {
  return absl::StrCat(dir, "/", FileName(shard_id));
}

absl::Status WriteCheckpoint(const std::string& dir, const ShardCheckpoint& c) {
  if (absl::Status s = ValidateForWrite(c); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "checkpoint of shard ", c.shard_id, " not written: ", s.message()));
  }
  GTOPK_RETURN_IF_ERROR(RemoveStaleTemps(dir, c.shard_id));

  const std::string final_path = CheckpointPath(dir, c.shard_id);
  std::string tmp_path = absl::StrCat(final_path, ".tmp-XXXXXX");
  const int fd = ::mkstemp(tmp_path.data());
  if (fd < 0) return ErrnoStatus(errno, "create temp file", tmp_path);
  Fd file(fd);

  absl::Status s = WriteContents(fd, c, tmp_path);
  if (s.ok()) s = file.Close(tmp_path);
  if (s.ok() && ::rename(tmp_path.c_str(), final_path.c_str()) != 0) {
    s = ErrnoStatus(errno, absl::StrCat("rename ", tmp_path, " to"),
                    final_path);
  }
  if (!s.ok()) {
    ::unlink(tmp_path.c_str());  // best effort; the next write retries
    return s;
  }
  // Makes the rename itself durable.
  return FsyncDir(dir);
}

absl::StatusOr<ShardCheckpoint> ReadCheckpoint(const std::string& dir,
                                               uint32_t shard_id) {
  return ReadCheckpointFile(CheckpointPath(dir, shard_id), shard_id);
}

namespace {

// The header's fields that are not ShardCheckpoint's.
struct HeaderCounts {
  uint32_t reserved = 0;
  uint64_t params = 0;    // floats of params
  uint64_t velocity = 0;  // floats of global_velocity
};

// ReadCheckpointFile's parts, in order: the header (magic, version, fields)
// into `header` and *out; ...
absl::Status ReadHeader(int fd, uint64_t size, const std::string& path,
                        unsigned char (&header)[kCheckpointHeaderBytes],
                        ShardCheckpoint* out, HeaderCounts* counts) {
  auto data_loss = [&path](auto&&... parts) {
    return absl::DataLossError(
        absl::StrCat("checkpoint ", path, ": ", parts...));
  };
  if (size < sizeof(kMagic)) {
    return data_loss("truncated: ", size, " bytes, shorter than the magic");
  }
  GTOPK_RETURN_IF_ERROR(ReadAll(fd, header, sizeof(kMagic), path));
  if (std::memcmp(header, kMagic, sizeof(kMagic)) != 0) {
    return data_loss("bad magic (not a gtopk checkpoint)");
  }
  if (size < kFixedBytes) {
    return data_loss("truncated: ", size, " bytes, a checkpoint has at least ",
                     kFixedBytes);
  }
  GTOPK_RETURN_IF_ERROR(ReadAll(fd, header + sizeof(kMagic),
                                sizeof(header) - sizeof(kMagic), path));
  const uint32_t version = Get32(header + 8);
  if (version == 1) {
    return data_loss(
        "format version 1, written by gtopk before 2026-12-06: it does not "
        "record which cluster and run wrote it, so it cannot be told from "
        "another cluster's checkpoint (this build reads version ",
        kCheckpointFormatVersion, "); remove it to start the shard empty");
  }
  if (version != kCheckpointFormatVersion) {
    return data_loss("unsupported format version ", version,
                     " (this build reads ", kCheckpointFormatVersion, ")");
  }
  ShardCheckpoint& c = *out;
  c.shard_id = Get32(header + 12);
  c.num_shards = Get32(header + 16);
  counts->reserved = Get32(header + 20);
  c.n = Get64(header + 24);
  c.begin = Get64(header + 32);
  c.end = Get64(header + 40);
  c.next_step = static_cast<int64_t>(Get64(header + 48));
  counts->params = Get64(header + 56);
  counts->velocity = Get64(header + 64);
  c.cluster_fingerprint = Get64(header + 72);
  c.run_id = Get64(header + 80);
  return absl::OkStatus();
}

// ... the header against the file's size and against itself ...
absl::Status CheckHeader(const ShardCheckpoint& c, const HeaderCounts& counts,
                         uint32_t shard_id, uint64_t size,
                         const std::string& path) {
  auto data_loss = [&path](auto&&... parts) {
    return absl::DataLossError(
        absl::StrCat("checkpoint ", path, ": ", parts...));
  };
  // The counts against the real file size, before anything is allocated
  // (written so that no product or sum can overflow).
  const uint64_t room = (size - kFixedBytes) / sizeof(float);
  if (counts.params > room || counts.velocity > room - counts.params) {
    return data_loss("truncated: header claims ", counts.params, " + ",
                     counts.velocity, " floats, the file has ", size,
                     " bytes (room for ", room, ")");
  }
  const uint64_t expected_size =
      kFixedBytes + sizeof(float) * (counts.params + counts.velocity);
  if (size != expected_size) {
    return data_loss(size, " bytes, header implies ", expected_size,
                     " (trailing bytes)");
  }

  // Header consistency.
  if (c.shard_id != shard_id) {
    return data_loss("inconsistent header: holds shard ", c.shard_id,
                     ", expected shard ", shard_id);
  }
  if (absl::Status s =
          ValidateLayout(c.shard_id, c.num_shards, c.n, c.begin, c.end);
      !s.ok()) {
    return data_loss("inconsistent header: ", s.message());
  }
  if (counts.reserved != 0) {
    return data_loss("inconsistent header: reserved field is ",
                     counts.reserved);
  }
  if (c.next_step < 0) {
    return data_loss("inconsistent header: next_step ", c.next_step,
                     " is negative");
  }
  const uint64_t len = c.end - c.begin;
  if (counts.params != len) {
    return data_loss("inconsistent header: params count ", counts.params,
                     " != end - begin = ", len);
  }
  if (counts.velocity != 0 && counts.velocity != len) {
    return data_loss("inconsistent header: global_velocity count ",
                     counts.velocity, " is neither 0 nor end - begin = ", len);
  }
  return absl::OkStatus();
}

// ... and the payloads, the checksum over header and payloads, and the
// values' finiteness.
absl::Status ReadPayload(int fd, const unsigned char* header,
                         const HeaderCounts& counts, const std::string& path,
                         ShardCheckpoint* out) {
  auto data_loss = [&path](auto&&... parts) {
    return absl::DataLossError(
        absl::StrCat("checkpoint ", path, ": ", parts...));
  };
  // Payloads: sizes are now bounded by the file size.
  ShardCheckpoint& c = *out;
  c.params.resize(counts.params);
  c.global_velocity.resize(counts.velocity);
  std::vector<unsigned char> buf(
      std::min<uint64_t>(std::max(counts.params, counts.velocity),
                         kChunkFloats) *
      sizeof(float));
  uint32_t crc = Crc(0, header, kCheckpointHeaderBytes);
  GTOPK_RETURN_IF_ERROR(
      ReadFloats(fd, absl::MakeSpan(c.params), buf, crc, path));
  GTOPK_RETURN_IF_ERROR(
      ReadFloats(fd, absl::MakeSpan(c.global_velocity), buf, crc, path));
  unsigned char trailer[kCheckpointTrailerBytes + 1];
  GTOPK_RETURN_IF_ERROR(ReadAll(fd, trailer, kCheckpointTrailerBytes, path));
  // The file must end here, also if it grew after the fstat.
  ssize_t extra;
  do {
    extra = ::read(fd, trailer + kCheckpointTrailerBytes, 1);
  } while (extra < 0 && errno == EINTR);
  if (extra < 0) return ErrnoStatus(errno, "read", path);
  if (extra > 0) return data_loss("trailing bytes after the checksum");

  const uint32_t stored = Get32(trailer);
  if (stored != crc) {
    return data_loss(absl::StrFormat(
        "checksum mismatch (stored crc32 0x%08x, computed 0x%08x)", stored,
        crc));
  }
  if (const int64_t i = FirstNonFinite(c.params); i >= 0) {
    return data_loss("non-finite value at params[", i, "]");
  }
  if (const int64_t i = FirstNonFinite(c.global_velocity); i >= 0) {
    return data_loss("non-finite value at global_velocity[", i, "]");
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ShardCheckpoint> ReadCheckpointFile(const std::string& path,
                                                   uint32_t shard_id) {
  const int raw_fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (raw_fd < 0) {
    if (errno == ENOENT) {
      return absl::NotFoundError(
          absl::StrCat("no checkpoint of shard ", shard_id, " at ", path));
    }
    return ErrnoStatus(errno, "open", path);
  }
  Fd fd(raw_fd);
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return ErrnoStatus(errno, "stat", path);
  if (!S_ISREG(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint ", path, " is not a regular file"));
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);

  unsigned char header[kCheckpointHeaderBytes];
  ShardCheckpoint c;
  HeaderCounts counts;
  GTOPK_RETURN_IF_ERROR(ReadHeader(fd.get(), size, path, header, &c, &counts));
  GTOPK_RETURN_IF_ERROR(CheckHeader(c, counts, shard_id, size, path));
  GTOPK_RETURN_IF_ERROR(ReadPayload(fd.get(), header, counts, path, &c));
  return c;
}

absl::Status ValidateCheckpointFor(const ShardCheckpoint& c, uint32_t shard_id,
                                   uint32_t num_shards, uint64_t n,
                                   uint64_t begin, uint64_t end) {
  if (absl::Status s = ValidateLayout(shard_id, num_shards, n, begin, end);
      !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("expected cluster layout: ", s.message()));
  }
  std::vector<std::string> diffs;
  auto compare = [&diffs](absl::string_view field, uint64_t have,
                          uint64_t want) {
    if (have != want) {
      diffs.push_back(absl::StrCat(field, " is ", have, " in the checkpoint, ",
                                   want, " in this cluster"));
    }
  };
  compare("shard_id", c.shard_id, shard_id);
  compare("num_shards", c.num_shards, num_shards);
  compare("n", c.n, n);
  compare("begin", c.begin, begin);
  compare("end", c.end, end);
  if (!diffs.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint does not belong to this cluster layout: ",
                     absl::StrJoin(diffs, "; ")));
  }
  if (absl::Status s = ValidateSizes(c); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("malformed checkpoint: ", s.message()));
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// History (crash recovery).

namespace {

std::string HistoryPrefix(uint32_t shard_id) {
  return absl::StrCat("shard-", shard_id, ".step-");
}

// The steps of `dir`'s history entries of `shard_id`, ascending. Names that
// do not parse (e.g. a user's copy) are ignored.
absl::StatusOr<std::vector<int64_t>> HistorySteps(const std::string& dir,
                                                  uint32_t shard_id) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return ErrnoStatus(errno, "open dir", dir);
  const std::string prefix = HistoryPrefix(shard_id);
  std::vector<int64_t> steps;
  errno = 0;
  while (const struct dirent* e = ::readdir(d)) {
    absl::string_view name(e->d_name);
    if (!absl::ConsumePrefix(&name, prefix) ||
        !absl::ConsumeSuffix(&name, ".ckpt")) {
      continue;
    }
    int64_t step = -1;
    if (!name.empty() &&
        name.find_first_not_of("0123456789") == absl::string_view::npos &&
        absl::SimpleAtoi(name, &step) && step >= 0) {
      steps.push_back(step);
    }
  }
  const int read_errno = errno;
  ::closedir(d);
  if (read_errno != 0) return ErrnoStatus(read_errno, "list dir", dir);
  std::sort(steps.begin(), steps.end());
  return steps;
}

// Copies `from` to a new file `to` and fsyncs it.
absl::Status CopyFileDurably(const std::string& from, const std::string& to) {
  const int in_fd = ::open(from.c_str(), O_RDONLY | O_CLOEXEC);
  if (in_fd < 0) return ErrnoStatus(errno, "open", from);
  Fd in(in_fd);
  const int out_fd =
      ::open(to.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (out_fd < 0) return ErrnoStatus(errno, "create", to);
  Fd out(out_fd);
  std::vector<unsigned char> buf(kChunkBytes);
  while (true) {
    const ssize_t got = ::read(in.get(), buf.data(), buf.size());
    if (got < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, "read", from);
    }
    if (got == 0) break;
    GTOPK_RETURN_IF_ERROR(
        WriteAll(out.get(), buf.data(), static_cast<size_t>(got), to));
  }
  if (::fsync(out.get()) != 0) return ErrnoStatus(errno, "fsync", to);
  return out.Close(to);
}

// Gives the file `from` the additional name `to`, atomically replacing an
// existing `to` (hard link to a temp name, then rename).
absl::Status LinkReplacing(const std::string& dir, uint32_t shard_id,
                           const std::string& from, const std::string& to) {
  const std::string tmp = absl::StrCat(dir, "/", TempPrefix(shard_id), "link");
  ::unlink(tmp.c_str());
  if (::link(from.c_str(), tmp.c_str()) != 0) {
    const int err = errno;
    if (err != EPERM && err != ENOTSUP && err != EOPNOTSUPP && err != EXDEV &&
        err != EMLINK) {
      return ErrnoStatus(err, absl::StrCat("link ", from, " to"), tmp);
    }
    // No hard links on this file system: copy (and fsync) instead.
    GTOPK_RETURN_IF_ERROR(CopyFileDurably(from, tmp));
  }
  if (::rename(tmp.c_str(), to.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return ErrnoStatus(err, absl::StrCat("rename ", tmp, " to"), to);
  }
  // When `to` already was a link to the same file, POSIX rename() does
  // nothing and succeeds, leaving `tmp` behind: remove it (ENOENT otherwise).
  ::unlink(tmp.c_str());
  return absl::OkStatus();
}

}  // namespace

std::string CheckpointHistoryPath(const std::string& dir, uint32_t shard_id,
                                  int64_t step) {
  return absl::StrCat(dir, "/", HistoryPrefix(shard_id), step, ".ckpt");
}

absl::Status RetainCheckpoint(const std::string& dir, uint32_t shard_id,
                              int64_t step, int keep) {
  if (keep < 1 || step < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "RetainCheckpoint: keep must be >= 1 and step >= 0, got keep ", keep,
        ", step ", step));
  }
  GTOPK_RETURN_IF_ERROR(
      LinkReplacing(dir, shard_id, CheckpointPath(dir, shard_id),
                    CheckpointHistoryPath(dir, shard_id, step)));
  GTOPK_ASSIGN_OR_RETURN(std::vector<int64_t> steps,
                         HistorySteps(dir, shard_id));
  for (size_t i = 0; i + static_cast<size_t>(keep) < steps.size(); ++i) {
    ::unlink(CheckpointHistoryPath(dir, shard_id, steps[i]).c_str());
  }
  return FsyncDir(dir);
}

absl::StatusOr<std::vector<int64_t>> ListCheckpointSteps(const std::string& dir,
                                                         uint32_t shard_id) {
  return HistorySteps(dir, shard_id);
}

absl::StatusOr<ShardCheckpoint> ReadCheckpointAt(const std::string& dir,
                                                 uint32_t shard_id,
                                                 int64_t step) {
  const std::string path = CheckpointHistoryPath(dir, shard_id, step);
  absl::StatusOr<ShardCheckpoint> c = ReadCheckpointFile(path, shard_id);
  if (absl::IsNotFound(c.status())) {
    return absl::NotFoundError(absl::StrCat("shard ", shard_id,
                                            " retains no checkpoint of step ",
                                            step, " in ", dir));
  }
  GTOPK_RETURN_IF_ERROR(c.status());
  if (c->next_step != step) {
    return absl::DataLossError(absl::StrCat("checkpoint ", path, " holds step ",
                                            c->next_step, ", not ", step));
  }
  return c;
}

absl::Status DiscardCheckpointsAfter(const std::string& dir, uint32_t shard_id,
                                     int64_t step) {
  GTOPK_ASSIGN_OR_RETURN(std::vector<int64_t> steps,
                         HistorySteps(dir, shard_id));
  bool removed = false;
  for (int64_t s : steps) {
    if (s <= step) continue;
    const std::string path = CheckpointHistoryPath(dir, shard_id, s);
    if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
      return ErrnoStatus(errno, "unlink", path);
    }
    removed = true;
  }
  return removed ? FsyncDir(dir) : absl::OkStatus();
}

absl::Status RewindCheckpoints(const std::string& dir, uint32_t shard_id,
                               int64_t step) {
  const std::string entry = CheckpointHistoryPath(dir, shard_id, step);
  struct stat st;
  if (::stat(entry.c_str(), &st) != 0) {
    if (errno == ENOENT) {
      return absl::NotFoundError(absl::StrCat("shard ", shard_id,
                                              " retains no checkpoint of step ",
                                              step, " in ", dir));
    }
    return ErrnoStatus(errno, "stat", entry);
  }
  // First the current checkpoint (what a restart restores), durably; then
  // the newer entries. A crash in between leaves newer entries only, which
  // the next start discards (they are newer than the restored step).
  GTOPK_RETURN_IF_ERROR(
      LinkReplacing(dir, shard_id, entry, CheckpointPath(dir, shard_id)));
  GTOPK_RETURN_IF_ERROR(FsyncDir(dir));
  return DiscardCheckpointsAfter(dir, shard_id, step);
}

}  // namespace server
}  // namespace gtopk
