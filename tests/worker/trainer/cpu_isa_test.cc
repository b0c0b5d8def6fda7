// --cpu-isa (worker/trainer/cpu_isa.h) without libtorch: "native" changes
// nothing, another value is INVALID_ARGUMENT naming the flag, "portable"
// sets every pin of PortableCpuPins (or, on a CPU without AVX2 and FMA,
// refuses). Built from the source alone (no libtorch): this binary loads
// neither OpenBLAS nor MKL, so "portable" never re-executes it.
#include "worker/trainer/cpu_isa.h"

#include <stdlib.h>

#include <cstdlib>
#include <set>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace gtopk {
namespace worker {
namespace {

using ::gtopk::testing::IsOk;
using ::gtopk::testing::StatusIs;
using ::testing::HasSubstr;

TEST(CpuIsaTest, PortablePinsEveryLibraryToAvx2) {
  std::set<std::string> variables;
  for (const auto& [variable, value] : PortableCpuPins()) {
    variables.insert(variable);
    EXPECT_FALSE(value.empty()) << variable;
  }
  EXPECT_EQ(variables,
            (std::set<std::string>{"ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA",
                                   "DNNL_MAX_CPU_ISA", "OPENBLAS_CORETYPE",
                                   "MKL_CBWR"}));
}

TEST(CpuIsaTest, NativeChangesNothing) {
  unsetenv("ATEN_CPU_CAPABILITY");
  std::string note;
  EXPECT_THAT(ApplyCpuIsa("native", nullptr, &note), IsOk());
  EXPECT_THAT(note, HasSubstr("--cpu-isa=native"));
  EXPECT_EQ(std::getenv("ATEN_CPU_CAPABILITY"), nullptr);
  EXPECT_THAT(ApplyCpuIsa("native", nullptr, nullptr), IsOk());
}

TEST(CpuIsaTest, AnotherValueIsRefusedNamingTheFlag) {
  EXPECT_THAT(ApplyCpuIsa("avx512", nullptr, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "--cpu-isa must be portable or native, got \"avx512\""));
  EXPECT_THAT(ApplyCpuIsa("", nullptr, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(CpuIsaTest, PortableSetsEveryPinOverridingOtherValues) {
  setenv("ATEN_CPU_CAPABILITY", "avx512", 1);
  std::string note;
  const absl::Status status = ApplyCpuIsa("portable", nullptr, &note);
  if (absl::IsFailedPrecondition(status)) {
    GTEST_SKIP() << "this CPU cannot run the pinned kernels: " << status;
  }
  ASSERT_THAT(status, IsOk());
  for (const auto& [variable, value] : PortableCpuPins()) {
    const char* set = std::getenv(variable.c_str());
    ASSERT_NE(set, nullptr) << variable;
    EXPECT_EQ(std::string(set), value) << variable;
    EXPECT_THAT(note, HasSubstr(variable + "=" + value));
  }
}

}  // namespace
}  // namespace worker
}  // namespace gtopk
