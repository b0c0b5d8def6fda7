// Checkpointer (server/checkpointer.h) on its own, over a ShardAggregator
// and a temporary checkpoint directory: what WriteNow writes and retains,
// that a failed write keeps the previous checkpoint and reports itself
// (health listener, metric), the restore-time checks and the rollback of
// the aggregator and of the checkpoint history.
#include "server/checkpointer.h"

#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "prometheus/registry.h"
#include "server/checkpoint.h"
#include "server/server_config.h"
#include "server/server_metrics.h"
#include "server/shard_aggregator.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"

namespace gtopk {
namespace server {
namespace {

using ::gtopk::testing::IsOk;
using ::gtopk::testing::IsOkAndHolds;
using ::gtopk::testing::StatusIs;
using ::gtopk::testing::TempDir;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

constexpr uint64_t kN = 4;
constexpr uint64_t kFingerprint = 0xf1f2f3f4;
constexpr uint64_t kRunId = 0x1234;

// Shard 0 of 1 holding kN parameters at `step`: params step, step+1, ...
ShardCheckpoint StateAt(int64_t step, uint64_t run_id = 0) {
  ShardCheckpoint c;
  c.shard_id = 0;
  c.num_shards = 1;
  c.n = kN;
  c.begin = 0;
  c.end = kN;
  c.next_step = step;
  for (uint64_t i = 0; i < kN; ++i) {
    c.params.push_back(static_cast<float>(step) + static_cast<float>(i));
  }
  c.global_velocity.assign(kN, 0.0f);
  c.cluster_fingerprint = run_id == 0 ? 0 : kFingerprint;
  c.run_id = run_id;
  return c;
}

class CheckpointerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(dir_.path().empty());
    config_.checkpoint_dir = dir_.path();
    config_.checkpoint_keep = 2;
  }

  // A checkpointer over `config_` that stamps kFingerprint and kRunId.
  std::unique_ptr<Checkpointer> Make() {
    return std::make_unique<Checkpointer>(
        config_, &metrics_, [this](ShardCheckpoint* c) {
          ++stamps_;
          c->cluster_fingerprint = kFingerprint;
          c->run_id = kRunId;
        });
  }

  std::unique_ptr<ShardAggregator> Aggregator() {
    ShardOptions options;
    options.n = kN;
    options.num_workers = 1;
    options.apply = config_.apply;
    absl::StatusOr<std::unique_ptr<ShardAggregator>> aggregator =
        ShardAggregator::Create(options, nullptr);
    if (!aggregator.ok()) {
      ADD_FAILURE() << aggregator.status();
      return nullptr;
    }
    return *std::move(aggregator);
  }

  // Puts `aggregator` at `step` and writes a checkpoint there.
  absl::Status WriteAt(Checkpointer& checkpointer, ShardAggregator& aggregator,
                       int64_t step) {
    absl::Status restored = aggregator.Restore(StateAt(step));
    if (!restored.ok()) return restored;
    return checkpointer.WriteNow(&aggregator);
  }

  TempDir dir_{"checkpointer_test"};
  ServerConfig config_;
  prometheus::Registry registry_;
  ServerMetrics metrics_{registry_};
  int stamps_ = 0;
};

TEST_F(CheckpointerTest, WriteNowWritesTheStampedStateAndRetainsIt) {
  std::unique_ptr<Checkpointer> checkpointer = Make();
  std::unique_ptr<ShardAggregator> aggregator = Aggregator();
  ASSERT_NE(aggregator, nullptr);
  ASSERT_THAT(WriteAt(*checkpointer, *aggregator, 3), IsOk());
  EXPECT_EQ(stamps_, 1);
  absl::StatusOr<ShardCheckpoint> written =
      ReadCheckpoint(dir_.path(), /*shard_id=*/0);
  ASSERT_THAT(written, IsOk());
  EXPECT_EQ(written->next_step, 3);
  EXPECT_THAT(written->params, ElementsAre(3.0f, 4.0f, 5.0f, 6.0f));
  EXPECT_EQ(written->cluster_fingerprint, kFingerprint);
  EXPECT_EQ(written->run_id, kRunId);
  EXPECT_THAT(checkpointer->StepsUpTo(100), IsOkAndHolds(ElementsAre(3)));
  EXPECT_EQ(metrics_.checkpoint_failures(), 0.0);
}

TEST_F(CheckpointerTest, WriteNowKeepsTheNewestCheckpointKeepEntries) {
  config_.checkpoint_keep = 2;
  std::unique_ptr<Checkpointer> checkpointer = Make();
  std::unique_ptr<ShardAggregator> aggregator = Aggregator();
  ASSERT_NE(aggregator, nullptr);
  for (int64_t step : {1, 2, 3, 5}) {
    ASSERT_THAT(WriteAt(*checkpointer, *aggregator, step), IsOk());
  }
  EXPECT_THAT(checkpointer->StepsUpTo(100), IsOkAndHolds(ElementsAre(3, 5)));
  EXPECT_THAT(checkpointer->StepsUpTo(4), IsOkAndHolds(ElementsAre(3)));
  EXPECT_THAT(checkpointer->StepsUpTo(2), IsOkAndHolds(IsEmpty()));
  EXPECT_THAT(ReadCheckpointAt(dir_.path(), 0, 3),
              IsOkAndHolds(::testing::Field(&ShardCheckpoint::next_step, 3)));
}

TEST_F(CheckpointerTest, NothingIsWrittenWithoutADirectoryOrParameters) {
  std::unique_ptr<Checkpointer> checkpointer = Make();
  EXPECT_THAT(checkpointer->WriteNow(nullptr), IsOk());
  // An aggregator without parameters has nothing to keep.
  std::unique_ptr<ShardAggregator> empty = Aggregator();
  ASSERT_NE(empty, nullptr);
  EXPECT_THAT(checkpointer->WriteNow(empty.get()), IsOk());
  EXPECT_THAT(ReadCheckpoint(dir_.path(), 0),
              StatusIs(absl::StatusCode::kNotFound));
  EXPECT_EQ(stamps_, 0);

  config_.checkpoint_dir = "";
  std::unique_ptr<Checkpointer> none = Make();
  std::unique_ptr<ShardAggregator> aggregator = Aggregator();
  ASSERT_NE(aggregator, nullptr);
  ASSERT_THAT(WriteAt(*none, *aggregator, 2), IsOk());
  EXPECT_EQ(stamps_, 0);
  EXPECT_THAT(none->StepsUpTo(100), IsOkAndHolds(IsEmpty()));
}

TEST_F(CheckpointerTest, AFailedWriteKeepsThePreviousCheckpointAndReportsIt) {
  std::unique_ptr<Checkpointer> checkpointer = Make();
  std::vector<bool> health;
  checkpointer->SetHealthListener([&](bool ok) { health.push_back(ok); });
  EXPECT_THAT(health, ElementsAre(true));  // told at once
  std::unique_ptr<ShardAggregator> aggregator = Aggregator();
  ASSERT_NE(aggregator, nullptr);
  ASSERT_THAT(WriteAt(*checkpointer, *aggregator, 1), IsOk());
  struct stat file;
  ASSERT_EQ(::stat(CheckpointPath(dir_.path(), 0).c_str(), &file), 0);

  // RLIMIT_FSIZE applies to root too: writes past it fail with EFBIG.
  rlimit saved;
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &saved), 0);
  auto* old_handler = ::signal(SIGXFSZ, SIG_IGN);
  rlimit small = saved;
  small.rlim_cur = static_cast<rlim_t>(file.st_size / 2);
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  const absl::Status failed = WriteAt(*checkpointer, *aggregator, 2);
  ::setrlimit(RLIMIT_FSIZE, &saved);
  ::signal(SIGXFSZ, old_handler);

  EXPECT_FALSE(failed.ok());
  EXPECT_EQ(metrics_.checkpoint_failures(), 1.0);
  EXPECT_THAT(health, ElementsAre(true, true, false));
  // The previous checkpoint is still the one a restart restores, and the
  // history has no entry of the failed step.
  EXPECT_THAT(ReadCheckpoint(dir_.path(), 0),
              IsOkAndHolds(::testing::Field(&ShardCheckpoint::next_step, 1)));
  EXPECT_THAT(checkpointer->StepsUpTo(100), IsOkAndHolds(ElementsAre(1)));

  ASSERT_THAT(WriteAt(*checkpointer, *aggregator, 3), IsOk());
  EXPECT_THAT(health, ElementsAre(true, true, false, true));
  EXPECT_EQ(metrics_.checkpoint_failures(), 1.0);
  EXPECT_THAT(checkpointer->StepsUpTo(100), IsOkAndHolds(ElementsAre(1, 3)));
}

TEST_F(CheckpointerTest, AListenerSetAfterAFailureIsToldAtOnce) {
  std::unique_ptr<Checkpointer> checkpointer = Make();
  std::unique_ptr<ShardAggregator> aggregator = Aggregator();
  ASSERT_NE(aggregator, nullptr);
  ASSERT_EQ(::rmdir(dir_.path().c_str()), 0);  // the directory is gone
  EXPECT_FALSE(WriteAt(*checkpointer, *aggregator, 1).ok());
  ASSERT_EQ(::mkdir(dir_.path().c_str(), 0700), 0);
  std::vector<bool> health;
  checkpointer->SetHealthListener([&](bool ok) { health.push_back(ok); });
  EXPECT_THAT(health, ElementsAre(false));
}

TEST_F(CheckpointerTest, ReadForRestoreFindsTheCurrentCheckpointOrNone) {
  std::unique_ptr<Checkpointer> checkpointer = Make();
  absl::StatusOr<std::optional<ShardCheckpoint>> none =
      checkpointer->ReadForRestore();
  ASSERT_THAT(none, IsOk());
  EXPECT_FALSE(none->has_value());
  std::unique_ptr<ShardAggregator> aggregator = Aggregator();
  ASSERT_NE(aggregator, nullptr);
  ASSERT_THAT(WriteAt(*checkpointer, *aggregator, 4), IsOk());
  absl::StatusOr<std::optional<ShardCheckpoint>> found =
      checkpointer->ReadForRestore();
  ASSERT_THAT(found, IsOk());
  ASSERT_TRUE(found->has_value());
  EXPECT_EQ((*found)->next_step, 4);
  EXPECT_EQ((*found)->run_id, kRunId);
}

TEST_F(CheckpointerTest, ReadForRestoreRefusesAnotherRunsCheckpoint) {
  config_.checkpoint_keep = 3;
  std::unique_ptr<Checkpointer> checkpointer = Make();
  std::unique_ptr<ShardAggregator> aggregator = Aggregator();
  ASSERT_NE(aggregator, nullptr);
  ASSERT_THAT(WriteAt(*checkpointer, *aggregator, 1), IsOk());
  ASSERT_THAT(WriteAt(*checkpointer, *aggregator, 2), IsOk());
  // Another run's checkpoint put in place of this shard's own.
  ASSERT_THAT(WriteCheckpoint(dir_.path(), StateAt(7, kRunId + 1)), IsOk());
  EXPECT_THAT(checkpointer->ReadForRestore(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("another cluster's or run's checkpoint")));
  // Nothing was changed.
  EXPECT_THAT(checkpointer->StepsUpTo(100), IsOkAndHolds(ElementsAre(1, 2)));
}

TEST_F(CheckpointerTest, RestoredDropsEntriesNewerThanTheRestoredStep) {
  config_.checkpoint_keep = 5;
  std::unique_ptr<Checkpointer> checkpointer = Make();
  std::unique_ptr<ShardAggregator> aggregator = Aggregator();
  ASSERT_NE(aggregator, nullptr);
  for (int64_t step : {1, 2, 3}) {
    ASSERT_THAT(WriteAt(*checkpointer, *aggregator, step), IsOk());
  }
  // A crash during a rollback to step 2: the current checkpoint is step
  // 2's, the history still has step 3.
  ASSERT_THAT(WriteCheckpoint(dir_.path(), StateAt(2, kRunId)), IsOk());
  ASSERT_THAT(checkpointer->Restored(2), IsOk());
  EXPECT_THAT(checkpointer->StepsUpTo(100), IsOkAndHolds(ElementsAre(1, 2)));
}

TEST_F(CheckpointerTest, RollBackRestoresTheRetainedStepAndRewindsHistory) {
  config_.checkpoint_keep = 5;
  std::unique_ptr<Checkpointer> checkpointer = Make();
  std::unique_ptr<ShardAggregator> aggregator = Aggregator();
  ASSERT_NE(aggregator, nullptr);
  for (int64_t step : {1, 2, 3}) {
    ASSERT_THAT(WriteAt(*checkpointer, *aggregator, step), IsOk());
  }
  EXPECT_THAT(checkpointer->RollBack(aggregator.get(), 1), IsOkAndHolds(3));
  EXPECT_EQ(aggregator->next_step(), 1);
  absl::StatusOr<ShardCheckpoint> now = aggregator->Snapshot();
  ASSERT_THAT(now, IsOk());
  EXPECT_THAT(now->params, ElementsAre(1.0f, 2.0f, 3.0f, 4.0f));
  EXPECT_THAT(checkpointer->StepsUpTo(100), IsOkAndHolds(ElementsAre(1)));
  EXPECT_THAT(ReadCheckpoint(dir_.path(), 0),
              IsOkAndHolds(::testing::Field(&ShardCheckpoint::next_step, 1)));
}

TEST_F(CheckpointerTest, RollBackToTheCurrentStepNeedsNoCheckpoint) {
  std::unique_ptr<Checkpointer> checkpointer = Make();
  std::unique_ptr<ShardAggregator> aggregator = Aggregator();
  ASSERT_NE(aggregator, nullptr);
  ASSERT_THAT(aggregator->Restore(StateAt(6)), IsOk());
  EXPECT_THAT(checkpointer->RollBack(aggregator.get(), 6), IsOkAndHolds(6));
  EXPECT_EQ(aggregator->next_step(), 6);
}

TEST_F(CheckpointerTest, RollBackToAStepWithoutACheckpointFails) {
  std::unique_ptr<Checkpointer> checkpointer = Make();
  std::unique_ptr<ShardAggregator> aggregator = Aggregator();
  ASSERT_NE(aggregator, nullptr);
  ASSERT_THAT(WriteAt(*checkpointer, *aggregator, 2), IsOk());
  ASSERT_THAT(aggregator->Restore(StateAt(4)), IsOk());
  EXPECT_THAT(checkpointer->RollBack(aggregator.get(), 3),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("shard 0 is at step 4")));
  EXPECT_EQ(aggregator->next_step(), 4);

  config_.checkpoint_dir = "";
  std::unique_ptr<Checkpointer> none = Make();
  EXPECT_THAT(none->RollBack(aggregator.get(), 2),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("keeps no checkpoints")));
  EXPECT_EQ(aggregator->next_step(), 4);
}

TEST_F(CheckpointerTest, RollBackUnderApplyWorkersRenumbersAndRecordsTheStep) {
  config_.apply = ApplyMode::kWorkers;
  config_.checkpoint_keep = 5;
  std::unique_ptr<Checkpointer> checkpointer = Make();
  std::unique_ptr<ShardAggregator> aggregator = Aggregator();
  ASSERT_NE(aggregator, nullptr);
  ASSERT_THAT(WriteAt(*checkpointer, *aggregator, 2), IsOk());
  ASSERT_THAT(WriteAt(*checkpointer, *aggregator, 4), IsOk());
  // Step 3 has no checkpoint: the shard is renumbered, and a checkpoint of
  // step 3 is written so that a restart comes back there.
  EXPECT_THAT(checkpointer->RollBack(aggregator.get(), 3), IsOkAndHolds(4));
  EXPECT_EQ(aggregator->next_step(), 3);
  EXPECT_THAT(checkpointer->StepsUpTo(100), IsOkAndHolds(ElementsAre(2, 3)));
  absl::StatusOr<ShardCheckpoint> current = ReadCheckpoint(dir_.path(), 0);
  ASSERT_THAT(current, IsOk());
  EXPECT_EQ(current->next_step, 3);
  EXPECT_EQ(current->run_id, kRunId);
}

}  // namespace
}  // namespace server
}  // namespace gtopk
