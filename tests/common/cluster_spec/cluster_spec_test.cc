// The cluster fingerprint (common/cluster_spec/cluster_spec.h): every
// cluster-wide setting changes it, per-process details do not, and the value is
// stable (a golden value: the fingerprint is compared between processes of
// different builds, so its canonical text must not change by accident).
#include "common/cluster_spec/cluster_spec.h"

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "gtopk/v1/gtopk.pb.h"
#include "tests/testing/status_matchers.h"

namespace gtopk {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

v1::ClusterSpec Base() {
  v1::ClusterSpec c;
  c.set_n(1000);
  c.set_num_workers(2);
  for (uint32_t s = 0; s < 2; ++s) {
    v1::ShardSpec* sh = c.add_shards();
    sh->set_shard_id(s);
    sh->set_address("10.0.0." + std::to_string(s + 1) + ":7000");
    sh->set_begin(s * 500);
    sh->set_end((s + 1) * 500);
  }
  c.set_mode(v1::MODE_GTOPK);
  c.set_selection(v1::SELECTION_THRESHOLD);
  c.set_selector("exact");
  c.set_selector_seed(0);
  c.set_index_codec("delta-varint");
  c.set_value_codec("fp32");
  v1::OptimizerSpec* o = c.mutable_optimizer();
  o->set_lr(0.1f);
  o->set_momentum(0.9f);
  o->set_momentum_mode(v1::MOMENTUM_MODE_GLOBAL);
  o->set_momentum_factor_masking(true);
  o->set_density(0.001);
  c.set_step_timeout_ms(30000);
  c.set_max_message_bytes(uint64_t{64} << 20);
  return c;
}

TEST(ClusterFingerprintTest, StableGoldenValueAndNeverZero) {
  const uint64_t f = ClusterFingerprint(Base());
  EXPECT_NE(f, 0u);
  EXPECT_EQ(f, ClusterFingerprint(Base()));
  // FNV-1a 64 of the canonical text, computed independently (Python:
  // "version=gtopk.cluster.v1\nn=1000\nworkers=2\nshards=2\n"
  // "shard=0:0-500\n..." per cluster_spec.cc). Changing the canonical text
  // changes every cluster's identity: bump the version tag and this value
  // together.
  EXPECT_EQ(FingerprintText(f), "0xe863e6cf1d8116dc");
}

TEST(ClusterFingerprintTest, AddedSettingsKeepOlderClustersFingerprints) {
  // A cluster that uses neither setting keeps the golden value above (its
  // checkpoints resume); servers apply spelled out is the same cluster.
  v1::ClusterSpec c = Base();
  c.set_apply(v1::APPLY_SERVERS);
  c.set_checksum_every(0);
  EXPECT_EQ(FingerprintText(ClusterFingerprint(c)), "0xe863e6cf1d8116dc");
  v1::ClusterSpec w = Base();
  w.set_apply(v1::APPLY_WORKERS);
  w.set_checksum_every(100);
  EXPECT_THAT(ClusterSpecDifferences(w, Base(), "on the leader"),
              ::testing::ElementsAre(
                  "--apply is workers here but servers on the leader",
                  "--checksum-every is 100 here but 0 on the leader"));
}

TEST(IdentityOptimizerSpecTest, OnlyTheDensityFieldsSurvive) {
  v1::OptimizerSpec o = Base().optimizer();
  o.set_weight_decay(0.1f);
  o.set_lr_warmup_steps(7);
  o.add_density_warmup(0.25);
  o.set_steps_per_epoch(3);
  const v1::OptimizerSpec id = IdentityOptimizerSpec(o);
  EXPECT_EQ(id.lr(), 1.0f);
  EXPECT_EQ(id.momentum(), 0.0f);
  EXPECT_EQ(id.momentum_mode(), v1::MOMENTUM_MODE_NONE);
  EXPECT_FALSE(id.momentum_factor_masking());
  EXPECT_EQ(id.weight_decay(), 0.0f);
  EXPECT_EQ(id.lr_warmup_steps(), 0);
  EXPECT_EQ(id.density(), o.density());
  ASSERT_EQ(id.density_warmup_size(), 1);
  EXPECT_EQ(id.density_warmup(0), 0.25);
  EXPECT_EQ(id.steps_per_epoch(), 3);
}

TEST(ClusterFingerprintTest, EverySettingChangesItPerProcessDetailsDoNot) {
  const uint64_t base = ClusterFingerprint(Base());
  const std::vector<std::function<void(v1::ClusterSpec&)>> edits = {
      [](v1::ClusterSpec& c) { c.set_n(1001); },
      [](v1::ClusterSpec& c) { c.set_num_workers(3); },
      [](v1::ClusterSpec& c) { c.mutable_shards()->RemoveLast(); },
      [](v1::ClusterSpec& c) { c.mutable_shards(0)->set_end(499); },
      [](v1::ClusterSpec& c) { c.set_mode(v1::MODE_TOPK); },
      [](v1::ClusterSpec& c) { c.set_selection(v1::SELECTION_QUOTA); },
      [](v1::ClusterSpec& c) { c.set_selector("dgc"); },
      [](v1::ClusterSpec& c) { c.set_selector_seed(1); },
      [](v1::ClusterSpec& c) { c.set_index_codec("raw"); },
      [](v1::ClusterSpec& c) { c.set_value_codec("fp16"); },
      [](v1::ClusterSpec& c) {
        c.mutable_optimizer()->set_lr(std::nextafter(0.1f, 1.0f));
      },
      [](v1::ClusterSpec& c) { c.mutable_optimizer()->set_momentum(0.5f); },
      [](v1::ClusterSpec& c) {
        c.mutable_optimizer()->set_momentum_mode(v1::MOMENTUM_MODE_DGC);
      },
      [](v1::ClusterSpec& c) {
        c.mutable_optimizer()->set_momentum_factor_masking(false);
      },
      [](v1::ClusterSpec& c) {
        c.mutable_optimizer()->set_weight_decay(1e-4f);
      },
      [](v1::ClusterSpec& c) { c.mutable_optimizer()->set_lr_warmup_steps(5); },
      [](v1::ClusterSpec& c) { c.mutable_optimizer()->set_density(0.01); },
      [](v1::ClusterSpec& c) {
        c.mutable_optimizer()->add_density_warmup(0.5);
      },
      [](v1::ClusterSpec& c) { c.mutable_optimizer()->set_steps_per_epoch(4); },
      [](v1::ClusterSpec& c) { c.set_step_timeout_ms(29999); },
      [](v1::ClusterSpec& c) { c.set_max_message_bytes(4096); },
      [](v1::ClusterSpec& c) { c.set_apply(v1::APPLY_WORKERS); },
      [](v1::ClusterSpec& c) { c.set_checksum_every(100); },
      [](v1::ClusterSpec& c) {
        c.set_selection(v1::SELECTION_LAYERWISE);
        c.set_bucket_size(40);
      },
      [](v1::ClusterSpec& c) { c.set_bucket_size(41); },
  };
  for (size_t i = 0; i < edits.size(); ++i) {
    v1::ClusterSpec c = Base();
    edits[i](c);
    EXPECT_NE(ClusterFingerprint(c), base) << "edit " << i;
    EXPECT_THAT(ClusterSpecDifferences(c, Base(), "there"),
                ::testing::Not(IsEmpty()))
        << "edit " << i;
  }
  v1::ClusterSpec same = Base();
  same.mutable_shards(1)->set_address("shard-1.gtopk:7000");
  same.set_next_step(42);
  same.set_cluster_fingerprint(123);
  EXPECT_EQ(ClusterFingerprint(same), base);
  EXPECT_THAT(ClusterSpecDifferences(same, Base(), "there"), IsEmpty());
}

TEST(ClusterSpecDifferencesTest, NamesTheBucketSizeAsTheFlagSpellsIt) {
  v1::ClusterSpec here = Base(), there = Base();
  here.set_selection(v1::SELECTION_LAYERWISE);
  there.set_selection(v1::SELECTION_LAYERWISE);
  here.set_bucket_size(uint64_t{25} << 18);  // 25 MiB of fp32
  there.set_bucket_size(uint64_t{1} << 18);  // 1 MiB
  EXPECT_THAT(ClusterSpecDifferences(here, there, "on the leader"),
              ElementsAre("--bucket-mb is 25 (6553600 values) here but 1 "
                          "(262144 values) on the leader"));
}

TEST(WorkerClusterSpecTest, LayerwiseNeedsABucketSizeAndNoOtherHasOne) {
  v1::ClusterSpec c = Base();
  GTOPK_EXPECT_OK(ValidateWorkerClusterSpec(c, 1000, 0));
  c.set_bucket_size(40);  // threshold selection with buckets
  EXPECT_THAT(ValidateWorkerClusterSpec(c, 1000, 0),
              ::gtopk::testing::StatusIs(absl::StatusCode::kInvalidArgument,
                                         ::testing::HasSubstr("bucket_size")));
  c.set_selection(v1::SELECTION_LAYERWISE);
  GTOPK_EXPECT_OK(ValidateWorkerClusterSpec(c, 1000, 0));
  c.set_bucket_size(0);
  EXPECT_THAT(ValidateWorkerClusterSpec(c, 1000, 0),
              ::gtopk::testing::StatusIs(absl::StatusCode::kInvalidArgument,
                                         ::testing::HasSubstr("layerwise")));
}

TEST(ClusterSpecDifferencesTest, NamesEachFlagWithBothValues) {
  v1::ClusterSpec here = Base();
  here.mutable_optimizer()->set_momentum(0.5f);
  here.set_num_workers(3);
  EXPECT_THAT(ClusterSpecDifferences(here, Base(), "on the leader"),
              ElementsAre("--workers is 3 here but 2 on the leader",
                          "--momentum is 0.5 here but 0.9 on the leader"));
}

// The settings check gtopk-worker's flags and the Python optimizer's
// arguments share: every field, in both spellings, against a plain
// statement of the expected message.
TEST(CheckExpectedSettingsTest, EachSettingNamedInFlagAndKeywordSpelling) {
  const v1::ClusterSpec c = Base();  // weight decay 0, momentum mode global
  EXPECT_TRUE(CheckExpectedSettings(ExpectedSettings(), c, "--").ok());
  ExpectedSettings all;
  all.mode = "gtopk";
  all.selection = "exact";  // the old spelling of "threshold"
  all.selector = "exact";
  all.index_codec = "delta-varint";
  all.value_codec = "fp32";
  all.momentum_mode = "global";
  all.density = 0.001;
  all.lr = 0.1;  // the float 0.1f as a double: within 1e-6
  all.momentum = 0.9;
  all.weight_decay = 0.0;
  EXPECT_TRUE(CheckExpectedSettings(all, c, "--").ok());

  struct Case {
    std::function<void(ExpectedSettings&)> set;
    std::string flag_message;     // with prefix "--"
    std::string keyword_message;  // with prefix ""
  };
  const std::vector<Case> cases = {
      {[](ExpectedSettings& e) { e.mode = "dense"; },
       "--mode=dense but the servers' cluster spec has mode gtopk",
       "mode=dense but the servers' cluster spec has mode gtopk"},
      {[](ExpectedSettings& e) { e.selection = "quota"; },
       "--selection=quota but the servers' cluster spec has selection "
       "threshold",
       "selection=quota but the servers' cluster spec has selection "
       "threshold"},
      {[](ExpectedSettings& e) { e.index_codec = "raw"; },
       "--index-codec=raw but the servers' cluster spec has index-codec "
       "delta-varint",
       "index_codec=raw but the servers' cluster spec has index_codec "
       "delta-varint"},
      {[](ExpectedSettings& e) { e.momentum_mode = "dgc"; },
       "--momentum-mode=dgc but the servers' cluster spec has momentum-mode "
       "global",
       "momentum_mode=dgc but the servers' cluster spec has momentum_mode "
       "global"},
      {[](ExpectedSettings& e) { e.lr = 0.2; },
       "--lr=0.2 but the servers' cluster spec has lr 0.1",
       "lr=0.2 but the servers' cluster spec has lr 0.1"},
      {[](ExpectedSettings& e) { e.weight_decay = 1e-4; },
       "--weight-decay=0.0001 but the servers' cluster spec has weight-decay 0",
       "weight_decay=0.0001 but the servers' cluster spec has weight_decay 0"},
      // Zero against a tiny non-zero is a difference, not a rounding.
      {[](ExpectedSettings& e) { e.weight_decay = 1e-9; },
       "--weight-decay=1e-09 but", "weight_decay=1e-09 but"},
  };
  for (const Case& k : cases) {
    ExpectedSettings e = all;
    k.set(e);
    const absl::Status flag = CheckExpectedSettings(e, c, "--");
    EXPECT_EQ(flag.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(std::string(flag.message()),
                ::testing::StartsWith(k.flag_message));
    EXPECT_THAT(std::string(CheckExpectedSettings(e, c, "").message()),
                ::testing::StartsWith(k.keyword_message));
  }

  // An unspecified momentum mode is the documented default, DGC.
  v1::ClusterSpec unspecified = c;
  unspecified.mutable_optimizer()->set_momentum_mode(
      v1::MOMENTUM_MODE_UNSPECIFIED);
  ExpectedSettings dgc;
  dgc.momentum_mode = "dgc";
  EXPECT_TRUE(CheckExpectedSettings(dgc, unspecified, "").ok());
  // A small non-zero weight decay is compared within 1e-6 relative.
  v1::ClusterSpec decayed = c;
  decayed.mutable_optimizer()->set_weight_decay(1e-4f);
  ExpectedSettings wd;
  wd.weight_decay = 1e-4;
  EXPECT_TRUE(CheckExpectedSettings(wd, decayed, "").ok());
}

// The cluster's modes (common/cluster_modes.h) and their wire enums: every
// enumerator against a table written out here, both directions.
TEST(ClusterModesTest, NamesParsesAndProtoRoundTrip) {
  struct ModeRow {
    AggregationMode mode;
    const char* name;
    v1::Mode proto;
  };
  for (const ModeRow& r :
       {ModeRow{AggregationMode::kGtopk, "gtopk", v1::MODE_GTOPK},
        ModeRow{AggregationMode::kTopk, "topk", v1::MODE_TOPK},
        ModeRow{AggregationMode::kDense, "dense", v1::MODE_DENSE}}) {
    EXPECT_EQ(AggregationModeName(r.mode), r.name);
    EXPECT_EQ(*ParseAggregationMode(r.name), r.mode);
    EXPECT_EQ(ToProto(r.mode), r.proto);
    EXPECT_EQ(*AggregationModeFromProto(r.proto), r.mode);
    EXPECT_EQ(ModeFlagValue(r.proto), r.name);
  }
  struct SelectionRow {
    SelectionKind kind;
    const char* name;
    v1::Selection proto;
  };
  for (const SelectionRow& r :
       {SelectionRow{SelectionKind::kThreshold, "threshold",
                     v1::SELECTION_THRESHOLD},
        SelectionRow{SelectionKind::kQuota, "quota", v1::SELECTION_QUOTA},
        SelectionRow{SelectionKind::kLayerwise, "layerwise",
                     v1::SELECTION_LAYERWISE}}) {
    EXPECT_EQ(SelectionKindName(r.kind), r.name);
    EXPECT_EQ(*ParseSelectionKind(r.name), r.kind);
    EXPECT_EQ(ToProto(r.kind), r.proto);
    EXPECT_EQ(*SelectionKindFromProto(r.proto), r.kind);
    EXPECT_EQ(SelectionFlagValue(r.proto), r.name);
  }
  // The old spelling and the old proto name still mean the same selection.
  EXPECT_EQ(*ParseSelectionKind("exact"), SelectionKind::kThreshold);
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
  EXPECT_EQ(static_cast<int>(v1::SELECTION_EXACT),
            static_cast<int>(v1::SELECTION_THRESHOLD));
#pragma GCC diagnostic pop
  struct MomentumRow {
    MomentumMode mode;
    const char* name;
    v1::MomentumMode proto;
  };
  for (const MomentumRow& r :
       {MomentumRow{MomentumMode::kNone, "none", v1::MOMENTUM_MODE_NONE},
        MomentumRow{MomentumMode::kDgcCorrection, "dgc", v1::MOMENTUM_MODE_DGC},
        MomentumRow{MomentumMode::kGlobal, "global",
                    v1::MOMENTUM_MODE_GLOBAL}}) {
    EXPECT_EQ(MomentumModeName(r.mode), r.name);
    EXPECT_EQ(*ParseMomentumMode(r.name), r.mode);
    EXPECT_EQ(ToProto(r.mode), r.proto);
    EXPECT_EQ(*MomentumModeFromProto(r.proto), r.mode);
    EXPECT_EQ(MomentumFlagValue(r.proto), r.name);
  }
  // UNSPECIFIED momentum is the documented default when read; printed as
  // what it is.
  EXPECT_EQ(*MomentumModeFromProto(v1::MOMENTUM_MODE_UNSPECIFIED),
            MomentumMode::kDgcCorrection);
  EXPECT_EQ(MomentumFlagValue(v1::MOMENTUM_MODE_UNSPECIFIED), "unknown(0)");
}

TEST(ClusterModesTest, UnknownNamesAndValuesAreInvalidArgument) {
  const absl::StatusOr<AggregationMode> mode = ParseAggregationMode("sparse");
  EXPECT_EQ(mode.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(mode.status().message(),
            "unknown mode \"sparse\"; known: gtopk, topk, dense");
  EXPECT_EQ(ParseSelectionKind("global").status().message(),
            "unknown selection \"global\"; known: threshold, quota, layerwise");
  EXPECT_EQ(ParseMomentumMode("nesterov").status().message(),
            "unknown momentum mode \"nesterov\"; known: none, dgc, global");
  EXPECT_EQ(ParseAggregationMode("").status().code(),
            absl::StatusCode::kInvalidArgument);

  EXPECT_EQ(AggregationModeFromProto(v1::MODE_UNSPECIFIED).status().message(),
            "cluster spec: unknown mode 0");
  EXPECT_EQ(AggregationModeFromProto(static_cast<v1::Mode>(7)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      SelectionKindFromProto(v1::SELECTION_UNSPECIFIED).status().message(),
      "cluster spec: unknown selection 0");
  EXPECT_EQ(MomentumModeFromProto(static_cast<v1::MomentumMode>(9))
                .status()
                .message(),
            "cluster spec: unknown momentum mode 9");
  EXPECT_EQ(ModeFlagValue(static_cast<v1::Mode>(7)), "unknown(7)");
  EXPECT_EQ(SelectionFlagValue(v1::SELECTION_UNSPECIFIED), "unknown(0)");
}

}  // namespace
}  // namespace gtopk
