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
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
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

// The most pieces a cluster's buckets may be cut into (all shards
// together). Every piece is its own top-k on every worker and its own round
// on its shard, about 1.2 us per piece per step (2.5 us overlapped) on the
// 2-core development machine (bench/piece_count_bench, P = 2, S = 2, n =
// 2,000,000, density 0.1: 64,518 pieces 0.16 s a plain step and 0.28 s
// overlapped; 400,000 pieces 0.55 s and 1.05 s). At this bound a step
// spends 0.1 to 0.2 s on its pieces; more is refused
// (CheckBucketPieceCount) before the first step instead of making every
// step slow. docs/overlap.md, "How many pieces".
inline constexpr uint64_t kMaxBucketPieces = uint64_t{1} << 16;

// How many pieces CutBucketPieces(n, bucket_size, shard_begins) cuts,
// without cutting them: O(shard_begins.size()). 0 for n == 0; shard
// begins >= n are ignored. Pure.
uint64_t CountBucketPieces(uint64_t n, uint64_t bucket_size,
                           absl::Span<const uint64_t> shard_begins);

// The smallest bucket size b (values, >= 1) such that every bucket size
// from b to n cuts [0, n) with `shard_begins` into at most `most` pieces,
// or n when even that is more than `most` (more shard ranges than `most`).
// Looks at most 256 sizes below a size that surely fits, so with very many
// shards the answer may be a little above the smallest; every size from it
// up still fits. Precondition: n >= 1, most >= 1. Pure.
uint64_t SmallestBucketSizeFor(uint64_t n,
                               absl::Span<const uint64_t> shard_begins,
                               uint64_t most);

// `values` fp32 values as --bucket-mb's MiB, the shortest decimal that
// gtopk-server turns back into exactly `values` (floor(MiB * 2^20 / 4),
// server/server_config.h BucketSizeValues), e.g. 4 -> "1.6e-05". Pure.
std::string BucketMbText(uint64_t values);

// FAILED_PRECONDITION when the cluster's buckets of `bucket_size` values
// cut n into more than kMaxBucketPieces pieces (with the shards'
// `shard_begins`), naming --bucket-mb (`bucket_mb_given`, the flag's value
// as given, or when empty the MiB of bucket_size), the piece count, the
// bound and the smallest --bucket-mb that fits; OK otherwise, and for
// bucket_size 0 (not layer-wise) or n == 0. Pure.
absl::Status CheckBucketPieceCount(uint64_t n, uint64_t bucket_size,
                                   absl::Span<const uint64_t> shard_begins,
                                   absl::string_view bucket_mb_given = "");

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
