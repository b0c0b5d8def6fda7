// The GPU selectors in the selector registry (common/selector.h,
// cuda::RegisterCudaSelectors in common/cuda/cuda_selector.h): exact,
// gaussiank and dgc registered as the device implementations of the host
// selectors of those names, made by CreateDevice/CreateCudaSelector; names
// without one, or unknown, are INVALID_ARGUMENT naming the known ones.
// Registration needs no device; the selections are skipped without one (CTest
// label `gpu`) and run on the CUDA emulator (label `emulator`).
#include "tests/common/cuda/sparsify_test_util.h"

namespace gtopk {
namespace cuda {
namespace sparsify_test {
namespace {

SelectorRegistry FullRegistry() {
  SelectorRegistry registry;
  EXPECT_TRUE(RegisterBuiltinSelectors(&registry).ok());
  EXPECT_TRUE(RegisterCudaSelectors(&registry).ok());
  return registry;
}

TEST(CudaSelectorRegistryTest, ListsTheGpuSelectorsUnderTheHostNames) {
  const SelectorRegistry registry = FullRegistry();
  EXPECT_EQ(registry.DeviceNames(),
            (std::vector<std::string>{"dgc", "exact", "gaussiank"}));
  EXPECT_EQ(registry.Names(),
            (std::vector<std::string>{"dgc", "exact", "gaussiank", "randomk"}));
}

TEST(CudaSelectorRegistryTest, UnknownOrHostOnlyNamesAreInvalidArgument) {
  const SelectorRegistry registry = FullRegistry();
  EXPECT_THAT(registry.CreateDevice("top1", {}, 10),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("unknown selector \"top1\"; known: dgc, "
                                 "exact, gaussiank, randomk")));
  EXPECT_THAT(CreateCudaSelector(registry, "randomk", {}, 10),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("selector \"randomk\" has no device "
                                 "implementation; with one: dgc, exact, "
                                 "gaussiank")));
  SelectorOptions options;
  options.dgc_sample_fraction = 0.001;
  EXPECT_THAT(CreateCudaSelector(registry, "dgc", options, 10),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("dgc_sample_fraction")));
}

TEST(CudaSelectorRegistryTest, RegistersOnceAndOnlyForKnownSelectors) {
  SelectorRegistry empty;
  EXPECT_THAT(RegisterCudaSelectors(&empty),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("is not a registered selector")));
  SelectorRegistry registry = FullRegistry();
  EXPECT_THAT(RegisterCudaSelectors(&registry),
              StatusIs(absl::StatusCode::kAlreadyExists,
                       HasSubstr("already has a device implementation")));
}

// Each registered GPU selector is a CudaSelector of that name with the CPU
// selector's count contract; exact's selection is the CPU reference's.
TEST_F(GpuTest, CreatesEveryGpuSelectorByName) {
  const SelectorRegistry registry = FullRegistry();
  const size_t n = 5003;
  const uint64_t k = 50;
  const std::vector<float> u = MakeInput(Distribution::kNormal, n, 3);
  for (const std::string& name : registry.DeviceNames()) {
    SCOPED_TRACE(name);
    GTOPK_ASSERT_OK_AND_ASSIGN(auto selector,
                               CreateCudaSelector(registry, name, {}, n));
    EXPECT_EQ(selector->name(), name);
    GTOPK_ASSERT_OK_AND_ASSIGN(auto host, registry.Create(name, {}));
    EXPECT_EQ(selector->MinCount(k), host->MinCount(k));
    EXPECT_EQ(selector->MaxCount(k), host->MaxCount(k));
    SparseVector got;
    GTOPK_ASSERT_OK(selector->Select(u, k, 0, &got));
    EXPECT_GE(got.size(), selector->MinCount(k));
    EXPECT_LE(got.size(), selector->MaxCount(k));
    if (name == "exact") ExpectSameBits(got, ReferenceTopK(u, k));
  }
}

}  // namespace
}  // namespace sparsify_test
}  // namespace cuda
}  // namespace gtopk
