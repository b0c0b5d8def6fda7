#include "common/cluster_modes.h"

#include <initializer_list>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace gtopk {
namespace {

// The enumerator of `all` whose name(e) is `name`, or INVALID_ARGUMENT
// "unknown <what> \"<name>\"; known: a, b, c".
template <typename E, typename NameFn>
absl::StatusOr<E> ParseByName(absl::string_view name, absl::string_view what,
                              std::initializer_list<E> all, NameFn name_of) {
  for (E e : all) {
    if (name == name_of(e)) return e;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown ", what, " \"", name,
      "\"; known: ", absl::StrJoin(all, ", ", [&](std::string* out, E e) {
        absl::StrAppend(out, name_of(e));
      })));
}

}  // namespace

absl::string_view AggregationModeName(AggregationMode mode) {
  switch (mode) {
    case AggregationMode::kGtopk:
      return "gtopk";
    case AggregationMode::kTopk:
      return "topk";
    case AggregationMode::kDense:
      return "dense";
  }
  return "unknown";
}

absl::string_view SelectionKindName(SelectionKind kind) {
  switch (kind) {
    case SelectionKind::kThreshold:
      return "threshold";
    case SelectionKind::kQuota:
      return "quota";
    case SelectionKind::kLayerwise:
      return "layerwise";
  }
  return "unknown";
}

absl::string_view MomentumModeName(MomentumMode mode) {
  switch (mode) {
    case MomentumMode::kNone:
      return "none";
    case MomentumMode::kDgcCorrection:
      return "dgc";
    case MomentumMode::kGlobal:
      return "global";
  }
  return "unknown";
}

absl::string_view ApplyModeName(ApplyMode mode) {
  switch (mode) {
    case ApplyMode::kServers:
      return "servers";
    case ApplyMode::kWorkers:
      return "workers";
  }
  return "unknown";
}

absl::StatusOr<AggregationMode> ParseAggregationMode(absl::string_view name) {
  return ParseByName(name, "mode",
                     {AggregationMode::kGtopk, AggregationMode::kTopk,
                      AggregationMode::kDense},
                     AggregationModeName);
}

absl::StatusOr<SelectionKind> ParseSelectionKind(absl::string_view name) {
  if (name == "exact") return SelectionKind::kThreshold;  // the old spelling
  return ParseByName(name, "selection",
                     {SelectionKind::kThreshold, SelectionKind::kQuota,
                      SelectionKind::kLayerwise},
                     SelectionKindName);
}

absl::StatusOr<MomentumMode> ParseMomentumMode(absl::string_view name) {
  return ParseByName(name, "momentum mode",
                     {MomentumMode::kNone, MomentumMode::kDgcCorrection,
                      MomentumMode::kGlobal},
                     MomentumModeName);
}

absl::StatusOr<ApplyMode> ParseApplyMode(absl::string_view name) {
  return ParseByName(name, "apply mode",
                     {ApplyMode::kServers, ApplyMode::kWorkers}, ApplyModeName);
}

}  // namespace gtopk
