#include "common/error_feedback.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/topk.h"

namespace gtopk {
namespace {

inline bool IsFinite(float x) {
  return cpu::MagnitudeKey(x) < cpu::kNonFiniteKey;
}

inline bool SameBits(float a, float b) {
  return std::memcmp(&a, &b, sizeof(float)) == 0;
}

// Prefixes a validation error with the argument's name.
absl::Status Named(const char* what, absl::Status status) {
  if (status.ok()) return status;
  return absl::Status(status.code(),
                      absl::StrCat(what, ": ", status.message()));
}

// Indices strictly ascending and < n, and as many values as indices.
absl::Status ValidateIndicesOnly(const SparseVector& v, uint64_t n) {
  if (v.indices.size() != v.values.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("sparse vector has ", v.indices.size(), " indices but ",
                     v.values.size(), " values"));
  }
  for (size_t j = 0; j < v.indices.size(); ++j) {
    if (v.indices[j] >= n) {
      return absl::InvalidArgumentError(
          absl::StrCat("sparse index out of range at position ", j, ": ",
                       v.indices[j], " >= n = ", n));
    }
    if (j > 0 && v.indices[j] <= v.indices[j - 1]) {
      return absl::InvalidArgumentError(
          absl::StrCat("sparse indices not strictly ascending at position ", j,
                       ": ", v.indices[j], " after ", v.indices[j - 1]));
    }
  }
  return absl::OkStatus();
}

// residual + received, where a zero residual (the lossless case) gives
// received's bits exactly, -0.0 included.
inline float PutBackSum(float residual, float received) {
  return cpu::MagnitudeKey(residual) == 0 ? received : residual + received;
}

// Calls visit(j) for every position j of `sent` whose index is not among
// global's indices. Both lists strictly ascending: one merge walk.
template <typename Visit>
void ForEachNotInGlobal(const SparseVector& sent, const SparseVector& global,
                        Visit visit) {
  const uint32_t* g = global.indices.data();
  const size_t gsize = global.indices.size();
  size_t gpos = 0;
  for (size_t j = 0; j < sent.size(); ++j) {
    const uint32_t index = sent.indices[j];
    while (gpos < gsize && g[gpos] < index) ++gpos;
    if (gpos < gsize && g[gpos] == index) continue;
    visit(j);
  }
}

}  // namespace

absl::StatusOr<ErrorFeedback> ErrorFeedback::Create(uint64_t n) {
  if (n > kMaxDenseLength) {
    return absl::InvalidArgumentError(
        absl::StrCat("ErrorFeedback: n = ", n, " exceeds 2^32"));
  }
  return ErrorFeedback(n);
}

ErrorFeedback::ErrorFeedback(uint64_t n)
    : residual_(static_cast<size_t>(n), 0.0f) {}

absl::Status ErrorFeedback::Accumulate(absl::Span<const float> update) {
  if (update.size() != residual_.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("Accumulate: update has length ", update.size(),
                     ", the residual ", residual_.size()));
  }
  const size_t n = residual_.size();
  const float* u = update.data();
  float* r = residual_.data();
  // Check pass: a non-finite update value or residual value, or an overflow,
  // all show as a non-finite sum. Branch-free so that it vectorises.
  uint32_t bad = 0;
  for (size_t i = 0; i < n; ++i) {
    bad |= cpu::MagnitudeKey(r[i] + u[i]) >= cpu::kNonFiniteKey;
  }
  if (bad) {
    for (size_t i = 0; i < n; ++i) {
      if (IsFinite(r[i] + u[i])) continue;
      if (!IsFinite(u[i])) {
        return absl::InvalidArgumentError(
            absl::StrCat("Accumulate: update has a non-finite value (", u[i],
                         ") at position ", i));
      }
      if (!IsFinite(r[i])) {
        return absl::FailedPreconditionError(
            absl::StrCat("Accumulate: residual has a non-finite value (", r[i],
                         ") at position ", i));
      }
      return absl::InvalidArgumentError(
          absl::StrCat("Accumulate: residual + update overflows at position ",
                       i, ": ", r[i], " + ", u[i]));
    }
  }
  for (size_t i = 0; i < n; ++i) r[i] += u[i];
  return absl::OkStatus();
}

absl::Status ErrorFeedback::MarkSent(const SparseVector& sent,
                                     const SparseVector& sent_as_received) {
  const uint64_t n = residual_.size();
  if (absl::Status s = Named("MarkSent: sent", ValidateSparseVector(sent, n));
      !s.ok()) {
    return s;
  }
  if (absl::Status s = Named("MarkSent: sent_as_received",
                             ValidateSparseVector(sent_as_received, n));
      !s.ok()) {
    return s;
  }
  if (sent.size() != sent_as_received.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "MarkSent: sent has ", sent.size(), " entries but sent_as_received ",
        sent_as_received.size()));
  }
  for (size_t j = 0; j < sent.size(); ++j) {
    const uint32_t index = sent.indices[j];
    if (sent_as_received.indices[j] != index) {
      return absl::InvalidArgumentError(absl::StrCat(
          "MarkSent: indices differ at position ", j, ": sent ", index,
          ", sent_as_received ", sent_as_received.indices[j]));
    }
    if (!SameBits(sent.values[j], residual_[index])) {
      return absl::FailedPreconditionError(absl::StrCat(
          "MarkSent: sent value at position ", j, " (index ", index, ") is ",
          sent.values[j], " but the residual holds ", residual_[index],
          "; select from the current residual"));
    }
    if (!IsFinite(residual_[index] - sent_as_received.values[j])) {
      return absl::InvalidArgumentError(absl::StrCat(
          "MarkSent: u - received overflows at position ", j, " (index ", index,
          "): ", residual_[index], " - ", sent_as_received.values[j]));
    }
  }
  for (size_t j = 0; j < sent.size(); ++j) {
    float& r = residual_[sent.indices[j]];
    r = r - sent_as_received.values[j];
  }
  pending_ = sent_as_received;
  has_pending_ = true;
  return absl::OkStatus();
}

absl::Status ErrorFeedback::PutBack(const SparseVector& sent_as_received,
                                    const SparseVector& global) {
  const uint64_t n = residual_.size();
  if (absl::Status s = Named("PutBack: sent_as_received",
                             ValidateSparseVector(sent_as_received, n));
      !s.ok()) {
    return s;
  }
  if (absl::Status s = Named("PutBack: global", ValidateIndicesOnly(global, n));
      !s.ok()) {
    return s;
  }
  if (!has_pending_) {
    return absl::FailedPreconditionError(
        "PutBack: no pending MarkSent (already put back, or never marked)");
  }
  if (sent_as_received != pending_) {
    return absl::FailedPreconditionError(
        "PutBack: sent_as_received differs from the one given to the last "
        "MarkSent");
  }
  absl::Status overflow = absl::OkStatus();
  ForEachNotInGlobal(sent_as_received, global, [&](size_t j) {
    const uint32_t index = sent_as_received.indices[j];
    if (overflow.ok() &&
        !IsFinite(PutBackSum(residual_[index], sent_as_received.values[j]))) {
      overflow = absl::FailedPreconditionError(absl::StrCat(
          "PutBack: residual + received is not finite at index ", index, ": ",
          residual_[index], " + ", sent_as_received.values[j],
          " (the residual changed since MarkSent)"));
    }
  });
  if (!overflow.ok()) return overflow;
  ForEachNotInGlobal(sent_as_received, global, [&](size_t j) {
    float& r = residual_[sent_as_received.indices[j]];
    r = PutBackSum(r, sent_as_received.values[j]);
  });
  pending_.clear();
  has_pending_ = false;
  return absl::OkStatus();
}

void ErrorFeedback::Reset() {
  std::fill(residual_.begin(), residual_.end(), 0.0f);
  pending_.clear();
  has_pending_ = false;
}

}  // namespace gtopk
