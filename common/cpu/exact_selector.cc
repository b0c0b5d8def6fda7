#include "common/cpu/selectors.h"

namespace gtopk {
namespace cpu {

absl::Status ExactSelector::Select(absl::Span<const float> u, uint64_t k,
                                   uint64_t /*step*/, SparseVector* out) {
  return ExactTopK(u, k, &scratch_, out);
}

}  // namespace cpu
}  // namespace gtopk
