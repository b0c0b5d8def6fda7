#include "common/cluster_spec/cluster_spec.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/strip.h"
#include "common/status_macros.h"

namespace gtopk {
namespace {

// FNV-1a 64 (Fowler, Noll, Vo): offset basis and prime.
constexpr uint64_t kFnvOffset = 0xcbf29ce484222325ull;
constexpr uint64_t kFnvPrime = 0x100000001b3ull;

class Fnv1a {
 public:
  void Add(absl::string_view key, absl::string_view value) {
    Bytes(key);
    Bytes("=");
    Bytes(value);
    Bytes("\n");
  }
  void Add(absl::string_view key, uint64_t value) {
    Add(key, absl::StrCat(value));
  }
  void Add(absl::string_view key, int64_t value) {
    Add(key, absl::StrCat(value));
  }
  void AddFloat(absl::string_view key, float value) {
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof(bits));
    Add(key, absl::StrFormat("%08x", bits));
  }
  void AddDouble(absl::string_view key, double value) {
    uint64_t bits;
    std::memcpy(&bits, &value, sizeof(bits));
    Add(key, absl::StrFormat("%016x", bits));
  }
  uint64_t hash() const { return hash_; }

 private:
  void Bytes(absl::string_view s) {
    for (const char c : s) {
      hash_ ^= static_cast<uint8_t>(c);
      hash_ *= kFnvPrime;
    }
  }
  uint64_t hash_ = kFnvOffset;
};

// The shortest decimal that reads back as exactly `v` (so that values that
// differ in their last bit print differently, and 0.1f prints as 0.1).
template <typename T>
std::string ShortestNumber(T v) {
  for (int digits = 1; digits <= 17; ++digits) {
    const std::string text = absl::StrFormat("%.*g", digits, v);
    if (static_cast<T>(std::strtod(text.c_str(), nullptr)) == v) return text;
  }
  return absl::StrFormat("%.17g", v);
}

}  // namespace

v1::Mode ToProto(AggregationMode mode) {
  switch (mode) {
    case AggregationMode::kGtopk:
      return v1::MODE_GTOPK;
    case AggregationMode::kTopk:
      return v1::MODE_TOPK;
    case AggregationMode::kDense:
      return v1::MODE_DENSE;
  }
  return v1::MODE_UNSPECIFIED;
}

v1::Selection ToProto(SelectionKind kind) {
  switch (kind) {
    case SelectionKind::kThreshold:
      return v1::SELECTION_THRESHOLD;
    case SelectionKind::kQuota:
      return v1::SELECTION_QUOTA;
    case SelectionKind::kLayerwise:
      return v1::SELECTION_LAYERWISE;
  }
  return v1::SELECTION_UNSPECIFIED;
}

v1::MomentumMode ToProto(MomentumMode mode) {
  switch (mode) {
    case MomentumMode::kNone:
      return v1::MOMENTUM_MODE_NONE;
    case MomentumMode::kDgcCorrection:
      return v1::MOMENTUM_MODE_DGC;
    case MomentumMode::kGlobal:
      return v1::MOMENTUM_MODE_GLOBAL;
  }
  return v1::MOMENTUM_MODE_UNSPECIFIED;
}

v1::Apply ToProto(ApplyMode mode) {
  switch (mode) {
    case ApplyMode::kServers:
      return v1::APPLY_SERVERS;
    case ApplyMode::kWorkers:
      return v1::APPLY_WORKERS;
  }
  return v1::APPLY_UNSPECIFIED;
}

absl::StatusOr<ApplyMode> ApplyModeFromProto(v1::Apply apply) {
  switch (apply) {
    case v1::APPLY_UNSPECIFIED:  // clusters from before the field
    case v1::APPLY_SERVERS:
      return ApplyMode::kServers;
    case v1::APPLY_WORKERS:
      return ApplyMode::kWorkers;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "cluster spec: unknown apply mode ", static_cast<int>(apply)));
  }
}

std::string ApplyFlagValue(v1::Apply apply) {
  const absl::StatusOr<ApplyMode> m = ApplyModeFromProto(apply);
  return m.ok() ? std::string(ApplyModeName(*m))
                : absl::StrCat("unknown(", static_cast<int>(apply), ")");
}

v1::OptimizerSpec IdentityOptimizerSpec(const v1::OptimizerSpec& spec) {
  v1::OptimizerSpec o = spec;
  o.set_lr(1.0f);
  o.set_momentum(0.0f);
  o.set_momentum_mode(v1::MOMENTUM_MODE_NONE);
  o.set_momentum_factor_masking(false);
  o.set_weight_decay(0.0f);
  o.set_lr_warmup_steps(0);
  return o;
}

absl::StatusOr<AggregationMode> AggregationModeFromProto(v1::Mode mode) {
  switch (mode) {
    case v1::MODE_GTOPK:
      return AggregationMode::kGtopk;
    case v1::MODE_TOPK:
      return AggregationMode::kTopk;
    case v1::MODE_DENSE:
      return AggregationMode::kDense;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("cluster spec: unknown mode ", static_cast<int>(mode)));
  }
}

absl::StatusOr<SelectionKind> SelectionKindFromProto(v1::Selection selection) {
  switch (selection) {
    case v1::SELECTION_THRESHOLD:
      return SelectionKind::kThreshold;
    case v1::SELECTION_QUOTA:
      return SelectionKind::kQuota;
    case v1::SELECTION_LAYERWISE:
      return SelectionKind::kLayerwise;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "cluster spec: unknown selection ", static_cast<int>(selection)));
  }
}

absl::StatusOr<MomentumMode> MomentumModeFromProto(v1::MomentumMode mode) {
  switch (mode) {
    case v1::MOMENTUM_MODE_NONE:
      return MomentumMode::kNone;
    case v1::MOMENTUM_MODE_UNSPECIFIED:  // the documented default
    case v1::MOMENTUM_MODE_DGC:
      return MomentumMode::kDgcCorrection;
    case v1::MOMENTUM_MODE_GLOBAL:
      return MomentumMode::kGlobal;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "cluster spec: unknown momentum mode ", static_cast<int>(mode)));
  }
}

std::string ModeFlagValue(v1::Mode mode) {
  const absl::StatusOr<AggregationMode> m = AggregationModeFromProto(mode);
  return m.ok() ? std::string(AggregationModeName(*m))
                : absl::StrCat("unknown(", static_cast<int>(mode), ")");
}

std::string SelectionFlagValue(v1::Selection selection) {
  const absl::StatusOr<SelectionKind> s = SelectionKindFromProto(selection);
  return s.ok() ? std::string(SelectionKindName(*s))
                : absl::StrCat("unknown(", static_cast<int>(selection), ")");
}

std::string MomentumFlagValue(v1::MomentumMode mode) {
  const absl::StatusOr<MomentumMode> m = MomentumModeFromProto(mode);
  return m.ok() && mode != v1::MOMENTUM_MODE_UNSPECIFIED
             ? std::string(MomentumModeName(*m))
             : absl::StrCat("unknown(", static_cast<int>(mode), ")");
}

uint64_t ClusterFingerprint(const v1::ClusterSpec& spec) {
  Fnv1a h;
  h.Add("version", "gtopk.cluster.v1");
  h.Add("n", uint64_t{spec.n()});
  h.Add("workers", uint64_t{spec.num_workers()});
  h.Add("shards", static_cast<uint64_t>(spec.shards_size()));
  for (const v1::ShardSpec& s : spec.shards()) {
    h.Add("shard", absl::StrCat(s.shard_id(), ":", s.begin(), "-", s.end()));
  }
  h.Add("mode", static_cast<int64_t>(spec.mode()));
  h.Add("selection", static_cast<int64_t>(spec.selection()));
  h.Add("selector", spec.selector());
  h.Add("seed", uint64_t{spec.selector_seed()});
  h.Add("index_codec", spec.index_codec());
  h.Add("value_codec", spec.value_codec());
  const v1::OptimizerSpec& o = spec.optimizer();
  h.AddFloat("lr", o.lr());
  h.AddFloat("momentum", o.momentum());
  h.Add("momentum_mode", static_cast<int64_t>(o.momentum_mode()));
  h.Add("momentum_masking", uint64_t{o.momentum_factor_masking() ? 1u : 0u});
  h.AddFloat("weight_decay", o.weight_decay());
  h.Add("lr_warmup_steps", int64_t{o.lr_warmup_steps()});
  h.AddDouble("density", o.density());
  h.Add("density_warmup", static_cast<uint64_t>(o.density_warmup_size()));
  for (const double d : o.density_warmup()) h.AddDouble("density_warmup", d);
  h.Add("steps_per_epoch", int64_t{o.steps_per_epoch()});
  h.Add("step_timeout_ms", uint64_t{spec.step_timeout_ms()});
  h.Add("max_message_bytes", uint64_t{spec.max_message_bytes()});
  // Added later: only when set, so older clusters keep their fingerprint.
  if (spec.apply() != v1::APPLY_UNSPECIFIED &&
      spec.apply() != v1::APPLY_SERVERS) {
    h.Add("apply", static_cast<int64_t>(spec.apply()));
  }
  if (spec.checksum_every() != 0) {
    h.Add("checksum_every", uint64_t{spec.checksum_every()});
  }
  if (spec.bucket_size() != 0) {
    h.Add("bucket_size", uint64_t{spec.bucket_size()});
  }
  const uint64_t hash = h.hash();
  return hash == 0 ? 1 : hash;  // 0 is "absent" on the wire
}

namespace {

// `name` in flag spelling ("index-codec"); as a keyword argument (empty
// prefix) with underscores ("index_codec").
absl::Status Mismatch(absl::string_view prefix, absl::string_view name,
                      absl::string_view mine, absl::string_view servers) {
  const std::string shown = prefix.empty()
                                ? absl::StrReplaceAll(name, {{"-", "_"}})
                                : std::string(name);
  return absl::FailedPreconditionError(absl::StrCat(
      prefix, shown, "=", mine, " but the servers' cluster spec has ", shown,
      " ", servers, " (configure the servers and workers alike)"));
}

// The canonical spelling of a mode name (an alias such as "exact" becomes
// "threshold"); an unknown name stays as it is, so that it mismatches.
template <typename Parse, typename Name>
std::string Canonical(const std::string& name, Parse parse, Name name_of) {
  const auto parsed = parse(name);
  return parsed.ok() ? std::string(name_of(*parsed)) : name;
}

bool Close(double a, double b) {
  return std::fabs(a - b) <= 1e-6 * std::max(1.0, std::fabs(a));
}

}  // namespace

absl::Status CheckExpectedSettings(const ExpectedSettings& e,
                                   const v1::ClusterSpec& c,
                                   absl::string_view prefix) {
  if (e.mode && Canonical(*e.mode, ParseAggregationMode, AggregationModeName) !=
                    ModeFlagValue(c.mode())) {
    return Mismatch(prefix, "mode", *e.mode, ModeFlagValue(c.mode()));
  }
  if (e.selection &&
      Canonical(*e.selection, ParseSelectionKind, SelectionKindName) !=
          SelectionFlagValue(c.selection())) {
    return Mismatch(prefix, "selection", *e.selection,
                    SelectionFlagValue(c.selection()));
  }
  if (e.selector && *e.selector != c.selector()) {
    return Mismatch(prefix, "selector", *e.selector, c.selector());
  }
  if (e.index_codec && *e.index_codec != c.index_codec()) {
    return Mismatch(prefix, "index-codec", *e.index_codec, c.index_codec());
  }
  if (e.value_codec && *e.value_codec != c.value_codec()) {
    return Mismatch(prefix, "value-codec", *e.value_codec, c.value_codec());
  }
  if (e.density && !Close(*e.density, c.optimizer().density())) {
    return Mismatch(prefix, "density", absl::StrCat(*e.density),
                    absl::StrCat(c.optimizer().density()));
  }
  if (e.lr && !Close(*e.lr, c.optimizer().lr())) {
    return Mismatch(prefix, "lr", absl::StrCat(*e.lr),
                    absl::StrCat(c.optimizer().lr()));
  }
  if (e.momentum && !Close(*e.momentum, c.optimizer().momentum())) {
    return Mismatch(prefix, "momentum", absl::StrCat(*e.momentum),
                    absl::StrCat(c.optimizer().momentum()));
  }
  // Relative: weight decays are small (1e-4), and 0 means "none".
  if (e.weight_decay &&
      std::fabs(*e.weight_decay - c.optimizer().weight_decay()) >
          1e-6 * std::max(std::fabs(*e.weight_decay),
                          std::fabs(double{c.optimizer().weight_decay()}))) {
    return Mismatch(prefix, "weight-decay", absl::StrCat(*e.weight_decay),
                    absl::StrCat(c.optimizer().weight_decay()));
  }
  if (e.momentum_mode) {
    // UNSPECIFIED is the documented default: DGC momentum correction.
    const v1::MomentumMode mode =
        c.optimizer().momentum_mode() == v1::MOMENTUM_MODE_UNSPECIFIED
            ? v1::MOMENTUM_MODE_DGC
            : c.optimizer().momentum_mode();
    if (Canonical(*e.momentum_mode, ParseMomentumMode, MomentumModeName) !=
        MomentumFlagValue(mode)) {
      return Mismatch(prefix, "momentum-mode", *e.momentum_mode,
                      MomentumFlagValue(mode));
    }
  }
  return absl::OkStatus();
}

std::string FingerprintText(uint64_t fingerprint) {
  return absl::StrFormat("0x%016x", fingerprint);
}

std::vector<std::string> ClusterSpecDifferences(const v1::ClusterSpec& here,
                                                const v1::ClusterSpec& there,
                                                absl::string_view there_name) {
  std::vector<std::string> differences;
  const v1::OptimizerSpec& a = here.optimizer();
  const v1::OptimizerSpec& b = there.optimizer();
  // `flag`: the gtopk-server flag that sets it; values as the flag would
  // spell them.
  auto differ = [&](const char* flag, const std::string& mine,
                    const std::string& theirs) {
    if (mine == theirs) return;
    differences.push_back(absl::StrCat("--", flag, " is ", mine, " here but ",
                                       theirs, " ", there_name));
  };
  auto num = [](auto v) { return ShortestNumber(v); };
  auto list = [](const google::protobuf::RepeatedField<double>& v) {
    std::vector<std::string> parts;
    for (double d : v) parts.push_back(ShortestNumber(d));
    return parts.empty() ? std::string("empty") : absl::StrJoin(parts, ",");
  };
  differ("workers", absl::StrCat(here.num_workers()),
         absl::StrCat(there.num_workers()));
  differ("num-shards", absl::StrCat(here.shards_size()),
         absl::StrCat(there.shards_size()));
  differ("mode", ModeFlagValue(here.mode()), ModeFlagValue(there.mode()));
  differ("selection", SelectionFlagValue(here.selection()),
         SelectionFlagValue(there.selection()));
  // In MiB as the flag spells it (to 4 significant digits) and in values,
  // what it became (floor(MiB * 2^20 / 4)).
  const auto bucket = [](uint64_t values) {
    return absl::StrFormat("%.4g (%u values)",
                           static_cast<double>(values) * 4.0 / (1 << 20),
                           values);
  };
  differ("bucket-mb", bucket(here.bucket_size()), bucket(there.bucket_size()));
  differ("selector", here.selector(), there.selector());
  differ("seed", absl::StrCat(here.selector_seed()),
         absl::StrCat(there.selector_seed()));
  differ("index-codec", here.index_codec(), there.index_codec());
  differ("value-codec", here.value_codec(), there.value_codec());
  differ("lr", num(a.lr()), num(b.lr()));
  differ("momentum", num(a.momentum()), num(b.momentum()));
  differ("momentum-mode", MomentumFlagValue(a.momentum_mode()),
         MomentumFlagValue(b.momentum_mode()));
  differ("momentum-masking", a.momentum_factor_masking() ? "true" : "false",
         b.momentum_factor_masking() ? "true" : "false");
  differ("weight-decay", num(a.weight_decay()), num(b.weight_decay()));
  differ("lr-warmup-steps", absl::StrCat(a.lr_warmup_steps()),
         absl::StrCat(b.lr_warmup_steps()));
  differ("density", num(a.density()), num(b.density()));
  differ("density-warmup", list(a.density_warmup()), list(b.density_warmup()));
  differ("steps-per-epoch", absl::StrCat(a.steps_per_epoch()),
         absl::StrCat(b.steps_per_epoch()));
  differ("step-timeout", absl::StrCat(here.step_timeout_ms(), "ms"),
         absl::StrCat(there.step_timeout_ms(), "ms"));
  differ("max-message-bytes", absl::StrCat(here.max_message_bytes()),
         absl::StrCat(there.max_message_bytes()));
  differ("apply", ApplyFlagValue(here.apply()), ApplyFlagValue(there.apply()));
  differ("checksum-every", absl::StrCat(here.checksum_every()),
         absl::StrCat(there.checksum_every()));
  if (here.n() != 0 && there.n() != 0 && here.n() != there.n()) {
    differences.push_back(absl::StrCat("the parameter count n is ", here.n(),
                                       " here but ", there.n(), " ",
                                       there_name));
  } else if (here.n() == there.n() &&
             here.shards_size() == there.shards_size()) {
    for (int s = 0; s < here.shards_size(); ++s) {
      const v1::ShardSpec& x = here.shards(s);
      const v1::ShardSpec& y = there.shards(s);
      if (x.begin() != y.begin() || x.end() != y.end()) {
        differences.push_back(absl::StrCat(
            "shard ", s, "'s range is [", x.begin(), ", ", x.end(),
            ") here but [", y.begin(), ", ", y.end(), ") ", there_name));
      }
    }
  }
  return differences;
}

absl::StatusOr<OptimizerOptions> OptimizerFromSpec(const v1::OptimizerSpec& s) {
  OptimizerOptions o;
  o.lr = s.lr();
  o.momentum = s.momentum();
  GTOPK_ASSIGN_OR_RETURN(o.momentum_mode,
                         MomentumModeFromProto(s.momentum_mode()));
  o.momentum_factor_masking = s.momentum_factor_masking();
  o.weight_decay = s.weight_decay();
  o.lr_warmup_steps = s.lr_warmup_steps();
  o.density = s.density();
  o.density_warmup.assign(s.density_warmup().begin(), s.density_warmup().end());
  o.steps_per_epoch = s.steps_per_epoch();
  return o;
}

absl::Status ValidateWorkerClusterSpec(const v1::ClusterSpec& c, uint64_t n,
                                       uint32_t rank) {
  if (c.n() != n) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cluster spec: cluster has n = ", c.n(), ", this worker has ", n));
  }
  if (c.num_workers() < 1 || rank >= c.num_workers()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cluster spec: rank ", rank, " not below P = ", c.num_workers()));
  }
  if (c.shards_size() < 1) {
    return absl::InvalidArgumentError("cluster spec: no shards");
  }
  uint64_t expected_begin = 0;
  for (int s = 0; s < c.shards_size(); ++s) {
    const v1::ShardSpec& sh = c.shards(s);
    if (sh.shard_id() != static_cast<uint32_t>(s) || sh.address().empty() ||
        sh.begin() != expected_begin || sh.end() < sh.begin() || sh.end() > n) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cluster spec: shard at position ", s, " (id ", sh.shard_id(),
          ", address \"", sh.address(), "\", range [", sh.begin(), ", ",
          sh.end(), ")) does not continue the tiling of [0, ", n, ") at ",
          expected_begin));
    }
    expected_begin = sh.end();
  }
  if (expected_begin != n) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cluster spec: shard ranges end at ", expected_begin, ", not n = ", n));
  }
  if (c.step_timeout_ms() == 0) {
    return absl::InvalidArgumentError("cluster spec: step_timeout_ms is 0");
  }
  if ((c.selection() == v1::SELECTION_LAYERWISE) != (c.bucket_size() != 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("cluster spec: bucket_size ", c.bucket_size(),
                     " with selection ", SelectionFlagValue(c.selection()),
                     " (layerwise needs a bucket size >= 1, the others none)"));
  }
  if (c.selection() == v1::SELECTION_LAYERWISE &&
      (n - 1) / c.bucket_size() >= (uint64_t{1} << 24)) {
    return absl::InvalidArgumentError(
        absl::StrCat("cluster spec: bucket_size ", c.bucket_size(),
                     " cuts n = ", n, " into more than 2^24 buckets"));
  }
  return absl::OkStatus();
}

}  // namespace gtopk
