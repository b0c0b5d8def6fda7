// GPU selector tests (common/cuda/sparsify.h): the API's contracts: errors, a
// stale CUDA error, non-finite input, SparseUpdater. Against the CPU reference
// (tests/testing/reference.h) on fresh seeded inputs; skipped, with the reason,
// without a CUDA device (CTest label `gpu`), and run on the CUDA emulator
// (label `emulator`).
#include "tests/common/cuda/sparsify_test_util.h"

namespace gtopk {
namespace cuda {
namespace sparsify_test {
namespace {

// A failed runtime call elsewhere leaves an error in CUDA's last-error state;
// the selector's launch checks must not report it as their own.
TEST_F(GpuTest, AnUnrelatedFailedCudaCallDoesNotFailTheNextSelection) {
  const size_t n = 4099;
  const std::vector<float> u = MakeInput(Distribution::kNormal, n, 8);
  GTOPK_ASSERT_OK_AND_ASSIGN(auto selector,
                             CudaSelector::Create("exact", {}, n));
  void* p = nullptr;
  ASSERT_NE(cudaMalloc(&p, size_t{1} << 50), cudaSuccess);  // 1 PiB
  SparseVector got;
  GTOPK_ASSERT_OK(selector->Select(u, 41, 0, &got));
  ExpectSameBits(got, ReferenceTopK(u, 41));
}

// SparseUpdater against plain loops, bit for bit: Set, Subtract, then global
// momentum (v = m*velocity + update; velocity = v; params -= v, with update
// +0.0 off the index list).
TEST_F(GpuTest, SparseUpdaterMatchesPlainLoops) {
  const size_t n = 70001;
  std::vector<float> params = MakeInput(Distribution::kNormal, n, 31);
  std::vector<float> velocity = MakeInput(Distribution::kNormal, n, 32);
  const std::vector<float> source =
      MakeInput(Distribution::kHeavyTailed, n, 33);
  std::vector<uint32_t> idx;
  std::vector<float> val, sub;
  for (uint32_t i = 3; i < n; i += 7) idx.push_back(i);
  idx.push_back(static_cast<uint32_t>(n - 1));
  for (uint32_t i : idx) {
    val.push_back(source[i]);
    sub.push_back(source[i] * 0.25f + 1.0f);
  }
  DeviceVector d_params(params), d_velocity(velocity);
  auto expect_equal = [](const std::vector<float>& got,
                         const std::vector<float>& want, const char* what) {
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_EQ(FloatBits(got[i]), FloatBits(want[i])) << what << " " << i;
    }
  };
  SparseUpdater updater;
  GTOPK_ASSERT_OK(ToAbslStatus(updater.Set(d_params.buffer.get(), n, idx.data(),
                                           val.data(), idx.size(), nullptr)));
  for (size_t j = 0; j < idx.size(); ++j) params[idx[j]] = val[j];
  expect_equal(d_params.ToHost(n), params, "set");
  GTOPK_ASSERT_OK(ToAbslStatus(updater.Subtract(
      d_params.buffer.get(), n, idx.data(), sub.data(), idx.size(), nullptr)));
  for (size_t j = 0; j < idx.size(); ++j) {
    params[idx[j]] = params[idx[j]] - sub[j];
  }
  expect_equal(d_params.ToHost(n), params, "subtract");
  const float m = 0.9f;
  GTOPK_ASSERT_OK(ToAbslStatus(
      updater.GlobalMomentum(d_params.buffer.get(), d_velocity.buffer.get(), n,
                             m, idx.data(), sub.data(), idx.size(), nullptr)));
  std::vector<float> update(n, 0.0f);
  for (size_t j = 0; j < idx.size(); ++j) update[idx[j]] = sub[j];
  for (size_t i = 0; i < n; ++i) {
    const float mv = m * velocity[i];
    const float v = mv + update[i];
    velocity[i] = v;
    params[i] = params[i] - v;
  }
  expect_equal(d_velocity.ToHost(n), velocity, "velocity");
  expect_equal(d_params.ToHost(n), params, "params");
}

TEST_F(GpuTest, NonFiniteInputIsInvalidArgumentAndChangesNothing) {
  const size_t n = 5000;
  for (const char* name : {"exact", "gaussiank", "dgc"}) {
    SCOPED_TRACE(name);
    std::vector<float> u = MakeInput(Distribution::kNormal, n, 9);
    u[1234] = std::numeric_limits<float>::quiet_NaN();
    u[4000] = std::numeric_limits<float>::infinity();
    GTOPK_ASSERT_OK_AND_ASSIGN(auto selector,
                               CudaSelector::Create(name, {}, n));
    DeviceVector d(u);
    SparseVector got;
    EXPECT_THAT(
        selector->SelectDevice(d.buffer.get(), n, 50, 0, nullptr, true, &got),
        StatusIs(absl::StatusCode::kInvalidArgument,
                 HasSubstr("non-finite value (nan) at position 1234")));
    EXPECT_TRUE(got.empty());
    ASSERT_NO_FATAL_FAILURE(ExpectZeroedExactly(d, u, {}));
  }
}

TEST_F(GpuTest, BadArgumentsAreRejected) {
  GTOPK_ASSERT_OK_AND_ASSIGN(auto selector,
                             CudaSelector::Create("exact", {}, 10));
  SparseVector got;
  const std::vector<float> u(10, 1.0f);
  EXPECT_THAT(selector->Select(u, 0, 0, &got),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(selector->Select(u, 11, 0, &got),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(CudaSelector::Create("randomk", {}, 10).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("no CUDA selector")));
  // The capacity grows with n.
  const std::vector<float> big = MakeInput(Distribution::kNormal, 5000, 1);
  GTOPK_ASSERT_OK(selector->Select(big, 7, 0, &got));
  ExpectSameBits(got, ReferenceTopK(big, 7));
}

}  // namespace
}  // namespace sparsify_test
}  // namespace cuda
}  // namespace gtopk
