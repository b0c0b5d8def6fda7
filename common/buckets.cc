#include "common/buckets.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
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

namespace {

// The distinct shard begins inside (0, n), ascending.
std::vector<uint64_t> InnerBegins(uint64_t n,
                                  absl::Span<const uint64_t> shard_begins) {
  std::vector<uint64_t> inner;
  for (const uint64_t s : shard_begins) {
    if (s > 0 && s < n) inner.push_back(s);
  }
  std::sort(inner.begin(), inner.end());
  inner.erase(std::unique(inner.begin(), inner.end()), inner.end());
  return inner;
}

uint64_t CountWithInner(uint64_t n, uint64_t bucket_size,
                        absl::Span<const uint64_t> inner) {
  const uint64_t size = bucket_size == 0 ? n : bucket_size;
  // A cut at every multiple of size below n, and at every shard begin that
  // is not one of them.
  uint64_t pieces = (n - 1) / size + 1;
  for (const uint64_t s : inner) pieces += s % size != 0;
  return pieces;
}

}  // namespace

uint64_t CountBucketPieces(uint64_t n, uint64_t bucket_size,
                           absl::Span<const uint64_t> shard_begins) {
  if (n == 0) return 0;
  return CountWithInner(n, bucket_size, InnerBegins(n, shard_begins));
}

uint64_t SmallestBucketSizeFor(uint64_t n,
                               absl::Span<const uint64_t> shard_begins,
                               uint64_t most) {
  const std::vector<uint64_t> inner = InnerBegins(n, shard_begins);
  if (inner.size() >= most) return n;  // n: one piece per shard range
  // Buckets of b values make at most ceil(n / b) + inner.size() pieces.
  const uint64_t room = most - inner.size();
  uint64_t b = (n - 1) / room + 1;
  for (int looked = 0; looked < 256 && b > 1; ++looked) {
    if (CountWithInner(n, b - 1, inner) > most) break;
    --b;
  }
  return b;
}

std::string BucketMbText(uint64_t values) {
  const double mib = static_cast<double>(values) * 4.0 / (1 << 20);
  auto reads_back = [values](const char* text) {
    double back = 0;
    return absl::SimpleAtod(text, &back) &&
           std::floor(back * (1 << 20) / 4.0) == static_cast<double>(values);
  };
  char text[32];
  const int exponent = static_cast<int>(std::floor(std::log10(mib)));
  for (int digits = 1; digits <= 17; ++digits) {
    // Rounded to nearest, and up (to nearest may fall below the bucket
    // size's first MiB value, which reads back as one value less).
    std::snprintf(text, sizeof(text), "%.*g", digits, mib);
    if (reads_back(text)) return text;
    const double scale = std::pow(10.0, digits - 1 - exponent);
    std::snprintf(text, sizeof(text), "%.*g", digits,
                  std::ceil(mib * scale) / scale);
    if (reads_back(text)) return text;
  }
  std::snprintf(text, sizeof(text), "%.17g", mib);
  return text;
}

absl::Status CheckBucketPieceCount(uint64_t n, uint64_t bucket_size,
                                   absl::Span<const uint64_t> shard_begins,
                                   absl::string_view bucket_mb_given) {
  if (n == 0 || bucket_size == 0) return absl::OkStatus();
  const uint64_t pieces = CountBucketPieces(n, bucket_size, shard_begins);
  if (pieces <= kMaxBucketPieces) return absl::OkStatus();
  const uint64_t fits =
      SmallestBucketSizeFor(n, shard_begins, kMaxBucketPieces);
  return absl::FailedPreconditionError(absl::StrCat(
      "--bucket-mb ",
      bucket_mb_given.empty() ? BucketMbText(bucket_size)
                              : std::string(bucket_mb_given),
      " (buckets of ", bucket_size, " values) cuts the model's n = ", n,
      " parameters into ", pieces, " bucket pieces, more than the ",
      kMaxBucketPieces,
      " a cluster may have (each piece is its own top-k and round every "
      "step; docs/overlap.md, \"How many pieces\"): use --bucket-mb of at "
      "least ",
      BucketMbText(fits), " (", fits, " values) for this n"));
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
