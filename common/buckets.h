// Layer-wise selection's buckets (--selection=layerwise): the flat vector
// [0, n) cut into contiguous buckets of `bucket_size` values, each cut again
// where a shard's range begins, so that every piece lies in one shard. Each
// piece is its own top-k: k_p = round(k * n_p / n) of its n_p values, on the
// workers (local selection) and on the shard that owns it (the top k_p of
// the sum over workers). This is layer-wise gTop-k (S. Shi et al.,
// "Layer-wise adaptive gradient sparsification for distributed deep
// learning with convergence guarantees" (LAGS-SGD), ECAI 2020) with quota
// selection across the shards that own a bucket's range; docs/overlap.md
// says when it fits. Shared by worker/ and server/ so that both cut the
// same pieces and give each the same k.
#ifndef GTOPK_COMMON_BUCKETS_H_
#define GTOPK_COMMON_BUCKETS_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace gtopk {

// One piece: [begin, end) of the flat vector, inside bucket `bucket`
// (= begin / bucket_size) and one shard's range.
struct BucketPiece {
  uint64_t begin = 0;
  uint64_t end = 0;
  uint32_t bucket = 0;
  uint64_t size() const { return end - begin; }
};

// The pieces of [0, n), in index order: the cut points are every multiple of
// `bucket_size` below n and every value of `shard_begins` (the shards'
// first indices; 0 and repeats are allowed, values must be <= n).
// bucket_size 0 means one bucket (pieces are then the shard ranges).
// INVALID_ARGUMENT for n == 0, a shard begin over n, or more than 2^24
// buckets (a bucket size far too small for n). Pure.
absl::StatusOr<std::vector<BucketPiece>> CutBucketPieces(
    uint64_t n, uint64_t bucket_size, absl::Span<const uint64_t> shard_begins);

// The pieces of `pieces` that lie in [begin, end) (a shard's range, whose
// ends are cut points), as indices into `pieces`. Pure.
std::vector<size_t> PiecesIn(absl::Span<const BucketPiece> pieces,
                             uint64_t begin, uint64_t end);

// A piece's k: round(k * piece_size / n), halves up, computed exactly
// (128-bit). 0 when the piece is too small for any entry at this density.
// Precondition: n > 0, piece_size <= n.
uint64_t PieceK(uint64_t k, uint64_t piece_size, uint64_t n);

}  // namespace gtopk

#endif  // GTOPK_COMMON_BUCKETS_H_
