#include "common/buckets.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace gtopk {

absl::StatusOr<std::vector<BucketPiece>> CutBucketPieces(
    uint64_t n, uint64_t bucket_size, absl::Span<const uint64_t> shard_begins) {
  if (n == 0) return absl::InvalidArgumentError("buckets: n must be >= 1");
  constexpr uint64_t kMostBuckets = uint64_t{1} << 24;
  const uint64_t size = bucket_size == 0 ? n : bucket_size;
  if ((n - 1) / size + 1 > kMostBuckets) {
    return absl::InvalidArgumentError(absl::StrCat(
        "buckets: a bucket size of ", bucket_size, " values cuts n = ", n,
        " into more than ", kMostBuckets, " buckets"));
  }
  std::vector<uint64_t> cuts;
  for (uint64_t b = 0; b < n; b += size) cuts.push_back(b);
  for (const uint64_t s : shard_begins) {
    if (s > n) {
      return absl::InvalidArgumentError(
          absl::StrCat("buckets: a shard begins at ", s, ", past n = ", n));
    }
    if (s < n) cuts.push_back(s);
  }
  std::sort(cuts.begin(), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  std::vector<BucketPiece> pieces;
  pieces.reserve(cuts.size());
  for (size_t i = 0; i < cuts.size(); ++i) {
    BucketPiece p;
    p.begin = cuts[i];
    p.end = i + 1 < cuts.size() ? cuts[i + 1] : n;
    p.bucket = static_cast<uint32_t>(p.begin / size);
    pieces.push_back(p);
  }
  return pieces;
}

std::vector<size_t> PiecesIn(absl::Span<const BucketPiece> pieces,
                             uint64_t begin, uint64_t end) {
  std::vector<size_t> out;
  for (size_t i = 0; i < pieces.size(); ++i) {
    if (pieces[i].begin >= begin && pieces[i].end <= end &&
        pieces[i].begin < pieces[i].end) {
      out.push_back(i);
    }
  }
  return out;
}

uint64_t PieceK(uint64_t k, uint64_t piece_size, uint64_t n) {
  const unsigned __int128 num =
      static_cast<unsigned __int128>(k) * piece_size + n / 2;
  return static_cast<uint64_t>(num / n);
}

}  // namespace gtopk
