// synthetic:N's gradient before and after issue 20, side by side in one
// process at n = 25,557,032, with a memset of the same array (one write
// pass) as the floor. Not part of the build (it carries a copy of the old
// generator); from the repository root:
//   g++ -std=c++17 -O3 -DNDEBUG -I. bench/model/synthetic_gradient_bench.cc \
//     -o /tmp/synthetic_gradient_bench && /tmp/synthetic_gradient_bench
// Prints the median and minimum over 12 steps of each, milliseconds.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <vector>

#include "absl/types/span.h"
#include "common/random.h"

// The generator as it was until issue 20 (worker/trainer/synthetic_model.h
// at f343719): a counter-based SplitMix64 stream, two values per word.
#include <cstdint>
namespace old {
void RandomGradient(uint64_t seed, uint32_t rank, int64_t step,
                    absl::Span<float> grad) {
  using gtopk::MixSeed;
  const uint64_t base =
      MixSeed(MixSeed(seed, rank), static_cast<uint64_t>(step));
  constexpr float kScale = 2.0f / 16777216.0f;
  const size_t n = grad.size();
  for (size_t i = 0; i + 1 < n; i += 2) {
    const uint64_t z = MixSeed(base, i / 2);
    grad[i] = static_cast<float>(z >> 40) * kScale - 1.0f;
    grad[i + 1] = static_cast<float>((z >> 8) & 0xffffff) * kScale - 1.0f;
  }
  if (n % 2 == 1) {
    grad[n - 1] =
        static_cast<float>(MixSeed(base, n / 2) >> 40) * kScale - 1.0f;
  }
}
}  // namespace old

#include "worker/trainer/synthetic_gradient.h"

int main() {
  const size_t n = 25557032;
  std::vector<float> g(n);
  using Clock = std::chrono::steady_clock;
  auto secs = [](Clock::time_point a) {
    return std::chrono::duration<double>(Clock::now() - a).count();
  };
  auto t0 = Clock::now();
  gtopk::worker::SyntheticGradient gen(n, 1);
  const double setup = secs(t0);
  std::vector<double> to, tn, tm;
  double sink = 0;
  for (int s = 0; s < 12; ++s) {
    auto a = Clock::now();
    old::RandomGradient(1, 0, s, absl::MakeSpan(g));
    to.push_back(secs(a));
    sink += g[s * 1000];
    a = Clock::now();
    gen.Fill(0, s, absl::MakeSpan(g));
    tn.push_back(secs(a));
    sink += g[s * 1000];
    a = Clock::now();
    std::memset(g.data(), s, n * sizeof(float));
    tm.push_back(secs(a));
  }
  for (auto* v : {&to, &tn, &tm}) std::sort(v->begin(), v->end());
  std::printf(
      "n=%zu old median %.2f min %.2f ms; new median %.2f min %.2f ms; "
      "memset median %.2f min %.2f ms; new pool setup %.1f ms (%g)\n",
      n, to[6] * 1e3, to[0] * 1e3, tn[6] * 1e3, tn[0] * 1e3, tm[6] * 1e3,
      tm[0] * 1e3, setup * 1e3, sink);
}
