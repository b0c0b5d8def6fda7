#include "server/checkpoint.h"

#include <signal.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <new>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/reference.h"
#include "tests/testing/status_matchers.h"

// ---------------------------------------------------------------------------
// Allocation watch: this binary replaces the global operator new so that tests
// can assert on the largest single allocation made while a watch is active
// (e.g. that a hostile header does not make the reader allocate 2^62 bytes,
// and that a large write does not copy the payload).
namespace {
std::atomic<bool> g_watch_allocations{false};
std::atomic<size_t> g_largest_allocation{0};
}  // namespace

// noinline: GCC would otherwise inline the free() into callers and warn
// (-Wmismatched-new-delete) about a pairing that is correct here.
__attribute__((noinline)) void* operator new(size_t size) {
  if (g_watch_allocations.load(std::memory_order_relaxed)) {
    size_t prev = g_largest_allocation.load(std::memory_order_relaxed);
    while (size > prev && !g_largest_allocation.compare_exchange_weak(
                              prev, size, std::memory_order_relaxed)) {
    }
  }
  if (void* p = std::malloc(size == 0 ? 1 : size)) return p;
  throw std::bad_alloc();
}
__attribute__((noinline)) void operator delete(void* p) noexcept {
  std::free(p);
}
__attribute__((noinline)) void operator delete(void* p, size_t) noexcept {
  std::free(p);
}

namespace gtopk {
namespace server {
namespace {

using ::gtopk::testing::BitEqual;
using ::gtopk::testing::FloatBits;
using ::gtopk::testing::StatusIs;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::UnorderedElementsAre;

// Records the largest allocation made between construction and Largest().
class AllocationWatch {
 public:
  AllocationWatch() {
    g_largest_allocation.store(0);
    g_watch_allocations.store(true);
  }
  ~AllocationWatch() { g_watch_allocations.store(false); }
  size_t Largest() const { return g_largest_allocation.load(); }
};

constexpr size_t kHeader = 88;
constexpr size_t kTrailer = 4;

// Independent bitwise CRC-32 (reflected, polynomial 0xEDB88320), as
// documented in checkpoint.h; deliberately not zlib.
uint32_t Crc32(const std::string& bytes, size_t len) {
  uint32_t crc = 0xFFFFFFFFu;
  for (size_t i = 0; i < len; ++i) {
    crc ^= static_cast<unsigned char>(bytes[i]);
    for (int b = 0; b < 8; ++b) crc = (crc >> 1) ^ (0xEDB88320u & -(crc & 1u));
  }
  return ~crc;
}

void Put32(std::string& s, size_t off, uint32_t v) {
  for (int i = 0; i < 4; ++i) s[off + i] = static_cast<char>(v >> (8 * i));
}
void Put64(std::string& s, size_t off, uint64_t v) {
  for (int i = 0; i < 8; ++i) s[off + i] = static_cast<char>(v >> (8 * i));
}
uint32_t Get32(const std::string& s, size_t off) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) {
    v |= uint32_t{static_cast<unsigned char>(s[off + i])} << (8 * i);
  }
  return v;
}
uint64_t Get64(const std::string& s, size_t off) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) {
    v |= uint64_t{static_cast<unsigned char>(s[off + i])} << (8 * i);
  }
  return v;
}

// Recomputes the trailing checksum so a test reaches the check it targets.
void FixCrc(std::string& file) {
  ASSERT_GE(file.size(), kTrailer);
  Put32(file, file.size() - kTrailer, Crc32(file, file.size() - kTrailer));
}

float FromBits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof(f));
  return f;
}

std::vector<float> RandomFloats(size_t count, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(count);
  for (float& x : v) x = dist(rng);
  return v;
}

ShardCheckpoint Make(uint32_t shard_id, uint32_t num_shards, uint64_t n,
                     uint64_t begin, uint64_t end, int64_t next_step,
                     bool with_velocity, uint32_t seed = 1) {
  ShardCheckpoint c;
  c.shard_id = shard_id;
  c.num_shards = num_shards;
  c.n = n;
  c.begin = begin;
  c.end = end;
  c.next_step = next_step;
  c.params = RandomFloats(end - begin, seed);
  if (with_velocity) c.global_velocity = RandomFloats(end - begin, seed + 1);
  return c;
}

void ExpectSame(const ShardCheckpoint& got, const ShardCheckpoint& want) {
  EXPECT_EQ(got.shard_id, want.shard_id);
  EXPECT_EQ(got.num_shards, want.num_shards);
  EXPECT_EQ(got.n, want.n);
  EXPECT_EQ(got.begin, want.begin);
  EXPECT_EQ(got.end, want.end);
  EXPECT_EQ(got.next_step, want.next_step);
  EXPECT_EQ(got.cluster_fingerprint, want.cluster_fingerprint);
  EXPECT_EQ(got.run_id, want.run_id);
  // Bit patterns, so -0.0 vs 0.0 and denormals are told apart.
  EXPECT_TRUE(BitEqual(got.params, want.params)) << "params differ";
  EXPECT_TRUE(BitEqual(got.global_velocity, want.global_velocity))
      << "global_velocity differs";
}

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

// Overwrites one byte in place (no truncation, so no forced flush on ext4).
void PatchByte(const std::string& path, size_t pos, char value) {
  std::fstream f(path, std::ios::binary | std::ios::in | std::ios::out);
  f.seekp(static_cast<std::streamoff>(pos));
  f.put(value);
  ASSERT_TRUE(f.good()) << path;
}

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string base = ::testing::TempDir();
    if (base.empty() || base.back() != '/') base += '/';
    std::string tmpl = base + "checkpoint_test.XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr) << tmpl;
    dir_ = tmpl;
  }
  void TearDown() override {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }

  std::vector<std::string> ListDir() const {
    std::vector<std::string> names;
    for (const auto& e : std::filesystem::directory_iterator(dir_)) {
      names.push_back(e.path().filename().string());
    }
    std::sort(names.begin(), names.end());
    return names;
  }

  // A small valid file: 3 params + 3 velocity values, 100 bytes.
  std::string SmallValidFile(uint32_t shard_id = 0) {
    ShardCheckpoint c = Make(shard_id, 2, 10, 4, 7, 42, true);
    EXPECT_THAT(WriteCheckpoint(dir_, c), ::gtopk::testing::IsOk());
    return ReadBytes(CheckpointPath(dir_, shard_id));
  }

  std::string dir_;
};

// ---------------------------------------------------------------------------
// History (crash recovery).

TEST_F(CheckpointTest, HistoryRetainsTheNewestReadsByStepAndRewinds) {
  for (int64_t step : {3, 6, 9}) {
    GTOPK_ASSERT_OK(WriteCheckpoint(
        dir_, Make(1, 2, 10, 5, 10, step, true, static_cast<uint32_t>(step))));
    GTOPK_ASSERT_OK(RetainCheckpoint(dir_, 1, step, /*keep=*/2));
  }
  GTOPK_ASSERT_OK_AND_ASSIGN(std::vector<int64_t> steps,
                             ListCheckpointSteps(dir_, 1));
  EXPECT_THAT(steps, ElementsAre(6, 9));
  EXPECT_THAT(ListDir(), ElementsAre("shard-1.ckpt", "shard-1.step-6.ckpt",
                                     "shard-1.step-9.ckpt"));
  GTOPK_ASSERT_OK_AND_ASSIGN(ShardCheckpoint at6, ReadCheckpointAt(dir_, 1, 6));
  ExpectSame(at6, Make(1, 2, 10, 5, 10, 6, true, 6));
  EXPECT_THAT(ReadCheckpointAt(dir_, 1, 3),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("step 3")));
  // Another shard's history is separate.
  GTOPK_ASSERT_OK_AND_ASSIGN(std::vector<int64_t> none,
                             ListCheckpointSteps(dir_, 0));
  EXPECT_THAT(none, IsEmpty());

  // Rewind: step 6 becomes the current checkpoint, step 9 is gone.
  GTOPK_ASSERT_OK(RewindCheckpoints(dir_, 1, 6));
  GTOPK_ASSERT_OK_AND_ASSIGN(ShardCheckpoint current, ReadCheckpoint(dir_, 1));
  ExpectSame(current, at6);
  EXPECT_THAT(ListDir(), ElementsAre("shard-1.ckpt", "shard-1.step-6.ckpt"));
  EXPECT_THAT(RewindCheckpoints(dir_, 1, 3),
              StatusIs(absl::StatusCode::kNotFound));
  GTOPK_EXPECT_OK(DiscardCheckpointsAfter(dir_, 1, 5));
  EXPECT_THAT(ListDir(), ElementsAre("shard-1.ckpt"));

  // A history file that holds another step than its name says.
  WriteBytes(CheckpointHistoryPath(dir_, 1, 7),
             ReadBytes(CheckpointPath(dir_, 1)));
  EXPECT_THAT(ReadCheckpointAt(dir_, 1, 7),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("holds step 6")));
  EXPECT_THAT(RetainCheckpoint(dir_, 1, 6, 0),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

// The restart path: the restored checkpoint is retained again under the step
// whose history entry is already a hard link to the same file, and a rollback
// to the step the shard is at links the entry back over the same file. POSIX
// rename() of two links to one inode does nothing and succeeds, so the temp
// name must be removed explicitly (a leaked temp link pins an old checkpoint's
// disk space after the history is pruned).
TEST_F(CheckpointTest, RetainingOrRewindingOntoTheSameFileLeavesNoTempFile) {
  GTOPK_ASSERT_OK(WriteCheckpoint(dir_, Make(1, 2, 10, 5, 10, 4, true, 4)));
  GTOPK_ASSERT_OK(RetainCheckpoint(dir_, 1, 4, /*keep=*/2));
  GTOPK_ASSERT_OK(RetainCheckpoint(dir_, 1, 4, /*keep=*/2));
  EXPECT_THAT(ListDir(), ElementsAre("shard-1.ckpt", "shard-1.step-4.ckpt"));
  GTOPK_ASSERT_OK(RewindCheckpoints(dir_, 1, 4));
  EXPECT_THAT(ListDir(), ElementsAre("shard-1.ckpt", "shard-1.step-4.ckpt"));
  GTOPK_ASSERT_OK_AND_ASSIGN(ShardCheckpoint current, ReadCheckpoint(dir_, 1));
  ExpectSame(current, Make(1, 2, 10, 5, 10, 4, true, 4));
}

// ---------------------------------------------------------------------------
// Round trips.

TEST_F(CheckpointTest, RoundTripIsBitExactIncludingSpecialValues) {
  ShardCheckpoint c;
  c.shard_id = 1;
  c.num_shards = 3;
  c.n = 1000;
  c.begin = 300;
  c.end = 310;
  c.next_step = 123456789012345;
  c.params = {-0.0f,
              0.0f,
              std::numeric_limits<float>::denorm_min(),
              -std::numeric_limits<float>::denorm_min(),
              FLT_MIN,
              -FLT_MIN,
              FLT_MAX,
              -FLT_MAX,
              1.0f,
              FromBits(0x00400001u) /* denormal */};
  c.global_velocity = {
      -0.0f, FromBits(0x807fffffu), 3.0f,  -2.5f, 1e-30f, 0.0f, -0.0f,
      7.0f,  FLT_EPSILON,           -1e30f};
  GTOPK_ASSERT_OK(WriteCheckpoint(dir_, c));
  GTOPK_ASSERT_OK_AND_ASSIGN(ShardCheckpoint got, ReadCheckpoint(dir_, 1));
  ExpectSame(got, c);
  EXPECT_TRUE(std::signbit(got.params[0]));
  EXPECT_THAT(ListDir(), ElementsAre("shard-1.ckpt"));
}

TEST_F(CheckpointTest, RoundTripWithoutVelocity) {
  const ShardCheckpoint c = Make(0, 1, 100, 0, 100, 7, /*with_velocity=*/false);
  GTOPK_ASSERT_OK(WriteCheckpoint(dir_, c));
  GTOPK_ASSERT_OK_AND_ASSIGN(ShardCheckpoint got, ReadCheckpoint(dir_, 0));
  ExpectSame(got, c);
  EXPECT_THAT(got.global_velocity, IsEmpty());
}

TEST_F(CheckpointTest, RoundTripEmptyRange) {
  for (bool with_velocity : {false, true}) {
    const ShardCheckpoint c = Make(2, 4, 10, 5, 5, 0, with_velocity);
    GTOPK_ASSERT_OK(WriteCheckpoint(dir_, c));
    EXPECT_EQ(std::filesystem::file_size(CheckpointPath(dir_, 2)),
              kHeader + kTrailer);
    GTOPK_ASSERT_OK_AND_ASSIGN(ShardCheckpoint got, ReadCheckpoint(dir_, 2));
    ExpectSame(got, c);
  }
  // n = 0: a model with no parameters is still a valid layout.
  const ShardCheckpoint empty = Make(0, 1, 0, 0, 0, 3, false);
  GTOPK_ASSERT_OK(WriteCheckpoint(dir_, empty));
  GTOPK_ASSERT_OK_AND_ASSIGN(ShardCheckpoint got, ReadCheckpoint(dir_, 0));
  ExpectSame(got, empty);
}

TEST_F(CheckpointTest, RoundTripMillionsOfFloatsStreamsWithoutCopying) {
  // 3M + 3M floats = 24 MB: several 1 MiB chunks plus a partial one.
  const uint64_t len = 3'000'017;
  const ShardCheckpoint c = Make(1, 2, 2 * len, len, 2 * len, 99, true, 7);
  {
    AllocationWatch watch;
    GTOPK_ASSERT_OK(WriteCheckpoint(dir_, c));
    // The staging buffer (1 MiB) and small strings, never a payload copy.
    EXPECT_LE(watch.Largest(), size_t{2} << 20);
  }
  EXPECT_EQ(std::filesystem::file_size(CheckpointPath(dir_, 1)),
            kHeader + kTrailer + 8 * len);
  AllocationWatch watch;
  GTOPK_ASSERT_OK_AND_ASSIGN(ShardCheckpoint got, ReadCheckpoint(dir_, 1));
  // The two result vectors themselves, nothing bigger.
  EXPECT_LE(watch.Largest(), len * sizeof(float));
  ExpectSame(got, c);
}

TEST_F(CheckpointTest, FileLayoutMatchesTheDocumentation) {
  ShardCheckpoint c = Make(1, 2, 10, 4, 6, 5, true);
  c.cluster_fingerprint = 0x0123456789ABCDEFull;
  c.run_id = 0xFEDCBA9876543210ull;
  c.params = {1.0f, -0.0f};
  c.global_velocity = {2.0f, 0.5f};
  GTOPK_ASSERT_OK(WriteCheckpoint(dir_, c));
  const std::string f = ReadBytes(CheckpointPath(dir_, 1));
  ASSERT_EQ(f.size(), kHeader + 16 + kTrailer);
  EXPECT_EQ(f.substr(0, 8), "GTOPKCK1");
  EXPECT_EQ(Get32(f, 8), kCheckpointFormatVersion);
  EXPECT_EQ(Get32(f, 12), 1u);                     // shard_id
  EXPECT_EQ(Get32(f, 16), 2u);                     // num_shards
  EXPECT_EQ(Get32(f, 20), 0u);                     // reserved
  EXPECT_EQ(Get64(f, 24), 10u);                    // n
  EXPECT_EQ(Get64(f, 32), 4u);                     // begin
  EXPECT_EQ(Get64(f, 40), 6u);                     // end
  EXPECT_EQ(Get64(f, 48), 5u);                     // next_step
  EXPECT_EQ(Get64(f, 56), 2u);                     // params count
  EXPECT_EQ(Get64(f, 64), 2u);                     // velocity count
  EXPECT_EQ(Get64(f, 72), 0x0123456789ABCDEFull);  // cluster_fingerprint
  EXPECT_EQ(Get64(f, 80), 0xFEDCBA9876543210ull);  // run_id
  EXPECT_EQ(Get32(f, 88), FloatBits(1.0f));
  EXPECT_EQ(Get32(f, 92), 0x80000000u);
  EXPECT_EQ(Get32(f, 96), FloatBits(2.0f));
  EXPECT_EQ(Get32(f, 100), FloatBits(0.5f));
  EXPECT_EQ(Get32(f, 104), Crc32(f, 104));
  GTOPK_ASSERT_OK_AND_ASSIGN(ShardCheckpoint got, ReadCheckpoint(dir_, 1));
  EXPECT_EQ(got.cluster_fingerprint, c.cluster_fingerprint);
  EXPECT_EQ(got.run_id, c.run_id);
}

TEST_F(CheckpointTest, VersionOneHasNoClusterIdentityAndIsRefused) {
  const ShardCheckpoint c = Make(1, 2, 10, 4, 6, 5, false);
  GTOPK_ASSERT_OK(WriteCheckpoint(dir_, c));
  std::string f = ReadBytes(CheckpointPath(dir_, 1));
  f[8] = 1;  // the version field: a file written before 2026-12-06
  WriteBytes(CheckpointPath(dir_, 1), f);
  EXPECT_THAT(ReadCheckpoint(dir_, 1),
              StatusIs(absl::StatusCode::kDataLoss,
                       AllOf(HasSubstr("format version 1"),
                             HasSubstr("which cluster and run"))));
}

TEST_F(CheckpointTest, OverwriteKeepsOnlyTheNewest) {
  const ShardCheckpoint old_c = Make(0, 2, 20, 0, 10, 5, true, 1);
  const ShardCheckpoint new_c = Make(0, 2, 20, 0, 10, 6, false, 2);
  GTOPK_ASSERT_OK(WriteCheckpoint(dir_, old_c));
  GTOPK_ASSERT_OK(WriteCheckpoint(dir_, new_c));
  GTOPK_ASSERT_OK_AND_ASSIGN(ShardCheckpoint got, ReadCheckpoint(dir_, 0));
  ExpectSame(got, new_c);
  EXPECT_THAT(ListDir(), ElementsAre("shard-0.ckpt"));
}

TEST_F(CheckpointTest, ShardsInOneDirectoryAreIndependent) {
  const ShardCheckpoint a = Make(0, 2, 20, 0, 10, 5, false, 1);
  const ShardCheckpoint b = Make(1, 2, 20, 10, 20, 5, false, 2);
  GTOPK_ASSERT_OK(WriteCheckpoint(dir_, a));
  EXPECT_THAT(ReadCheckpoint(dir_, 1),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("shard-1.ckpt")));
  GTOPK_ASSERT_OK(WriteCheckpoint(dir_, b));
  GTOPK_ASSERT_OK_AND_ASSIGN(ShardCheckpoint got_a, ReadCheckpoint(dir_, 0));
  GTOPK_ASSERT_OK_AND_ASSIGN(ShardCheckpoint got_b, ReadCheckpoint(dir_, 1));
  ExpectSame(got_a, a);
  ExpectSame(got_b, b);
}

// ---------------------------------------------------------------------------
// Corruption: every fault is DATA_LOSS, never a crash or a wrong value.

TEST_F(CheckpointTest, EveryTruncationIsDataLoss) {
  const std::string file = SmallValidFile();
  ASSERT_EQ(file.size(), kHeader + 24 + kTrailer);
  const std::string path = CheckpointPath(dir_, 0);
  for (size_t len = 0; len < file.size(); ++len) {
    WriteBytes(path, file.substr(0, len));
    EXPECT_THAT(ReadCheckpoint(dir_, 0),
                StatusIs(absl::StatusCode::kDataLoss, HasSubstr(path)))
        << "truncated to " << len << " bytes";
  }
  WriteBytes(path, file);
  GTOPK_EXPECT_OK(ReadCheckpoint(dir_, 0));
}

TEST_F(CheckpointTest, TrailingBytesAreDataLoss) {
  const std::string file = SmallValidFile();
  const std::string path = CheckpointPath(dir_, 0);
  for (const std::string& extra :
       {std::string(1, '\0'), std::string("abcd"), std::string(1000, 'x')}) {
    WriteBytes(path, file + extra);
    EXPECT_THAT(ReadCheckpoint(dir_, 0),
                StatusIs(absl::StatusCode::kDataLoss, HasSubstr("trailing")));
  }
}

TEST_F(CheckpointTest, EverySingleByteFlipIsDataLoss) {
  const std::string file = SmallValidFile();
  const std::string path = CheckpointPath(dir_, 0);
  for (size_t pos = 0; pos < file.size(); ++pos) {
    for (unsigned mask : {0x01u, 0x10u, 0x80u, 0xFFu}) {
      PatchByte(path, pos, static_cast<char>(file[pos] ^ mask));
      EXPECT_THAT(ReadCheckpoint(dir_, 0),
                  StatusIs(absl::StatusCode::kDataLoss, HasSubstr(path)))
          << "byte " << pos << " xor " << mask;
    }
    PatchByte(path, pos, file[pos]);
  }
  EXPECT_EQ(ReadBytes(path), file);
  GTOPK_EXPECT_OK(ReadCheckpoint(dir_, 0));
}

TEST_F(CheckpointTest, ChecksumMismatchIsNamed) {
  std::string file = SmallValidFile();
  file[kHeader + 5] ^= 0x04;  // inside params[1]
  WriteBytes(CheckpointPath(dir_, 0), file);
  EXPECT_THAT(
      ReadCheckpoint(dir_, 0),
      StatusIs(absl::StatusCode::kDataLoss, HasSubstr("checksum mismatch")));
}

TEST_F(CheckpointTest, HostileCountsAreRejectedWithoutAllocating) {
  const std::string file = SmallValidFile();
  struct Case {
    uint64_t params_count, velocity_count, begin, end, n;
  };
  const uint64_t k60 = uint64_t{1} << 60;
  const uint64_t kMax = std::numeric_limits<uint64_t>::max();
  for (const Case& hc : {
           Case{k60, 0, 0, k60, k60},    // 2^60 floats, self-consistent
           Case{k60, k60, 0, k60, k60},  // and the same velocity
           Case{uint64_t{1} << 62, 0, 0, uint64_t{1} << 62, kMax},  // 4x wraps
           Case{kMax, 0, 0, kMax, kMax},
           Case{3, kMax - 2, 4, 7, 10},  // sum wraps to 0
           Case{kMax, 7, 4, 7, 10},
       }) {
    std::string bad = file;
    Put64(bad, 24, hc.n);
    Put64(bad, 32, hc.begin);
    Put64(bad, 40, hc.end);
    Put64(bad, 56, hc.params_count);
    Put64(bad, 64, hc.velocity_count);
    FixCrc(bad);
    WriteBytes(CheckpointPath(dir_, 0), bad);
    AllocationWatch watch;
    EXPECT_THAT(ReadCheckpoint(dir_, 0),
                StatusIs(absl::StatusCode::kDataLoss, HasSubstr("truncated")))
        << hc.params_count << " + " << hc.velocity_count;
    EXPECT_LT(watch.Largest(), size_t{64} << 10);
  }
}

TEST_F(CheckpointTest, InconsistentHeaderNamesTheFault) {
  const std::string file = SmallValidFile();  // shard 0 of 2, [4, 7) of 10
  struct Case {
    const char* name;
    std::function<void(std::string&)> corrupt;
    const char* message;
  };
  const Case cases[] = {
      {"magic", [](std::string& f) { f[0] = 'X'; }, "bad magic"},
      {"version", [](std::string& f) { Put32(f, 8, 3); },
       "unsupported format version 3"},
      {"wrong shard", [](std::string& f) { Put32(f, 12, 1); },
       "holds shard 1, expected shard 0"},
      {"no shards", [](std::string& f) { Put32(f, 16, 0); }, "num_shards is 0"},
      {"reserved", [](std::string& f) { Put32(f, 20, 9); }, "reserved"},
      {"begin > end", [](std::string& f) { Put64(f, 32, 8); }, "range [8, 7)"},
      {"end > n", [](std::string& f) { Put64(f, 24, 6); }, "n = 6"},
      {"count vs range",
       [](std::string& f) {
         Put64(f, 56, 6);  // 6 params + 0 velocity: same file size
         Put64(f, 64, 0);
       },
       "params count 6 != end - begin = 3"},
      {"velocity count",
       [](std::string& f) {
         Put64(f, 40, 5);  // range of 1; 1 param + 5 velocity
         Put64(f, 56, 1);
         Put64(f, 64, 5);
       },
       "global_velocity count 5"},
      {"negative step",
       [](std::string& f) { Put64(f, 48, static_cast<uint64_t>(-3)); },
       "next_step -3"},
      {"NaN param", [](std::string& f) { Put32(f, kHeader + 4, 0x7fc00000u); },
       "non-finite value at params[1]"},
      {"Inf velocity",
       [](std::string& f) { Put32(f, kHeader + 12 + 8, 0xff800000u); },
       "non-finite value at global_velocity[2]"},
  };
  for (const Case& tc : cases) {
    std::string bad = file;
    tc.corrupt(bad);
    FixCrc(bad);
    WriteBytes(CheckpointPath(dir_, 0), bad);
    EXPECT_THAT(ReadCheckpoint(dir_, 0),
                StatusIs(absl::StatusCode::kDataLoss, HasSubstr(tc.message)))
        << tc.name;
  }
}

// ---------------------------------------------------------------------------
// Missing files, unusable directories, crashes.

TEST_F(CheckpointTest, MissingIsNotFound) {
  EXPECT_THAT(ReadCheckpoint(dir_, 0),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("shard-0.ckpt")));
  EXPECT_THAT(ReadCheckpoint(dir_ + "/no-such-dir", 3),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("shard-3.ckpt")));
}

TEST_F(CheckpointTest, NonRegularFileIsAnError) {
  ASSERT_EQ(::mkdir(CheckpointPath(dir_, 0).c_str(), 0700), 0);
  EXPECT_THAT(ReadCheckpoint(dir_, 0),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("not a regular file")));
}

TEST_F(CheckpointTest, UnusableDirectoryIsAnErrorNotACrash) {
  const ShardCheckpoint c = Make(0, 1, 8, 0, 8, 1, false);
  // Tests run as root, where permission bits do not stop writes: use paths
  // that no user can create files under.
  const std::string file = dir_ + "/regular-file";
  WriteBytes(file, "x");
  for (const std::string& bad_dir :
       {file, file + "/sub", dir_ + "/missing", dir_ + "/missing/sub"}) {
    const absl::Status s = WriteCheckpoint(bad_dir, c);
    EXPECT_FALSE(s.ok()) << bad_dir;
    EXPECT_THAT(std::string(s.message()), HasSubstr(bad_dir));
  }
  EXPECT_THAT(WriteCheckpoint(dir_ + "/missing", c),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("missing")));
  EXPECT_THAT(ListDir(), ElementsAre("regular-file"));
}

TEST_F(CheckpointTest, FailedWriteRemovesTempAndKeepsThePreviousCheckpoint) {
  const ShardCheckpoint old_c = Make(0, 1, 16, 0, 16, 3, false, 1);
  GTOPK_ASSERT_OK(WriteCheckpoint(dir_, old_c));
  // RLIMIT_FSIZE applies to root too: writes past it fail with EFBIG.
  struct rlimit saved;
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &saved), 0);
  auto* old_handler = ::signal(SIGXFSZ, SIG_IGN);
  struct rlimit small = saved;
  small.rlim_cur = 4096;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  const ShardCheckpoint big = Make(0, 1, 100'000, 0, 100'000, 4, true, 2);
  const absl::Status s = WriteCheckpoint(dir_, big);
  ::setrlimit(RLIMIT_FSIZE, &saved);
  ::signal(SIGXFSZ, old_handler);
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.message()), HasSubstr("shard-0.ckpt.tmp-"));
  EXPECT_THAT(ListDir(), ElementsAre("shard-0.ckpt"));
  GTOPK_ASSERT_OK_AND_ASSIGN(ShardCheckpoint got, ReadCheckpoint(dir_, 0));
  ExpectSame(got, old_c);
}

TEST_F(CheckpointTest, LeftoverTempFilesAreIgnoredThenCleaned) {
  // A crash before the rename: only a temp file, no checkpoint.
  WriteBytes(dir_ + "/shard-0.ckpt.tmp-crash1", "partial garbage");
  EXPECT_THAT(ReadCheckpoint(dir_, 0),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("shard-0.ckpt")));
  // A crash after an earlier good write: the good one is read.
  const ShardCheckpoint c = Make(0, 2, 20, 0, 10, 8, true, 1);
  GTOPK_ASSERT_OK(WriteCheckpoint(dir_, c));
  WriteBytes(dir_ + "/shard-0.ckpt.tmp-crash2",
             ReadBytes(CheckpointPath(dir_, 0)).substr(0, 50));
  WriteBytes(dir_ + "/shard-0.ckpt.tmp-crash3", "x");
  WriteBytes(dir_ + "/shard-1.ckpt.tmp-other", "another shard's");
  GTOPK_ASSERT_OK_AND_ASSIGN(ShardCheckpoint before, ReadCheckpoint(dir_, 0));
  ExpectSame(before, c);
  // The next write of shard 0 removes shard 0's leftovers only: shard 1's
  // writer may be running right now.
  const ShardCheckpoint next = Make(0, 2, 20, 0, 10, 9, true, 2);
  GTOPK_ASSERT_OK(WriteCheckpoint(dir_, next));
  EXPECT_THAT(ListDir(),
              UnorderedElementsAre("shard-0.ckpt", "shard-1.ckpt.tmp-other"));
  GTOPK_ASSERT_OK_AND_ASSIGN(ShardCheckpoint got, ReadCheckpoint(dir_, 0));
  ExpectSame(got, next);
}

// ---------------------------------------------------------------------------
// Write-side validation.

TEST_F(CheckpointTest, WriteRejectsInvalidCheckpoints) {
  struct Case {
    const char* name;
    std::function<void(ShardCheckpoint&)> mutate;
    const char* message;
  };
  const Case cases[] = {
      {"no shards", [](ShardCheckpoint& c) { c.num_shards = 0; },
       "num_shards is 0"},
      {"shard id", [](ShardCheckpoint& c) { c.shard_id = 4; },
       "shard_id 4 >= num_shards 4"},
      {"begin > end", [](ShardCheckpoint& c) { c.begin = 20; }, "[20, 13)"},
      {"end > n", [](ShardCheckpoint& c) { c.n = 12; }, "n = 12"},
      {"params size", [](ShardCheckpoint& c) { c.params.pop_back(); },
       "params has 2 values"},
      {"velocity size",
       [](ShardCheckpoint& c) { c.global_velocity.push_back(1.0f); },
       "global_velocity has 4 values"},
      {"negative step", [](ShardCheckpoint& c) { c.next_step = -1; },
       "next_step -1"},
      {"NaN param",
       [](ShardCheckpoint& c) {
         c.params[2] = std::numeric_limits<float>::quiet_NaN();
       },
       "params[2] is not finite"},
      {"Inf velocity",
       [](ShardCheckpoint& c) {
         c.global_velocity[1] = -std::numeric_limits<float>::infinity();
       },
       "global_velocity[1] is not finite"},
  };
  for (const Case& tc : cases) {
    ShardCheckpoint c = Make(3, 4, 16, 10, 13, 5, true);
    tc.mutate(c);
    EXPECT_THAT(
        WriteCheckpoint(dir_, c),
        StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(tc.message)))
        << tc.name;
  }
  EXPECT_THAT(ListDir(), IsEmpty());
}

// ---------------------------------------------------------------------------
// ValidateCheckpointFor.

TEST(ValidateCheckpointForTest, AcceptsItsOwnLayout) {
  const ShardCheckpoint c = Make(1, 3, 30, 10, 20, 4, true);
  GTOPK_EXPECT_OK(ValidateCheckpointFor(c, 1, 3, 30, 10, 20));
}

TEST(ValidateCheckpointForTest, MismatchesNameBothValues) {
  const ShardCheckpoint c = Make(1, 3, 30, 10, 20, 4, false);
  const auto code = absl::StatusCode::kFailedPrecondition;
  EXPECT_THAT(ValidateCheckpointFor(c, 2, 3, 30, 10, 20),
              StatusIs(code, HasSubstr("shard_id is 1 in the checkpoint, 2 "
                                       "in this cluster")));
  EXPECT_THAT(
      ValidateCheckpointFor(c, 1, 4, 30, 10, 20),
      StatusIs(code, HasSubstr("num_shards is 3 in the checkpoint, 4")));
  EXPECT_THAT(ValidateCheckpointFor(c, 1, 3, 31, 10, 20),
              StatusIs(code, HasSubstr("n is 30 in the checkpoint, 31")));
  EXPECT_THAT(ValidateCheckpointFor(c, 1, 3, 30, 11, 20),
              StatusIs(code, HasSubstr("begin is 10 in the checkpoint, 11")));
  EXPECT_THAT(ValidateCheckpointFor(c, 1, 3, 30, 10, 21),
              StatusIs(code, HasSubstr("end is 20 in the checkpoint, 21")));
  // Several at once are all named.
  EXPECT_THAT(
      ValidateCheckpointFor(c, 1, 2, 40, 20, 40),
      StatusIs(code, AllOf(HasSubstr("num_shards is 3"), HasSubstr("n is 30"),
                           HasSubstr("begin is 10"), HasSubstr("end is 20"))));
}

TEST(ValidateCheckpointForTest, InvalidExpectedLayoutOrMalformedCheckpoint) {
  ShardCheckpoint c = Make(1, 3, 30, 10, 20, 4, false);
  EXPECT_THAT(ValidateCheckpointFor(c, 3, 3, 30, 10, 20),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("shard_id 3 >= num_shards 3")));
  EXPECT_THAT(ValidateCheckpointFor(c, 1, 3, 30, 20, 10),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("range")));
  c.params.resize(3);
  EXPECT_THAT(ValidateCheckpointFor(c, 1, 3, 30, 10, 20),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("params has 3 values")));
}

// ---------------------------------------------------------------------------
// Concurrency.

TEST_F(CheckpointTest, DistinctShardsWriteConcurrently) {
  constexpr uint32_t kShards = 4;
  constexpr int kRounds = 10;
  std::vector<std::thread> threads;
  std::vector<absl::Status> errors(kShards);
  for (uint32_t s = 0; s < kShards; ++s) {
    threads.emplace_back([this, s, &errors] {
      for (int r = 0; r < kRounds && errors[s].ok(); ++r) {
        errors[s] =
            WriteCheckpoint(dir_, Make(s, kShards, 4000, s * 1000,
                                       (s + 1) * 1000, r, true, s * 100 + r));
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (uint32_t s = 0; s < kShards; ++s) {
    GTOPK_EXPECT_OK(errors[s]) << "shard " << s;
    GTOPK_ASSERT_OK_AND_ASSIGN(ShardCheckpoint got, ReadCheckpoint(dir_, s));
    ExpectSame(got, Make(s, kShards, 4000, s * 1000, (s + 1) * 1000,
                         kRounds - 1, true, s * 100 + kRounds - 1));
  }
  EXPECT_EQ(ListDir().size(), kShards);
}

TEST_F(CheckpointTest, ReaderDuringWritesSeesOldOrNewNeverPartial) {
  constexpr int kWrites = 30;
  const uint64_t len = 50'000;  // 400 KB per file: writes take a while
  auto make = [len](int step) {
    ShardCheckpoint c = Make(0, 1, len, 0, len, step, true);
    std::fill(c.params.begin(), c.params.end(), static_cast<float>(step));
    std::fill(c.global_velocity.begin(), c.global_velocity.end(),
              static_cast<float>(-step));
    return c;
  };
  GTOPK_ASSERT_OK(WriteCheckpoint(dir_, make(0)));
  std::atomic<bool> done{false};
  absl::Status writer_status;
  std::thread writer([&] {
    for (int step = 1; step <= kWrites && writer_status.ok(); ++step) {
      writer_status = WriteCheckpoint(dir_, make(step));
    }
    done.store(true);
  });
  int reads = 0;
  int64_t last_step = 0;
  while (!done.load() || reads == 0) {
    absl::StatusOr<ShardCheckpoint> got = ReadCheckpoint(dir_, 0);
    ASSERT_TRUE(got.ok()) << got.status();
    const float v = static_cast<float>(got->next_step);
    EXPECT_GE(got->next_step, last_step);  // never goes back
    last_step = got->next_step;
    EXPECT_TRUE(std::all_of(got->params.begin(), got->params.end(),
                            [v](float x) { return x == v; }));
    EXPECT_TRUE(std::all_of(got->global_velocity.begin(),
                            got->global_velocity.end(),
                            [v](float x) { return x == -v; }));
    ++reads;
  }
  writer.join();
  GTOPK_EXPECT_OK(writer_status);
  GTOPK_ASSERT_OK_AND_ASSIGN(ShardCheckpoint final_c, ReadCheckpoint(dir_, 0));
  EXPECT_EQ(final_c.next_step, kWrites);
}

}  // namespace
}  // namespace server
}  // namespace gtopk
