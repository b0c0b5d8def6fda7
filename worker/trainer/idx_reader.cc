#include "worker/trainer/idx_reader.h"

#include <sys/stat.h>
#include <zlib.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace gtopk {
namespace worker {
namespace {

constexpr uint32_t kImagesMagic = 0x00000803;
constexpr uint32_t kLabelsMagic = 0x00000801;

uint32_t BigEndian32(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) |
         (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

// Reads the whole (decompressed) file, at most kMaxIdxBytes.
absl::StatusOr<std::vector<uint8_t>> ReadAll(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    const int err = errno;
    if (err == ENOENT || err == ENOTDIR) {
      return absl::NotFoundError(absl::StrCat(
          "Fashion-MNIST file ", path,
          " not found: install the Debian package dataset-fashion-mnist or "
          "pass --data-dir"));
    }
    return absl::PermissionDeniedError(
        absl::StrCat("cannot open ", path, ": ", std::strerror(err)));
  }
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, " is not a regular file"));
  }
  gzFile f = gzopen(path.c_str(), "rb");
  if (f == nullptr) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot open ", path, ": ", std::strerror(errno)));
  }
  std::vector<uint8_t> out;
  // 64 KiB per gzread: as fast as larger reads for the 47 MB files, and a
  // small file (a label file, a truncated download) does not cost a
  // zeroed 1 MiB buffer per call (the IDX fuzz harness runs ~10x faster).
  std::vector<uint8_t> buf(64 << 10);
  absl::Status status;
  for (;;) {
    const int got = gzread(f, buf.data(), static_cast<unsigned>(buf.size()));
    if (got < 0) {
      int errnum = 0;
      const char* msg = gzerror(f, &errnum);
      status = absl::DataLossError(absl::StrCat(
          path, ": corrupt gzip stream (", msg ? msg : "unknown error",
          "); reinstall dataset-fashion-mnist or pass --data-dir"));
      break;
    }
    if (got == 0) {
      // gzread returns 0 at the end, and also for a stream cut short
      // (Z_BUF_ERROR reported by gzerror).
      int errnum = 0;
      const char* msg = gzerror(f, &errnum);
      if (errnum != Z_OK) {
        status = absl::DataLossError(
            absl::StrCat(path, ": truncated or corrupt gzip stream (",
                         msg ? msg : "unknown error", ")"));
      }
      break;
    }
    if (out.size() + static_cast<size_t>(got) > kMaxIdxBytes) {
      status = absl::InvalidArgumentError(absl::StrCat(
          path, ": larger than ", kMaxIdxBytes, " bytes decompressed"));
      break;
    }
    out.insert(out.end(), buf.begin(), buf.begin() + got);
  }
  gzclose(f);
  if (!status.ok()) return status;
  return out;
}

absl::Status CheckMagic(const std::string& path,
                        const std::vector<uint8_t>& data, uint32_t want,
                        size_t header_bytes) {
  if (data.size() < header_bytes) {
    return absl::DataLossError(absl::StrCat(path, ": truncated IDX header (",
                                            data.size(), " bytes, need ",
                                            header_bytes, ")"));
  }
  const uint32_t magic = BigEndian32(data.data());
  if (magic != want) {
    return absl::DataLossError(
        absl::StrCat(path, ": wrong IDX magic 0x",
                     absl::Hex(magic, absl::kZeroPad8), ", expected 0x",
                     absl::Hex(want, absl::kZeroPad8), " (not a Fashion-MNIST ",
                     want == kImagesMagic ? "image" : "label", " file)"));
  }
  return absl::OkStatus();
}

absl::Status CheckPayload(const std::string& path, uint64_t have,
                          uint64_t want) {
  if (have < want) {
    return absl::DataLossError(absl::StrCat(path, ": truncated: header says ",
                                            want, " payload bytes, file has ",
                                            have));
  }
  if (have > want) {
    return absl::DataLossError(
        absl::StrCat(path, ": ", have - want, " unexpected bytes after the ",
                     want, " payload bytes the header announces"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<IdxImages> ReadIdxImages(const std::string& path) {
  absl::StatusOr<std::vector<uint8_t>> data = ReadAll(path);
  if (!data.ok()) return data.status();
  constexpr size_t kHeader = 16;
  if (absl::Status s = CheckMagic(path, *data, kImagesMagic, kHeader);
      !s.ok()) {
    return s;
  }
  IdxImages images;
  images.count = BigEndian32(data->data() + 4);
  images.rows = BigEndian32(data->data() + 8);
  images.cols = BigEndian32(data->data() + 12);
  if (images.rows != 28 || images.cols != 28) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": images are ", images.rows, "x", images.cols,
                     ", expected 28x28"));
  }
  // 64-bit product of 32-bit values: no overflow.
  const uint64_t want = uint64_t{images.count} * images.rows * images.cols;
  if (absl::Status s = CheckPayload(path, data->size() - kHeader, want);
      !s.ok()) {
    return s;
  }
  images.pixels.assign(data->begin() + kHeader, data->end());
  return images;
}

absl::StatusOr<IdxLabels> ReadIdxLabels(const std::string& path) {
  absl::StatusOr<std::vector<uint8_t>> data = ReadAll(path);
  if (!data.ok()) return data.status();
  constexpr size_t kHeader = 8;
  if (absl::Status s = CheckMagic(path, *data, kLabelsMagic, kHeader);
      !s.ok()) {
    return s;
  }
  const uint64_t count = BigEndian32(data->data() + 4);
  if (absl::Status s = CheckPayload(path, data->size() - kHeader, count);
      !s.ok()) {
    return s;
  }
  IdxLabels labels;
  labels.labels.assign(data->begin() + kHeader, data->end());
  for (size_t i = 0; i < labels.labels.size(); ++i) {
    if (labels.labels[i] > 9) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": label ", int{labels.labels[i]}, " at index ", i,
                       " is out of range 0..9"));
    }
  }
  return labels;
}

FashionMnistFiles FashionMnistPaths(const std::string& dir) {
  FashionMnistFiles f;
  f.train_images = absl::StrCat(dir, "/train-images-idx3-ubyte.gz");
  f.train_labels = absl::StrCat(dir, "/train-labels-idx1-ubyte.gz");
  f.test_images = absl::StrCat(dir, "/t10k-images-idx3-ubyte.gz");
  f.test_labels = absl::StrCat(dir, "/t10k-labels-idx1-ubyte.gz");
  return f;
}

absl::StatusOr<IdxDataset> ReadIdxDataset(const std::string& images_path,
                                          const std::string& labels_path) {
  IdxDataset d;
  absl::StatusOr<IdxImages> images = ReadIdxImages(images_path);
  if (!images.ok()) return images.status();
  absl::StatusOr<IdxLabels> labels = ReadIdxLabels(labels_path);
  if (!labels.ok()) return labels.status();
  if (images->count != labels->labels.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(images_path, " has ", images->count, " images but ",
                     labels_path, " has ", labels->labels.size(), " labels"));
  }
  d.images = *std::move(images);
  d.labels = *std::move(labels);
  return d;
}

}  // namespace worker
}  // namespace gtopk
