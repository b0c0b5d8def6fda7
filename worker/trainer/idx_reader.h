// Reader of the IDX files Fashion-MNIST ships in (gzipped or plain; zlib's
// gzread reads both). No libtorch dependency.
//
// Format (big-endian): images: magic 0x00000803, count, rows, cols, then
// count*rows*cols uint8 pixels; labels: magic 0x00000801, count, then count
// uint8 labels (0..9 here). Nothing is allocated from an unchecked header:
// the payload is read first, bounded by a hard cap, and the header's sizes
// are checked against the bytes actually decompressed.
#ifndef GTOPK_WORKER_TRAINER_IDX_READER_H_
#define GTOPK_WORKER_TRAINER_IDX_READER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace gtopk {
namespace worker {

// Where the Debian package dataset-fashion-mnist installs the data.
inline constexpr char kDefaultFashionMnistDir[] =
    "/usr/share/datasets/fashion-mnist";

struct IdxImages {
  uint32_t count = 0;
  uint32_t rows = 0;
  uint32_t cols = 0;
  std::vector<uint8_t> pixels;  // count * rows * cols, row-major per image
};

struct IdxLabels {
  std::vector<uint8_t> labels;  // each 0..9
};

// Largest decompressed file accepted (1 GiB; Fashion-MNIST's largest is 47 MB).
inline constexpr uint64_t kMaxIdxBytes = uint64_t{1} << 30;

// Reads an IDX image file (magic 0x00000803; rows and cols must be 28).
// Errors: NOT_FOUND naming the path (and the Debian package) when missing;
// DATA_LOSS for a wrong magic, a truncated file, trailing bytes or a corrupt
// gzip stream; INVALID_ARGUMENT for other image sizes than 28x28.
absl::StatusOr<IdxImages> ReadIdxImages(const std::string& path);

// Reads an IDX label file (magic 0x00000801).
// Errors: as ReadIdxImages; INVALID_ARGUMENT for a label > 9.
absl::StatusOr<IdxLabels> ReadIdxLabels(const std::string& path);

// The Fashion-MNIST file names inside a data directory.
struct FashionMnistFiles {
  std::string train_images, train_labels, test_images, test_labels;
};
FashionMnistFiles FashionMnistPaths(const std::string& dir);

// One split of a data set, images and labels checked against each other.
struct IdxDataset {
  IdxImages images;
  IdxLabels labels;
};
// Reads `images_path` and `labels_path`; INVALID_ARGUMENT when their counts
// differ (both paths named).
absl::StatusOr<IdxDataset> ReadIdxDataset(const std::string& images_path,
                                          const std::string& labels_path);

}  // namespace worker
}  // namespace gtopk

#endif  // GTOPK_WORKER_TRAINER_IDX_READER_H_
