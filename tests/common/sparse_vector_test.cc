#include "common/sparse_vector.h"

#include <cmath>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/testing/reference.h"
#include "tests/testing/status_matchers.h"

namespace gtopk {
namespace {

using ::gtopk::testing::FloatBits;
using ::gtopk::testing::MakeSparse;
using ::gtopk::testing::StatusIs;
using ::testing::HasSubstr;

TEST(SparseVectorTest, AcceptsValidVectors) {
  GTOPK_EXPECT_OK(ValidateSparseVector(SparseVector{}, 0));
  GTOPK_EXPECT_OK(
      ValidateSparseVector(MakeSparse({0, 3, 9}, {1, -2, -0.0f}), 10));
  GTOPK_EXPECT_OK(ValidateSparseVector(
      MakeSparse({0, 0xffffffffu},
                 {1, std::numeric_limits<float>::denorm_min()}),
      kMaxDenseLength));
}

TEST(SparseVectorTest, NamesTheFirstFaultAndItsPosition) {
  EXPECT_THAT(ValidateSparseVector(MakeSparse({1, 2}, {1}), 10),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("2 indices but 1 values")));
  EXPECT_THAT(ValidateSparseVector(MakeSparse({1, 5, 4}, {1, 2, 3}), 10),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("not strictly ascending at position 2")));
  EXPECT_THAT(
      ValidateSparseVector(MakeSparse({1, 5, 5}, {1, 2, 3}), 10),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("(duplicate)")));
  EXPECT_THAT(ValidateSparseVector(MakeSparse({1, 10}, {1, 2}), 10),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("out of range at position 1: 10 >= n = 10")));
  EXPECT_THAT(
      ValidateSparseVector(MakeSparse({1, 2, 3}, {1, NAN, INFINITY}), 10),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("not finite at position 1 (index 2)")));
  EXPECT_THAT(
      ValidateSparseVector(MakeSparse({7}, {-INFINITY}), 10),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("position 0")));
  // Range is checked before order at the same position.
  EXPECT_THAT(
      ValidateSparseVector(MakeSparse({3}, {1}), 0),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("out of range")));
}

TEST(SparseVectorTest, ValidateFiniteNamesPosition) {
  std::vector<float> x = {0, 1, 2, NAN, INFINITY};
  EXPECT_THAT(ValidateFinite(x, "gradient"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("gradient has a non-finite value (nan) at "
                                 "position 3")));
  x.resize(3);
  GTOPK_EXPECT_OK(ValidateFinite(x, "gradient"));
}

// The blocked scan against a plain loop: every fault kind at positions
// around the 1024-float blocks, in sizes that are and are not multiples of a
// block; the first fault is the one named, with its position.
TEST(SparseVectorTest, ValidateFiniteFindsTheFirstFaultAcrossBlocks) {
  const float faults[] = {NAN, -NAN, INFINITY, -INFINITY};
  const float fine[] = {std::numeric_limits<float>::max(),
                        -std::numeric_limits<float>::max(),
                        std::numeric_limits<float>::denorm_min(), -0.0f};
  for (size_t n : {1u, 1023u, 1024u, 1025u, 3000u, 4096u}) {
    std::vector<float> x(n, 0.5f);
    for (size_t j = 0; j < n; ++j) x[j] = fine[j % 4];
    GTOPK_EXPECT_OK(ValidateFinite(x, "v")) << n;
    for (size_t pos : {size_t{0}, size_t{1}, size_t{1022}, size_t{1023},
                       size_t{1024}, size_t{2047}, n - 1}) {
      if (pos >= n) continue;
      for (float f : faults) {
        std::vector<float> y = x;
        y[pos] = f;
        if (pos + 7 < n) y[pos + 7] = NAN;  // a later fault is not named
        size_t expected = n;                // the plain reference
        for (size_t j = 0; j < n; ++j) {
          if (!std::isfinite(y[j])) {
            expected = j;
            break;
          }
        }
        ASSERT_EQ(expected, pos);
        EXPECT_THAT(ValidateFinite(y, "v"),
                    StatusIs(absl::StatusCode::kInvalidArgument,
                             HasSubstr(absl::StrCat("at position ", pos))))
            << "n " << n << " pos " << pos << " fault " << f;
      }
    }
  }
}

TEST(SparseVectorTest, EqualityIsBitwise) {
  EXPECT_EQ(MakeSparse({1}, {0.0f}), MakeSparse({1}, {0.0f}));
  EXPECT_NE(MakeSparse({1}, {0.0f}), MakeSparse({1}, {-0.0f}));
  EXPECT_NE(MakeSparse({1}, {1.0f}), MakeSparse({2}, {1.0f}));
}

TEST(SparseVectorTest, ToDense) {
  EXPECT_EQ(ToDense(MakeSparse({0, 3}, {1.5f, -2.0f}), 5),
            (std::vector<float>{1.5f, 0, 0, -2.0f, 0}));
}

}  // namespace
}  // namespace gtopk
