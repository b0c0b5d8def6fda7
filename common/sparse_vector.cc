#include "common/sparse_vector.h"

#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace gtopk {

bool operator==(const SparseVector& a, const SparseVector& b) {
  if (a.indices != b.indices || a.values.size() != b.values.size()) {
    return false;
  }
  // Bitwise comparison: -0.0 and +0.0 differ, which replicas must not.
  return a.values.empty() || std::memcmp(a.values.data(), b.values.data(),
                                         a.values.size() * sizeof(float)) == 0;
}

namespace {

// Position of the first NaN or +-Inf in `values`, or values.size(). Blocks
// are scanned without branches on the float bits (an all-ones exponent), which
// the compiler vectorises: about twice as fast as std::isfinite with an early
// exit on a gradient of 25.5 M floats. Only a block with a fault is rescanned.
size_t FirstNonFinite(absl::Span<const float> values) {
  constexpr size_t kBlock = 1024;
  const size_t n = values.size();
  const float* v = values.data();
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    uint32_t bad = 0;
    for (size_t j = 0; j < kBlock; ++j) {
      uint32_t bits;
      std::memcpy(&bits, v + i + j, sizeof(bits));
      bad |= static_cast<uint32_t>((bits & 0x7f800000u) == 0x7f800000u);
    }
    if (bad != 0) break;
  }
  for (; i < n; ++i) {
    if (!std::isfinite(v[i])) return i;
  }
  return n;
}

}  // namespace

absl::Status ValidateFinite(absl::Span<const float> values, const char* what) {
  const size_t first = FirstNonFinite(values);
  for (size_t j = first; j < values.size(); ++j) {
    if (!std::isfinite(values[j])) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, " has a non-finite value (", values[j], ") at position ", j));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateSparse(absl::Span<const uint32_t> indices,
                            absl::Span<const float> values, uint64_t n) {
  if (indices.size() != values.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("sparse vector has ", indices.size(), " indices but ",
                     values.size(), " values"));
  }
  for (size_t j = 0; j < indices.size(); ++j) {
    if (indices[j] >= n) {
      return absl::InvalidArgumentError(
          absl::StrCat("sparse index out of range at position ", j, ": ",
                       indices[j], " >= n = ", n));
    }
    if (j > 0 && indices[j] <= indices[j - 1]) {
      return absl::InvalidArgumentError(
          absl::StrCat("sparse indices not strictly ascending at position ", j,
                       ": ", indices[j], " after ", indices[j - 1],
                       indices[j] == indices[j - 1] ? " (duplicate)" : ""));
    }
    if (!std::isfinite(values[j])) {
      return absl::InvalidArgumentError(
          absl::StrCat("sparse value not finite at position ", j, " (index ",
                       indices[j], "): ", values[j]));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateSparseVector(const SparseVector& v, uint64_t n) {
  return ValidateSparse(v.indices, v.values, n);
}

std::vector<float> ToDense(const SparseVector& v, uint64_t n) {
  std::vector<float> dense(n, 0.0f);
  for (size_t j = 0; j < v.size(); ++j) dense[v.indices[j]] = v.values[j];
  return dense;
}

}  // namespace gtopk
