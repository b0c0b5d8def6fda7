// The standard normal quantile (common/normal_quantile.h) that the CPU and
// GPU Gaussian-k selectors share: reference values, symmetry, monotonicity,
// and Phi(NormalQuantile(p)) = p. GaussianKTest.NormalQuantile moved from
// tests/common/selector_test.cc (issue 44: tests mirror sources).
#include "common/normal_quantile.h"

#include <cmath>
#include <vector>

#include "gtest/gtest.h"

namespace gtopk {
namespace {

TEST(GaussianKTest, NormalQuantile) {
  EXPECT_NEAR(NormalQuantile(0.5), 0.0, 1e-12);
  EXPECT_NEAR(NormalQuantile(0.975), 1.959963984540054, 1e-9);
  EXPECT_NEAR(NormalQuantile(1 - 0.0005), 3.290526731491926, 1e-9);
  EXPECT_NEAR(NormalQuantile(0.025), -1.959963984540054, 1e-9);
}

double Phi(double x) { return 0.5 * std::erfc(-x / std::sqrt(2.0)); }

TEST(NormalQuantileTest, IsOddAroundOneHalf) {
  // p with 1 - p exact in double (binary fractions), so both sides ask for
  // the same tail. (Deeper upper tails lose digits: Phi near 1 is computed
  // as 1 - tail, to about 1e-16 absolute.)
  for (double p : {0x1p-20, 0x1p-10, 0.015625, 0.125, 0.375}) {
    EXPECT_NEAR(NormalQuantile(p), -NormalQuantile(1.0 - p), 1e-9) << p;
    EXPECT_LT(NormalQuantile(p), 0.0) << p;
  }
}

TEST(NormalQuantileTest, InvertsTheNormalDistribution) {
  double previous = -1e300;
  for (double p :
       {1e-12, 1e-6, 0.001, 0.02, 0.25, 0.5, 0.75, 0.9, 0.999, 1 - 1e-6}) {
    const double z = NormalQuantile(p);
    EXPECT_NEAR(Phi(z), p, 1e-12 + 1e-9 * p) << p;
    EXPECT_GT(z, previous) << p;  // increasing
    previous = z;
  }
}

TEST(NormalQuantileTest, TheGaussianKDensitiesGiveTheirTextbookZ) {
  // Gaussian-k keeps |x| > mean + z * std with z = Phi^-1(1 - density / 2).
  EXPECT_NEAR(NormalQuantile(1 - 0.01 / 2), 2.5758293035489, 1e-9);
  EXPECT_NEAR(NormalQuantile(1 - 0.001 / 2), 3.2905267314919, 1e-9);
  EXPECT_NEAR(NormalQuantile(0.8413447460685429), 1.0, 1e-9);
}

}  // namespace
}  // namespace gtopk
