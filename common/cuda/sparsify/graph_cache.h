// The selector's cache of captured CUDA graphs (Sparsifier::set_use_graphs):
// up to kMaxGraphs selections, each under the key of everything its enqueue
// depended on, the least recently used dropped. A template over the graph
// handle and the host-side snapshot saved with it, so that it is plain C++
// (testable without nvcc or the emulator).
#ifndef GTOPK_COMMON_CUDA_SPARSIFY_GRAPH_CACHE_H_
#define GTOPK_COMMON_CUDA_SPARSIFY_GRAPH_CACHE_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace gtopk {
namespace cuda {
namespace internal {

// What a captured selection's enqueue depended on.
struct GraphKey {
  int method;  // static_cast<int>(Method)
  const float* u;
  uint64_t n, k;
  bool zero, reuse;
  int max_adjustments;
  double dgc_sample_fraction;
  bool expect_exact;
  bool expect_from_u;  // exact's, or gaussiank's fallback's, sample missed
  uint64_t exact_sample_min_n;  // SparsifierTuning's
  uint64_t one_block_max_n;     // SparsifierTuning's
  bool update_sampled;          // exact after Accumulate from a sample
  // gaussiank: its gated exact fallback plans with the first pass's
  // candidates (GaussFallbackFromUpdate), not from a sample.
  bool gauss_fallback_from_update;
  // gaussiank from u: its own histogram pass counts a predicted key's
  // ties (Histogram).
  bool gauss_ties_pass;
  bool operator==(const GraphKey& o) const {
    return update_sampled == o.update_sampled &&
           gauss_fallback_from_update == o.gauss_fallback_from_update &&
           gauss_ties_pass == o.gauss_ties_pass && method == o.method &&
           u == o.u && n == o.n && k == o.k && zero == o.zero &&
           reuse == o.reuse && max_adjustments == o.max_adjustments &&
           dgc_sample_fraction == o.dgc_sample_fraction &&
           expect_exact == o.expect_exact && expect_from_u == o.expect_from_u &&
           exact_sample_min_n == o.exact_sample_min_n &&
           one_block_max_n == o.one_block_max_n;
  }
};

template <typename Exec, typename Snapshot>
class GraphCache {
 public:
  static constexpr size_t kMaxGraphs = 8;
  using Destroy = void (*)(Exec);
  struct Entry {
    GraphKey key;
    Exec exec{};
    Snapshot snapshot;
    uint64_t last_used = 0;
  };

  // `destroy` frees a handle the cache drops.
  explicit GraphCache(Destroy destroy) : destroy_(destroy) {}
  ~GraphCache() { Clear(); }
  GraphCache(const GraphCache&) = delete;
  GraphCache& operator=(const GraphCache&) = delete;

  // The entry captured under `key`, or null.
  Entry* Find(const GraphKey& key) {
    for (Entry& g : graphs_) {
      if (g.key == key) return &g;
    }
    return nullptr;
  }
  // Marks an entry (from Find) as just used.
  void Touch(Entry* entry) { entry->last_used = ++clock_; }

  // Adds a captured graph, dropping the least recently used one when full.
  void Insert(const GraphKey& key, Exec exec, const Snapshot& snapshot) {
    Entry entry;
    entry.key = key;
    entry.exec = exec;
    entry.snapshot = snapshot;
    entry.last_used = ++clock_;
    if (graphs_.size() >= kMaxGraphs) {
      auto oldest = std::min_element(graphs_.begin(), graphs_.end(),
                                     [](const Entry& a, const Entry& b) {
                                       return a.last_used < b.last_used;
                                     });
      destroy_(oldest->exec);
      graphs_.erase(oldest);
    }
    graphs_.push_back(entry);
  }

  // Drops every graph.
  void Clear() {
    for (Entry& g : graphs_) destroy_(g.exec);
    graphs_.clear();
  }

  size_t size() const { return graphs_.size(); }

 private:
  Destroy destroy_;
  std::vector<Entry> graphs_;
  uint64_t clock_ = 0;
};

}  // namespace internal
}  // namespace cuda
}  // namespace gtopk

#endif  // GTOPK_COMMON_CUDA_SPARSIFY_GRAPH_CACHE_H_
